"""The lab's names block in a hosts file and its path checks (meshkit/lab_netns.py)."""

from __future__ import annotations

import base64
import hashlib
import json
import os

import pytest

from meshkit import lab_netns
from meshkit.lab_netns import (
    STATE_VERSION,
    Lab,
    LabError,
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


# ---- changing a running lab in place -------------------------------------------------------------


def record(lab: Lab, recorded_plan) -> None:
    lab.dir.mkdir(parents=True, exist_ok=True)
    state = {"version": STATE_VERSION, "plan": recorded_plan.as_dict(), "holders": {}, "known_hosts": []}
    lab.state_file.write_text(json.dumps(state))


def test_a_healthy_lab_that_differs_in_hosts_and_cables_alone_is_changed_in_place(tmp_path, monkeypatch):
    lab = make_lab(tmp_path, lab_size=5)
    record(lab, lab_plan())
    monkeypatch.setattr(Lab, "problems", lambda self: [] if self.plan.size == 4 else ["rebuild"])
    before, diff = lab.in_place_changes()
    assert before == lab_plan()
    assert diff.summary() == (
        "added node5; cables added node4:tb1-node5:tb0, node5:tb1-node1:tb1; removed node4:tb1-node1:tb1"
    )
    # The same request once the record says so: nothing to change.
    record(lab, lab.plan)
    assert lab.in_place_changes() is None


def test_a_broken_lab_or_another_subnet_is_built_again_saying_why(tmp_path, monkeypatch):
    lab = make_lab(tmp_path, lab_size=5)
    record(lab, lab_plan())
    monkeypatch.setattr(lab_netns, "ip_json", lambda *args: [])  # no namespace exists
    assert lab.in_place_changes() is None
    (reason,) = lab.problems()
    assert reason.startswith("the lab was built differently: size 4 -> 5, cables 4 -> 5 (not changeable in place")
    assert "node1: namespace hd-node1 is missing" in reason
    other = make_lab(tmp_path, lab_size=5, lab_mgmt_subnet="198.19.92.0/24")
    assert other.in_place_changes() is None
    assert "not changeable in place: mgmt_subnet 198.19.91.0/24 -> 198.19.92.0/24" in other.problems()[0]


def fake_host(links, addrs=(), routes=()):
    def fake_ip_json(*args):
        if "addr" in args:
            return list(addrs)
        if "route" in args:
            return list(routes)
        return links

    return fake_ip_json


def test_the_factory_network_puts_detached_ports_back_in_bridge0(tmp_path, monkeypatch):
    lab = make_lab(tmp_path)
    node1 = lab.plan.hosts[0]
    # As setup.yml leaves a host: ports out of bridge0 with a /30 each, bridge0 down, a route.
    links = [
        {"ifname": "bridge0", "flags": ["BROADCAST"], "linkinfo": {"info_data": {"stp_state": 1}}},
        {"ifname": "tb0", "flags": ["UP", "LOWER_UP"], "mtu": 1500},
        {"ifname": "tb1", "flags": ["UP", "LOWER_UP"], "mtu": 9000, "master": "bridge0"},
    ]
    addrs = [
        {"ifname": "tb0", "addr_info": [
            {"family": "inet", "local": "10.0.0.1", "prefixlen": 30, "scope": "global"},
            {"family": "inet6", "local": "fe80::1", "prefixlen": 64, "scope": "link"},
        ]},
    ]  # fmt: skip
    routes = [
        {"dst": "10.0.0.0/30", "dev": "tb0", "protocol": "kernel"},
        {"dst": "10.9.0.0/24", "dev": "tb0", "gateway": "10.0.0.2"},
    ]
    monkeypatch.setattr(lab_netns, "ip_json", fake_host(links, addrs, routes))
    assert lab._factory_fixes(node1) == [
        "route del 10.9.0.0/24 dev tb0 via 10.0.0.2",
        "addr del 10.0.0.1/30 dev tb0",
        "link set tb0 master bridge0",
        "link set tb1 mtu 1500",
        "link set bridge0 up",
    ]
    # Already so: nothing to do (reported unchanged).
    factory = [
        {"ifname": "bridge0", "flags": ["UP"], "linkinfo": {"info_data": {"stp_state": 1}}},
        {"ifname": "tb0", "flags": ["UP"], "mtu": 1500, "master": "bridge0"},
        {"ifname": "tb1", "flags": ["UP"], "mtu": 1500, "master": "bridge0"},
    ]
    monkeypatch.setattr(lab_netns, "ip_json", fake_host(factory))
    assert lab._factory_fixes(node1) == []
    # bridge0 gone altogether: made again as at build, STP on.
    monkeypatch.setattr(lab_netns, "ip_json", fake_host(factory[1:]))
    fixes = lab._factory_fixes(node1)
    assert fixes[0] == lab._bridge_add(node1)
    assert fixes[0].endswith(" type bridge stp_state 1 hello_time 100 max_age 600 forward_delay 400")
    assert fixes[-1] == "link set bridge0 up"


def test_the_factory_network_names_what_it_cannot_do(tmp_path):
    lab = make_lab(tmp_path, lab_head=True)
    with pytest.raises(LabError, match="names node9, not a host of lab hd"):
        lab.factory_network(["node9"])
    with pytest.raises(LabError, match="head is the head node, which has no cables"):
        lab.factory_network(["head"])
    networkd = make_lab(tmp_path, lab_network_daemon="networkd")
    with pytest.raises(LabError, match="reboot the host to have it apply them \\(-e lab_reboot=node2\\)"):
        networkd.factory_network(["node2"])


def fake_machine(monkeypatch, holder: int, scanned) -> list[str]:
    """The lab's commands and host boots recorded instead of run: the ``ip`` lines, the files written per
    host; every host boots as ``holder``, ssh-keyscan answers ``scanned(host)``. Returns the record."""
    commands: list[str] = []

    def fake_run(cmd, stdin=None, check=True):
        commands.extend(" ".join(cmd[:-1]) + " : " + line for line in (stdin or "").splitlines())
        if not stdin:
            commands.append(" ".join(cmd))

    monkeypatch.setattr(lab_netns, "run", fake_run)
    monkeypatch.setattr(lab_netns, "ip_json", lambda *args: [{"ifname": "bridge0"}] if "-n" in args else [])
    monkeypatch.setattr(
        Lab, "_write_files", lambda self, hosts=None: commands.append(f"files {[h.name for h in hosts]}")
    )
    monkeypatch.setattr(Lab, "_start_holder", lambda self, h: holder)
    monkeypatch.setattr(Lab, "_wait_for_sshd", lambda self, hosts=None: None)
    monkeypatch.setattr(Lab, "_scan_host_keys", lambda self, hosts=None: [scanned(h) for h in hosts])
    return commands


def test_growing_a_ring_touches_only_the_cable_it_replaces_and_the_new_host(tmp_path, monkeypatch):
    lab = make_lab(tmp_path, lab_size=5)
    before = lab_plan()
    record(lab, before)
    commands = fake_machine(monkeypatch, 4242, lambda h: f"{h.mgmt_ip} ssh-ed25519 KEY")
    removed = lab.reshape(before, lab_netns.plan_diff(before, lab.plan))
    assert removed == ["cable node4:tb1-node1:tb1"]
    assert commands == [
        "ip -n hd-node4 -batch : link del tb1",
        "files ['node5']",
        "ip -batch : netns add hd-node5",
        "ip -batch : link add hd-m5 type veth peer name mgmt0 netns hd-node5",
        "ip -batch : link set hd-m5 master hd-mgmt",
        "ip -batch : link set hd-m5 up",
        "ip -batch : link add tb1 netns hd-node4 type veth peer name tb0 netns hd-node5",
        "ip -batch : link add tb1 netns hd-node5 type veth peer name tb1 netns hd-node1",
        "ip -n hd-node5 -batch : link set tb0 mtu 1500",
        "ip -n hd-node5 -batch : link set tb1 mtu 1500",
        "ip -n hd-node5 -batch : link set lo up",
        f"ip -n hd-node5 -batch : {lab._bridge_add(lab.plan.hosts[4])}",
        "ip -n hd-node5 -batch : link set tb0 master bridge0",
        "ip -n hd-node5 -batch : link set tb0 up",
        "ip -n hd-node5 -batch : link set tb1 master bridge0",
        "ip -n hd-node5 -batch : link set tb1 up",
        "ip -n hd-node5 -batch : link set bridge0 up",
        "ip -n hd-node5 -batch : addr add 198.19.91.6/24 dev mgmt0",
        "ip -n hd-node5 -batch : link set mgmt0 up",
        "ip -n hd-node4 -batch : link set tb1 mtu 1500",
        "ip -n hd-node4 -batch : link set tb1 master bridge0",
        "ip -n hd-node4 -batch : link set tb1 up",
        "ip -n hd-node1 -batch : link set tb1 mtu 1500",
        "ip -n hd-node1 -batch : link set tb1 master bridge0",
        "ip -n hd-node1 -batch : link set tb1 up",
    ]
    # node2 and node3, whose cables stay, are not touched at all.
    assert not [c for c in commands if "hd-node2" in c or "hd-node3" in c]
    state = lab.recorded()
    assert state["plan"] == lab.plan.as_dict()
    assert state["holders"] == {"node5": 4242}
    assert state["known_hosts"] == ["198.19.91.6 ssh-ed25519 KEY"]


def test_every_bridge0_has_a_mac_of_its_own_that_no_cable_changes(tmp_path):
    # Without one a Linux bridge takes its ports' lowest MAC: recabling would change it (and its STP id).
    lab = make_lab(tmp_path)
    macs = [lab._bridge_add(h).split()[4] for h in lab.plan.hosts]
    assert len(set(macs)) == 4
    assert all(int(mac[:2], 16) & 0b11 == 0b10 for mac in macs)  # locally administered, unicast
    assert macs == [make_lab(tmp_path, lab_size=5)._bridge_add(h).split()[4] for h in lab.plan.hosts]


def test_a_replaced_host_is_a_new_machine_in_the_same_ports_whose_key_known_hosts_trusts_only_later(
    tmp_path, monkeypatch
):
    lab = make_lab(tmp_path)
    record(lab, lab.plan)
    node3 = lab.plan.hosts[2]
    old_line = f"{node3.mgmt_ip} ssh-ed25519 {base64.b64encode(b'old machine').decode()}"
    new_line = f"{node3.mgmt_ip} ssh-ed25519 {base64.b64encode(b'new machine').decode()}"
    others = [f"{h.mgmt_ip} ssh-ed25519 {base64.b64encode(h.name.encode()).decode()}" for h in lab.plan.hosts]
    state = lab.recorded()
    state["known_hosts"] = sorted([old_line, *others[:2], others[3]])
    lab._save_state(state)
    commands = fake_machine(monkeypatch, 4343, lambda h: new_line)
    monkeypatch.setattr(Lab, "existing_netns", lambda self: [h.netns for h in self.plan.hosts])
    monkeypatch.setattr(Lab, "_kill_netns_processes", lambda self, netns: commands.append(f"kill {netns}"))
    monkeypatch.setattr(Lab, "_close_ssh_masters", lambda self: commands.append("close ssh masters"))
    lab.host_dir("node3").mkdir(parents=True)
    (lab.host_dir("node3") / "machine-id").write_text("old\n")

    with pytest.raises(LabError, match=r"lab_replace names node9, not a host of lab hd .*-e lab_replace=node2"):
        lab.replace(["node9"])
    done = lab.replace(["node3"])

    assert done["replaced"] == ["node3"]
    assert done["cables"] == ["node2:tb1-node3:tb0", "node3:tb1-node4:tb0"]
    fingerprint = "SHA256:" + base64.b64encode(hashlib.sha256(b"old machine").digest()).decode().rstrip("=")
    assert done["host_keys"]["node3"]["old"] == fingerprint
    assert done["host_keys"]["node3"]["new"].startswith("SHA256:") and done["host_keys"]["node3"]["new"] != fingerprint
    # The old machine is gone whole (its files too: a new host key and machine id are made), then the new one
    # comes in the same ports, cabled to the same peer ports.
    assert commands[:4] == [
        "ip -n hd-node2 -batch : link del tb1",
        "ip -n hd-node3 -batch : link del tb1",
        "kill hd-node3",
        "ip netns del hd-node3",
    ]
    assert not lab.host_dir("node3").exists()
    assert "files ['node3']" in commands
    assert "ip -batch : link add tb1 netns hd-node2 type veth peer name tb0 netns hd-node3" in commands
    assert "ip -batch : link add tb1 netns hd-node3 type veth peer name tb0 netns hd-node4" in commands
    assert not [c for c in commands if "hd-node1" in c]
    # known_hosts keeps the old machine's key (SSH refuses the new one) until the next run trusts the new key.
    state = lab.recorded()
    assert old_line in state["known_hosts"] and new_line not in state["known_hosts"]
    assert lab.untrusted() == [new_line]
    assert state["holders"]["node3"] == 4343  # the new machine's init, which settle() looks into
    assert lab.report()["known_hosts"] == state["known_hosts"]
    assert lab.trust_replaced() == ["node3"]
    state = lab.recorded()
    assert new_line in state["known_hosts"] and old_line not in state["known_hosts"] and len(state["known_hosts"]) == 4
    assert lab.untrusted() == [] and lab.trust_replaced() == []


def test_roots_home_on_a_host_is_its_own_with_the_distributions_dotfiles(tmp_path, monkeypatch):
    # Never the machine's ~/.bashrc (a version manager's init, whose shims and lock every host would share).
    dot = tmp_path / "dot.bashrc"
    dot.write_text("# the distribution's\n")
    monkeypatch.setitem(lab_netns.ROOT_HOME, ".bashrc", (str(tmp_path / "absent"), str(dot)))
    monkeypatch.setitem(lab_netns.ROOT_HOME, ".profile", (str(tmp_path / "absent"),))
    lab = make_lab(tmp_path)
    home = lab._root_home("node2")
    assert home == lab.host_dir("node2") / "root"
    assert sorted(p.name for p in home.iterdir()) == [".ansible", ".bashrc", ".cache", ".profile"]
    assert (home / ".bashrc").read_text() == "# the distribution's\n"
    assert (home / ".profile").read_text() == ""  # no such file anywhere: an empty one, never the machine's
    assert oct(home.stat().st_mode & 0o777) == oct(0o700)
    assert oct((home / ".cache").stat().st_mode & 0o777) == oct(0o700)
    # Built again: the dotfiles are the factory's again, the caches stay (as across a reboot).
    (home / ".bashrc").write_text("changed on the host\n")
    (home / ".cache" / "pip").mkdir()
    lab._root_home("node2")
    assert (home / ".bashrc").read_text() == "# the distribution's\n"
    assert (home / ".cache" / "pip").is_dir()
