"""Slurm's configuration from the inventory, `slurmd -C` and the cabling plan (module_utils/slurm.py
and the slurm_config module): on `slurmd -C` outputs recorded on Debian 12's Slurm 22.05
(tests/fixtures/slurm/) and on plans made by meshkit's own planner. The slurm.conf written is parsed
by Slurm itself (scontrol, no daemon)."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from collections import deque
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.meshkit.cluster.plugins.module_utils.slurm import (
    HARDWARE_KEYS,
    WRITTEN_BY,
    SlurmConfigError,
    parse_slurmd_c,
    slurm_conf,
    slurm_name,
    topology_conf,
    topology_tree,
)
from ansible_collections.meshkit.cluster.plugins.modules import slurm_config

from meshkit.topology import Observation, build_plan

from .module_harness import patch_exits, run_module

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "tests" / "fixtures" / "slurm"

Switches = list[tuple[str, list[str], list[str]]]


def recorded(name: str) -> str:
    """The stdout of a recorded `slurmd -C` (see tests/fixtures/slurm/README.md)."""
    return (SLURM / f"{name}.txt").read_text()


# Each inventory host's own recording: slurmd -C prints the host's short name as NodeName.
SLURMD_C = {name: recorded(f"uts_{name}") for name in ("node1", "node3", "node4")} | {"node2": recorded("lab_node2")}


def bigger(text: str) -> str:
    """The recorded line with the numbers of a 2-socket, 4-core, 2-thread host with 64000 MB (a
    consistent topology: CPUs = sockets x cores x threads), so every node's own hardware shows."""
    out = text
    for key, value in {"CPUs": 16, "SocketsPerBoard": 2, "CoresPerSocket": 4, "ThreadsPerCore": 2}.items():
        out = re.sub(rf"\b{key}=\d+", f"{key}={value}", out)
    out = re.sub(r"\bRealMemory=\d+", "RealMemory=64000", out)
    assert out.count("=16 ") + out.count("=64000") == 2
    return out


# The role's own defaults for what slurm.conf takes from the inventory.
DEFAULTS = yaml.safe_load((ROOT / "roles" / "slurm" / "defaults" / "main.yml").read_text())
OPTIONS = {
    key: DEFAULTS[f"slurm_{key}"]
    for key in ("slurmctld_port", "slurmd_port", "proctrack", "task_plugin", "select_parameters", "mpi_default")
}
ADDR = {f"node{i}": f"198.19.1.{i + 1}" for i in range(1, 6)} | {"node5.lab.example": "198.19.1.6"}


def plan_of(pairs: list[tuple[str, str]], hosts: list[str]) -> dict[str, Any]:
    """meshkit's plan (as plan.json holds it) for cables between hosts, ports tb0, tb1, ... per host."""
    used = dict.fromkeys(hosts, 0)
    obs = []
    for a, b in pairs:
        pa, pb = f"tb{used[a]}", f"tb{used[b]}"
        used[a] += 1
        used[b] += 1
        obs.append(Observation(a, pa, f"id-{a}-{pa}", [f"id-{b}-{pb}"]))
        obs.append(Observation(b, pb, f"id-{b}-{pb}", [f"id-{a}-{pa}"]))
    return build_plan(hosts, obs).as_dict()


def cycle(order: list[str]) -> list[tuple[str, str]]:
    """The cables of a ring through `order` (two parallel cables for two hosts)."""
    return [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]


NODES4 = [f"node{i}" for i in range(1, 5)]
RING4 = plan_of(cycle(["node1", "node3", "node2", "node4"]), NODES4)  # the lab's cabling
MESH4 = plan_of([(a, b) for i, a in enumerate(NODES4) for b in NODES4[i + 1 :]], NODES4)


def check_tree(switches: Switches, hosts: list[str], plan: dict[str, Any]) -> dict[str, list[str]]:
    """What Slurm's topology/tree needs and what meshkit promises, for any cabling: one tree (the
    last switch its root, every other switch with exactly one parent), every node in exactly one
    leaf, every switch below the root holding either ring hosts only or none, and every switch of
    ring hosts holding a contiguous arc of the ring whose neighbours are cabled. Returns the nodes
    under each switch."""
    names = [name for name, _, _ in switches]
    assert len(set(names)) == len(names), names
    by_name = {name: (nodes, children) for name, nodes, children in switches}
    for name, nodes, children in switches:
        assert bool(nodes) != bool(children), f"switch {name} must hold nodes or switches: {nodes} {children}"
        assert all(child in by_name for child in children), f"switch {name}: unknown child in {children}"
    assert sorted(n for _, nodes, _ in switches for n in nodes) == sorted(hosts)  # each node in one leaf
    root = names[-1]
    parents = {name: [p for p, _, children in switches if name in children] for name in names}
    assert parents[root] == [], f"the root {root} has a parent"
    assert all(len(parents[name]) == 1 for name in names if name != root), parents
    seen, todo = {root}, deque([root])
    while todo:
        for child in by_name[todo.popleft()][1]:
            assert child not in seen
            seen.add(child)
            todo.append(child)
    assert seen == set(names), f"not under the root {root}: {set(names) - seen}"

    def under(name: str) -> list[str]:
        nodes, children = by_name[name]
        return [*nodes, *(n for child in children for n in under(child))]

    ring = [h for h in plan.get("ring") or [] if h in hosts]
    pos = {h: i for i, h in enumerate(ring)}
    cabled = {frozenset(end["host"] for end in cable["ends"]) for cable in plan["cables"]}
    held = {name: under(name) for name in names}
    assert sorted(held[root]) == sorted(hosts)
    for name in names:
        in_ring = [h for h in held[name] if h in pos]
        if name != root:
            assert len(in_ring) in (0, len(held[name])), f"{name} mixes ring hosts with others: {held[name]}"
        if in_ring and len(in_ring) == len(held[name]):
            idx = sorted(pos[h] for h in in_ring)
            assert idx == list(range(idx[0], idx[0] + len(idx))), f"{name} holds {held[name]}, not an arc of {ring}"
            arc = [ring[i] for i in idx]
            assert all(frozenset(pair) in cabled for pair in pairwise(arc)), f"{name}: {arc} not cabled in turn"
    return held


# ---- slurmd -C -------------------------------------------------------------------------------


def test_parse_slurmd_c_reads_the_recorded_node_line() -> None:
    assert parse_slurmd_c(recorded("lab_node2"), "node2") == {
        "NodeName": "node2",
        "CPUs": 2,
        "Boards": 1,
        "SocketsPerBoard": 1,
        "CoresPerSocket": 2,
        "ThreadsPerCore": 1,
        "RealMemory": 24105,
    }
    # A host whose hostname is a FQDN: slurmd -C names it by its short name, as slurmd finds its node.
    assert parse_slurmd_c(recorded("uts_node5.lab.example"), "node5.lab.example")["NodeName"] == "node5"
    assert parse_slurmd_c(recorded("vm"), "vm")["RealMemory"] == 24105
    assert parse_slurmd_c(bigger(recorded("lab_node2")), "node2")["CPUs"] == 16


@pytest.mark.parametrize("key", HARDWARE_KEYS)
def test_parse_slurmd_c_refuses_a_missing_field_naming_host_and_field(key: str) -> None:
    text = re.sub(rf" {key}=\d+", "", recorded("lab_node2"))
    with pytest.raises(SlurmConfigError, match=rf"^node2: 'slurmd -C' printed no {key} \(line: 'NodeName=node2 "):
        parse_slurmd_c(text, "node2")


@pytest.mark.parametrize(("key", "value"), [("CPUs", "two"), ("RealMemory", "24105M"), ("ThreadsPerCore", "")])
def test_parse_slurmd_c_refuses_a_non_number_naming_host_and_field(key: str, value: str) -> None:
    text = re.sub(rf"\b{key}=\d+", f"{key}={value}", recorded("lab_node2"))
    with pytest.raises(SlurmConfigError, match=rf"^node2: 'slurmd -C' printed {key}='{value}', not a number"):
        parse_slurmd_c(text, "node2")


@pytest.mark.parametrize(
    "text",
    ["", "UpTime=0-20:42:34\n", "slurmd: error: Unable to initialize hwloc\n", "bash: slurmd: command not found\n"],
)
def test_parse_slurmd_c_without_a_node_line_names_the_host_and_says_what_to_check(text: str) -> None:
    with pytest.raises(
        SlurmConfigError, match=r"^node3: 'slurmd -C' printed no NodeName= line .*is slurmd installed\?"
    ):
        parse_slurmd_c(text, "node3")


# ---- topology/tree from the cabling ------------------------------------------------------------


def test_a_full_mesh_is_one_switch_holding_every_host() -> None:
    assert MESH4["mesh"]
    switches, how = topology_tree(MESH4, NODES4)
    assert switches == [("mesh", NODES4, [])]
    assert how.startswith("full mesh of 4 hosts: one switch")
    check_tree(switches, NODES4, MESH4)
    text = topology_conf(switches, how, "lab")
    assert [line for line in text.splitlines() if not line.startswith("#")] == [
        "SwitchName=mesh Nodes=node1,node2,node3,node4"
    ]
    assert text.startswith("# Slurm topology of meshkit cluster lab:") and f"# {how}.\n" in text


def test_a_4_host_ring_is_a_tree_of_arcs_in_ring_order() -> None:
    assert RING4["ring"] == ["node1", "node3", "node2", "node4"] and not RING4["mesh"]
    switches, how = topology_tree(RING4, NODES4)
    assert switches == [
        ("arc0", ["node1", "node3"], []),
        ("arc1", ["node2", "node4"], []),
        ("arcs1_0", [], ["arc0", "arc1"]),
    ]
    assert how.startswith("ring of 4 hosts") and "cannot be told that the ring closes" in how
    check_tree(switches, NODES4, RING4)
    assert [line for line in topology_conf(switches, how, "lab").splitlines() if not line.startswith("#")] == [
        "SwitchName=arc0 Nodes=node1,node3",
        "SwitchName=arc1 Nodes=node2,node4",
        "SwitchName=arcs1_0 Switches=arc0,arc1",
    ]


def test_a_3_host_ring() -> None:
    # Three hosts cabled in a triangle are a full mesh: one switch.
    triangle = plan_of(cycle(["node1", "node2", "node3"]), NODES4[:3])
    assert triangle["mesh"]
    assert topology_tree(triangle, NODES4[:3])[0] == [("mesh", NODES4[:3], [])]
    # The same triangle in a cabling that is not a mesh (node4 hangs off node1): a tree over the ring.
    plan = plan_of([*cycle(["node1", "node3", "node2"]), ("node1", "node4")], NODES4)
    assert sorted(plan["ring"]) == NODES4[:3] and not plan["mesh"]
    a, b, c = plan["ring"]
    switches, how = topology_tree(plan, plan["ring"])
    assert switches == [("arc0", [a, b], []), ("arc1", [c], []), ("arcs1_0", [], ["arc0", "arc1"])]
    assert how.startswith("ring of 3 hosts")
    check_tree(switches, plan["ring"], plan)


@pytest.mark.parametrize("spur", [False, True], ids=["ring", "ring+spur"])
@pytest.mark.parametrize("n", range(2, 10))
def test_every_ring_becomes_one_tree_of_cabled_arcs(n: int, spur: bool) -> None:
    """Rings of 2..9 hosts cabled in a shuffled order, alone or with one more host cabled to the
    ring's first (not in the ring, so not a mesh): the tree properties of check_tree."""
    hosts = [f"node{i}" for i in range(1, n + 2 if spur else n + 1)]
    order = hosts[:n]
    random.Random(n).shuffle(order)
    pairs = cycle(order) + ([(order[0], hosts[-1])] if spur else [])
    plan = plan_of(pairs, hosts)
    assert len(plan["ring"]) == n and set(plan["ring"]) == set(order)
    switches, _ = topology_tree(plan, hosts)
    held = check_tree(switches, hosts, plan)
    if plan["mesh"]:  # 2 or 3 hosts alone
        assert n <= 3 and switches == [("mesh", hosts, [])]
    else:
        leaves = [nodes for _, nodes, _ in switches if nodes]
        ring_leaves = [nodes for nodes in leaves if set(nodes) <= set(plan["ring"])]
        assert [h for nodes in ring_leaves for h in nodes] == plan["ring"]  # leaves follow the ring
        assert all(len(nodes) <= 2 for nodes in ring_leaves)
    if spur:
        # A leaf of its own, directly under the root: never grouped with ring hosts below the root.
        leaf = [name for name, nodes, _ in switches if hosts[-1] in nodes]
        assert [nodes for name, nodes, _ in switches if name in leaf] == [[hosts[-1]]]
        assert [name for name, h in held.items() if hosts[-1] in h] == [*leaf, switches[-1][0]]


def test_a_host_the_ring_leaves_out_gets_its_own_leaf_under_a_root() -> None:
    hosts = [*NODES4, "node5"]
    plan = plan_of([*cycle(["node1", "node3", "node2", "node4"]), ("node5", "node1")], hosts)
    assert "node5" in plan["hosts"] and "node5" not in plan["ring"]
    switches, _ = topology_tree(plan, hosts)
    assert switches == [
        ("arc0", ["node1", "node3"], []),
        ("arc1", ["node2", "node4"], []),
        ("arcs1_0", [], ["arc0", "arc1"]),
        ("uncabled", ["node5"], []),
        ("root", [], ["arcs1_0", "uncabled"]),
    ]
    held = check_tree(switches, hosts, plan)
    assert [name for name, nodes in held.items() if "node5" in nodes] == ["uncabled", "root"]


@pytest.mark.parametrize("plan", [RING4, MESH4], ids=["ring", "mesh"])
def test_hosts_not_in_the_plan_meet_the_cabled_ones_only_at_the_root(plan: dict[str, Any]) -> None:
    hosts = [*NODES4, "gpu7", "gpu8"]
    switches, _ = topology_tree(plan, hosts)
    held = check_tree(switches, hosts, plan)
    root = switches[-1][0]
    for extra in ("gpu7", "gpu8"):
        assert all(set(nodes) <= {"gpu7", "gpu8"} for name, nodes in held.items() if extra in nodes and name != root)
    assert sorted(held[root]) == sorted(hosts)


def test_a_mesh_whose_ring_leaves_out_a_host_still_has_each_node_in_one_leaf() -> None:
    """plan.json's keys taken at their word: every host cabled to every other (mesh), a ring
    through three of them. build_plan always rings a whole mesh, the contract does not say so."""
    plan = dict(MESH4, ring=["node1", "node2", "node3"])
    switches, _ = topology_tree(plan, NODES4)
    check_tree(switches, NODES4, plan)


@pytest.mark.parametrize(
    "bad",
    ["node 1", "node[1-2]", "node1,node2", "-node1", "", "nöde1", "node1\n"],
)
def test_names_slurm_cannot_carry_are_refused_by_name(bad: str) -> None:
    with pytest.raises(SlurmConfigError, match=r"not usable as a Slurm node name.*rename the host in the inventory"):
        topology_tree(RING4, [*NODES4, bad])
    with pytest.raises(SlurmConfigError, match=re.escape(bad) + ": not usable as a Slurm node name"):
        slurm_conf(**conf_args(order=["node1", bad]))


# ---- slurm.conf ------------------------------------------------------------------------------


def node_facts(name: str, text: str) -> dict[str, Any]:
    """What the module gives slurm_conf per node."""
    hardware = parse_slurmd_c(text, name)
    return {"hostname": hardware["NodeName"], "addr": ADDR[name], "hardware": hardware}


def conf_args(**over: Any) -> dict[str, Any]:
    nodes = {name: node_facts(name, text) for name, text in SLURMD_C.items()}
    args = {
        "cluster": "lab",
        "controller": "node1",
        "controller_hostname": "node1",
        "controller_addr": ADDR["node1"],
        "nodes": nodes,
        "order": RING4["ring"],
        "partition": "meshkit",
        "options": OPTIONS,
    }
    return args | over


def settings(text: str) -> list[dict[str, str]]:
    """slurm.conf as one dict per non-comment line (Key=Value words)."""
    return [
        dict(word.split("=", 1) for word in line.split())
        for line in text.splitlines()
        if line.strip() and not line.startswith("#")
    ]


def node_lines(text: str) -> dict[str, dict[str, str]]:
    return {s["NodeName"]: s for s in settings(text) if "NodeName" in s}


def test_every_node_line_has_the_hardware_of_its_own_slurmd_c() -> None:
    texts = {**SLURMD_C, "node4": bigger(SLURMD_C["node4"])}
    nodes = {name: node_facts(name, text) for name, text in texts.items()}
    lines = node_lines(slurm_conf(**conf_args(nodes=nodes)))
    assert list(lines) == ["node1", "node3", "node2", "node4"]
    for name, line in lines.items():
        hardware = parse_slurmd_c(texts[name], name)
        assert {key: line[key] for key in HARDWARE_KEYS} == {key: str(hardware[key]) for key in HARDWARE_KEYS}
        assert line["NodeAddr"] == ADDR[name] and line["State"] == "UNKNOWN"
    assert lines["node4"]["CPUs"] == "16" and lines["node4"]["RealMemory"] == "64000"
    assert lines["node1"]["CPUs"] == "2" and lines["node1"]["RealMemory"] == "24105"


def test_node_hostname_only_where_the_short_host_name_is_not_the_inventory_name() -> None:
    nodes = conf_args()["nodes"] | {
        "node5.lab.example": node_facts("node5.lab.example", recorded("uts_node5.lab.example"))
    }
    order = [*RING4["ring"], "node5.lab.example"]
    lines = node_lines(slurm_conf(**conf_args(nodes=nodes, order=order)))
    assert lines["node5.lab.example"]["NodeHostname"] == "node5"
    assert lines["node5.lab.example"]["NodeAddr"] == "198.19.1.6"
    assert all("NodeHostname" not in lines[name] for name in NODES4)


def test_slurm_conf_names_the_controller_the_cluster_and_a_partition_in_ring_order() -> None:
    text = slurm_conf(**conf_args(cluster="Lab-Ring 4"))
    conf = settings(text)
    flat = {k: v for s in conf if len(s) == 1 for k, v in s.items()}
    assert flat["ClusterName"] == "lab_ring_4"
    assert flat["SlurmctldHost"] == "node1(198.19.1.2)"
    assert flat["SlurmctldPort"] == str(OPTIONS["slurmctld_port"]) and flat["SlurmdPort"] == str(OPTIONS["slurmd_port"])
    assert flat["TopologyPlugin"] == "topology/tree"
    partitions = [s for s in conf if "PartitionName" in s]
    assert partitions == [
        {
            "PartitionName": "meshkit",
            "Nodes": "node1,node3,node2,node4",
            "Default": "YES",
            "MaxTime": "INFINITE",
            "State": "UP",
        }
    ]
    assert "slurmctld runs on" not in text  # the controller is a compute node
    away = slurm_conf(**conf_args(controller="head", controller_hostname="head", controller_addr="198.19.1.100"))
    assert "# slurmctld runs on head, which is not a compute node." in away
    assert "SlurmctldHost=head(198.19.1.100)" in away.splitlines()


@pytest.mark.parametrize(
    ("cluster", "name"),
    [
        ("lab", "lab"),
        ("Lab-Ring 4", "lab_ring_4"),
        ("mac.studio", "mac_studio"),
        ("---", "meshkit"),
        ("x" * 50, "x" * 40),
    ],
)
def test_cluster_name_is_made_from_the_meshkit_cluster_name(cluster: str, name: str) -> None:
    assert slurm_name(cluster) == name


def test_a_node_without_hardware_facts_is_named() -> None:
    nodes = {name: facts for name, facts in conf_args()["nodes"].items() if name != "node2"}
    with pytest.raises(SlurmConfigError, match=r"^node2: no hardware facts \(slurmd -C\) for this host$"):
        slurm_conf(**conf_args(nodes=nodes))


# ---- Slurm itself parses what is written --------------------------------------------------------


def scontrol_parse(conf_dir: Path) -> subprocess.CompletedProcess[str]:
    """scontrol reads and checks the whole slurm.conf before any command, no daemon needed; a
    node list expansion is the cheapest command that needs the configuration loaded."""
    env = {**os.environ, "SLURM_CONF": str(conf_dir / "slurm.conf")}
    return subprocess.run(
        ["scontrol", "show", "hostnames", "node[1-4]"], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def module(monkeypatch: pytest.MonkeyPatch):
    patch_exits(monkeypatch)
    return lambda check=False, **args: run_module(slurm_config, args, check)


def module_args(**over: Any) -> dict[str, Any]:
    texts = {**SLURMD_C, "node4": bigger(SLURMD_C["node4"])}
    args = {
        "cluster": "lab",
        "controller": "node1",
        "nodes": {name: {"addr": ADDR[name], "slurmd_c": text} for name, text in texts.items()},
        "plan": RING4,
        "options": OPTIONS,
    }
    return args | over


def test_slurm_parses_the_slurm_conf_written_and_refuses_a_broken_one(module, tmp_path: Path) -> None:
    if shutil.which("scontrol") is None:
        pytest.skip("needs Slurm's scontrol (Debian/Ubuntu: slurm-client, in scripts/system-deps)")
    ok, out = module(**module_args())
    assert ok, out
    (tmp_path / "slurm.conf").write_text(out["slurm_conf"])
    (tmp_path / "topology.conf").write_text(out["topology_conf"])
    done = scontrol_parse(tmp_path)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.split() == NODES4
    # The same check fails on a broken file: a non-number, an unknown key, a hardware line that does
    # not add up (CPUs not sockets x cores x threads: Slurm only complains on stderr), no controller.
    broken = {
        "CPUs=two": out["slurm_conf"].replace("CPUs=16 ", "CPUs=two "),
        "unknown key": out["slurm_conf"].replace("KillWait=", "KillWiat="),
        "CPUs=3": out["slurm_conf"].replace("CPUs=16 ", "CPUs=3 "),
        "no SlurmctldHost": re.sub(r"(?m)^SlurmctldHost=.*\n", "", out["slurm_conf"]),
    }
    for what, text in broken.items():
        assert text != out["slurm_conf"], what
        (tmp_path / "slurm.conf").write_text(text)
        done = scontrol_parse(tmp_path)
        assert done.returncode != 0 or done.stderr, f"scontrol accepted a slurm.conf with {what}"


def test_every_file_the_role_writes_carries_the_mark_its_undo_looks_for() -> None:
    """slurm_state: absent removes exactly the files in /etc/slurm that carry the role's mark (its
    find: those of slurm_files with a line holding slurm_mark, any case), and every one of them says so
    in its first line: slurm.conf and topology.conf from here, mpi.conf from tasks/present.yml. A header
    reworded on one side only would leave a file behind."""
    role = ROOT / "roles" / "slurm"
    role_vars = yaml.safe_load((role / "vars" / "main.yml").read_text())
    assert role_vars["slurm_mark"] == WRITTEN_BY
    tasks = yaml.safe_load((role / "tasks" / "present.yml").read_text())
    setup = next(t for t in tasks if "block" in t)["block"]
    written = {
        Path(t["ansible.builtin.copy"]["dest"]).name: t["ansible.builtin.copy"]["content"]
        for t in setup
        if t.get("ansible.builtin.copy", {}).get("dest", "").startswith("/etc/slurm/")
    }
    assert sorted(written) == sorted(role_vars["slurm_files"])
    texts = {
        "slurm.conf": slurm_conf(**conf_args()),
        "topology.conf": topology_conf(*topology_tree(RING4, NODES4), "lab"),
        "mpi.conf": written["mpi.conf"],
    }
    for name, text in texts.items():
        assert WRITTEN_BY.lower() in text.splitlines()[0].lower(), (name, text.splitlines()[0])


# ---- the module, as Ansible runs it -------------------------------------------------------------


def test_module_returns_both_files_from_the_inventory_and_changes_nothing(module) -> None:
    args = module_args()
    ok, out = module(**args)
    assert ok and out["changed"] is False
    assert out["order"] == ["node1", "node3", "node2", "node4"]
    assert out["topology"].startswith("ring of 4 hosts")
    lines = node_lines(out["slurm_conf"])
    assert list(lines) == out["order"]
    assert lines["node4"]["CPUs"] == "16" and lines["node2"]["CPUs"] == "2"
    assert all("NodeHostname" not in line for line in lines.values())
    assert "SlurmctldHost=node1(198.19.1.2)" in out["slurm_conf"].splitlines()
    assert "PartitionName=meshkit Nodes=node1,node3,node2,node4 " in out["slurm_conf"]
    assert out["topology_conf"] == topology_conf(*topology_tree(RING4, NODES4), "lab")
    assert module(check=True, **args) == (True, out)  # --check: the same text


def test_module_fails_naming_the_node_whose_slurmd_c_is_unusable(module) -> None:
    nodes = module_args()["nodes"]
    ok, out = module(**module_args(nodes=nodes | {"node3": {"addr": ADDR["node3"], "slurmd_c": ""}}))
    assert not ok
    assert out["msg"].startswith("Slurm's configuration: node3: 'slurmd -C' printed no NodeName= line")
    no_memory = re.sub(r" RealMemory=\d+", "", SLURMD_C["node2"])
    ok, out = module(**module_args(nodes=nodes | {"node2": {"addr": ADDR["node2"], "slurmd_c": no_memory}}))
    assert not ok and out["msg"].startswith("Slurm's configuration: node2: 'slurmd -C' printed no RealMemory")
    ok, out = module(**module_args(nodes=nodes | {"node4": {"slurmd_c": SLURMD_C["node4"]}}))
    assert not ok and out["msg"] == "Slurm's configuration: node4: no addr given for this node"


def test_nodes_sharing_a_short_host_name_are_refused_naming_them() -> None:
    """slurmd finds its node by its short host name: two nodes named alike could not tell which is theirs."""
    line = recorded("lab_node2")
    nodes = {n: {"hostname": "node2", "addr": f"10.0.0.{i}", "hardware": parse_slurmd_c(line, n)}
             for i, n in enumerate(["node1", "node2"])}  # fmt: skip
    with pytest.raises(SlurmConfigError, match=r"node1, node2: all have the short host name 'node2'"):
        slurm_conf(
            cluster="c", controller="node1", controller_hostname="node2", controller_addr="10.0.0.0",
            nodes=nodes, order=["node1", "node2"], partition="p", options=OPTIONS,
        )  # fmt: skip


def test_no_nodes_and_an_empty_node_name_are_refused() -> None:
    with pytest.raises(SlurmConfigError, match="no compute nodes"):
        topology_tree({"hosts": [], "ring": [], "mesh": True}, [])
    with pytest.raises(SlurmConfigError, match="node9: 'slurmd -C' printed an empty NodeName"):
        parse_slurmd_c(
            "NodeName= CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=9", "node9"
        )
