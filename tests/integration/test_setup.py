"""setup.yml on real labs: bridge out, discovery, plan, one /30 per cable, pings, idempotence."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import time
from collections import Counter

from .conftest import ENV, RECAP, REPO, ip_json, ping_hosts, run_playbook, sh

POOL = ipaddress.IPv4Network("198.18.128.0/17")


def setup(lab, artifacts, *extra):
    return run_playbook("setup.yml", "-e", f"meshkit_artifacts_dir={artifacts}", *extra, inventory=str(lab.inventory))


def netns_of(lab) -> dict[str, str]:
    return {name: h["meshkit_lab_netns"] for name, h in lab.hosts().items()}


def pool_addresses(ns: str) -> dict[str, str]:
    """{port: address/prefix} of the cable pool's addresses inside one host."""
    out = {}
    for link in ip_json("-n", ns, "addr", "show"):
        for a in link.get("addr_info", []):
            if a["family"] == "inet" and ipaddress.IPv4Address(a["local"]) in POOL:
                out[link["ifname"]] = f"{a['local']}/{a['prefixlen']}"
    return out


def snapshot(lab) -> dict[str, object]:
    """Addresses, routes and bridge membership of every host, for comparing before/after."""
    state = {}
    for name, ns in netns_of(lab).items():
        links = ip_json("-n", ns, "link", "show")
        state[name] = {
            "addrs": sorted(
                (link["ifname"], a["local"], a["prefixlen"])
                for link in ip_json("-n", ns, "addr", "show")
                for a in link.get("addr_info", [])
            ),
            "routes": sorted(json.dumps(r, sort_keys=True) for r in ip_json("-n", ns, "route", "show")),
            "masters": sorted((link["ifname"], link.get("master", "")) for link in links),
            "up": sorted(link["ifname"] for link in links if "UP" in link.get("flags", [])),
        }
    return state


def true_cables(lab) -> Counter:
    return Counter(tuple(sorted((e["host"], e["port"]) for e in c["ends"])) for c in lab.cabling()["cables"])


def plan_cables(plan: dict) -> Counter:
    return Counter(tuple(sorted((e["host"], e["port"]) for e in c["ends"])) for c in plan["cables"])


def check_converged(lab, artifacts) -> dict:
    """Discovery found exactly the true cabling; each cable has a /30 on both ends and pings
    across from both ends; bridge0 has no members."""
    plan = json.loads((artifacts / "plan.json").read_text())
    assert plan_cables(plan) == true_cables(lab)
    netns = netns_of(lab)
    for c in plan["cables"]:
        a, b = c["ends"]
        net = ipaddress.IPv4Network(c["network"])
        assert net.prefixlen == 30 and net.subnet_of(POOL)
        assert {a["address"], b["address"]} == {str(h) for h in net.hosts()}
        for mine, theirs in ((a, b), (b, a)):
            assert pool_addresses(netns[mine["host"]]).get(mine["port"]) == f"{mine['address']}/30"
            ping = sh(
                "ip",
                "netns",
                "exec",
                netns[mine["host"]],
                "ping",
                "-c",
                "1",
                "-W",
                "2",
                "-I",
                mine["port"],
                theirs["address"],
                check=False,
            )
            assert ping.returncode == 0, (mine, theirs, ping.stdout)
    for name, ns in netns.items():
        assert ip_json("-n", ns, "link", "show", "master", "bridge0") == [], name
    return plan


def test_mesh4_converges_is_idempotent_and_reports_a_cabling_change(make_lab, tmp_path):
    lab = make_lab(lab_size=4, lab_shape="mesh")
    assert lab.up().rc == 0
    first = setup(lab, tmp_path)
    assert first.rc == 0, first.output
    plan = check_converged(lab, tmp_path)
    assert plan["mesh"] is True
    assert plan["ring"] == ["node1", "node2", "node3", "node4"]
    assert plan["backend"] == "ring"
    assert "cables: 6 (full mesh)" in first.output

    second = setup(lab, tmp_path)
    assert second.rc == 0, second.output
    assert set(second.recap) == {"node1", "node2", "node3", "node4"}
    assert all(r["changed"] == 0 for r in second.recap.values()), second.output

    # Pull one cable: the next run reports it against the recorded plan.
    sh("ip", "-n", netns_of(lab)["node1"], "link", "del", "tb2")
    third = setup(lab, tmp_path)
    assert third.rc == 0, third.output
    assert "cabling changed since the last plan" in third.output
    assert "removed node1:tb2 <-> node4:tb0" in third.output
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"] is False
    assert plan["missing_mesh"] == [["node1", "node4"]]


def test_ring5_converges(make_lab, tmp_path):
    lab = make_lab(lab_size=5, lab_shape="ring")
    assert lab.up().rc == 0
    run = setup(lab, tmp_path, "-e", "meshkit_backend=ring")
    assert run.rc == 0, run.output
    plan = check_converged(lab, tmp_path)
    assert plan["ring"] == ["node1", "node2", "node3", "node4", "node5"]
    assert plan["backend"] == "ring"
    assert plan["mesh"] is False


def test_line3_ring_backend_fails_naming_the_missing_cable_and_without_it_still_gets_addresses(make_lab, tmp_path):
    lab = make_lab(lab_size=3, lab_shape="line")
    assert lab.up().rc == 0
    run = setup(lab, tmp_path, "-e", "meshkit_backend=ring")
    assert run.rc != 0
    assert "backend ring needs a ring through all 3 hosts; missing cable(s): node1 <-> node3" in run.output
    for ns in netns_of(lab).values():
        assert pool_addresses(ns) == {}
    # The same line with the backend left automatic: no backend, every cable addressed.
    run = setup(lab, tmp_path)
    assert run.rc == 0, run.output
    plan = check_converged(lab, tmp_path)
    assert plan["backend"] == ""
    assert len(plan["cables"]) == 2
    assert "backend: none" in run.output


def test_doubled_cables_give_parallel_rings(make_lab, tmp_path):
    lab = make_lab(lab_cables=[[1, 2], [1, 2], [2, 3], [2, 3], [3, 1], [3, 1]])
    assert lab.up().rc == 0
    run = setup(lab, tmp_path)
    assert run.rc == 0, run.output
    plan = check_converged(lab, tmp_path)
    assert len(plan["cables"]) == 6
    assert len({c["network"] for c in plan["cables"]}) == 6
    assert len(plan["rings"]) == 2
    assert "(2 parallel rings)" in run.output


def test_sixteen_host_ring(make_lab, tmp_path):
    """setup.yml's network at scale: bridge, discovery, plan, addresses and hostfiles on 16 hosts.
    meshccl's install (a venv with numpy per host, most of the time here) is left out: it is the same
    per host, and the 4-host labs prove it (test_launch.py)."""
    lab = make_lab(lab_size=16, lab_shape="ring")
    assert lab.up().rc == 0
    start = time.monotonic()
    run = setup(lab, tmp_path, "-e", "meshkit_meshccl_install=false")
    elapsed = time.monotonic() - start
    assert run.rc == 0, run.output
    print(f"\nsetup.yml on a 16-host ring lab: {elapsed:.1f} s")
    plan = check_converged(lab, tmp_path)
    assert len(plan["cables"]) == 16
    assert len(plan["ring"]) == 16


BAD_INVENTORY = [
    (["-e", "meshkit_backend=rung"], "meshkit_backend = 'rung': unallowed value rung"),
    (["-e", "meshkit_mtu=big"], "meshkit_mtu = 'big'"),
    (["-e", "meshkit_address_pool=10.0.0.1/8"], "meshkit_address_pool = '10.0.0.1/8': not an IPv4 network"),
    (["-e", "meshkit_backnd=ring"], "meshkit_backnd is not a meshkit variable; did you mean meshkit_backend?"),
]


def test_bad_inventory_and_management_in_the_bridge_are_refused_before_any_host_is_touched(make_lab, tmp_path):
    lab = make_lab(lab_size=2, lab_shape="line")
    assert lab.up().rc == 0
    before = snapshot(lab)
    for extra, message in BAD_INVENTORY:
        run = setup(lab, tmp_path, *extra)
        assert run.rc != 0
        assert "node1, node2: " + message in run.output, run.output
        assert "nothing was changed on any host" in run.output
    assert snapshot(lab) == before

    ns = netns_of(lab)["node1"]
    ip = lab.hosts()["node1"]["ansible_host"]
    prefix = lab.subnet.split("/")[1]
    # node1's management address moves onto bridge0, with mgmt0 as a member (as on a Mac
    # reached over its Thunderbolt Bridge). STP off so the port forwards at once.
    for cmd in (
        ["link", "set", "bridge0", "type", "bridge", "stp_state", "0"],
        ["addr", "del", f"{ip}/{prefix}", "dev", "mgmt0"],
        ["link", "set", "mgmt0", "master", "bridge0"],
        ["addr", "add", f"{ip}/{prefix}", "dev", "bridge0"],
    ):
        sh("ip", "-n", ns, *cmd)
    before = snapshot(lab)
    run = setup(lab, tmp_path)
    assert run.rc != 0
    assert "node1: the management connection runs over bridge0 itself" in run.output
    # Refused in the first step, before node2 (whose own management is fine) changed either.
    assert snapshot(lab) == before


def test_check_mode_on_a_fresh_lab_changes_nothing_and_a_host_lost_mid_run_stops_every_host(make_lab, tmp_path):
    """--check on a fresh lab says what it would change and changes nothing. Then node2's management
    link goes down once its peer ports are out of the bridge: every host stops, the failure names
    node2 and the step it was in, and once node2 is back a re-run converges with nothing lost."""
    lab = make_lab(lab_size=3, lab_shape="ring")
    assert lab.up().rc == 0
    before = snapshot(lab)
    run = setup(lab, tmp_path, "--check", "--diff")
    assert run.rc == 0, run.output
    assert sum(r["changed"] for r in run.recap.values()) > 0  # it says what it would change
    assert "bridge0 members: tb0, tb1" in run.output
    assert "not probed (still in a bridge" in run.output
    assert snapshot(lab) == before
    assert not (tmp_path / "plan.json").exists()

    ns = netns_of(lab)
    cmd = ["ansible-playbook", "setup.yml", "-i", str(lab.inventory), "-e", f"meshkit_artifacts_dir={tmp_path}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=REPO)
    try:
        # The bridge step has run on node2 when its peer ports are no longer in bridge0.
        deadline = time.monotonic() + 120
        while ip_json("-n", ns["node2"], "link", "show", "master", "bridge0") and proc.poll() is None:
            assert time.monotonic() < deadline, "node2's ports never left bridge0"
            time.sleep(0.05)
        sh("ip", "-n", ns["node2"], "link", "set", "mgmt0", "down")
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        sh("ip", "-n", ns["node2"], "link", "set", "mgmt0", "up")
    assert proc.returncode != 0, output
    recap = {m.group(1): int(m.group(4)) for m in RECAP.finditer(output)}
    assert recap.get("node2") == 1, output  # unreachable=1
    # The failure names the host and the step: the task header right before node2's UNREACHABLE.
    lost = re.search(r"TASK \[([^\]]+)\][^\n]*\n(?:(?!TASK \[).*\n)*?fatal: \[node2\]: UNREACHABLE!", output)
    assert lost, output
    step = lost.group(1)
    # Every host stopped at that step: no task after it ran anywhere.
    after = output[lost.end() :]
    assert "TASK [" not in after.split("PLAY RECAP")[0], output
    # The other hosts finished what they started (the bridge step) and were left alone after it:
    # their peer ports are out of the bridge, and no pool address reached any host yet unless the
    # step that failed was the address step itself.
    for name in ("node1", "node3"):
        assert ip_json("-n", ns[name], "link", "show", "master", "bridge0") == [], name
    print(f"\nnode2 lost during: {step}")

    # node2 is back: a re-run converges everything, every cable addressed and pinging.
    deadline = time.monotonic() + 60
    while ping_hosts(lab).get("node2") != "SUCCESS":
        assert time.monotonic() < deadline, "node2 did not come back"
    again = setup(lab, tmp_path)
    assert again.rc == 0, again.output
    check_converged(lab, tmp_path)
