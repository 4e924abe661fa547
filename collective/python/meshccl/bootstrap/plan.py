"""What every source of a plan shares: the :class:`Plan`, the :class:`Source` interface a launcher's
convention implements, the checks of what a file or the environment says, and the job token's
rules."""

from __future__ import annotations

import ipaddress
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshccl._meshccl import AuthError, BootstrapError

Endpoint = tuple[str, int]


@dataclass
class Plan:
    """One rank's view of the job: where it listens and how it reaches each linked rank."""

    rank: int
    size: int
    listen: list[Endpoint] = field(default_factory=list)
    # peer rank -> (endpoints to reach it, one per link; who initiates: 1 me, 0 them, -1 higher rank)
    peers: dict[int, tuple[list[Endpoint], int]] = field(default_factory=dict)
    complete: bool = False  # every pair of ranks linked (same on every rank)
    ring: bool = False  # rank r linked to r+1 mod size (same on every rank)
    ring_links: int = 1  # links per ring neighbour pair, the minimum over the ring
    source: str = ""  # where the plan came from, for messages
    same_host: set[int] = field(default_factory=set)  # linked ranks on this rank's host (shared memory)


@dataclass(frozen=True)
class Options:
    """What plan_from_env is given besides the environment."""

    token: str = ""  # the job token (MESHCCL_TOKEN)
    timeout: float = 60.0  # seconds a rendezvous may take
    job_id: str = ""  # what the token's proofs are bound to (job_id_from_env)
    allow_no_token: bool = False  # a job of more than one rank may run without a token


@dataclass(frozen=True)
class Source:
    """One launcher's convention: whether an environment follows it, and the plan it gives.
    meshccl.bootstrap.plan_from_env takes the first of SOURCES that applies."""

    name: str  # for messages and docs
    applies: Callable[[dict[str, str]], bool]  # does this environment follow the convention?
    plan: Callable[[dict[str, str], Options], Plan]  # this rank's plan (BootstrapError naming what is wrong)
    checks_token: bool = False  # plan() itself refuses a job without a token, before touching the network


def _fail(where: str, msg: str) -> None:
    raise BootstrapError(f"{where}: {msg}")


def _check_address(where: str, address: Any) -> str:
    if not isinstance(address, str):
        _fail(where, f"address {address!r} is not a string")
    try:
        ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        _fail(where, f"'{address}' is not a numeric IPv4 or IPv6 address")
    return address.strip("[]")


def _check_port(where: str, port: Any) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        _fail(where, f"port {port!r} is not a TCP port (1-65535)")
    return port


def _int_env(env: dict[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise BootstrapError(f"{name}={raw!r} is not an integer") from None


def _graph_facts(size: int, linked: dict[int, dict[int, int]]) -> tuple[bool, bool, int]:
    """(complete, ring, ring_links) from every rank's links: linked[a][b] = links between a, b."""
    complete = all(b in linked.get(a, {}) for a in range(size) for b in range(size) if a != b)
    ring = size == 1 or all((r + 1) % size in linked.get(r, {}) for r in range(size))
    ring_links = min((linked[r][(r + 1) % size] for r in range(size)), default=1) if ring and size > 1 else 1
    return complete, ring, ring_links


def _load_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise BootstrapError(f"cannot read hostfile {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise BootstrapError(f"hostfile {path} is not valid JSON: {e}") from None


# --- job token --------------------------------------------------------------------------------


def no_token_message(rank: int, size: int) -> str:
    return (
        f"rank {rank} of {size}: no job token (MESHCCL_TOKEN is empty or unset): without one any process that "
        "reaches this job's ports could join it and read or write its data, so meshccl refuses to start. "
        "`meshkit launch` gives every rank one; under torchrun / mpirun / mlx.launch make ONE secret "
        "(python3 -c 'import secrets; print(secrets.token_hex(32))') and run export MESHCCL_TOKEN=<that value> "
        "on every node's launching shell, the same value everywhere (torchrun passes its environment to its workers; "
        "mpirun needs -x MESHCCL_TOKEN), "
        "or set MESHCCL_ALLOW_NO_TOKEN=1 to run without authentication on a network you trust"
    )


def check_token(rank: int, size: int, token: str, allow_no_token: bool) -> None:
    """Refuses a job of more than one rank without a token (before anything touches the
    network), unless the user opted out; then warns once on stderr."""
    if token or size <= 1:
        return
    if not allow_no_token:
        raise AuthError(no_token_message(rank, size))
    print(
        f"meshccl[rank {rank}]: WARNING: running without a job token (MESHCCL_ALLOW_NO_TOKEN=1): any process "
        "that reaches this job's ports can join it and read or write its data",
        file=sys.stderr,
        flush=True,
    )


def allow_no_token_from_env(env: dict[str, str]) -> bool:
    raw = env.get("MESHCCL_ALLOW_NO_TOKEN", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise BootstrapError(
        f"MESHCCL_ALLOW_NO_TOKEN={env['MESHCCL_ALLOW_NO_TOKEN']!r}: set it to 1 to run without a job token, "
        "or leave it unset"
    )


def job_id_from_env(env: dict[str, str]) -> str:
    """MESHCCL_JOB_ID (meshkit launch sets it), else torchrun's TORCHELASTIC_RUN_ID, else
    "slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>" in a task srun started (every task of a step has the
    same), else ""."""
    explicit = env.get("MESHCCL_JOB_ID") or env.get("TORCHELASTIC_RUN_ID")
    if explicit:
        return explicit
    job, step = env.get("SLURM_JOB_ID", "").strip(), env.get("SLURM_STEP_ID", "").strip()
    return f"slurm-{job}.{step}" if job and step else ""
