"""host_ports and host_network: several host steps in one module call (issue 23), on recorded `ip -j`
outputs of a lab host (tests/fixtures/linux/) and a recorded RDMA sysfs tree: each step sees its own
options, a step's failure names it and stops the steps after it, check mode changes nothing."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ansible_collections.meshkit.cluster.plugins.modules import host_network, host_ports

from .module_harness import Fail
from .test_modules_linux import MGMT, NETWORKD, POOL, PORT, RUNTIME, linux, recorded  # noqa: F401

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "rdma" / "sysfs"
NEIGH = {("ip", "-j", "-6", "neigh", "show"): (0, "[]", "")}


def links(tmp_path: Path) -> dict:
    return {"ports": [PORT], "pool": POOL, "peer_ports": ["tb*"], "management_address": MGMT,
            "networkd_dir": str(tmp_path / "networkd")}  # fmt: skip


def test_host_network_addresses_pings_and_makes_the_jobs_directory_in_one_call(linux, tmp_path):  # noqa: F811
    jobs = tmp_path / "state" / "jobs"
    args = {
        "links": links(tmp_path),
        "ping": {"count": 1, "fail": False, "host": "node1"},
        "rdma": {"sysfs_root": str(SYSFS / "roce_v2_ipv4_ipv6")},
        "directories": [{"path": str(jobs), "mode": "1777"}],
    }
    result, mutating = linux(host_network, args, {**recorded("converged"), **NETWORKD})
    # The cable end has its address already: only networkd's drop-in is new. That is a change: the far
    # end may be changing too, so no ping now (the caller pings again once every host is done).
    assert mutating == [["networkctl", "reload"]]
    assert result["links"]["files"] == [str(tmp_path / "networkd" / "00-meshkit-tb0.network.d" / "50-address.conf")]
    assert result["reping"] is True and "ping" not in result
    assert result["ansible_facts"] == {"meshkit_rdma": result["rdma"]}
    assert result["changed"] is True
    assert stat.S_IMODE(os.stat(jobs).st_mode) == 0o1777
    assert [d["after_header"] for d in result["diff"]] == ["links", str(jobs)]
    # Nothing to change: one call addresses nothing, pings the cable (it answered: rc 0), reads RDMA.
    again, mutating = linux(host_network, args, {**recorded("converged"), **NETWORKD})
    assert again["changed"] is False and again["reping"] is False and "diff" not in again
    assert mutating == [["ping", "-n", "-q", "-c", "1", "-i", "0.2", "-w", "3", "-I", "tb0", "198.18.128.2"]]
    assert again["ping"]["cables"] == [
        {"port": "tb0", "peer": "node2:tb0", "peer_address": "198.18.128.2", "alive": True}
    ]
    assert again["ansible_facts"] == {"meshkit_cable_check": again["ping"], "meshkit_rdma": again["rdma"]}


def test_the_ping_alone_marks_a_dead_cable_without_failing(linux):  # noqa: F811
    args = {"ping": {"ports": [PORT], "count": 1, "fail": False, "host": "node1"}}
    answers = {("ping", "-n", "-q", "-c", "1", "-i", "0.2", "-w", "3", "-I", "tb0", "198.18.128.2"): (1, "", "")}
    result, mutating = linux(host_network, args, answers)
    assert [c[0] for c in mutating] == ["ping"] and result["changed"] is False
    assert result["ping"]["dead_ends"] == ["node1:tb0"]
    assert result["ansible_facts"]["meshkit_cable_check"]["dead"] == ["node1:tb0 -> node2:tb0 (198.18.128.2): no reply"]


def test_host_network_check_mode_makes_nothing(linux, tmp_path):  # noqa: F811
    jobs = tmp_path / "jobs"
    args = {"links": links(tmp_path), "directories": [{"path": str(jobs), "mode": "1777"}]}
    result, mutating = linux(host_network, args, {**recorded("converged"), **NETWORKD}, check_mode=True)
    assert result["changed"] is True and mutating == []
    assert not jobs.exists()
    assert "ping" not in result and "rdma" not in result


def test_a_failed_step_is_named_and_the_steps_after_it_do_not_run(linux, tmp_path):  # noqa: F811
    jobs = tmp_path / "jobs"
    args = {
        "links": {**links(tmp_path), "persist": "runtime"},
        "ping": {"host": "node1"},
        "directories": [{"path": str(jobs), "mode": "1777"}],
    }
    result, mutating = linux(host_network, args, {**recorded("fresh"), **RUNTIME}, expect=Fail)
    assert result["step"] == "links"
    assert "tb0 is still enslaved to bridge0" in result["msg"]
    assert mutating == [] and not jobs.exists()


def test_a_step_given_bad_options_is_refused_by_name(linux, tmp_path):  # noqa: F811
    args = {"links": {"ports": [PORT]}, "directories": [{"path": str(tmp_path / "jobs"), "mode": "1777"}]}
    result, mutating = linux(host_network, args, recorded("converged"), expect=Fail)
    assert result["step"] == "links"
    assert result["msg"] == "links: missing required arguments: pool"
    assert mutating == [] and not (tmp_path / "jobs").exists()


def test_host_ports_leaves_discovery_for_later_where_the_bridge_changes(linux, tmp_path):  # noqa: F811
    args = {
        "bridge": {"management_address": MGMT, "peer_ports": ["tb*"], "networkd_dir": str(tmp_path)},
        "discover": {"peer_ports": ["tb*"], "management_address": MGMT},
        "rdma": {"sysfs_root": str(SYSFS / "roce_v2_ipv4_ipv6")},
    }
    result, mutating = linux(host_ports, args, {**recorded("fresh"), **NETWORKD, **NEIGH}, check_mode=True)
    # Check mode: the bridge would change (its diff says how); nothing runs. A peer may still be in its
    # bridge: discovery is left for the caller's second call, once every host's ports are out.
    assert result["changed"] is True and result["rediscover"] is True
    assert result["bridge"]["members"] == ["tb0"]
    assert [d["before_header"] for d in result["diff"]] == ["bridge"]
    assert mutating == []
    assert "discovery" not in result and "ansible_facts" not in result


def test_host_ports_with_the_bridge_already_out_discovers_and_reads_rdma_in_the_same_call(linux, tmp_path):  # noqa: F811
    args = {
        "bridge": {"management_address": MGMT, "peer_ports": ["tb*"], "networkd_dir": str(tmp_path)},
        "discover": {"peer_ports": ["tb*"], "management_address": MGMT},
        "rdma": {"sysfs_root": str(SYSFS / "roce_v2_ipv4_ipv6")},
    }
    linux(host_ports, args, {**recorded("converged"), **NETWORKD, **NEIGH})  # writes networkd's files
    result, mutating = linux(host_ports, args, {**recorded("converged"), **NETWORKD, **NEIGH})
    assert result["changed"] is False and result["rediscover"] is False
    assert all(c[0] == "ping" for c in mutating)
    assert [p["port"] for p in result["discovery"]["ports"]] == ["tb0"]
    assert result["discovery"]["management_interface"] == "mgmt0"
    assert result["ansible_facts"] == {"meshkit_rdma": result["rdma"], "meshkit_discovery": result["discovery"]}


def test_host_ports_without_the_bridge_step_touches_no_bridge(linux, tmp_path):  # noqa: F811
    args = {"discover": {"peer_ports": ["tb*"], "management_address": MGMT}}
    result, mutating = linux(host_ports, args, {**recorded("fresh"), **NETWORKD, **NEIGH})
    assert "bridge" not in result and result["changed"] is False
    assert all(c[0] == "ping" for c in mutating)
    # Still in the bridge: discovery reports the port and no peer on it, so RDMA reads no port.
    assert result["discovery"]["ports"][0]["in_bridge"] == "bridge0"
    assert result["rdma"]["ports"] == {}


def test_discovery_counts_only_the_neighbours_that_answered_its_probe(linux, tmp_path):  # noqa: F811
    """The neighbour table may still hold a host the port reached before: a moved cable, or a new host whose
    Thunderbolt Bridge joined two ports for a while (it then answered for the far side too). Only the address
    that answered this probe is the peer."""
    args = {"discover": {"peer_ports": ["tb*"], "management_address": MGMT}}
    probe = ("ping", "-6", "-n", "-L", "-c", "1", "-w", "1", "-I", "tb0", "ff02::1")
    reply = "64 bytes from fe80::1c2:3ff:fe04:506%tb0: icmp_seq=1 ttl=64 time=0.07 ms\n"
    table = [
        {"dst": "fe80::1c2:3ff:fe04:506", "dev": "tb0", "lladdr": "02:c2:03:04:05:06", "state": ["REACHABLE"]},
        {"dst": "fe80::5a:beff:fe00:1", "dev": "tb0", "lladdr": "02:5a:be:00:00:01", "state": ["STALE"]},
    ]
    answers = {
        **recorded("converged"),
        **NETWORKD,
        probe: (0, reply, ""),
        ("ip", "-j", "-6", "neigh", "show"): (0, json.dumps(table), ""),
    }
    result, _ = linux(host_ports, args, answers)
    [tb0] = result["discovery"]["ports"]
    assert tb0["seen"] == ["02:c2:03:04:05:06"]
    # Without an answer (nothing cabled, or the peer silent) the stale entry is no peer either.
    result, _ = linux(host_ports, args, {**answers, probe: (1, "", "")})
    assert result["discovery"]["ports"][0]["seen"] == []
