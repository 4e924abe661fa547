"""Slurm: a task ``srun`` started (``SLURM_PROCID`` set) with meshkit's hostfile
(``MESHCCL_HOSTFILE``, else /var/lib/meshkit/hostfiles/meshccl.json).

srun gives every task of a step the same environment but its own SLURM_PROCID / SLURM_LOCALID,
and slurmd its node's name (SLURMD_NODENAME). With meshkit's hostfile (the cabling) that is
enough: the step's nodes (SLURM_STEP_NODELIST, expanded by ``scontrol show hostnames``), taken in
the hostfile's ring order, each hold their Slurm task count (SLURM_STEP_TASKS_PER_NODE) of
consecutive meshccl ranks (local rank = SLURM_LOCALID). meshccl's rank is therefore the
ring-order rank, which equals SLURM_PROCID when the tasks were placed in ring order
(SLURM_HOSTFILE + --distribution=arbitrary, as meshkit launch does) and may differ otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

from meshccl._meshccl import BootstrapError
from meshccl.bootstrap.hostfile import MESHCCL_FORMAT, MESHCCL_VERSION, _hostfile_ranks, plan_from_meshccl_hostfile
from meshccl.bootstrap.plan import Options, Plan, Source, _int_env, _load_json

MESHKIT_HOSTFILE = "/var/lib/meshkit/hostfiles/meshccl.json"  # what meshkit's setup writes on every host
SCONTROL_TIMEOUT_S = 30.0
_TASK_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def parse_tasks_per_node(text: str, name: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Slurm's compressed task counts, one per node: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        m = _TASK_COUNT.fullmatch(part.strip())
        if not m or (m.group(2) is not None and int(m.group(2)) < 1):
            raise BootstrapError(
                f"{name}={text!r}: {part!r} is not a task count in Slurm's form (N or N(xREPEAT), e.g. '2(x3),1')"
            )
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def expand_nodelist(text: str, env: dict[str, str], name: str = "SLURM_STEP_NODELIST") -> list[str]:
    """Slurm's compressed node list as node names, in Slurm's order. A plain comma-separated list
    is split as it is; one with ranges ("node[1-3,7]") is expanded by `scontrol show hostnames`,
    which reads Slurm's configuration (SLURM_CONF, else the node's own slurm.conf)."""
    if not text.strip():
        raise BootstrapError(f"{name} is empty: Slurm names the step's nodes there")
    if "[" not in text:
        return [n.strip() for n in text.split(",") if n.strip()]
    conf = env.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        # scontrol would retry a missing configuration for a minute before failing
        raise BootstrapError(
            f"SLURM_CONF={conf} is not a file: scontrol needs Slurm's configuration to expand {name}={text!r}"
        )
    exe = shutil.which("scontrol", path=env.get("PATH", os.defpath))
    if exe is None:
        raise BootstrapError(
            f"cannot expand {name}={text!r}: scontrol is not on PATH ({env.get('PATH', '')!r}); install Slurm's "
            "client commands (Debian/Ubuntu: slurm-client) where the task runs, or put them on its PATH"
        )
    try:
        done = subprocess.run(
            [exe, "show", "hostnames", text],
            check=False,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise BootstrapError(
            f"`scontrol show hostnames {text}` (expanding {name}) did not answer within {SCONTROL_TIMEOUT_S:g} s"
        ) from None
    except OSError as e:
        raise BootstrapError(f"cannot run {exe} (expanding {name}={text!r}): {e.strerror or e}") from None
    nodes = done.stdout.split()
    if done.returncode != 0 or not nodes:
        why = done.stderr.strip() or done.stdout.strip() or "no output"
        raise BootstrapError(
            f"`scontrol show hostnames {text}` (expanding {name}) failed with exit status {done.returncode}: {why}"
        )
    return nodes


def _slurm_var(env: dict[str, str], *names: str) -> tuple[str, str]:
    """(name, value) of the first of `names` that is set; BootstrapError naming them all if none is."""
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    raise BootstrapError(
        f"under Slurm (SLURM_PROCID={env.get('SLURM_PROCID')!r}) meshccl needs {' or '.join(names)}, which srun sets "
        "for every task: start the program with srun"
    )


def slurm_hostfile_path(env: dict[str, str]) -> str:
    """MESHCCL_HOSTFILE, else meshkit's default path if it exists."""
    if env.get("MESHCCL_HOSTFILE"):
        return env["MESHCCL_HOSTFILE"]
    if os.path.isfile(MESHKIT_HOSTFILE):
        return MESHKIT_HOSTFILE
    raise BootstrapError(
        f"under Slurm (SLURM_PROCID={env.get('SLURM_PROCID')!r}) meshccl needs meshkit's hostfile: "
        f"{MESHKIT_HOSTFILE} does not exist on this node; set MESHCCL_HOSTFILE to it (meshkit's setup writes it "
        "on every host as <meshkit_state_dir>/hostfiles/meshccl.json) and export it to every task "
        "(srun passes the environment it is started with)"
    )


def slurm_hostfile(env: dict[str, str], data: dict[str, Any], path: str) -> tuple[dict[str, Any], int]:
    """(meshccl hostfile of exactly the step's ranks, this task's meshccl rank) from meshkit's
    hostfile `data` (read from `path`) and the Slurm step in `env`."""
    by_rank, _size = _hostfile_ranks(data, path)
    order: list[str] = []  # hosts in the hostfile's ring order (the order of their first rank)
    first: dict[str, dict[str, Any]] = {}
    port: dict[str, int] = {}
    for _r, e in sorted(by_rank.items()):
        h = e["host"]
        if h not in first:
            order.append(h)
            first[h] = e
        port[h] = min(port.get(h, e["port"]), e["port"])

    list_name, list_raw = _slurm_var(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    count_name, count_raw = _slurm_var(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    ntasks_name, _raw = _slurm_var(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    ntasks = _int_env(env, ntasks_name)
    nodes = expand_nodelist(list_raw, env, list_name)
    counts = parse_tasks_per_node(count_raw, count_name)
    if len(counts) != len(nodes):
        raise BootstrapError(
            f"{count_name}={count_raw!r} gives task counts for {len(counts)} node(s) but {list_name}={list_raw!r} "
            f"names {len(nodes)}: {', '.join(nodes)}"
        )
    twice = sorted({n for n in nodes if nodes.count(n) > 1})
    if twice:
        raise BootstrapError(f"{list_name}={list_raw!r} names node(s) {', '.join(twice)} more than once")
    if sum(counts) != ntasks:
        raise BootstrapError(
            f"{count_name}={count_raw!r} adds up to {sum(counts)} task(s) but {ntasks_name}={ntasks}: "
            "the two must describe the same step"
        )
    per_node = dict(zip(nodes, counts))
    unknown = [n for n in nodes if n not in first]
    if unknown:
        raise BootstrapError(
            f"Slurm runs this step on node(s) {', '.join(unknown)} ({list_name}={list_raw!r}), which {path} does not "
            f"list: its hosts are {', '.join(order)}. Slurm's node names must be the hosts' names in meshkit's "
            "inventory; run the job on those hosts only (srun -w / --nodelist)"
        )
    me = env.get("SLURMD_NODENAME", "").strip()
    if not me:
        raise BootstrapError(
            "SLURMD_NODENAME is not set: meshccl needs the name of the node this Slurm task runs on (slurmd sets it "
            "for every task srun starts)"
        )
    if me not in per_node:
        raise BootstrapError(
            f"SLURMD_NODENAME={me} is not one of the step's nodes ({list_name}={list_raw!r}: {', '.join(nodes)})"
        )
    if "SLURM_LOCALID" not in env:
        raise BootstrapError("SLURM_LOCALID is not set: srun sets it for every task (the task's number on its node)")
    local = _int_env(env, "SLURM_LOCALID")
    if not 0 <= local < per_node[me]:
        raise BootstrapError(
            f"SLURM_LOCALID={local} but the step has {per_node[me]} task(s) on node {me} ({count_name}={count_raw!r}): "
            f"local ids run 0..{per_node[me] - 1}"
        )

    ranks: list[dict[str, Any]] = []
    hosts: dict[str, dict[str, Any]] = {}
    rank = -1
    for node_rank, h in enumerate(n for n in order if per_node.get(n, 0) > 0):
        mine = []
        for local_rank in range(per_node[h]):
            if h == me and local_rank == local:
                rank = len(ranks)
            mine.append(len(ranks))
            links = [dict(link) for link in first[h].get("links", [])]
            ranks.append(
                {
                    "rank": len(ranks),
                    "host": h,
                    "node_rank": node_rank,
                    "local_rank": local_rank,
                    "port": port[h] + local_rank,
                    "links": links,
                }
            )
        hosts[h] = {"management": (data.get("hosts") or {}).get(h, {}).get("management", h), "ranks": mine}
    out = {
        "format": MESHCCL_FORMAT,
        "version": MESHCCL_VERSION,
        "cluster": data.get("cluster", ""),
        "fingerprint": data.get("fingerprint", ""),
        "world_size": ntasks,
        "hosts": hosts,
        "ranks": ranks,
    }
    return out, rank


def plan_from_slurm(env: dict[str, str]) -> Plan:
    """Plan for a task that srun started (SLURM_PROCID set), from meshkit's hostfile and the step's
    layout in Slurm's environment (see slurm_hostfile)."""
    path = slurm_hostfile_path(env)
    _int_env(env, "SLURM_PROCID")
    data, rank = slurm_hostfile(env, _load_json(path), path)
    job, step = env.get("SLURM_JOB_ID", "").strip(), env.get("SLURM_STEP_ID", "").strip()
    where = f"{path} under Slurm job {job or '?'}" + (f" step {step}" if step else "")
    return plan_from_meshccl_hostfile(data, rank, f"{where} (hosts {', '.join(data['hosts'])})")


def _applies(env: dict[str, str]) -> bool:
    return "SLURM_PROCID" in env


def _plan_from_env(env: dict[str, str], options: Options) -> Plan:
    return plan_from_slurm(env)


SOURCE = Source("Slurm", _applies, _plan_from_env)
