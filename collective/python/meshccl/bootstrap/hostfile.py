"""meshccl's own hostfile (``MESHCCL_RANK`` + ``MESHCCL_HOSTFILE``, format ``meshccl-hostfile``
version 1, see docs/hostfiles.md): meshkit writes it, per rank its port and, per cable of its
host, the address it listens on and the peer's address on the same cable."""

from __future__ import annotations

from typing import Any

from meshccl._meshccl import BootstrapError
from meshccl.bootstrap.plan import (
    Endpoint,
    Options,
    Plan,
    Source,
    _check_address,
    _check_port,
    _fail,
    _graph_facts,
    _int_env,
    _load_json,
)

MESHCCL_FORMAT = "meshccl-hostfile"
MESHCCL_VERSION = 1


def _hostfile_ranks(data: dict[str, Any], source: str) -> tuple[dict[int, dict[str, Any]], int]:
    """(rank -> entry, world size) of a parsed meshccl.json, every field checked; the cabling's
    shape (ring or mesh) is not."""
    if not isinstance(data, dict) or data.get("format") != MESHCCL_FORMAT:
        _fail(source, f"not a meshccl hostfile (format must be '{MESHCCL_FORMAT}')")
    if data.get("version") != MESHCCL_VERSION:
        _fail(
            source, f"version {data.get('version')!r} is not supported (this meshccl reads version {MESHCCL_VERSION})"
        )
    entries = data.get("ranks")
    if not isinstance(entries, list) or not entries:
        _fail(source, "'ranks' must be a non-empty list")
    by_rank: dict[int, dict[str, Any]] = {}
    for i, e in enumerate(entries):
        where = f"{source}: ranks[{i}]"
        if not isinstance(e, dict):
            _fail(where, "must be an object")
        r = e.get("rank")
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            _fail(where, f"'rank' {r!r} is not a rank number")
        if r in by_rank:
            _fail(where, f"rank {r} is listed twice")
        if not isinstance(e.get("host"), str) or not e["host"]:
            _fail(where, "'host' must name the rank's host")
        _check_port(f"{where} (rank {r})", e.get("port"))
        links = e.get("links", [])
        if not isinstance(links, list):
            _fail(where, "'links' must be a list")
        for k, link in enumerate(links):
            lw = f"{where} (rank {r}) links[{k}]"
            if not isinstance(link, dict):
                _fail(lw, "must be an object")
            _check_address(lw + " address", link.get("address"))
            _check_address(lw + " peer_address", link.get("peer_address"))
            if not isinstance(link.get("peer_host"), str):
                _fail(lw, "'peer_host' must name the host at the other end of the cable")
        by_rank[r] = e
    declared = data.get("world_size", max(by_rank) + 1)
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
        _fail(source, f"world_size {declared!r} is not a positive number")
    size = declared
    outside = sorted(r for r in by_rank if r >= size)
    if outside:
        _fail(source, f"world_size is {size} but rank(s) {outside} are listed")
    missing = [r for r in range(size) if r not in by_rank]
    if missing:
        _fail(source, f"ranks must be numbered 0..{size - 1}; missing rank(s) {missing}")
    return by_rank, size


def plan_from_meshccl_hostfile(data: dict[str, Any], rank: int, source: str = "hostfile") -> Plan:
    """Plan for `rank` from a parsed meshccl.json (format meshccl-hostfile, version 1)."""
    by_rank, size = _hostfile_ranks(data, source)
    if rank not in by_rank:
        _fail(source, f"this process is rank {rank}, but the hostfile lists ranks 0..{size - 1} only")

    # Every (address, port) a rank listens on must be its own: two ranks of one host on one port
    # could never both start.
    owner: dict[tuple[str, str, int], int] = {}
    for r, e in sorted(by_rank.items()):
        addrs = {link["address"] for link in e.get("links", [])}
        if sum(1 for x in by_rank.values() if x["host"] == e["host"]) > 1:
            addrs.add("127.0.0.1")
        for a in addrs:
            key = (e["host"], a, e["port"])
            if key in owner:
                _fail(source, f"rank {owner[key]} and rank {r} on host {e['host']} both listen on {a}:{e['port']}")
            owner[key] = r

    def links_between(a: int, b: int) -> list[Endpoint]:
        ea, eb = by_rank[a], by_rank[b]
        if ea["host"] == eb["host"]:
            return [("127.0.0.1", eb["port"])]
        return [(link["peer_address"], eb["port"]) for link in ea.get("links", []) if link["peer_host"] == eb["host"]]

    linked: dict[int, dict[int, int]] = {r: {} for r in range(size)}
    for a in range(size):
        for b in range(size):
            if a != b and (n := len(links_between(a, b))):
                linked[a][b] = n
    me = by_rank[rank]
    listen = sorted({(link["address"], me["port"]) for link in me.get("links", [])})
    if any(by_rank[r]["host"] == me["host"] for r in by_rank if r != rank):
        listen.append(("127.0.0.1", me["port"]))
    complete, ring, ring_links = _graph_facts(size, linked)
    if size > 1 and not (complete or ring):
        _fail(source, "the cables form neither a ring through the ranks in order nor a full mesh")
    peers = {b: (links_between(rank, b), -1) for b in linked[rank]}
    same_host = {b for b in peers if by_rank[b]["host"] == me["host"]}
    return Plan(rank, size, listen, peers, complete, ring, ring_links, source, same_host)


def one_host_hostfile(n: int, base_port: int, host: str = "local") -> dict[str, Any]:
    """A meshccl.json for n ranks on this one host (ports base_port..+n-1): every pair meets on
    127.0.0.1 and moves data through shared memory. For local runs and benchmarks."""
    return {
        "format": MESHCCL_FORMAT,
        "version": MESHCCL_VERSION,
        "world_size": n,
        "ranks_per_host": n,
        "ring": [host],
        "mesh": False,
        "hosts": {host: {"management": "127.0.0.1", "ranks": list(range(n))}},
        "ranks": [
            {"rank": r, "host": host, "node_rank": 0, "local_rank": r, "port": base_port + r, "links": []}
            for r in range(n)
        ],
    }


def _applies(env: dict[str, str]) -> bool:
    # MESHCCL_HOSTFILE alone, in a task srun started (SLURM_PROCID), is for the Slurm way (slurm.py)
    return "MESHCCL_RANK" in env or ("MESHCCL_HOSTFILE" in env and "SLURM_PROCID" not in env)


def _plan_from_env(env: dict[str, str], options: Options) -> Plan:
    if "MESHCCL_RANK" not in env or "MESHCCL_HOSTFILE" not in env:
        raise BootstrapError(
            "set both MESHCCL_RANK and MESHCCL_HOSTFILE (meshkit's launch sets them), or start the ranks with "
            "Slurm's srun (SLURM_PROCID) and MESHCCL_HOSTFILE alone"
        )
    path = env["MESHCCL_HOSTFILE"]
    rank = _int_env(env, "MESHCCL_RANK")
    plan = plan_from_meshccl_hostfile(_load_json(path), rank, path)
    # Under torch (meshkit launch -r torch) both name this process: they must agree, or two
    # processes would claim one rank (torchrun started inside a launched rank hands all its
    # workers the launcher's MESHCCL_RANK).
    if (
        "RANK" in env
        and "WORLD_SIZE" in env
        and (_int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")) != (rank, plan.size)
    ):
        raise BootstrapError(
            f"MESHCCL_RANK={rank} of {plan.size} ({path}) but torch's RANK={env['RANK']} of "
            f"WORLD_SIZE={env['WORLD_SIZE']}: the two must name the same rank. meshkit launch -r torch sets "
            "both; do not start torchrun inside it (give meshkit launch -n the ranks per host instead)"
        )
    return plan


SOURCE = Source("meshccl hostfile", _applies, _plan_from_env)
