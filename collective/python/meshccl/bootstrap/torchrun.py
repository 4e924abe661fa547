"""torchrun's environment (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``): rank 0
runs meshccl's rendezvous (meshccl.bootstrap.rendezvous) on ``MASTER_ADDR``, port
``MESHCCL_MASTER_PORT``, default MASTER_PORT + 1 (leaving MASTER_PORT to torch's own store);
every rank claims its place with the address it reaches rank 0 from and a port, and all ranks
connect to all."""

from __future__ import annotations

import socket
import time

from meshccl._meshccl import BootstrapError
from meshccl.bootstrap import rendezvous
from meshccl.bootstrap.plan import Options, Plan, Source, _int_env, check_token
from meshccl.bootstrap.rendezvous import (
    RateLimitedLog,
    RendezvousServer,
    _free_port,
    _hostport,
    _join,
    _mac,
    _resolve,
    _serve,
)


def plan_from_torchrun(
    rank: int,
    size: int,
    master_addr: str,
    master_port: int,
    token: str,
    timeout: float,
    job_id: str = "",
    allow_no_token: bool = False,
) -> Plan:
    """Rendezvous through rank 0 at master_addr:master_port; every rank linked to every rank.

    Both ends prove the job token (never sent); a job of more than one rank without a token
    is refused before anything is sent unless allow_no_token.
    """
    if size < 1 or not 0 <= rank < size:
        raise BootstrapError(f"RANK={rank} is not one of 0..{size - 1} (WORLD_SIZE={size})")
    check_token(rank, size, token, allow_no_token)
    if size == 1:
        return Plan(0, 1, source="torchrun")
    master = _resolve(master_addr)
    # Ranks compare host identities (equal: shared memory) but need not read them: a keyed hash
    # keeps the host name and boot id from whatever answers on the port before it is proved.
    # (rendezvous.host_identity, looked up at each call: tests stand in for it there.)
    me = _mac(token, "meshccl/2 host identity", job_id, rendezvous.host_identity())
    if rank == 0:
        family = socket.AF_INET6 if ":" in master else socket.AF_INET
        where = _hostport(master, master_port)
        deadline = time.monotonic() + timeout
        machine = RendezvousServer(
            size, token, job_id, (master, _free_port(master), me), RateLimitedLog("meshccl[rank 0]: rendezvous: ")
        )
        with socket.socket(family, socket.SOCK_STREAM) as srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                srv.bind((master, master_port))
            except OSError as e:
                raise BootstrapError(
                    f"rank 0 cannot listen on {where} for the rendezvous: {e.strerror or e} "
                    "(another job or process holds the port? set MESHCCL_MASTER_PORT)"
                ) from None
            srv.listen(256)
            _serve(srv, machine, deadline, timeout, where)
        table = dict(machine.entries)
    else:
        table = _join(rank, size, (master, master_port), token, job_id, me, timeout)
    peers = {r: ([(e[0], e[1])], -1) for r, e in table.items() if r != rank}
    same_host = {r for r in peers if table[r][2] == me}
    return Plan(rank, size, [(table[rank][0], table[rank][1])], peers, True, True, 1, "torchrun", same_host)


def _applies(env: dict[str, str]) -> bool:
    return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _plan_from_env(env: dict[str, str], options: Options) -> Plan:
    port = _int_env(env, "MESHCCL_MASTER_PORT") if "MESHCCL_MASTER_PORT" in env else _int_env(env, "MASTER_PORT") + 1
    size = _int_env(env, "WORLD_SIZE")
    if "MESHCCL_WORLD_SIZE" in env and _int_env(env, "MESHCCL_WORLD_SIZE") != size:
        raise BootstrapError(f"MESHCCL_WORLD_SIZE={env['MESHCCL_WORLD_SIZE']} but WORLD_SIZE={size}")
    return plan_from_torchrun(
        _int_env(env, "RANK"),
        size,
        env["MASTER_ADDR"],
        port,
        options.token,
        options.timeout,
        options.job_id,
        options.allow_no_token,
    )


SOURCE = Source("torchrun", _applies, _plan_from_env, checks_token=True)
