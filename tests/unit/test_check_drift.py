"""`meshkit check`'s configuration drift: the host facts the launch agent reads (module_utils/host_facts.py:
MTU, speed, routes per planned port; RDMA sysfs next to torch.env) and drift() turning them into flags.

The network half runs the agent as `meshkit launch` ships it (its sources over stdin, through nsenter)
in two real network namespaces cabled by veth pairs, each drifted a different way; the RDMA half reads
the recorded sysfs trees of tests/fixtures/rdma (SOURCES.md) with torch.env written by setup.yml's own
writers (rdma.nccl_env, hostfiles.torch_env)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import hostfiles, rdma
from ansible_collections.meshkit.cluster.plugins.module_utils.host_facts import ZERO_GID, env_file, host_facts

from meshkit import launch_fast
from meshkit.check_drift import FLAGS, cable_key, display, drift
from meshkit.topology import Observation, build_plan

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "rdma" / "sysfs"
SSH = {"node1": "10.9.0.1", "node2": "10.9.0.2"}


def plan_of(pairs: list[tuple[int, int]], n: int, network: str = "198.18.250.0/24") -> dict[str, Any]:
    """A plan for cables between host numbers, ports tb0, tb1, ... in cable order per host."""
    used = dict.fromkeys(range(1, n + 1), 0)
    obs = []
    for a, b in pairs:
        pa, pb = f"tb{used[a]}", f"tb{used[b]}"
        used[a] += 1
        used[b] += 1
        obs.append(Observation(f"node{a}", pa, f"id-{a}-{pa}", [f"id-{b}-{pb}"]))
        obs.append(Observation(f"node{b}", pb, f"id-{b}-{pb}", [f"id-{a}-{pa}"]))
    return build_plan([f"node{i}" for i in range(1, n + 1)], obs, network, "", False).as_dict()


def link_of(plan: dict[str, Any], host: str, port: str) -> dict[str, Any]:
    return next(link for link in plan["per_host"][host] if link["port"] == port)


def key_of(plan: dict[str, Any], host: str, port: str) -> str:
    for cable in plan["cables"]:
        a, b = cable["ends"]
        if (host, port) in ((a["host"], a["port"]), (b["host"], b["port"])):
            return cable_key(a, b)
    raise KeyError((host, port))


def found(items: list[dict[str, Any]]) -> set[tuple[str, str, str | None]]:
    return {(i["flag"], i["where"], i["cable"]) for i in items}


# ---- the network half: two real hosts --------------------------------------------------------------


def ip(command: str) -> str:
    """``ip`` with a command line of plain words (names and addresses here have no spaces)."""
    return subprocess.run(["ip", *command.split()], check=True, capture_output=True, text=True, timeout=10).stdout


def wait_for(condition, what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def two_hosts() -> Iterator[dict[str, Any]]:
    """node1 and node2: a network namespace each, with a holder process (as the lab's hosts have)
    entered with nsenter, cabled tb0..tb3 <-> tb0..tb3 as plan_of plans them, addressed and routed as
    peer_network leaves them. Removed whatever happens."""
    if os.geteuid() != 0:
        pytest.fail("needs root: builds network namespaces (the project's tests run as root)")
    tag = f"mkdrift{os.getpid()}"
    names = {"node1": f"{tag}-1", "node2": f"{tag}-2"}
    plan = plan_of([(1, 2)] * 4, 2)
    holders: list[subprocess.Popen] = []
    made: list[str] = []
    try:
        for ns in names.values():
            ip(f"netns add {ns}")
            made.append(ns)
            ip(f"-n {ns} link set lo up")
        for cable in plan["cables"]:
            a, b = cable["ends"]
            ends = f"{a['port']} netns {names[a['host']]} type veth peer name {b['port']} netns {names[b['host']]}"
            ip(f"link add {ends}")
        for host, ns in names.items():
            for link in plan["per_host"][host]:
                port, address = link["port"], link["address"]
                ip(f"-n {ns} link set {port} up")
                ip(f"-n {ns} addr add {address}/{link['prefix']} dev {port}")
                ip(f"-n {ns} route replace {link['peer_address']}/32 dev {port} src {address}")
        connections = {}
        me = os.stat("/proc/self/ns/net").st_ino
        for host, ns in names.items():
            holder = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"])
            holders.append(holder)
            pid = holder.pid

            def entered(pid: int = pid) -> bool:
                # exec'd into sleep: ip has switched the network namespace and mounted its sysfs.
                return (
                    os.stat(f"/proc/{pid}/ns/net").st_ino != me and Path(f"/proc/{pid}/comm").read_text() == "sleep\n"
                )

            wait_for(entered, f"{host}'s holder in {ns}")
            connections[host] = {"kind": "nsenter", "pid": pid}
        yield {"plan": plan, "netns": names, "connections": connections}
    finally:
        for holder in holders:
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=10)
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=10)


def ask(hosts: dict[str, Any], state_dir: Path, **extra: Any) -> dict[str, dict[str, Any]]:
    """Every host's facts, asked as `meshkit launch` asks them (launch_fast.run_checks)."""
    specs = {
        host: {
            "state_dir": str(state_dir),
            "links": hosts["plan"]["per_host"][host],
            "peer_ports": ["tb*"],
            "management_interface": "",
            "arp_wait": 0.3,
            **extra,
        }
        for host in hosts["connections"]
    }
    answers = launch_fast.run_checks(hosts["connections"], specs, timeout=60)
    for host, answer in answers.items():
        assert "error" not in answer, f"{host}: {answer}"
    return {host: answer["facts"] for host, answer in answers.items()}


def test_a_clean_cabling_has_no_drift_and_the_facts_say_mtu_speed_and_no_extra_routes(two_hosts, tmp_path):
    facts = ask(two_hosts, tmp_path)
    plan = two_hosts["plan"]
    for host in ("node1", "node2"):
        ports = facts[host]["ports"]
        assert sorted(ports) == ["tb0", "tb1", "tb2", "tb3"]
        for port, info in ports.items():
            link = link_of(plan, host, port)
            assert info["up"] is True
            assert info["addresses"] == [f"{link['address']}/{link['prefix']}"]
            assert info["route"] == port
            assert info["mtu"] == 1500
            assert info["speed_mbps"] == 10000  # veth's; read from the namespace's own sysfs
            assert info["routes"] == []  # the /30 and the peer's /32 are the plan's
        assert facts[host]["unplanned"] == []
        assert "rdma" not in facts[host]
    assert drift(plan, facts) == []


def test_every_kind_of_network_drift_is_flagged_on_its_port_and_cable(two_hosts, tmp_path):
    plan, ns = two_hosts["plan"], two_hosts["netns"]
    n1, n2 = ns["node1"], ns["node2"]
    peer_of_tb1 = link_of(plan, "node1", "tb1")["peer_address"]
    # tb0: an MTU of 9000 at node1 only, a stray address and a stray route on node1's end.
    ip(f"-n {n1} link set tb0 mtu 9000")
    ip(f"-n {n1} addr add 198.18.251.1/24 dev tb0")
    ip(f"-n {n1} route add 198.18.252.0/24 dev tb0")
    # tb1: node1's route to node2:tb1 moved onto tb0; node2:tb1 lost its address.
    ip(f"-n {n1} route replace {peer_of_tb1}/32 dev tb0")
    tb1 = link_of(plan, "node2", "tb1")
    ip(f"-n {n2} addr del {tb1['address']}/{tb1['prefix']} dev tb1")
    # tb2: down at node2 (node1's end loses carrier).
    ip(f"-n {n2} link set tb2 down")
    # A new cable the plan does not have: node1:tb9 <-> node2:u9 (u9 matches no peer port pattern).
    ip(f"link add tb9 netns {n1} type veth peer name u9 netns {n2}")
    ip(f"-n {n1} link set tb9 up")
    ip(f"-n {n2} link set u9 up")
    wait_for(lambda: "LOWER_UP" in ip(f"-n {n1} link show tb9"), "tb9's carrier")

    facts = ask(two_hosts, tmp_path)
    p1, p2 = facts["node1"]["ports"], facts["node2"]["ports"]
    assert (p1["tb0"]["mtu"], p2["tb0"]["mtu"]) == (9000, 1500)
    assert sorted(p1["tb0"]["routes"]) == sorted(["198.18.251.0/24", "198.18.252.0/24", peer_of_tb1])
    assert p1["tb1"]["route"] == "tb0"
    assert p2["tb1"]["addresses"] == []
    assert p2["tb2"]["up"] is False and p1["tb2"]["up"] is False
    assert p2["tb2"]["speed_mbps"] is None  # a down port's speed is unreadable
    assert facts["node1"]["unplanned"] == ["tb9"] and facts["node2"]["unplanned"] == []

    items = drift(plan, facts)
    k = {port: key_of(plan, "node1", port) for port in ("tb0", "tb1", "tb2", "tb3")}
    assert found(items) == {
        ("mtu-mismatch", display(k["tb0"]), k["tb0"]),
        ("address-unplanned", "node1:tb0", k["tb0"]),
        ("route-unplanned", "node1:tb0", k["tb0"]),  # 198.18.252.0/24 and the moved host route: two items
        ("route-wrong-port", "node1:tb1", k["tb1"]),
        ("address-missing", "node2:tb1", k["tb1"]),
        ("port-down", "node1:tb2", k["tb2"]),
        ("port-down", "node2:tb2", k["tb2"]),
        ("port-unplanned", "node1:tb9", None),
    }
    assert not any(i["cable"] == k["tb3"] for i in items)  # the untouched cable
    assert {i["flag"] for i in items} <= set(FLAGS)

    def detail(flag: str, where: str) -> str:
        (text,) = [i["detail"] for i in items if (i["flag"], i["where"]) == (flag, where)]
        return text

    assert detail("mtu-mismatch", display(k["tb0"])).startswith("node1:tb0 mtu 9000, node2:tb0 mtu 1500: ")
    assert display(k["tb0"]) == "node1:tb0 \u2194 node2:tb0"
    stray = detail("address-unplanned", "node1:tb0")
    assert (
        "198.18.251.1/24 besides its planned 198.18.250.1/30" in stray
        and "ip addr del 198.18.251.1/24 dev tb0" in stray
    )
    # Two stray routes; the stray address's own /24 is address-unplanned's, not a third route item.
    routes = sorted(i["detail"] for i in items if i["flag"] == "route-unplanned")
    assert routes == sorted(
        f"node1:tb0 carries a route to {dst} that the plan does not have (traffic for it goes to node2:tb0): "
        f"remove it (`ip route del {dst} dev tb0`) and whatever re-adds it"
        for dst in ("198.18.252.0/24", peer_of_tb1)
    )
    assert f"to {peer_of_tb1} (node2:tb1) leaves through tb0, not tb1" in detail("route-wrong-port", "node1:tb1")
    missing = detail("address-missing", "node2:tb1")
    assert f"lacks its planned address {tb1['address']}/30 (has no IPv4 address)" in missing
    assert "is gone meanwhile" in missing  # the route went with the address; no second item for it
    assert "no carrier from node1:tb2" in detail("port-down", "node2:tb2")
    assert "run setup.yml to plan it" in detail("port-unplanned", "node1:tb9")


# ---- the RDMA half: recorded sysfs trees -------------------------------------------------------------


def write_torch_env(state_dir: Path, plan: dict[str, Any], host: str, nccl: dict[str, str]) -> None:
    """torch.env as setup.yml's hostfiles module writes it."""
    (state_dir / "hostfiles").mkdir(parents=True, exist_ok=True)
    text = hostfiles.torch_env(plan, host, SSH, 1, 29500, nccl, "fp")
    (state_dir / "hostfiles" / "torch.env").write_text(text)


def rdma_facts(tree: Path, state_dir: Path) -> dict[str, Any]:
    """node1's facts as the agent reports them (Linux, no planned link: only the RDMA part matters)."""
    return host_facts({"state_dir": str(state_dir), "rdma": True, "sysfs_root": str(tree), "links": []})


def rdma_setup(tmp_path: Path, case: str, fabric: list[str]) -> tuple[Path, dict[str, Any], dict[str, str]]:
    """A copy of a recorded tree (to drift it) and the torch.env setup.yml would write from it."""
    tree = tmp_path / "sys"
    shutil.copytree(SYSFS / case, tree)
    plan = plan_of([(1, 2)], 2)
    nccl = rdma.nccl_env(rdma.read_sysfs(str(tree)), fabric)
    write_torch_env(tmp_path / "state", plan, "node1", nccl)
    return tree, plan, nccl


def test_torch_env_is_read_back_as_written(tmp_path):
    tree, _plan, nccl = rdma_setup(tmp_path, "roce_v1v2_ipv4_index5_cx5", ["tb0"])
    assert nccl["NCCL_IB_HCA"] == "=rocep0s6:1" and nccl["NCCL_IB_GID_INDEX"] == "5"
    got = rdma_facts(tree, tmp_path / "state")["rdma"]
    assert got["env"] == {"NCCL_IB_HCA": "=rocep0s6:1", "NCCL_IB_GID_INDEX": "5"}
    assert env_file("A='x y'\n# c\nB=\nC=\"q\"\n") == {"A": "x y", "B": "", "C": "q"}


def test_rdma_as_setup_left_it_has_no_drift(tmp_path):
    tree, plan, _nccl = rdma_setup(tmp_path, "roce_v1v2_ipv4_index5_cx5", ["tb0"])
    assert drift(plan, {"node1": rdma_facts(tree, tmp_path / "state")}) == []
    tree2 = tmp_path / "other"
    shutil.copytree(SYSFS / "port_down", tree2)
    nccl = rdma.nccl_env(rdma.read_sysfs(str(tree2)), ["tb0"])
    assert nccl["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1,mlx5_7:1"
    write_torch_env(tmp_path / "state2", plan, "node1", nccl)
    assert drift(plan, {"node1": rdma_facts(tree2, tmp_path / "state2")}) == []


def test_a_listed_port_gone_down_is_rdma_drift(tmp_path):
    tree, plan, _nccl = rdma_setup(tmp_path, "roce_v1v2_ipv4_index5_cx5", ["tb0"])
    (tree / "class/infiniband/rocep0s6/ports/1/state").write_text("1: DOWN\n")
    items = drift(plan, {"node1": rdma_facts(tree, tmp_path / "state")})
    assert found(items) == {("rdma-drift", "node1", None)}
    assert items[0]["detail"] == (
        "node1: rocep0s6 port 1 is DOWN, but torch.env's NCCL_IB_HCA==rocep0s6:1 lists it: "
        "check its link (`ibstat`, `rdma link`), then run setup.yml"
    )


def test_the_ipv4_gid_at_another_index_or_gone_is_rdma_drift(tmp_path):
    tree, plan, nccl = rdma_setup(tmp_path, "roce_v1v2_ipv4_index5_cx5", ["tb0"])
    write_torch_env(tmp_path / "state", plan, "node1", nccl | {"NCCL_IB_GID_INDEX": "3"})
    items = drift(plan, {"node1": rdma_facts(tree, tmp_path / "state")})
    assert [i["detail"] for i in items] == [
        "node1: rocep0s6 port 1: its RoCE v2 IPv4-mapped GID (::ffff:10.0.3.1) is at index 5, torch.env says "
        "NCCL_IB_GID_INDEX=3: run setup.yml to rewrite torch.env"
    ]
    # The interface lost its IPv4 address: the kernel empties its IPv4 GID slots.
    write_torch_env(tmp_path / "state", plan, "node1", nccl)
    port = tree / "class/infiniband/rocep0s6/ports/1"
    for index in ("4", "5"):
        (port / "gids" / index).write_text(ZERO_GID + "\n")
        (port / "gid_attrs/types" / index).unlink()
    items = drift(plan, {"node1": rdma_facts(tree, tmp_path / "state")})
    assert [i["flag"] for i in items] == ["rdma-drift"]
    assert (
        "rocep0s6 port 1 has no RoCE v2 IPv4-mapped GID now, torch.env says NCCL_IB_GID_INDEX=5" in items[0]["detail"]
    )


def test_rdma_drift_on_a_planned_port_is_that_cables(tmp_path):
    # mlx5_7's netdev is net1: a plan whose node1 port is net1 puts the item on that cable.
    tree, _plan, nccl = rdma_setup(tmp_path, "port_down", ["net1"])
    plan = plan_of([(1, 2)], 2)
    for link in plan["per_host"]["node1"]:
        link["port"] = "net1"
    end = plan["cables"][0]["ends"][0]
    assert end["host"] == "node1"
    end["port"] = "net1"
    write_torch_env(tmp_path / "state", plan, "node1", nccl | {"NCCL_IB_GID_INDEX": "3"})
    items = drift(plan, {"node1": rdma_facts(tree, tmp_path / "state")})
    key = cable_key(*plan["cables"][0]["ends"])
    # mlx5_7 (Ethernet, ACTIVE, no IPv4 GID in the recording) on net1; mlx5_0 (Ethernet, gid 0 zero) on no port.
    assert found(items) == {("rdma-drift", "node1:net1", key), ("rdma-drift", "node1", None)}
    assert key == "node1:net1 <-> node2:tb0"


def test_a_listed_device_that_is_gone_and_rdma_disabled_while_active_are_rdma_drift(tmp_path):
    tree, plan, _nccl = rdma_setup(tmp_path, "roce_v1v2_ipv4_index5_cx5", ["tb0"])
    write_torch_env(tmp_path / "state", plan, "node1", {"NCCL_IB_HCA": "=mlx5_9:1", "NCCL_IB_GID_INDEX": "5"})
    items = drift(plan, {"node1": rdma_facts(tree, tmp_path / "state")})
    assert [i["detail"] for i in items] == [
        f"node1: torch.env's NCCL_IB_HCA==mlx5_9:1 names mlx5_9:1, which {tree}/class/infiniband does not have: "
        "the adapter is gone or renamed; run setup.yml to rewrite the hostfiles"
    ]
    write_torch_env(tmp_path / "state", plan, "node1", {"NCCL_IB_DISABLE": "1"})
    items = drift(plan, {"node1": rdma_facts(tree, tmp_path / "state")})
    assert [i["detail"] for i in items] == [
        "node1: torch.env disables RDMA (NCCL_IB_DISABLE=1) but rocep0s6:1 ACTIVE now: run setup.yml to use it"
    ]


def test_an_unreadable_state_is_not_called_down_and_a_prefix_list_needs_one_active(tmp_path):
    # roce_two_devices_index3 has no state files (show_gids does not print state): UNKNOWN, not DOWN.
    tree, plan, _nccl = rdma_setup(tmp_path, "roce_two_devices_index3", ["tb0"])
    write_torch_env(tmp_path / "state", plan, "node1", {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1"})
    assert drift(plan, {"node1": rdma_facts(tree, tmp_path / "state")}) == []
    # A hand-written prefix list ("mlx5"): one ACTIVE port of it is enough.
    tree2 = tmp_path / "pd"
    shutil.copytree(SYSFS / "port_down", tree2)
    write_torch_env(tmp_path / "s2", plan, "node1", {"NCCL_IB_HCA": "mlx5"})
    assert drift(plan, {"node1": rdma_facts(tree2, tmp_path / "s2")}) == []
    write_torch_env(tmp_path / "s2", plan, "node1", {"NCCL_IB_HCA": "=mlx5_2"})
    assert [i["detail"].split(",")[0] for i in drift(plan, {"node1": rdma_facts(tree2, tmp_path / "s2")})] == [
        "node1: mlx5_2 port 1 is DOWN"
    ]
    write_torch_env(tmp_path / "s2", plan, "node1", {"NCCL_IB_HCA": "^=mlx5_2"})  # excluded: not checked
    assert drift(plan, {"node1": rdma_facts(tree2, tmp_path / "s2")}) == []


# ---- hosts that report no ports ------------------------------------------------------------------------


def port(mtu: int | None, **over: Any) -> dict[str, Any]:
    return {"exists": True, "up": True, "addresses": [], "route": None, "mtu": mtu, "routes": []} | over


def test_a_host_without_port_facts_gets_no_item_and_no_mtu_comparison():
    plan = plan_of([(1, 2), (2, 3)], 3)
    linux = {
        "platform": "linux",
        "ports": {
            link["port"]: port(9000, addresses=[f"{link['address']}/{link['prefix']}"], route=link["port"])
            for link in plan["per_host"]["node2"]
        },
        "unplanned": [],
    }
    facts = {
        "node1": {"platform": "darwin", "fingerprint": "x", "torch_env": None},  # macOS stops before the ports
        "node2": linux,
        # node3 did not answer; the agent's answer shape is accepted too.
        "node3": {"error": "no answer within 90 s"},
    }
    assert drift(plan, facts) == []
    # The same Linux host as an agent answer, against a Linux node3 with another MTU: that cable only.
    node3 = {
        "platform": "linux",
        "ports": {"tb0": port(1500, addresses=[f"{link_of(plan, 'node3', 'tb0')['address']}/30"], route="tb0")},
    }
    items = drift(plan, {"node1": facts["node1"], "node2": {"preflight": {}, "facts": linux}, "node3": node3})
    assert found(items) == {("mtu-mismatch", "node2:tb1 \u2194 node3:tb0", "node2:tb1 <-> node3:tb0")}
    assert items[0]["detail"].startswith("node2:tb1 mtu 9000, node3:tb0 mtu 1500: frames over 1500 bytes are dropped")


def test_a_missing_port_is_port_down_naming_the_cable():
    plan = plan_of([(1, 2)], 2)
    items = drift(plan, {"node1": {"platform": "linux", "ports": {"tb0": {"exists": False}}, "unplanned": []}})
    assert found(items) == {("port-down", "node1:tb0", "node1:tb0 <-> node2:tb0")}
    assert items[0]["detail"].startswith(
        "node1:tb0 does not exist on node1 (adapter removed or renamed; cable to node2:tb0)"
    )


def test_every_drift_flag_has_its_runbook_entry():
    runbook = (Path(__file__).resolve().parents[2] / "docs" / "runbooks" / "check.md").read_text()
    for flag in (*FLAGS, "unreachable", "slow", "slow-under-load", "asymmetric", "lossy", "busbw-low", "not-ready"):
        assert f"\n## {flag}\n" in runbook, flag
