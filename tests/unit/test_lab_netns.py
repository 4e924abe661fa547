"""The lab's names block in a hosts file and its path checks (meshkit/lab_netns.py)."""

from __future__ import annotations

import json
import os

import pytest

from meshkit import lab_netns
from meshkit.lab_netns import (
    STATE_VERSION,
    Lab,
    _blocked_by,
    describe_change,
    host_links,
    names_block,
    replace_block,
    update_hosts_block,
)
from meshkit.lab_spec import plan, validate

BASE = "127.0.0.1 localhost\n::1 localhost\n"
OTHER = names_block("other", ["198.19.9.2\tnode1.other.meshkit.test"])


def test_a_block_is_added_replaced_and_removed_leaving_other_lines_and_labs():
    lines = ["198.19.1.2\tnode1.lab1.meshkit.test", "198.19.1.3\tnode2.lab1.meshkit.test"]
    text = replace_block(BASE + OTHER, "lab1", lines)
    assert text == BASE + OTHER + "# BEGIN meshkit lab lab1\n" + "\n".join(lines) + "\n# END meshkit lab lab1\n"
    # Built again with other addresses: one block, the new one.
    again = replace_block(text, "lab1", ["198.19.2.2\tnode1.lab1.meshkit.test"])
    assert again.count("# BEGIN meshkit lab lab1") == 1
    assert "198.19.1.2" not in again and "198.19.2.2\tnode1.lab1.meshkit.test" in again
    assert replace_block(again, "lab1", None) == BASE + OTHER


def test_every_stale_copy_of_a_block_goes_and_a_lab_named_like_a_prefix_is_not_touched():
    stale = names_block("lab1", ["192.0.2.1\tx"]) + names_block("lab1", ["192.0.2.2\ty"])
    prefixed = names_block("lab10", ["198.19.3.2\tnode1.lab10.meshkit.test"])
    text = replace_block(BASE + stale + prefixed, "lab1", ["198.19.1.2\tnode1.lab1.meshkit.test"])
    assert "192.0.2" not in text
    assert prefixed in text
    assert text.count("# BEGIN meshkit lab lab1\n") == 1


def test_update_writes_in_place_and_reports_change(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(BASE)
    inode = os.stat(hosts).st_ino
    assert update_hosts_block(str(hosts), "lab1", ["198.19.1.2\tnode1.lab1.meshkit.test"]) is True
    assert update_hosts_block(str(hosts), "lab1", ["198.19.1.2\tnode1.lab1.meshkit.test"]) is False
    assert os.stat(hosts).st_ino == inode  # the same file (a bind mount stays valid), not a renamed copy
    assert update_hosts_block(str(hosts), "lab1", None) is True
    assert hosts.read_text() == BASE
    assert update_hosts_block(str(tmp_path / "missing"), "lab1", None) is False


def test_blocked_by_names_the_directory_others_cannot_enter(tmp_path):
    closed = tmp_path / "closed"
    (closed / "inner").mkdir(parents=True)
    closed.chmod(0o700)
    target = closed / "inner"
    for parent in reversed(tmp_path.parents):
        if parent.stat().st_mode & 0o001 == 0:
            closed = parent  # pytest's own base directory is 0700 too: that one comes first
            break
    assert _blocked_by(str(target)).startswith(f" ({closed} is mode 0700: others cannot")
    assert _blocked_by("/usr/bin") == ""


def lab_plan(**overrides):
    doc = {
        "lab_name": "hd",
        "lab_state": "present",
        "lab_size": 4,
        "lab_shape": "ring",
        "lab_cables": [],
        "lab_link_rate": "",
        "lab_mgmt_subnet": "198.19.91.0/24",
        **overrides,
    }
    return plan(validate(doc))


def make_lab(tmp_path, **overrides) -> Lab:
    return Lab(lab_plan(**overrides), str(tmp_path / "lab"), "/nonexistent/lab_init.py", "/usr/bin/python3")


def test_the_head_namespace_is_the_labs_and_no_other_labs(tmp_path):
    lab = make_lab(tmp_path, lab_head=True)
    ours = ["hd-node1", "hd-node4", "hd-boot5", "hd-head"]
    theirs = ["hd1-head", "hd-heads", "xhd-head", "hd-node", "hd-head1", "other-head"]
    assert [n for n in ours + theirs if lab.netns_re.match(n)] == ours
    assert lab.root_port_re.match(lab.plan.head.mgmt_root_port)


def test_the_head_has_its_management_port_alone(tmp_path):
    lab = make_lab(tmp_path, lab_head=True)
    head = lab.plan.head
    assert host_links(head) == {"lo", "mgmt0"}
    assert host_links(lab.plan.hosts[0]) == {"lo", "mgmt0", "bridge0", "tb0", "tb1"}
    # An uncabled node (lab_size above the cables' hosts) keeps its bridge0, as before lab_head.
    spare = make_lab(tmp_path, lab_size=3, lab_cables=[[1, 2]]).plan.hosts[2]
    assert host_links(spare) == {"lo", "mgmt0", "bridge0"}


def test_the_heads_factory_network_has_no_bridge(tmp_path, monkeypatch):
    batches: dict[str, str] = {}

    def fake_run(cmd, stdin=None, check=True):
        batches[cmd[2]] = stdin

    monkeypatch.setattr(lab_netns, "run", fake_run)
    lab = make_lab(tmp_path, lab_head=True)
    for host in lab.plan.hosts:
        lab._factory_network(host)
    assert batches["hd-head"].splitlines() == [
        "link set lo up",
        "addr add 198.19.91.6/24 dev mgmt0",
        "link set mgmt0 up",
    ]
    assert "link set tb1 master bridge0" in batches["hd-node1"].splitlines()
    assert "link set bridge0 up" in batches["hd-node1"].splitlines()
    # With networkd, the head's own configuration is its management port's file alone.
    networkd = make_lab(tmp_path, lab_head=True, lab_network_daemon="networkd")
    assert sorted(networkd._network_files(networkd.plan.head)) == ["10-mgmt0.network"]
    assert "Address=198.19.91.6/24" in networkd._network_files(networkd.plan.head)["10-mgmt0.network"]
    assert sorted(networkd._network_files(networkd.plan.hosts[0])) == [
        "10-mgmt0.network",
        "20-bridge0.netdev",
        "20-bridge0.network",
        "30-tb.network",
    ]


def test_the_head_is_named_everywhere_the_nodes_are(tmp_path):
    lab = make_lab(tmp_path, lab_head=True, lab_names=True)
    assert lab.names_lines()[-1] == "198.19.91.6\thead.hd.meshkit.test"
    hosts = lab._host_hosts_file(lab.plan.head)
    assert "127.0.1.1\thead\n" in hosts
    assert "198.19.91.2\tnode1.hd.meshkit.test\n" in hosts and "198.19.91.6\thead.hd.meshkit.test\n" in hosts


def test_adding_or_removing_the_head_is_said(tmp_path):
    before = lab_plan().as_dict()
    after = lab_plan(lab_head=True).as_dict()
    assert describe_change(before, after) == "the lab was built differently: head node added"
    assert describe_change(after, before) == "the lab was built differently: head node removed"


# The record of a 2-host lab as meshkit wrote it before lab_head existed (its plan, verbatim).
OLD_RECORD_PLAN = {
    "name": "old", "size": 2, "shape": "ring", "link_rate": None, "mgmt_subnet": "198.18.7.0/24",
    "controller_ip": "198.18.7.1", "mgmt_bridge": "old-mgmt", "access": "root", "login_user": "root",
    "names": True, "domain": "old.meshkit.test", "network_daemon": "none",
    "hosts": [
        {"index": 1, "name": "node1", "netns": "old-node1", "mgmt_ip": "198.18.7.2", "mgmt_root_port": "old-m1",
         "ports": ["tb0"], "fqdn": "node1.old.meshkit.test", "ssh_name": "node1.old.meshkit.test"},
        {"index": 2, "name": "node2", "netns": "old-node2", "mgmt_ip": "198.18.7.3", "mgmt_root_port": "old-m2",
         "ports": ["tb0"], "fqdn": "node2.old.meshkit.test", "ssh_name": "node2.old.meshkit.test"},
    ],
    "cables": [{"index": 0, "ends": [{"host": "node1", "port": "tb0"}, {"host": "node2", "port": "tb0"}]}],
}  # fmt: skip


@pytest.mark.parametrize("names", [True, "true"])
def test_a_record_written_before_lab_head_still_matches_its_plan(tmp_path, names):
    lab = make_lab(
        tmp_path, lab_name="old", lab_size=2, lab_mgmt_subnet="198.18.7.0/24", lab_names=names, lab_head="false"
    )
    lab.dir.mkdir()
    record = {"version": STATE_VERSION, "plan": OLD_RECORD_PLAN, "holders": {"node1": 1, "node2": 2}}
    lab.state_file.write_text(json.dumps(record))
    assert lab.recorded() == record
    assert lab.plan.as_dict() == OLD_RECORD_PLAN  # so the lab is neither rebuilt nor described as changed


def test_a_lab_planned_without_a_head_still_removes_one_it_built(tmp_path):
    # Rebuilt or removed without lab_head=true (-e lab_state=absent alone), a lab built with a head
    # must still find the head's namespace and machine-side port as its own.
    lab = make_lab(tmp_path)
    assert lab.plan.head is None
    assert lab.netns_re.match("hd-head") and lab.root_port_re.match("hd-m5")
