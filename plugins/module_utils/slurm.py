# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Slurm's configuration from meshkit's inventory, each host's hardware and the cabling plan.

- :func:`parse_slurmd_c` reads ``slurmd -C`` (slurmd's own hardware detection, what slurmd will
  register with: a node configured with more than it finds is drained as "invalid").
- :func:`topology_tree` turns the cabling into Slurm's ``topology/tree`` (what Debian 12's Slurm
  22.05 has; ``topology/block`` is in newer Slurm releases only).
- :func:`slurm_conf` and :func:`topology_conf` write the two files every host gets.

What topology/tree can say about cables: Slurm places a job under the lowest switch that holds
enough nodes, so a switch stands for "these nodes are close". A full mesh is one switch (any
subset is fully cabled). A ring (or any cabling with a ring through the hosts) becomes a binary
tree over the ring's order: every switch holds a contiguous arc of the ring, so a job that fits
under one switch gets hosts joined by a path of cables. What it cannot say: that the ring
closes (the last host is cabled to the first), so an arc across the ring's seam is never
preferred; that a mesh missing a few cables is nearly a mesh (it is treated as its ring); and the
number of cables between two hosts.
"""

from __future__ import annotations

import re
from typing import Any

# Every file the role writes says so in its first line: the role's slurm_state: absent removes exactly the files
# that do (roles/slurm/vars/main.yml, slurm_mark), and leaves a slurm.conf of anyone else's.
WRITTEN_BY = "written by the meshkit.cluster.slurm role"

HARDWARE_KEYS = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")

# Slurm's node and switch names: what hostlist expressions can carry.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class SlurmConfigError(ValueError):
    """Inputs Slurm cannot be configured from; the message names the host or field."""


def parse_slurmd_c(text: str, host: str) -> dict[str, Any]:
    """The node line of ``slurmd -C``: {"NodeName": ..., "CPUs": int, ..., "RealMemory": int}.

    slurmd -C prints e.g. ``NodeName=node1 CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2
    ThreadsPerCore=1 RealMemory=24036`` then ``UpTime=...``.
    """
    for line in text.splitlines():
        if not line.startswith("NodeName="):
            continue
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if not fields["NodeName"]:
            raise SlurmConfigError(f"{host}: 'slurmd -C' printed an empty NodeName (the host has no host name?)")
        out: dict[str, Any] = {"NodeName": fields["NodeName"]}
        for key in HARDWARE_KEYS:
            if key not in fields:
                raise SlurmConfigError(f"{host}: 'slurmd -C' printed no {key} (line: {line.strip()!r})")
            try:
                out[key] = int(fields[key])
            except ValueError:
                raise SlurmConfigError(f"{host}: 'slurmd -C' printed {key}={fields[key]!r}, not a number") from None
        return out
    raise SlurmConfigError(
        f"{host}: 'slurmd -C' printed no NodeName= line (output: {text.strip()[:200]!r}); is slurmd installed?"
    )


def slurm_name(text: str) -> str:
    """A Slurm ClusterName from a meshkit cluster name: lower case, letters, digits and '_'."""
    name = re.sub(r"[^a-z0-9_]+", "_", text.lower()).strip("_")
    return (name or "meshkit")[:40]


def _check_names(hosts: list[str]) -> None:
    if not hosts:
        raise SlurmConfigError("no compute nodes: the slurm role needs at least one host")
    bad = [h for h in hosts if not _NAME_RE.fullmatch(h) or "," in h]
    if bad:
        raise SlurmConfigError(
            f"{', '.join(bad)}: not usable as a Slurm node name (letters, digits, '.', '_', '-'); "
            "rename the host in the inventory"
        )


def topology_tree(plan: dict[str, Any], hosts: list[str]) -> tuple[list[tuple[str, list[str], list[str]]], str]:
    """Switches of topology/tree for `hosts` (Slurm's nodes) from the cabling plan.

    Returns ([(switch, nodes, child switches)], how the cabling was expressed). Leaves come first;
    the last switch is the root. Hosts the plan does not cable get a leaf of their own under the
    root (Slurm needs every node under some switch, or it cannot place jobs across them).
    """
    _check_names(hosts)
    wanted = set(hosts)
    ring = [h for h in plan.get("ring") or [] if h in wanted]
    in_plan = [h for h in plan.get("hosts") or [] if h in wanted]
    mesh = bool(plan.get("mesh")) and bool(in_plan)
    uncabled = [h for h in hosts if h not in (in_plan if mesh else ring)]
    switches: list[tuple[str, list[str], list[str]]] = []
    if mesh:
        switches.append(("mesh", in_plan, []))
        how = f"full mesh of {len(switches[0][1])} hosts: one switch (any subset of hosts is fully cabled)"
        if uncabled:
            switches.append(("uncabled", uncabled, []))
            switches.append(("root", [], ["mesh", "uncabled"]))
        return switches, how
    # A binary tree over the ring's order: leaves of two consecutive hosts, then pairs of switches.
    level: list[str] = []
    for i in range(0, len(ring), 2):
        name = f"arc{i // 2}"
        switches.append((name, ring[i : i + 2], []))
        level.append(name)
    depth = 1
    while len(level) > 1:
        upper: list[str] = []
        for i in range(0, len(level), 2):
            group = level[i : i + 2]
            if len(group) == 1:
                upper.append(group[0])
                continue
            name = f"arcs{depth}_{i // 2}"
            switches.append((name, [], group))
            upper.append(name)
        level = upper
        depth += 1
    how = (
        f"ring of {len(ring)} hosts: a binary tree over the ring's order (each switch holds a contiguous arc; "
        "Slurm cannot be told that the ring closes)"
        if ring
        else "no ring through the hosts"
    )
    if uncabled:
        switches.append(("uncabled", uncabled, []))
        top = [level[0]] if level else []
        switches.append(("root", [], [*top, "uncabled"]))
    return switches, how


def topology_conf(switches: list[tuple[str, list[str], list[str]]], how: str, cluster: str) -> str:
    lines = [
        f"# Slurm topology of meshkit cluster {cluster}: {WRITTEN_BY} from plan.json.",
        f"# {how}.",
        "# topology/tree: a job is placed under the lowest switch that holds enough nodes.",
    ]
    for name, nodes, children in switches:
        if nodes:
            lines.append(f"SwitchName={name} Nodes={','.join(nodes)}")
        else:
            lines.append(f"SwitchName={name} Switches={','.join(children)}")
    return "\n".join(lines) + "\n"


def slurm_conf(
    *,
    cluster: str,
    controller: str,
    controller_hostname: str,
    controller_addr: str,
    nodes: dict[str, dict[str, Any]],
    order: list[str],
    partition: str,
    options: dict[str, Any],
) -> str:
    """slurm.conf: the same file on every host.

    nodes: inventory name -> {"hostname": short hostname, "addr": how others reach it,
    "hardware": parse_slurmd_c(...)}. order: node names in the cabling's ring order.
    """
    _check_names(order)
    missing = [h for h in order if h not in nodes]
    if missing:
        raise SlurmConfigError(f"{', '.join(missing)}: no hardware facts (slurmd -C) for this host")
    # slurmd finds its node by its short host name: two nodes of one name could not tell which they are.
    named: dict[str, list[str]] = {}
    for name in order:
        named.setdefault(nodes[name]["hostname"], []).append(name)
    shared = {short: names for short, names in named.items() if len(names) > 1}
    if shared:
        raise SlurmConfigError(
            "; ".join(f"{', '.join(names)}: all have the short host name {short!r}" for short, names in shared.items())
            + ": slurmd finds its node by that name; give each host its own (hostnamectl set-hostname)"
        )
    lines = [
        f"# Slurm configuration of meshkit cluster {cluster}: {WRITTEN_BY}.",
        "# Every host has the same file; a change here is made in the inventory and setup.yml runs again.",
        f"ClusterName={slurm_name(cluster)}",
        f"SlurmctldHost={controller_hostname}({controller_addr})",
        "AuthType=auth/munge",
        "CryptoType=crypto/munge",
        "SlurmUser=slurm",
        f"SlurmctldPort={options['slurmctld_port']}",
        f"SlurmdPort={options['slurmd_port']}",
        "StateSaveLocation=/var/lib/slurm/slurmctld",
        "SlurmdSpoolDir=/var/lib/slurm/slurmd",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid",
        "SlurmctldLogFile=/var/log/slurm/slurmctld.log",
        "SlurmdLogFile=/var/log/slurm/slurmd.log",
        f"ProctrackType={options['proctrack']}",
        f"TaskPlugin={options['task_plugin']}",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        f"SelectTypeParameters={options['select_parameters']}",
        "TopologyPlugin=topology/tree",
        # A node that was down comes back by itself once it registers with a valid configuration.
        "ReturnToService=2",
        f"MpiDefault={options['mpi_default']}",
        "SlurmctldTimeout=120",
        "SlurmdTimeout=300",
        # An srun (or salloc) that stopped answering (killed, its host lost) frees its nodes after this.
        "InactiveLimit=120",
        "KillWait=10",
        "MinJobAge=300",
        "",
    ]
    for name in order:
        node = nodes[name]
        hw = node["hardware"]
        parts = [f"NodeName={name}"]
        if node["hostname"] != name:
            parts.append(f"NodeHostname={node['hostname']}")
        parts.append(f"NodeAddr={node['addr']}")
        parts += [f"{key}={hw[key]}" for key in HARDWARE_KEYS]
        parts.append("State=UNKNOWN")
        lines.append(" ".join(parts))
    lines.append("")
    lines.append(f"PartitionName={partition} Nodes={','.join(order)} Default=YES MaxTime=INFINITE State=UP")
    if controller not in nodes:
        lines.insert(1, f"# slurmctld runs on {controller}, which is not a compute node.")
    return "\n".join(lines) + "\n"
