"""meshccl.linkcheck: measure every cable of a cluster (the worker of `meshkit check`).

Run as every rank of a meshccl job with one rank per host (``meshkit check`` starts it as
``python3 -m meshccl.linkcheck [--quick]``; the environment is a meshccl job's: MESHCCL_HOSTFILE,
MESHCCL_RANK, MESHCCL_TOKEN, MESHCCL_JOB_ID). Besides the job's own (world) communicator, both
ends of every cable build a two-rank communicator bound to that cable's two addresses only, so
what it measures is that cable and nothing else:

- connect: every cable's pair communicator at once; one that does not connect within
  ``--connect-timeout`` gets an error and is left out of every later phase (the job goes on);
- latency: one cable at a time, 8-byte ping-pong (median and p99 round trip);
- alone: one cable at a time, a->b then b->a, bytes per second seen by the receiver;
- load: every cable at once, both directions at once;
- loss: numbered UDP datagrams both ways on every cable at once, between the cable's addresses;
- allreduce: the world communicator's all_reduce (float32 sum) at 1, 4 and 16 MiB, checked.

``--quick`` runs connect, latency and loss only (no bulk traffic). Every phase ends with a world
barrier, and every rank makes the same world calls in the same order whatever happened to its
cables. Output: lines ``MESHKIT-CHECK <json>`` on stdout (records "progress", "cable",
"allreduce", "done", "error"; the shapes are in docs of `meshkit check`); anything else is a
warning for people. Exit status: 0 when measured (a cable that failed is reported in its record),
2 for a hostfile or argument this cannot run with, 1 when the job itself failed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import socket
import statistics
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

import meshccl
from meshccl import _env_options
from meshccl.bootstrap import Plan, allow_no_token_from_env, job_id_from_env, plan_from_meshccl_hostfile

PREFIX = "MESHKIT-CHECK "
CHUNK = 1 << 20  # bytes of the probe that sizes a direction's timed transfer
# A timed transfer is PIECES pieces, each timed; the figure is bytes over time without at most
# STALLS_LEFT_OUT pieces that took over STALL times the median piece: one stall (a retransmit
# timeout after a lost packet, 200 ms or more) does not make a healthy cable look slow, while a
# cable slow throughout is slow in every piece. Lost packets are the loss phase's to show. The
# pieces read at once right after a stall go with it (steady_rate).
PIECES = 16
STALL, STALLS_LEFT_OUT = 3.0, 2
MIN_PIECE, MAX_PIECE = 64 << 10, 64 << 20
MIN_CHUNKS, MAX_CHUNKS = PIECES, 4096
PING_WARMUP, PING_ROUNDS = 5, 50
LOSS_BYTES = 64
LOSS_SPREAD_S = 0.2  # the probes of one direction are paced over this long
LOSS_GRACE_S = 0.5  # after the peer's last send, wait this long for stragglers
LOSS_RCVBUF = 4 << 20
ALLREDUCE_SIZES = (1 << 20, 4 << 20, 16 << 20)
ALLREDUCE_MAX_ITERS = 50
THREAD_SLACK_S = 30.0  # a phase's threads get their own bound plus this before they are aborted


class Fatal(Exception):
    """A problem that ends the run: printed as an "error" record, exit status `code`."""

    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.code = code


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")
    sys.stdout.flush()


def flat(e: BaseException) -> str:
    """An exception's text on one line: meshccl's connect errors span several, some repeated
    (one per connection), and start with the rank (the records name it already)."""
    lines: list[str] = []
    for raw in str(e).splitlines():
        line = raw.strip()
        if line and line not in lines:
            lines.append(line)
    return re.sub(r"^rank \d+: ", "", " ".join(lines)) or type(e).__name__


def pair_text(e: BaseException, cable: Cable) -> str:
    """A pair communicator's error on one line, its ranks named by host (rank 0 is end a)."""
    text = flat(e)
    if not isinstance(e, meshccl.Error):
        return text
    text = text.replace(" Are all ranks started with the same hostfile, and are the links up?", "")
    text = text.replace("connecting the job", "connecting the cable's pair")
    return re.sub(r"\brank ([01])\b", lambda m: cable.a_host if m.group(1) == "0" else cable.b_host, text)


def clamp(x: float, lo: int, hi: int) -> int:
    if not math.isfinite(x):
        return hi
    return int(max(lo, min(hi, round(x))))


def rate(nbytes: float, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9)


def piece_bytes(bytes_per_second: float, seconds: float) -> int:
    """The size of each of the PIECES pieces of a transfer lasting about ``seconds`` at that
    rate (4 KiB multiples, MIN_PIECE..MAX_PIECE)."""
    want = bytes_per_second * seconds / PIECES if math.isfinite(bytes_per_second) else MAX_PIECE
    return int(max(MIN_PIECE, min(MAX_PIECE, want))) // 4096 * 4096


def steady_rate(piece: int, stamps: list[float]) -> float:
    """Bytes per second of pieces of ``piece`` bytes timed by ``stamps`` (before the first, after
    each), leaving out at most STALLS_LEFT_OUT stalls (see PIECES)."""
    took = [b - a for a, b in zip(stamps, stamps[1:])]
    typical = statistics.median(took)
    stalls = sorted((i for i, t in enumerate(took) if t > STALL * typical), key=lambda i: -took[i])
    out = set()
    for stall in stalls[:STALLS_LEFT_OUT]:
        out.add(stall)
        # The pieces read at once after a stall (far faster than the typical piece) arrived during it and
        # waited in the socket's buffer, the receiver not running: they go with it, or they would count
        # a stall's bytes without its time (a 100 Mb/s cable read 450 Mb/s on a busy 2-core machine).
        after = stall + 1
        while after < len(took) and took[after] * STALL < typical:
            out.add(after)
            after += 1
    kept = [t for i, t in enumerate(took) if i not in out]
    return rate(piece * len(kept), sum(kept))


# --- the hostfile's cables ---------------------------------------------------------------------


@dataclass
class Cable:
    """One cable of the hostfile, the same on every rank."""

    index: int  # in sorted cable-name order
    key: str  # "A:pa <-> B:pb", a = the plan's cable ends[0]
    a: str  # "A:pa"
    b: str
    a_host: str
    b_host: str
    a_rank: int | None = None
    b_rank: int | None = None
    a_link: dict[str, Any] | None = None  # end a's entry in its rank's "links"
    b_link: dict[str, Any] | None = None
    port: int = 0  # the pair communicator's TCP port (and the loss probes' UDP port)
    problem: str | None = None  # why it cannot be measured at all (hostfile)

    @property
    def printer(self) -> int:
        """The rank that prints this cable's record: end a's, else end b's."""
        if self.a_rank is not None:
            return self.a_rank
        assert self.b_rank is not None
        return self.b_rank


def read_hostfile(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise Fatal(f"cannot read the meshccl hostfile {path}: {e.strerror or e}", 2) from None
    except json.JSONDecodeError as e:
        raise Fatal(f"the meshccl hostfile {path} is not valid JSON: {e}", 2) from None


def one_rank_per_host(data: dict[str, Any], path: str) -> None:
    """Refuses a hostfile with several ranks on a host."""
    by_host: dict[str, list[int]] = {}
    for e in data["ranks"]:
        by_host.setdefault(e["host"], []).append(e["rank"])
    crowded = {h: sorted(r) for h, r in by_host.items() if len(r) > 1}
    if crowded:
        where = ", ".join(f"{h} has ranks {r}" for h, r in sorted(crowded.items()))
        raise Fatal(
            f"{path}: linkcheck needs exactly one rank per host ({where}): the two ends of a cable are told apart "
            "by host. Start it with one rank per host (meshkit check does: -n 1)",
            2,
        )


def cables_of(data: dict[str, Any], path: str, port_offset: int) -> list[Cable]:
    """Every cable named in the hostfile, in sorted name order, with both ends found."""
    ends: dict[str, dict[str, tuple[int, dict[str, Any]]]] = {}
    port_of: dict[int, int] = {}
    for e in data["ranks"]:
        port_of[e["rank"]] = e["port"]
        for link in e.get("links", []):
            name = link.get("cable")
            if not isinstance(name, str) or not name:
                raise Fatal(f"{path}: rank {e['rank']} ({e['host']}) has a link without a 'cable' name", 2)
            ends.setdefault(name, {})[e["host"]] = (e["rank"], link)
    out = []
    for index, name in enumerate(sorted(ends)):
        left, sep, right = name.partition(" <-> ")
        a_host, b_host = left.rpartition(":")[0], right.rpartition(":")[0]
        cable = Cable(index, name, left, right, a_host, b_host)
        out.append(cable)
        found = ends[name]
        if not sep or not a_host or not b_host:
            cable.problem = f"the cable name '{name}' is not 'HOST:PORT <-> HOST:PORT'"
            cable.a_rank = next(iter(found.values()))[0]  # someone must print the record
            continue
        if a_host in found:
            cable.a_rank, cable.a_link = found[a_host]
        if b_host in found:
            cable.b_rank, cable.b_link = found[b_host]
        if cable.a_rank is None and cable.b_rank is None:
            # listed by hosts that the name does not mention
            cable.a_rank = next(iter(found.values()))[0]
            cable.problem = f"the cable is listed by {', '.join(sorted(found))}, not by the hosts its name names"
            continue
        if a_host == b_host:
            cable.problem = f"both ends are on {a_host}"
            continue
        missing = [h for h in (a_host, b_host) if h not in found]
        if missing:
            cable.problem = (
                f"the hostfile lists the cable for {', '.join(sorted(found))} only, not for {', '.join(missing)} "
                "(made from another plan? run setup.yml again)"
            )
            continue
        assert cable.a_rank is not None
        cable.port = port_of[cable.a_rank] + port_offset
        if not 0 < cable.port < 65536:
            cable.problem = f"its pair port ({port_of[cable.a_rank]} + --port-offset {port_offset}) is not a TCP port"
    return out


# --- this rank's end of a cable ----------------------------------------------------------------


@dataclass
class End:
    """This rank's end of one cable: its pair communicator and what it measured."""

    cable: Cable
    side: str  # "a" or "b"
    host: str
    comm: meshccl.Communicator | None = None
    error: str | None = None
    rtt_us: float | None = None
    rtt_p99_us: float | None = None
    alone_rx: float | None = None  # bytes/s this end received alone
    alone_tx: float | None = None  # bytes/s the other end received from this one (learned)
    load_rx: float | None = None
    loss_rx: float | None = None  # ratio of the peer's probes this end did not receive
    loss_probes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def peer(self) -> int:
        """The other end's rank in the pair communicator (a is 0, b is 1)."""
        return 1 if self.side == "a" else 0

    @property
    def link(self) -> dict[str, Any]:
        link = self.cable.a_link if self.side == "a" else self.cable.b_link
        assert link is not None
        return link

    def fail(self, phase: str, problem: str | BaseException) -> None:
        """Records the first failure and aborts the pair (the other end's call fails too, at once)."""
        msg = problem if isinstance(problem, str) else pair_text(problem, self.cable)
        with self.lock:
            if self.error is None:
                self.error = f"{phase}: {self.host}: {msg}"
            comm = self.comm
        if comm is not None:
            with contextlib.suppress(meshccl.Error):
                comm.abort(f"linkcheck on {self.host}: {phase}: {msg}")

    def drop(self) -> None:
        with self.lock:
            comm, self.comm = self.comm, None
        if comm is not None:
            with contextlib.suppress(meshccl.Error):
                comm.close()

    def results(self) -> dict[str, Any]:
        return {
            "rtt_us": self.rtt_us,
            "rtt_p99_us": self.rtt_p99_us,
            "alone_rx": self.alone_rx,
            "load_rx": self.load_rx,
            "loss_rx": self.loss_rx,
            "loss_probes": self.loss_probes,
        }


def pair_plan(end: End) -> Plan:
    """The pair communicator's plan: rank 0 (end a) listens on its own cable address, rank 1
    (end b) connects to it, at the address its hostfile entry names for the other end."""
    c, link = end.cable, end.link
    source = f"linkcheck pair {c.key}"
    if end.side == "a":
        listen = [(link["address"].strip("[]"), c.port)]
        return Plan(0, 2, listen, {1: ([(link["peer_address"].strip("[]"), c.port)], -1)}, True, True, 1, source)
    return Plan(1, 2, [], {0: ([(link["peer_address"].strip("[]"), c.port)], -1)}, True, True, 1, source)


# --- the run -------------------------------------------------------------------------------------


class LinkCheck:
    def __init__(self, args: argparse.Namespace, env: dict[str, str]) -> None:
        self.args = args
        self.env = env
        path = env.get("MESHCCL_HOSTFILE")
        if not path or "MESHCCL_RANK" not in env:
            raise Fatal(
                "linkcheck runs as a rank of a meshccl job: set MESHCCL_HOSTFILE and MESHCCL_RANK "
                "(meshkit check sets them)",
                2,
            )
        try:
            self.rank = int(env["MESHCCL_RANK"])
        except ValueError:
            raise Fatal(f"MESHCCL_RANK={env['MESHCCL_RANK']!r} is not a number", 2) from None
        data = read_hostfile(path)
        try:  # meshccl's own checks of the hostfile, with its messages
            plan_from_meshccl_hostfile(data, self.rank, path)
        except meshccl.BootstrapError as e:
            raise Fatal(flat(e), 2) from None
        one_rank_per_host(data, path)
        self.host = next(e["host"] for e in data["ranks"] if e["rank"] == self.rank)
        self.cables = cables_of(data, path, args.port_offset)
        self.token = env.get("MESHCCL_TOKEN", "")
        self.job_id = job_id_from_env(env)
        try:
            self.allow_no_token = allow_no_token_from_env(env)
            self.options = _env_options(env)
        except meshccl.BootstrapError as e:
            raise Fatal(flat(e), 2) from None
        self.options.update(
            timeout=float(args.timeout),
            connect_timeout=float(args.connect_timeout),
            handshake_timeout=min(float(self.options.get("handshake_timeout", 5.0)), float(args.connect_timeout)),
            transport="tcp",
        )
        self.ends: dict[int, End] = {}
        for c in self.cables:
            if c.problem is None and self.rank in (c.a_rank, c.b_rank):
                self.ends[c.index] = End(c, "a" if c.a_rank == self.rank else "b", self.host)
        self.failed: dict[int, list[str]] = {c.index: [c.problem] for c in self.cables if c.problem}
        self.world: meshccl.Communicator | None = None
        self.phase = "start"

    # -- world helpers: every rank calls these the same number of times, in the same order --

    def progress(self, phase: str, step: int, steps: int, what: str) -> None:
        self.phase = phase
        if self.rank == 0:
            emit({"t": "progress", "phase": phase, "step": step, "steps": steps, "what": what})

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able `obj`, in rank order, on every rank (two world all_gathers)."""
        assert self.world is not None
        raw = json.dumps(obj, separators=(",", ":")).encode()
        lens = self.world.all_gather(np.array([len(raw)], np.int64))
        width = int(lens.max())
        buf = np.zeros(width, np.uint8)
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
        everything = self.world.all_gather(buf)
        return [json.loads(everything[r * width : r * width + int(n)].tobytes()) for r, n in enumerate(lens)]

    def sync(self) -> None:
        """Ends a phase: every rank learns every cable that failed on either end during it (so
        both ends leave it out from now on) and closes its end of those."""
        mine = {str(i): e.error for i, e in self.ends.items() if e.error and i not in self.failed}
        for reports in self.gather(mine):
            for i, msg in reports.items():
                self.failed.setdefault(int(i), []).append(msg)
        for i, e in self.ends.items():
            if i in self.failed:
                e.drop()

    def usable(self) -> list[Cable]:
        return [c for c in self.cables if c.index not in self.failed]

    def mine(self, c: Cable) -> End | None:
        e = self.ends.get(c.index)
        return e if e is not None and e.comm is not None and c.index not in self.failed else None

    def run_threads(self, tasks: list[tuple[End, Callable[[], None]]], limit: float) -> None:
        """Runs each end's task on its own thread; past `limit` s a task's pair is aborted (its
        call ends with an error) and the cable fails; returns within limit + a few seconds."""
        phase = self.phase

        def guard(end: End, fn: Callable[[], None]) -> None:
            try:
                fn()
            except Exception as e:  # any failure is this cable's, never the run's
                end.fail(phase, e)

        threads = []
        for end, fn in tasks:
            t = threading.Thread(target=guard, args=(end, fn), name=f"linkcheck {end.cable.key}", daemon=True)
            t.start()
            threads.append((end, t))
        deadline = time.monotonic() + limit
        for _end, t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        late = [(end, t) for end, t in threads if t.is_alive()]
        for end, _t in late:
            end.fail(phase, f"did not finish within {limit:g} s")
        for _end, t in late:
            t.join(5.0)

    # -- phases --

    def connect(self) -> None:
        self.progress("connect", 1, 1, f"{len(self.usable())} cables")

        def connect_one(end: End) -> Callable[[], None]:
            def fn() -> None:
                comm = meshccl.Communicator(
                    pair_plan(end),
                    token=self.token,
                    job_id=f"{self.job_id}-c{end.cable.index}",
                    allow_no_token=self.allow_no_token,
                    **self.options,
                )
                with end.lock:
                    gave_up = end.error is not None
                    if not gave_up:
                        end.comm = comm
                if gave_up:
                    comm.close()

            return fn

        self.run_threads([(e, connect_one(e)) for e in self.ends.values()], float(self.args.connect_timeout) + 10.0)
        self.sync()

    def latency(self) -> None:
        cables = self.usable()
        for step, c in enumerate(cables, 1):
            self.progress("latency", step, len(cables), c.key)
            end = self.mine(c)
            if end is not None:
                try:
                    self.ping(end)
                except Exception as e:  # this cable's failure: the run goes on
                    end.fail("latency", e)
            self.world_barrier()
        self.sync()

    def ping(self, end: End) -> None:
        comm, peer = end.comm, end.peer
        assert comm is not None
        buf = np.zeros(1, np.int64)
        samples = []
        for i in range(PING_WARMUP + PING_ROUNDS):
            if end.side == "a":
                t0 = time.perf_counter()
                comm.send(buf, peer)
                comm.recv(buf, peer)
                if i >= PING_WARMUP:
                    samples.append(time.perf_counter() - t0)
            else:
                comm.recv(buf, peer)
                comm.send(buf, peer)
        if samples:
            ordered = sorted(samples)
            end.rtt_us = statistics.median(ordered) * 1e6
            end.rtt_p99_us = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] * 1e6

    def alone(self) -> None:
        cables = self.usable()
        for step, c in enumerate(cables, 1):
            self.progress("alone", step, len(cables), c.key)
            end = self.mine(c)
            if end is not None:
                try:
                    self.one_way(end, sender="a")
                    self.one_way(end, sender="b")
                    comm = end.comm
                    assert comm is not None and end.alone_rx is not None
                    theirs = np.zeros(1, np.float64)
                    comm.exchange([(np.array([end.alone_rx], np.float64), end.peer)], [(theirs, end.peer)])
                    end.alone_tx = float(theirs[0])
                except Exception as e:  # this cable's failure: the run goes on
                    end.fail("alone", e)
            self.world_barrier()
        self.sync()

    def one_way(self, end: End, sender: str) -> None:
        """One direction alone: a 1 MiB probe sizes the transfer, then n pieces of ``piece`` bytes
        (the receiver's "go" carries both) each timed by the receiver (see PIECES)."""
        comm, peer = end.comm, end.peer
        assert comm is not None
        go = np.zeros(2, np.int64)
        probe_data = np.zeros(CHUNK, np.uint8)
        if end.side == sender:
            comm.recv(go, peer)
            comm.send(probe_data, peer)
            comm.recv(go, peer)
            data = np.zeros(int(go[1]), np.uint8)
            for _piece in range(int(go[0])):
                comm.send(data, peer)
            return
        go[:] = (1, CHUNK)
        t0 = time.perf_counter()
        comm.send(go, peer)
        comm.recv(probe_data, peer)
        probe = rate(CHUNK, time.perf_counter() - t0)
        piece = piece_bytes(probe, self.args.seconds)
        n = clamp(self.args.seconds * probe / piece, MIN_CHUNKS, MAX_CHUNKS)
        data = np.zeros(piece, np.uint8)
        go[:] = (n, piece)
        stamps = [time.perf_counter()]
        comm.send(go, peer)
        for _piece in range(n):
            comm.recv(data, peer)
            stamps.append(time.perf_counter())
        end.alone_rx = steady_rate(piece, stamps)

    def load(self) -> None:
        self.progress("load", 1, 1, f"{len(self.usable())} cables")
        tasks = []
        for c in self.usable():
            end = self.mine(c)
            if end is not None:
                tasks.append((end, self.both_ways(end)))
        self.run_threads(tasks, float(self.args.timeout) + 60 * float(self.args.seconds) + THREAD_SLACK_S)
        self.sync()

    def both_ways(self, end: End) -> Callable[[], None]:
        def fn() -> None:
            comm, peer = end.comm, end.peer
            assert comm is not None and end.alone_rx is not None and end.alone_tx is not None
            # Both ends compute the same sizes from the same two figures.
            slower = min(end.alone_rx, end.alone_tx)
            piece = piece_bytes(slower, self.args.seconds)
            k = clamp(self.args.seconds * slower / piece, MIN_CHUNKS, MAX_CHUNKS)
            out, into = np.zeros(piece, np.uint8), np.zeros(piece, np.uint8)
            stamps = [time.perf_counter()]
            for _step in range(k):
                comm.exchange([(out, peer)], [(into, peer)])
                stamps.append(time.perf_counter())
            end.load_rx = steady_rate(piece, stamps)

        return fn

    def loss(self) -> None:
        self.progress("loss", 1, 1, f"{len(self.usable())} cables")
        probes = int(self.args.loss_probes)
        receivers: list[tuple[End, LossReceiver]] = []
        for c in self.usable():
            end = self.mine(c)
            if end is not None:
                try:
                    receivers.append((end, LossReceiver(end, probes, self.job_id)))
                except OSError as e:  # no socket at all (out of descriptors): the other end's calls fail too
                    end.fail("loss", f"cannot open a UDP socket: {e.strerror or e}")
        for _end, rx in receivers:
            rx.start()
        self.world_barrier()  # every end's socket is bound before any probe is sent
        try:
            tasks = [(end, self.probe(end, rx, probes)) for end, rx in receivers]
            self.run_threads(tasks, float(self.args.timeout) * 2 + LOSS_SPREAD_S + LOSS_GRACE_S + THREAD_SLACK_S)
        finally:
            for _end, rx in receivers:
                rx.close()
        self.sync()

    def probe(self, end: End, rx: LossReceiver, probes: int) -> Callable[[], None]:
        def fn() -> None:
            comm, peer = end.comm, end.peer
            assert comm is not None
            sent = rx.send_all()
            theirs = np.zeros(1, np.int64)
            comm.exchange([(np.array([sent], np.int64), peer)], [(theirs, peer)])
            peer_sent = int(theirs[0])  # the peer has sent all it will
            rx.wait_for(peer_sent, LOSS_GRACE_S)
            got = rx.stop()
            comm.exchange([(np.array([got], np.int64), peer)], [(theirs, peer)])
            end.loss_probes = probes
            if got < 0 or peer_sent < 0:
                end.loss_rx = None
                why = rx.problem or "the other end could not send probes (see its warnings)"
                warn(self.rank, f"{end.cable.key}: no loss figure for the direction towards {self.host}: {why}")
            else:
                end.loss_rx = 1.0 - got / peer_sent if peer_sent > 0 else 0.0

        return fn

    def allreduce(self) -> list[dict[str, Any]]:
        world = self.world
        assert world is not None
        n, rows, checks = world.size, [], []
        expected = np.float32(n * (n + 1) // 2)
        for step, nbytes in enumerate(ALLREDUCE_SIZES, 1):
            self.progress("allreduce", step, len(ALLREDUCE_SIZES), f"{nbytes >> 20} MiB")
            count = nbytes // 4
            x = np.full(count, self.rank + 1, np.float32)
            y = np.empty(count, np.float32)
            t0 = time.perf_counter()
            world.all_reduce(x, out=y)
            warm = time.perf_counter() - t0
            k = np.array([clamp(math.ceil(self.args.seconds / max(warm, 1e-9)), 1, ALLREDUCE_MAX_ITERS)], np.int64)
            world.all_reduce(k, op="max")
            iters = int(k[0])
            y.fill(0)
            world.barrier()
            t0 = time.perf_counter()
            for _iteration in range(iters):
                world.all_reduce(x, out=y)
            per_op = (time.perf_counter() - t0) / iters
            checks.append(1 if bool(np.all(y == expected)) else 0)
            algbw = rate(nbytes, per_op)
            busbw = algbw * 2 * (n - 1) / n
            rows.append(
                {
                    "bytes": nbytes,
                    "count": count,
                    "dtype": "float32",
                    "time_us": per_op * 1e6,
                    "algbw": algbw,
                    "busbw": busbw,
                    "correct": True,
                }
            )
        ok = np.array(checks, np.int32)
        world.all_reduce(ok, op="min")  # correct only where every rank's result was
        for row, good in zip(rows, ok):
            row["correct"] = bool(good)
        self.world_barrier()
        return rows

    def world_barrier(self) -> None:
        assert self.world is not None
        self.world.barrier()

    # -- the whole run --

    def run(self) -> int:
        try:
            self.world = meshccl.init(dict(self.env))
        except meshccl.Error as e:
            raise Fatal(f"rank {self.rank} ({self.host}): the job could not start: {flat(e)}", 1) from None
        try:
            self.connect()
            self.latency()
            if not self.args.quick:
                self.alone()
                self.load()
            self.loss()
            rows = None if self.args.quick else self.allreduce()
            self.phase = "results"
            mine = {str(i): e.results() for i, e in self.ends.items()}
            everything = self.gather(mine)
        except meshccl.Error as e:
            raise Fatal(
                f"rank {self.rank} ({self.host}): the job's own communicator failed during {self.phase}: {flat(e)}", 1
            ) from None
        except Exception as e:  # a bug here: still one record the controller can show
            raise Fatal(f"rank {self.rank} ({self.host}): linkcheck failed during {self.phase}: {e!r}", 1) from e
        for c in self.cables:
            if c.printer == self.rank:
                emit(self.record(c, everything))
        if rows is not None and self.rank == 0:
            emit({"t": "allreduce", "world_size": self.world.size, "rows": rows})
        for e in self.ends.values():
            e.drop()
        self.world.close()
        emit({"t": "done", "rank": self.rank})
        return 0

    def record(self, c: Cable, everything: list[dict[str, Any]]) -> dict[str, Any]:
        a = everything[c.a_rank].get(str(c.index), {}) if c.a_rank is not None else {}
        b = everything[c.b_rank].get(str(c.index), {}) if c.b_rank is not None else {}

        def pair(key: str) -> dict[str, float] | None:
            ab, ba = b.get(key), a.get(key)  # "ab" is what b received
            return {"ab": ab, "ba": ba} if ab is not None and ba is not None else None

        loss = pair("loss_rx")
        if loss is not None:
            loss["probes"] = int(self.args.loss_probes)
        errors = self.failed.get(c.index)
        return {
            "t": "cable",
            "cable": c.key,
            "a": c.a,
            "b": c.b,
            "rtt_us": a.get("rtt_us"),
            "rtt_p99_us": a.get("rtt_p99_us"),
            "alone": pair("alone_rx"),
            "load": pair("load_rx"),
            "loss": loss,
            "error": "; ".join(errors) if errors else None,
        }


class LossReceiver:
    """One end's UDP socket for the loss phase: bound to this end's cable address at the pair's
    port, counting the peer's numbered probes on a thread of its own."""

    def __init__(self, end: End, probes: int, job_id: str) -> None:
        link = end.link
        self.end = end
        self.probes = probes
        self.peer = (link["peer_address"].strip("[]"), end.cable.port)
        own = link["address"].strip("[]")
        family = socket.AF_INET6 if ":" in own else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.problem: str | None = None
        self.seen: set[int] = set()
        self.expected = probes
        self.done = threading.Event()
        self.complete = threading.Event()
        self.thread: threading.Thread | None = None

        def tag(side: str) -> bytes:
            return hashlib.sha256(f"meshccl-linkcheck|{job_id}|{end.cable.index}|{side}".encode()).digest()[:8]

        self.tag_out = tag(end.side)
        self.tag_in = tag("b" if end.side == "a" else "a")
        force = getattr(socket, "SO_RCVBUFFORCE", None)
        try:  # room for every probe even if this thread is held up for a while
            self.sock.setsockopt(socket.SOL_SOCKET, force if force is not None else socket.SO_RCVBUF, LOSS_RCVBUF)
        except OSError:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, LOSS_RCVBUF)
        try:
            self.sock.bind((own, end.cable.port))
            self.bound = True
        except OSError as e:
            self.problem = f"cannot receive probes on UDP {own}:{end.cable.port}: {e.strerror or e}"
            self.bound = False
            with contextlib.suppress(OSError):
                self.sock.bind((own, 0))  # can still send from the cable's address

    def start(self) -> None:
        if self.bound:
            self.thread = threading.Thread(target=self.count, name=f"linkcheck loss {self.end.cable.key}", daemon=True)
            self.thread.start()

    def count(self) -> None:
        self.sock.settimeout(0.05)
        deadline = time.monotonic() + 3600.0  # stop() ends it long before: a bound in any case
        while not self.done.is_set() and time.monotonic() < deadline:
            try:
                data = self.sock.recv(2048)
            except socket.timeout:
                continue
            except OSError:
                if self.done.is_set():
                    return
                continue
            if len(data) == LOSS_BYTES and data[:8] == self.tag_in:
                (seq,) = struct.unpack_from("!I", data, 8)
                if seq < self.probes:
                    self.seen.add(seq)
                    if len(self.seen) >= self.expected:
                        self.complete.set()

    def send_all(self) -> int:
        """Sends the probes, paced over LOSS_SPREAD_S; the number sent (-1: could not send)."""
        t0 = time.monotonic()
        for seq in range(self.probes):
            due = t0 + LOSS_SPREAD_S * seq / self.probes
            wait = due - time.monotonic()
            if wait > 0.002:
                time.sleep(wait)
            payload = self.tag_out + struct.pack("!I", seq)
            try:
                self.sock.sendto(payload.ljust(LOSS_BYTES, b"\0"), self.peer)
            except OSError as e:
                if seq == 0 and not self.bound:
                    self.problem = f"{self.problem}; cannot send either: {e.strerror or e}"
                    return -1
                # a probe the network refused is a probe lost
        return self.probes

    def wait_for(self, peer_sent: int, grace: float) -> None:
        if not self.bound or peer_sent <= 0:
            return
        self.expected = peer_sent
        if len(self.seen) >= peer_sent:
            return
        self.complete.wait(grace)

    def stop(self) -> int:
        """Stops counting; the number of distinct probes received (-1: could not receive)."""
        self.done.set()
        if self.thread is not None:
            self.thread.join(1.0)
        return len(self.seen) if self.bound else -1

    def close(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join(1.0)
        self.sock.close()


def warn(rank: int, msg: str) -> None:
    print(f"meshccl.linkcheck[rank {rank}]: warning: {msg}", file=sys.stderr, flush=True)


def positive(kind: type, name: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, not {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be more than 0, not {text}")
        return value

    return parse


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # a bad argument is an "error" record too
        emit({"t": "error", "msg": f"{self.prog}: {message}"})
        super().error(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(
        prog="python -m meshccl.linkcheck",
        description="Measure every cable of a meshccl job (one rank per host) and the job's all_reduce; "
        "records on stdout as 'MESHKIT-CHECK <json>' lines (meshkit check runs it).",
    )
    p.add_argument("--quick", action="store_true", help="connect, latency and loss only: no bulk transfers")
    p.add_argument(
        "--seconds", type=positive(float, "--seconds"), default=0.25, help="target length of each timed transfer"
    )
    p.add_argument(
        "--port-offset",
        type=int,
        default=1,
        help="a cable's pair communicator listens on end a's rank port + this (default 1)",
    )
    p.add_argument(
        "--connect-timeout",
        type=positive(float, "--connect-timeout"),
        default=10.0,
        help="seconds a cable's pair communicator has to connect before the cable is reported unreachable",
    )
    p.add_argument(
        "--timeout",
        type=positive(float, "--timeout"),
        default=30.0,
        help="seconds one operation on a cable may take before the cable fails",
    )
    p.add_argument(
        "--loss-probes", type=positive(int, "--loss-probes"), default=400, help="UDP probes per direction and cable"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = os.environ.get("MESHCCL_RANK", "?")
    try:
        return LinkCheck(args, dict(os.environ)).run()
    except Fatal as e:
        msg, code = str(e), e.code
    except Exception as e:  # a bug: still one record the controller can show, and the traceback for people
        traceback.print_exc()
        msg, code = f"rank {rank}: linkcheck failed: {e!r}", 1
    emit({"t": "error", "msg": msg})
    print(f"meshccl.linkcheck[rank {rank}]: {msg}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
