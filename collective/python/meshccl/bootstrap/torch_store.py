"""Plans for torch process groups that meshccl's environment does not describe, through torch's
store: the store meshccl.torch's backend is handed (anything with c10d's set, get and wait:
nothing here imports torch).

- plan_from_store: every rank of the group linked to every other, over the address it reaches
  MASTER_ADDR (torch's store) from, on a free port; ports and host identities go through the store.
- plan_from_sub_hostfile: a group of some of the ranks of a job meshccl's hostfile describes,
  over the cables it names, on fresh ports agreed through the store.

The store is not authenticated, but nothing it carries is trusted: every meshccl connection
proves the job token at both ends.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Callable, Sequence
from typing import Any

from meshccl._meshccl import BootstrapError
from meshccl.bootstrap import rendezvous
from meshccl.bootstrap.hostfile import plan_from_meshccl_hostfile
from meshccl.bootstrap.plan import Plan, _int_env, _load_json
from meshccl.bootstrap.rendezvous import _mac, _resolve


def _free_port_on_all(addresses: Sequence[str]) -> int:
    """A port free on every one of `addresses` right now."""
    for _attempt in range(50):
        first = addresses[0]
        family = socket.AF_INET6 if ":" in first else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((first, 0))
            port = int(s.getsockname()[1])
        ok = True
        for a in addresses[1:]:
            fam = socket.AF_INET6 if ":" in a else socket.AF_INET
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                try:
                    s.bind((a, port))
                except OSError:
                    ok = False
                    break
        if ok:
            return port
    raise BootstrapError(f"no port is free on all of {', '.join(addresses)}")


def _store_host(store: Any) -> str | None:
    while store is not None:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
    return None


def _my_address(env: dict[str, str], store: Any) -> str:
    """The address this rank is reached on: the one it reaches MASTER_ADDR (torch's store) from."""
    target = env.get("MASTER_ADDR") or _store_host(store)
    if not target:
        raise BootstrapError(
            "meshccl backend: cannot tell which address this rank listens on: set MASTER_ADDR "
            "(torchrun does), or use a TCP store / init_method tcp://"
        )
    master = _resolve(target)
    if ipaddress.ip_address(master).is_loopback:
        return master
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))  # UDP: no packet is sent, the kernel only picks the route
        return str(s.getsockname()[0])


EXCHANGE_ROUNDS = 8


def _exchange(
    store: Any,
    prefix: str,
    rank: int,
    size: int,
    pick: Callable[[], int],
    entry: Callable[[int], list[Any]],
    unique: Callable[[int, list[Any]], tuple[Any, ...]],
) -> list[list[Any]]:
    """Every rank's entry (``entry(port)``, JSON) through the store, with a port ``pick()`` chose.
    Ports are probed free, then closed until meshccl listens: two ranks of one host can be handed
    the same one. Every rank sees the same table, so all find such a clash (``unique(rank, entry)``
    equal for two ranks) alike; the later of the two picks again and every rank publishes again
    under the next round's keys."""
    port = pick()
    for attempt in range(EXCHANGE_ROUNDS):
        store.set(f"{prefix}/{attempt}/{rank}", json.dumps(entry(port)))
        keys = [f"{prefix}/{attempt}/{r}" for r in range(size)]
        store.wait(keys)
        table = [json.loads(bytes(store.get(k)).decode()) for k in keys]
        first: dict[tuple[Any, ...], int] = {}
        clashing = set()
        for r, e in enumerate(table):
            if unique(r, e) in first:
                clashing.add(r)
            else:
                first[unique(r, e)] = r
        if not clashing:
            return table
        if rank in clashing:
            port = pick()
    raise BootstrapError(f"meshccl backend: ranks of one host kept picking the same port ({EXCHANGE_ROUNDS} rounds)")


def plan_from_store(store: Any, rank: int, size: int, gen: int, env: dict[str, str], token: str, job_id: str) -> Plan:
    """Every rank of the group linked to every other over the address it reaches MASTER_ADDR from,
    ports and host identities exchanged through the store."""
    if size == 1:
        return Plan(0, 1, source="torch store")
    address = _my_address(env, store)
    me = _mac(token, "meshccl/2 host identity", job_id, rendezvous.host_identity())
    table = _exchange(
        store,
        f"meshccl/{gen}/rank",
        rank,
        size,
        lambda: _free_port_on_all([address]),
        lambda port: [address, port, me],
        lambda _r, e: (e[0], e[1], e[2]),
    )
    port = int(table[rank][1])
    peers = {r: ([(str(e[0]), int(e[1]))], -1) for r, e in enumerate(table) if r != rank}
    same_host = {r for r in peers if table[r][2] == me}
    return Plan(rank, size, [(address, port)], peers, True, True, 1, "torch store", same_host)


def plan_from_sub_hostfile(store: Any, rank: int, members: list[int], gen: int, env: dict[str, str]) -> Plan:
    """A group of some of the job's ranks over the cables meshccl.json names, on fresh ports."""
    path = env["MESHCCL_HOSTFILE"]
    data = _load_json(path)
    global_rank = members[rank]
    if "MESHCCL_RANK" in env and _int_env(env, "MESHCCL_RANK") != global_rank:
        raise BootstrapError(
            f"meshccl backend: MESHCCL_RANK={env['MESHCCL_RANK']} but torch says this process is global rank "
            f"{global_rank}"
        )
    entries = {e.get("rank"): e for e in data.get("ranks", []) if isinstance(e, dict)}
    missing = [g for g in members if g not in entries]
    if missing:
        raise BootstrapError(f"{path}: rank(s) {missing} of the group are not in the hostfile")
    mine = entries[global_rank]
    addrs = sorted({link["address"] for link in mine.get("links", [])})
    if sum(1 for g in members if entries[g]["host"] == mine["host"]) > 1:
        addrs.append("127.0.0.1")
    table = _exchange(
        store,
        f"meshccl/{gen}/port",
        rank,
        len(members),
        lambda: _free_port_on_all(addrs or ["127.0.0.1"]),
        lambda port: [port],
        lambda r, e: (entries[members[r]]["host"], e[0]),
    )
    ports = [int(e[0]) for e in table]
    sub = dict(data)
    sub["world_size"] = len(members)
    sub["ranks"] = [dict(entries[g], rank=i, port=ports[i]) for i, g in enumerate(members)]
    try:
        return plan_from_meshccl_hostfile(sub, rank, f"{path} (ranks {members})")
    except BootstrapError as e:
        raise BootstrapError(
            f"meshccl backend: new_group(ranks={members}): {e}; a meshccl group needs its ranks' hosts cabled as a "
            "ring in rank order or a full mesh: use backend='gloo' for this group"
        ) from None
