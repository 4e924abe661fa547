"""Who this rank is and whom it talks to, from the environment a launcher sets.

Three conventions, tried in this order:

- ``MESHCCL_RANK`` + ``MESHCCL_HOSTFILE``: meshccl's own hostfile (meshkit writes it; format
  ``meshccl-hostfile`` version 1, see docs/hostfiles.md): per rank its port and, per cable of
  its host, the address it listens on and the peer's address on the same cable.
- ``MLX_RANK`` + ``MLX_HOSTFILE``: MLX's ring format (what ``mlx.launch`` hands each rank): a
  JSON list, per rank, of "ip:port" strings; rank i listens on its own and connects to rank
  i+1's, as MLX does.
- torchrun's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``: rank 0 runs a
  small rendezvous on ``MASTER_ADDR`` (port ``MESHCCL_MASTER_PORT``, default MASTER_PORT + 1,
  leaving MASTER_PORT to torch's own store); every rank reports the address it reaches
  rank 0 from and a port, and all ranks connect to all.

The result is a :class:`Plan`; the C++ core does the connecting. Every problem found here is a
:class:`meshccl.BootstrapError` naming the file, rank and field.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshccl._meshccl import BootstrapError, TimeoutError

MESHCCL_FORMAT = "meshccl-hostfile"
MESHCCL_VERSION = 1

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


# --- meshccl's own hostfile ---------------------------------------------------------------


def plan_from_meshccl_hostfile(data: dict[str, Any], rank: int, source: str = "hostfile") -> Plan:
    """Plan for `rank` from a parsed meshccl.json (format meshccl-hostfile, version 1)."""
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


# --- MLX ring hostfile ----------------------------------------------------------------------


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


# --- torchrun ---------------------------------------------------------------------------------


def _recv_line(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed during the rendezvous")
        buf += chunk
        if len(buf) > limit:
            raise ConnectionError("rendezvous message too long")
    return buf


def _resolve(name: str) -> str:
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise BootstrapError(f"MASTER_ADDR={name!r} does not resolve: {e}") from None
    return str(infos[0][4][0])


def _free_port(address: str) -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def host_identity() -> str:
    """This process's host as other ranks can compare it: name, kernel boot, network namespace.

    Ranks with the same identity share memory; the network namespace keeps lab "hosts" that
    are namespaces on one machine apart.
    """
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        parts.append("?")
    try:
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        parts.append("?")
    return "/".join(parts)


def plan_from_torchrun(rank: int, size: int, master_addr: str, master_port: int, token: str, timeout: float) -> Plan:
    """Rendezvous through rank 0 at master_addr:master_port; every rank linked to every rank."""
    master = _resolve(master_addr)
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    deadline = time.monotonic() + timeout
    table: dict[int, Endpoint]
    hosts: dict[int, str] = {}
    me = host_identity()
    if size == 1:
        return Plan(0, 1, source="torchrun")
    if rank == 0:
        port = _free_port(master)
        table = {0: (master, port)}
        hosts[0] = me
        with socket.socket(family, socket.SOCK_STREAM) as srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                srv.bind((master, master_port))
            except OSError as e:
                raise BootstrapError(
                    f"rank 0 cannot listen on {master}:{master_port} for the rendezvous: {e}"
                ) from None
            srv.listen(size)
            clients: list[socket.socket] = []
            try:
                while len(table) < size:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = sorted(set(range(size)) - set(table))
                        raise TimeoutError(
                            f"rendezvous on {master}:{master_port}: ranks {missing} did not report within {timeout} s"
                        )
                    srv.settimeout(left)
                    try:
                        conn, peer = srv.accept()
                    except TimeoutError:
                        continue
                    conn.settimeout(max(1.0, deadline - time.monotonic()))
                    try:
                        msg = json.loads(_recv_line(conn))
                        ok = hmac.compare_digest(str(msg.get("token", "")).encode(), token.encode())
                        r = msg.get("rank")
                        if (
                            not ok
                            or msg.get("size") != size
                            or not isinstance(r, int)
                            or not 0 < r < size
                            or r in table
                        ):
                            print(f"meshccl[rank 0]: rejected a rendezvous from {peer[0]}: wrong token, rank or size")
                            conn.close()
                            continue
                        table[r] = (
                            _check_address("rendezvous", msg["address"]),
                            _check_port("rendezvous", msg["port"]),
                        )
                        hosts[r] = str(msg.get("host", ""))
                        clients.append(conn)
                    except (OSError, ValueError, KeyError):
                        conn.close()
                reply = (json.dumps({str(r): [*ep, hosts[r]] for r, ep in table.items()}) + "\n").encode()
                for c in clients:
                    c.sendall(reply)
            finally:
                for c in clients:
                    c.close()
    else:
        last = "no attempt yet"
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {rank}: could not reach the rendezvous at {master}:{master_port} within {timeout} s: {last}"
                )
            try:
                with socket.create_connection((master, master_port), timeout=2.0) as s:
                    own = s.getsockname()[0]
                    port = _free_port(own)
                    s.sendall(
                        (
                            json.dumps(
                                {"rank": rank, "size": size, "token": token, "address": own, "port": port, "host": me}
                            )
                            + "\n"
                        ).encode()
                    )
                    s.settimeout(max(1.0, deadline - time.monotonic()))
                    reply = json.loads(_recv_line(s))
                    table = {int(k): (v[0], int(v[1])) for k, v in reply.items()}
                    hosts = {int(k): str(v[2]) for k, v in reply.items()}
                    break
            except (OSError, ValueError) as e:
                last = str(e)
                time.sleep(0.1)
    peers = {r: ([ep], -1) for r, ep in table.items() if r != rank}
    same_host = {r for r in peers if hosts.get(r) == me}
    return Plan(rank, size, [table[rank]], peers, True, True, 1, "torchrun", same_host)


# --- from the environment -----------------------------------------------------------------------


def plan_from_env(env: dict[str, str] | None = None, token: str = "", timeout: float = 60.0) -> Plan:
    env = dict(os.environ if env is None else env)
    if "MESHCCL_RANK" in env or "MESHCCL_HOSTFILE" in env:
        if "MESHCCL_RANK" not in env or "MESHCCL_HOSTFILE" not in env:
            raise BootstrapError("set both MESHCCL_RANK and MESHCCL_HOSTFILE (meshkit's launch sets them)")
        path = env["MESHCCL_HOSTFILE"]
        rank = _int_env(env, "MESHCCL_RANK")
        plan = plan_from_meshccl_hostfile(_load_json(path), rank, path)
    elif "MLX_RANK" in env and "MLX_HOSTFILE" in env:
        path = env["MLX_HOSTFILE"]
        rank = _int_env(env, "MLX_RANK")
        plan = plan_from_mlx_hostfile(_load_json(path), rank, path)
    elif all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        port = (
            _int_env(env, "MESHCCL_MASTER_PORT") if "MESHCCL_MASTER_PORT" in env else _int_env(env, "MASTER_PORT") + 1
        )
        plan = plan_from_torchrun(
            _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE"), env["MASTER_ADDR"], port, token, timeout
        )
    else:
        raise BootstrapError(
            "no rank in the environment: set MESHCCL_RANK + MESHCCL_HOSTFILE (meshkit), MLX_RANK + MLX_HOSTFILE "
            "(mlx.launch), or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun)"
        )
    if "MESHCCL_WORLD_SIZE" in env and _int_env(env, "MESHCCL_WORLD_SIZE") != plan.size:
        raise BootstrapError(
            f"MESHCCL_WORLD_SIZE={env['MESHCCL_WORLD_SIZE']} but {plan.source} describes {plan.size} ranks"
        )
    return plan


def _load_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise BootstrapError(f"cannot read hostfile {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise BootstrapError(f"hostfile {path} is not valid JSON: {e}") from None
