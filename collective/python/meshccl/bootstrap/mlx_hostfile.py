"""MLX's ring hostfile (``MLX_RANK`` + ``MLX_HOSTFILE``, what ``mlx.launch`` hands each rank): a
JSON list, per rank, of "ip:port" strings; rank i listens on its own and connects to rank i+1's,
as MLX does."""

from __future__ import annotations

from typing import Any

from meshccl.bootstrap.plan import (
    Endpoint,
    Options,
    Plan,
    Source,
    _check_address,
    _check_port,
    _fail,
    _int_env,
    _load_json,
)


def _split_endpoint(where: str, text: Any) -> Endpoint:
    if not isinstance(text, str) or ":" not in text:
        _fail(where, f"{text!r} is not 'ip:port'")
    host, _sep, port = text.rpartition(":")
    try:
        port_n = int(port)
    except ValueError:
        _fail(where, f"{text!r}: port is not a number")
    return _check_address(where, host), _check_port(where, port_n)


def plan_from_mlx_hostfile(data: Any, rank: int, source: str = "MLX_HOSTFILE") -> Plan:
    """Plan from MLX's ring runtime format: hosts[i] = ["ip:port", ...] that rank i listens on."""
    if not isinstance(data, list) or not data or not all(isinstance(h, list) and h for h in data):
        _fail(source, "must be a JSON list with, per rank, a non-empty list of 'ip:port' strings")
    hosts = [[_split_endpoint(f"{source}: rank {i}", t) for t in h] for i, h in enumerate(data)]
    size = len(hosts)
    if not 0 <= rank < size:
        _fail(source, f"this process is rank {rank}, but the file lists {size} ranks")
    plan = Plan(rank, size, listen=list(hosts[rank]), source=source)
    if size == 1:
        return plan
    right, left = (rank + 1) % size, (rank - 1) % size
    # As in MLX: rank i connects to rank i+1's addresses and accepts from rank i-1 on its own.
    # Two ranks: rank 0 connects, once, to rank 1's addresses.
    if size == 2:
        # Both ends name rank 1's addresses: rank 0 connects to them, rank 1 expects that many.
        plan.peers[right] = (hosts[1], 1 if rank == 0 else 0)
        plan.listen = list(hosts[1]) if rank == 1 else []
    else:
        plan.peers[right] = (hosts[right], 1)
        plan.peers[left] = (hosts[rank], 0)
    plan.complete = size <= 3
    plan.ring = True
    plan.ring_links = min(len(h) for h in hosts)
    # The file names no hosts: two ranks listening on the same addresses share a host.
    ips = [{a for a, _port in h} for h in hosts]
    plan.same_host = {r for r in plan.peers if ips[r] == ips[rank]}
    return plan


def _applies(env: dict[str, str]) -> bool:
    return "MLX_RANK" in env and "MLX_HOSTFILE" in env


def _plan_from_env(env: dict[str, str], options: Options) -> Plan:
    path = env["MLX_HOSTFILE"]
    rank = _int_env(env, "MLX_RANK")
    return plan_from_mlx_hostfile(_load_json(path), rank, path)


SOURCE = Source("MLX hostfile", _applies, _plan_from_env)
