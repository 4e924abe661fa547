"""Who this rank is and whom it talks to, from the environment a launcher sets.

Four conventions, tried in this order:

- ``MESHCCL_RANK`` + ``MESHCCL_HOSTFILE``: meshccl's own hostfile (meshkit writes it; format
  ``meshccl-hostfile`` version 1, see docs/hostfiles.md): per rank its port and, per cable of
  its host, the address it listens on and the peer's address on the same cable.
- ``MLX_RANK`` + ``MLX_HOSTFILE``: MLX's ring format (what ``mlx.launch`` hands each rank): a
  JSON list, per rank, of "ip:port" strings; rank i listens on its own and connects to rank
  i+1's, as MLX does.
- torchrun's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``: rank 0 runs a
  small rendezvous on ``MASTER_ADDR`` (port ``MESHCCL_MASTER_PORT``, default MASTER_PORT + 1,
  leaving MASTER_PORT to torch's own store); every rank claims its place with the address it
  reaches rank 0 from and a port, both ends proving the job token without sending it, and all
  ranks connect to all.
- Slurm: a task ``srun`` started (``SLURM_PROCID`` set) with meshkit's hostfile
  (``MESHCCL_HOSTFILE``, else /var/lib/meshkit/hostfiles/meshccl.json): the step's nodes
  (``SLURM_STEP_NODELIST``, expanded by ``scontrol show hostnames``) and task counts
  (``SLURM_STEP_TASKS_PER_NODE``), this task's node and local id (``SLURMD_NODENAME``,
  ``SLURM_LOCALID``). Ranks follow the hostfile's ring order: the step's hosts in that order,
  each with its Slurm task count of consecutive ranks (see plan_from_slurm).

A job of more than one rank needs a token (``MESHCCL_TOKEN``) unless the user opts out
(``MESHCCL_ALLOW_NO_TOKEN=1``); without one it is refused before anything is sent.

The result is a :class:`Plan`; the C++ core does the connecting. Every problem found here is a
:class:`meshccl.BootstrapError` naming the file, rank and field.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import hmac
import ipaddress
import itertools
import json
import os
import re
import secrets
import selectors
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshccl._meshccl import AuthError, BootstrapError, TimeoutError

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


# --- torchrun: the rendezvous ---------------------------------------------------------------------
#
# Rank 0 listens on MASTER_ADDR:MESHCCL_MASTER_PORT and serves every connection at once. The
# token never crosses the wire; both ends prove they hold it (HMAC-SHA256 over both sides'
# fresh nonces, the job id, the rank and what is claimed):
#
#   rank 0 -> client  {"meshccl": "rendezvous", "v": 2, "nonce": N0}              (on accept)
#   client -> rank 0  {"rank", "size", "nonce": N1, "address", "port", "host",
#                      "proof": HMAC(token, [CLAIM_LABEL, job, N0, N1, rank, size, address, port, host])}
#   rank 0 -> client  {"table": {"0": [address, port, host], ...},
#                      "proof": HMAC(token, [TABLE_LABEL, job, N0, N1, rank, canonical(table)])}
#                     (once every rank has claimed)   or   {"error": why} and close (claim refused)
#
# One JSON object per line, canonical encoding (_canonical) for everything a MAC covers. A
# stranger's connection gets RDV_HANDSHAKE_S to send a valid claim, at most RDV_MAX_PENDING
# unauthenticated connections are kept (a new one pushes out the oldest), a line is at most
# RDV_LINE_MAX bytes; whatever it sends is refused with a reason, logged (rate-limited), and
# never raises out of rank 0.

RDV_VERSION = 2
RDV_LINE_MAX = 4096  # bytes in a line rank 0 reads from a connection it has not authenticated
RDV_HANDSHAKE_S = 5.0  # seconds from accept to a valid claim
RDV_MAX_PENDING = 64  # connections accepted and not yet authenticated
_CLAIM_LABEL = "meshccl/2 rendezvous claim"
_TABLE_LABEL = "meshccl/2 rendezvous table"
_CLAIM_FIELDS = ("rank", "size", "nonce", "address", "port", "host", "proof")
_HOST_MAX = 512
_HEX = frozenset("0123456789abcdef")

Entry = tuple[str, int, str]  # address, port, host identity


@dataclass(frozen=True)
class Claim:
    """A rank's authenticated claim, as rank 0 accepted it."""

    rank: int
    size: int
    nonce: str
    address: str
    port: int
    host: str


@dataclass(frozen=True)
class Hello:
    """Rank 0's greeting: its fresh nonce for this connection."""

    nonce: str


@dataclass(frozen=True)
class Refusal:
    """What answered said it refused the claim, and why. Not authenticated: a hint for messages."""

    reason: str


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(token: str, *parts: Any) -> str:
    key = token.encode("utf-8", "surrogateescape")
    return hmac.new(key, _canonical(list(parts)), hashlib.sha256).hexdigest()


def claim_proof(
    token: str,
    job_id: str,
    server_nonce: str,
    client_nonce: str,
    rank: int,
    size: int,
    address: str,
    port: int,
    host: str,
) -> str:
    return _mac(token, _CLAIM_LABEL, job_id, server_nonce, client_nonce, rank, size, address, port, host)


def table_proof(token: str, job_id: str, server_nonce: str, client_nonce: str, rank: int, table: Any) -> str:
    return _mac(token, _TABLE_LABEL, job_id, server_nonce, client_nonce, rank, _canonical(table).decode())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hex(value: Any, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and set(value) <= _HEX


def _short(value: Any, limit: int = 40) -> str:
    """A value a stranger sent, safe and short enough for a log line."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _printable(text: str, limit: int = 200) -> str:
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _ip_or_reason(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 64:
        return f"address {_short(value)} is not an IP address"
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return f"address {_short(value)} is not an IP address"
    return ""


def _load_line(line: bytes, limit: int) -> tuple[Any, str]:
    """The JSON value of one protocol line, or (None, why not)."""
    if len(line) > limit:
        return None, f"line longer than {limit} bytes"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    try:
        return json.loads(text), ""
    except (ValueError, RecursionError) as e:
        return None, f"not JSON ({_printable(str(e), 80)})"


def hello_line(nonce: str) -> bytes:
    return _canonical({"meshccl": "rendezvous", "v": RDV_VERSION, "nonce": nonce}) + b"\n"


def parse_hello(line: bytes) -> Hello | str:
    """Rank 0's greeting, or why it is not one."""
    msg, why = _load_line(line, RDV_LINE_MAX)
    if why:
        return why
    if not isinstance(msg, dict) or msg.get("meshccl") != "rendezvous":
        return "not a meshccl rendezvous greeting"
    v = msg.get("v")
    if not _is_int(v) or v != RDV_VERSION:
        return f"rendezvous version {_short(v)}, this meshccl speaks version {RDV_VERSION}"
    if not _is_hex(msg.get("nonce"), 64):
        return "the greeting's nonce is not 32 bytes in hex"
    return Hello(msg["nonce"])


def claim_line(
    token: str,
    job_id: str,
    server_nonce: str,
    client_nonce: str,
    rank: int,
    size: int,
    address: str,
    port: int,
    host: str,
) -> bytes:
    proof = claim_proof(token, job_id, server_nonce, client_nonce, rank, size, address, port, host)
    fields = (rank, size, client_nonce, address, port, host, proof)
    return _canonical(dict(zip(_CLAIM_FIELDS, fields))) + b"\n"  # as many fields as names (no strict=: 3.9)


def parse_claim(line: bytes, *, size: int, token: str, job_id: str, server_nonce: str) -> Claim | str:
    """A client's claim checked in full (shape, types, ranges, proof), or why it is refused.

    Pure: never raises, whatever `line` holds. Whether the rank is already taken is rank 0's
    state, not the claim's (RendezvousServer checks it).
    """
    msg, why = _load_line(line, RDV_LINE_MAX)
    if why:
        return why
    if not isinstance(msg, dict):
        return f"a JSON {type(msg).__name__}, not an object"
    if set(msg) != set(_CLAIM_FIELDS):
        missing = [k for k in _CLAIM_FIELDS if k not in msg]
        extra = [_short(k, 20) for k in msg if k not in _CLAIM_FIELDS][:5]
        return "fields " + "; ".join(
            part for part in (f"missing {missing}" if missing else "", f"unknown {extra}" if extra else "") if part
        )
    rank, n, nonce, address, port, host, proof = (msg[k] for k in _CLAIM_FIELDS)
    if not _is_int(n) or n != size:
        return f"size {_short(n)}, but this job has {size} ranks"
    if not _is_int(rank) or not 0 < rank < size:
        return f"rank {_short(rank)} is not one of 1..{size - 1}"
    if not _is_hex(nonce, 64) or nonce == server_nonce:
        return "'nonce' is not a fresh 32 bytes in hex"
    if why := _ip_or_reason(address):
        return why
    if not _is_int(port) or not 0 < port < 65536:
        return f"port {_short(port)} is not a TCP port (1-65535)"
    if not (isinstance(host, str) and 0 < len(host) <= _HOST_MAX and host.isascii() and host.isprintable()):
        return f"host {_short(host)} is not a printable host identity of 1-{_HOST_MAX} characters"
    if not _is_hex(proof, 64):
        return "'proof' is not an HMAC-SHA256 in hex"
    want = claim_proof(token, job_id, server_nonce, nonce, rank, size, address, port, host)
    if not hmac.compare_digest(want, proof):
        return "bad proof: it does not hold this job's token (or has another MESHCCL_JOB_ID)"
    return Claim(rank, size, nonce, address, port, host)


def table_limit(size: int) -> int:
    """Longest table line a client accepts for a job of `size` ranks."""
    return RDV_LINE_MAX + 1024 * size


def table_line(token: str, job_id: str, server_nonce: str, claim: Claim, entries: dict[int, Entry]) -> bytes:
    table = {str(r): list(e) for r, e in sorted(entries.items())}
    proof = table_proof(token, job_id, server_nonce, claim.nonce, claim.rank, table)
    return _canonical({"table": table, "proof": proof}) + b"\n"


def parse_table(
    line: bytes,
    *,
    token: str,
    job_id: str,
    server_nonce: str,
    client_nonce: str,
    rank: int,
    size: int,
    mine: Entry,
) -> dict[int, Entry] | Refusal | str:
    """Rank 0's answer to this rank's claim: the table (proved, complete, carrying this rank's
    claim as sent), a Refusal (rank 0 refused the claim), or why the answer cannot be trusted.

    Pure: never raises, whatever `line` holds.
    """
    msg, why = _load_line(line, table_limit(size))
    if why:
        return why
    if not isinstance(msg, dict):
        return f"a JSON {type(msg).__name__}, not an object"
    if set(msg) == {"error"} and isinstance(msg["error"], str):
        return Refusal(_printable(msg["error"]))
    if set(msg) != {"table", "proof"}:
        return "not a rendezvous table"
    table, proof = msg["table"], msg["proof"]
    if not _is_hex(proof, 64):
        return "the table's proof is not an HMAC-SHA256 in hex"
    try:
        want = table_proof(token, job_id, server_nonce, client_nonce, rank, table)
    except (ValueError, RecursionError):
        return "the table cannot be encoded"
    if not hmac.compare_digest(want, proof):
        return "bad proof on the table"
    if not isinstance(table, dict) or set(table) != {str(r) for r in range(size)}:
        return f"the table does not list ranks 0..{size - 1}"
    out: dict[int, Entry] = {}
    for key, e in table.items():
        if not (isinstance(e, list) and len(e) == 3) or _ip_or_reason(e[0]):
            return f"the table's entry for rank {_short(key)} is not [address, port, host]"
        if not (_is_int(e[1]) and 0 < e[1] < 65536 and isinstance(e[2], str)):
            return f"the table's entry for rank {_short(key)} is not [address, port, host]"
        out[int(key)] = (e[0], e[1], e[2])
    if out[rank] != tuple(mine):
        return "the table does not carry this rank's claim"
    return out


class RateLimitedLog:
    """stderr lines with a common prefix, at most `limit` per `window` seconds; the rest are
    counted and the count is printed when the next window opens (or on flush)."""

    def __init__(
        self,
        prefix: str,
        limit: int = 10,
        window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        write: Callable[[str], None] | None = None,
    ) -> None:
        self.prefix, self.limit, self.window, self.clock = prefix, limit, window, clock
        self.write = write or (lambda text: print(text, file=sys.stderr, flush=True))
        self.start, self.shown, self.suppressed = clock(), 0, 0

    def __call__(self, message: str) -> None:
        now = self.clock()
        if now - self.start >= self.window:
            self.flush()
            self.start, self.shown = now, 0
        if self.shown < self.limit:
            self.shown += 1
            self.write(self.prefix + message)
        else:
            self.suppressed += 1

    def flush(self) -> None:
        if self.suppressed:
            self.write(
                f"{self.prefix}... and {self.suppressed} more like these "
                f"(at most {self.limit} lines per {self.window:g} s)"
            )
            self.suppressed = 0


@dataclass
class _Conn:
    peer: str
    nonce: str
    opened: float
    buf: bytearray = field(default_factory=bytearray)
    claim: Claim | None = None


class RendezvousServer:
    """Rank 0's side of the rendezvous, without sockets: connections are ids, input is bytes,
    output is `actions` (id, bytes to send, close after). Every input is accepted or refused
    with a logged reason; nothing raises. _serve() drives it over real sockets."""

    def __init__(
        self,
        size: int,
        token: str,
        job_id: str,
        entry0: Entry,
        log: Callable[[str], None],
        max_pending: int = RDV_MAX_PENDING,
        handshake_s: float = RDV_HANDSHAKE_S,
    ) -> None:
        self.size, self.token, self.job_id, self.log = size, token, job_id, log
        self.max_pending, self.handshake_s = max_pending, handshake_s
        self.conns: dict[int, _Conn] = {}  # insertion order is accept order
        self.claims: dict[int, int] = {}  # rank -> connection id
        self.entries: dict[int, Entry] = {0: entry0}
        self.actions: list[tuple[int, bytes, bool]] = []
        self.refused = 0

    @property
    def complete(self) -> bool:
        return len(self.entries) == self.size

    def missing(self) -> list[int]:
        return [r for r in range(self.size) if r not in self.entries]

    def _pending(self) -> list[int]:
        return [cid for cid, c in self.conns.items() if c.claim is None]

    def opened(self, cid: int, peer: str, now: float) -> None:
        pending = self._pending()
        for old in pending[: max(0, len(pending) - self.max_pending + 1)]:
            self.refuse(old, f"dropped: {self.max_pending} handshakes pending, the oldest goes first")
        nonce = secrets.token_hex(32)
        self.conns[cid] = _Conn(peer, nonce, now)
        self.actions.append((cid, hello_line(nonce), False))

    def refuse(self, cid: int, reason: str) -> None:
        c = self.conns.pop(cid, None)
        if c is None:
            return
        self.refused += 1
        self.log(f"refused {c.peer}: {reason}")
        if c.claim is not None:
            self._release(c)
        self.actions.append((cid, _canonical({"error": reason}) + b"\n", True))

    def _release(self, c: _Conn) -> None:
        assert c.claim is not None
        r = c.claim.rank
        self.claims.pop(r, None)
        self.entries.pop(r, None)
        self.log(f"rank {r} ({c.peer}) left before the table was sent; its claim is released")

    def received(self, cid: int, data: bytes, now: float) -> None:
        c = self.conns.get(cid)
        if c is None:
            return
        if c.claim is not None:
            self.refuse(cid, f"rank {c.claim.rank} sent data after its claim")
            return
        c.buf += data
        nl = c.buf.find(b"\n")
        if nl < 0:
            if len(c.buf) > RDV_LINE_MAX:
                self.refuse(cid, f"line longer than {RDV_LINE_MAX} bytes")
            return
        if len(c.buf) > nl + 1:
            self.refuse(cid, "data after the claim line")
            return
        got = parse_claim(bytes(c.buf[:nl]), size=self.size, token=self.token, job_id=self.job_id, server_nonce=c.nonce)
        if isinstance(got, str):
            self.refuse(cid, got)
            return
        if got.rank in self.claims:
            self.refuse(cid, f"rank {got.rank} is already claimed (by {self.conns[self.claims[got.rank]].peer})")
            return
        c.buf.clear()
        c.claim = got
        self.claims[got.rank] = cid
        self.entries[got.rank] = (got.address, got.port, got.host)

    def closed(self, cid: int) -> None:
        c = self.conns.pop(cid, None)
        if c is not None and c.claim is not None:
            self._release(c)

    def shed(self) -> None:
        """Out of file descriptors: drop the older half of the unauthenticated connections (a
        real rank claims within milliseconds of its greeting; old pending ones are idle)."""
        pending = self._pending()
        for cid in pending[: max(1, len(pending) // 2)]:
            self.refuse(cid, "dropped: out of file descriptors, the oldest pending handshakes go first")

    def expire(self, now: float) -> None:
        for cid in self._pending():
            if now - self.conns[cid].opened >= self.handshake_s:
                self.refuse(cid, f"no valid claim within {self.handshake_s:g} s")

    def next_deadline(self) -> float | None:
        opened = [self.conns[cid].opened for cid in self._pending()]
        return min(opened) + self.handshake_s if opened else None

    def tables(self) -> dict[int, bytes]:
        """Per claimed connection, its table line (call once complete)."""
        out = {}
        for cid, c in self.conns.items():
            if c.claim is not None:
                out[cid] = table_line(self.token, self.job_id, c.nonce, c.claim, self.entries)
        return out


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


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


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


_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def _serve(srv: socket.socket, machine: RendezvousServer, deadline: float, timeout: float, where: str) -> None:
    """Rank 0: drives `machine` over the listening socket until every rank has claimed, then
    sends each its table. Raises meshccl.TimeoutError naming the ranks that never arrived."""
    sel = selectors.DefaultSelector()
    socks: dict[int, socket.socket] = {}
    ids = itertools.count(1)
    srv.setblocking(False)
    sel.register(srv, selectors.EVENT_READ, 0)
    listening, resume_at, backoff = True, 0.0, 0.05

    def drop(cid: int) -> None:
        s = socks.pop(cid, None)
        if s is not None:
            sel.unregister(s)
            s.close()

    def flush() -> None:
        while machine.actions:
            actions, machine.actions = machine.actions, []
            for cid, payload, close in actions:
                s = socks.get(cid)
                if s is None:
                    continue
                try:
                    sent = s.send(payload) if payload else 0
                except OSError:
                    sent = -1
                if close or sent < len(payload):
                    drop(cid)
                    if not close:
                        machine.closed(cid)

    try:
        while True:
            now = time.monotonic()
            machine.expire(now)
            flush()
            if machine.complete:
                break
            if now >= deadline:
                refused = f"; {machine.refused} connection(s) refused (see above)" if machine.refused else ""
                raise TimeoutError(
                    f"rank 0: the rendezvous on {where} timed out after {timeout:g} s: rank(s) {machine.missing()} "
                    f"never arrived{refused}"
                )
            if not listening and now >= resume_at:
                sel.register(srv, selectors.EVENT_READ, 0)
                listening = True
            wake = min(deadline, machine.next_deadline() or deadline, deadline if listening else resume_at)
            for key, _mask in sel.select(max(0.0, wake - now)):
                if key.data == 0:
                    for _attempt in range(64):
                        try:
                            conn, peer = srv.accept()
                        except BlockingIOError:
                            break
                        except OSError as e:
                            if e.errno in _OUT_OF_FDS:
                                # Stop watching the listener for a while (the kernel keeps the
                                # backlog) and free a descriptor, instead of spinning on accept.
                                machine.log(f"accept failed ({e.strerror}); not accepting for {backoff:g} s")
                                machine.shed()
                                sel.unregister(srv)
                                listening, resume_at, backoff = False, now + backoff, min(backoff * 2, 2.0)
                            break
                        backoff = 0.05
                        conn.setblocking(False)
                        cid = next(ids)
                        socks[cid] = conn
                        sel.register(conn, selectors.EVENT_READ, cid)
                        machine.opened(cid, _hostport(str(peer[0]), int(peer[1])), now)
                    continue
                cid = key.data
                s = socks.get(cid)
                if s is None:
                    continue
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    machine.received(cid, data, time.monotonic())
                else:
                    drop(cid)
                    machine.closed(cid)
            flush()
        for cid, line in machine.tables().items():
            s = socks[cid]
            try:
                s.setblocking(True)
                s.settimeout(max(1.0, min(RDV_HANDSHAKE_S, deadline - time.monotonic())))
                s.sendall(line)
            except OSError as e:
                machine.log(f"could not send the table to {machine.conns[cid].peer}: {e}")
    finally:
        getattr(machine.log, "flush", lambda: None)()
        for s in socks.values():
            s.close()
        sel.close()


def _read_line(sock: socket.socket, limit: int, deadline: float) -> tuple[bytes | None, str]:
    """One line (without its newline) before `deadline`, or (None, "closed" | "timeout" | "too long")."""
    buf = bytearray()
    while True:
        nl = buf.find(b"\n")
        if nl >= 0:
            return (bytes(buf[:nl]), "") if nl <= limit else (None, "too long")
        if len(buf) > limit:
            return None, "too long"
        left = deadline - time.monotonic()
        if left <= 0:
            return None, "timeout"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except builtins.TimeoutError:  # socket timeouts (this module's TimeoutError is meshccl's)
            return None, "timeout"
        if not chunk:
            return None, "closed"
        buf += chunk


def _claim_once(
    rank: int, size: int, address: Endpoint, token: str, job_id: str, me: str, deadline: float
) -> dict[int, Entry] | tuple[str, bool]:
    """One attempt: the table, or (why it failed, whether rank 0's greeting arrived). Raises
    AuthError when what answered is not this job's rank 0."""
    where = _hostport(*address)
    left = deadline - time.monotonic()
    try:
        sock = socket.create_connection(address, timeout=max(0.01, min(2.0, left)))
    except OSError as e:
        return f"connecting: {e.strerror or e}", False
    greeted = False
    with sock:
        try:
            line, why = _read_line(sock, RDV_LINE_MAX, min(deadline, time.monotonic() + RDV_HANDSHAKE_S))
            if line is None:
                return f"no greeting from {where} ({why})", False
            hello = parse_hello(line)
            if isinstance(hello, str):
                return f"{where} is not a meshccl rendezvous: {hello}", False
            greeted = True
            own = str(sock.getsockname()[0])
            mine = (own, _free_port(own), me)
            nonce = secrets.token_hex(32)
            sock.sendall(claim_line(token, job_id, hello.nonce, nonce, rank, size, *mine))
            line, why = _read_line(sock, table_limit(size), deadline)
        except OSError as e:
            return f"talking to {where}: {e.strerror or e}", greeted
    if line is None:
        if why == "timeout":
            return f"claimed rank {rank}; rank 0 sent no table yet (waiting for other ranks: see rank 0's error)", True
        if why == "closed":
            return "rank 0 closed the connection after the claim", True
        got: dict[int, Entry] | Refusal | str = f"an answer longer than {table_limit(size)} bytes"
    else:
        got = parse_table(
            line,
            token=token,
            job_id=job_id,
            server_nonce=hello.nonce,
            client_nonce=nonce,
            rank=rank,
            size=size,
            mine=mine,
        )
    if isinstance(got, Refusal):
        return f"rank 0 refused the claim: {got.reason}", True
    if isinstance(got, str):
        raise AuthError(
            f"rank {rank}: the process at {where} (MASTER_ADDR, MESHCCL_MASTER_PORT) could not prove the job token: "
            f"not this job's rank 0 (someone else holds the port?): {got}"
        )
    return got


def _join(
    rank: int, size: int, address: Endpoint, token: str, job_id: str, me: str, timeout: float
) -> dict[int, Entry]:
    """Ranks other than 0: claim a place until a proved table comes or the deadline passes."""
    deadline = time.monotonic() + timeout
    last, refused, reached, pause = "nothing tried", "", False, 0.05
    while True:
        got = _claim_once(rank, size, address, token, job_id, me, deadline)
        if isinstance(got, dict):
            return got
        last, reached = got[0], reached or got[1]
        if last.startswith("rank 0 refused"):
            refused = last
        left = deadline - time.monotonic()
        if left <= 0:
            if refused and refused != last:  # the reason matters more than the last try's timeout
                last = f"{last}; before that, {refused}"
            where = _hostport(*address)
            if reached:
                raise TimeoutError(
                    f"rank {rank}: the rendezvous at {where} did not complete within {timeout:g} s: {last}"
                )
            raise TimeoutError(
                f"rank {rank}: the rendezvous at {where} (rank 0 on MASTER_ADDR, port MESHCCL_MASTER_PORT or "
                f"MASTER_PORT+1) was never reached within {timeout:g} s: {last}"
            )
        time.sleep(min(pause, left))
        pause = min(pause * 2, 1.0)


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
    me = _mac(token, "meshccl/2 host identity", job_id, host_identity())
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


# --- Slurm: a task started by srun ---------------------------------------------------------------
#
# srun gives every task of a step the same environment but its own SLURM_PROCID / SLURM_LOCALID,
# and slurmd its node's name (SLURMD_NODENAME). With meshkit's hostfile (the cabling) that is
# enough: the step's nodes, taken in the hostfile's ring order, each hold their Slurm task count
# of consecutive meshccl ranks (local rank = SLURM_LOCALID). meshccl's rank is therefore the
# ring-order rank, which equals SLURM_PROCID when the tasks were placed in ring order
# (SLURM_HOSTFILE + --distribution=arbitrary, as meshkit launch does) and may differ otherwise.

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


# --- from the environment -----------------------------------------------------------------------


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


def plan_from_env(
    env: dict[str, str] | None = None,
    token: str = "",
    timeout: float = 60.0,
    job_id: str = "",
    allow_no_token: bool = False,
) -> Plan:
    """This rank's plan from the environment. A job of more than one rank without `token` is
    refused (AuthError, before any rendezvous or connect) unless allow_no_token."""
    env = dict(os.environ if env is None else env)
    slurm = "SLURM_PROCID" in env  # a task started by srun: MESHCCL_HOSTFILE alone is for the Slurm way
    if "MESHCCL_RANK" in env or ("MESHCCL_HOSTFILE" in env and not slurm):
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
            and (_int_env(env, "RANK"), _int_env(env, "WORLD_SIZE"))
            != (
                rank,
                plan.size,
            )
        ):
            raise BootstrapError(
                f"MESHCCL_RANK={rank} of {plan.size} ({path}) but torch's RANK={env['RANK']} of "
                f"WORLD_SIZE={env['WORLD_SIZE']}: the two must name the same rank. meshkit launch -r torch sets "
                "both; do not start torchrun inside it (give meshkit launch -n the ranks per host instead)"
            )
    elif "MLX_RANK" in env and "MLX_HOSTFILE" in env:
        path = env["MLX_HOSTFILE"]
        rank = _int_env(env, "MLX_RANK")
        plan = plan_from_mlx_hostfile(_load_json(path), rank, path)
    elif all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        port = (
            _int_env(env, "MESHCCL_MASTER_PORT") if "MESHCCL_MASTER_PORT" in env else _int_env(env, "MASTER_PORT") + 1
        )
        size = _int_env(env, "WORLD_SIZE")
        if "MESHCCL_WORLD_SIZE" in env and _int_env(env, "MESHCCL_WORLD_SIZE") != size:
            raise BootstrapError(f"MESHCCL_WORLD_SIZE={env['MESHCCL_WORLD_SIZE']} but WORLD_SIZE={size}")
        plan = plan_from_torchrun(
            _int_env(env, "RANK"), size, env["MASTER_ADDR"], port, token, timeout, job_id, allow_no_token
        )
    elif slurm:
        plan = plan_from_slurm(env)
    else:
        raise BootstrapError(
            "no rank in the environment: set MESHCCL_RANK + MESHCCL_HOSTFILE (meshkit), MLX_RANK + MLX_HOSTFILE "
            "(mlx.launch), or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun), or start the program with "
            "Slurm's srun (SLURM_PROCID) beside meshkit's hostfile"
        )
    if "MESHCCL_WORLD_SIZE" in env and _int_env(env, "MESHCCL_WORLD_SIZE") != plan.size:
        raise BootstrapError(
            f"MESHCCL_WORLD_SIZE={env['MESHCCL_WORLD_SIZE']} but {plan.source} describes {plan.size} ranks"
        )
    if plan.source != "torchrun":  # plan_from_torchrun checked before its rendezvous
        check_token(plan.rank, plan.size, token, allow_no_token)
    return plan


def _load_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise BootstrapError(f"cannot read hostfile {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise BootstrapError(f"hostfile {path} is not valid JSON: {e}") from None
