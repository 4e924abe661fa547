"""torchrun's rendezvous: rank 0 and every other rank meet, each proving the job token, and
learn every rank's address, port and host (meshccl.bootstrap.torchrun runs it).

Rank 0 listens on MASTER_ADDR:MESHCCL_MASTER_PORT and serves every connection at once. The
token never crosses the wire; both ends prove they hold it (HMAC-SHA256 over both sides'
fresh nonces, the job id, the rank and what is claimed)::

  rank 0 -> client  {"meshccl": "rendezvous", "v": 2, "nonce": N0}              (on accept)
  client -> rank 0  {"rank", "size", "nonce": N1, "address", "port", "host",
                     "proof": HMAC(token, [CLAIM_LABEL, job, N0, N1, rank, size, address, port, host])}
  rank 0 -> client  {"table": {"0": [address, port, host], ...},
                     "proof": HMAC(token, [TABLE_LABEL, job, N0, N1, rank, canonical(table)])}
                    (once every rank has claimed)   or   {"error": why} and close (claim refused)

One JSON object per line, canonical encoding (_canonical) for everything a MAC covers. A
stranger's connection gets RDV_HANDSHAKE_S to send a valid claim, at most RDV_MAX_PENDING
unauthenticated connections are kept (a new one pushes out the oldest), a line is at most
RDV_LINE_MAX bytes; whatever it sends is refused with a reason, logged (rate-limited), and
never raises out of rank 0.
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
import secrets
import selectors
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshccl._meshccl import AuthError, BootstrapError, TimeoutError
from meshccl.bootstrap.plan import Endpoint

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
