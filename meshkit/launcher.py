# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The controller side of a launch: one agent per host, supervised together, failing fast.

Each host's agent (module_utils/launch_agent.py and its parts) is started over that host's
connection: its sources go down the connection's stdin (agent_input()), then the host's share of
the job. From then on the connection carries the ranks' output up and stop / stdin messages down.
The first rank that exits non-zero (or a host whose connection drops) stops every rank on every
host; so do the overall timeout and Ctrl-C. A host's agent also stops its ranks by itself when its
connection closes, so a killed controller leaves nothing behind either.

No host can hold the launcher up: every write to a host's connection is non-blocking, from a
per-host buffer flushed when the selector says the pipe takes more, so a wedged host (its ssh no
longer reading) cannot freeze the job timeout, Ctrl-C or the stopping of the other hosts. Both
ends send heartbeats every ``heartbeat_interval(host_timeout)`` seconds: a host not heard from
for ``host_timeout`` seconds (a partition: traffic silently dropped) is declared lost, its
connection killed and every other rank stopped; its agent, not hearing from the controller for
as long, stops its own ranks.

Used by the ``meshkit.cluster.launch`` action (launch.yml) and by ``meshkit launch``.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import json
import os
import selectors
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ansible_collections.meshkit.cluster.plugins.module_utils import agent_sources

from meshkit.launch_connection import (
    DEFAULT_HOST_TIMEOUT,
    become_argv,
    nsenter_argv,
    ssh_argv,
)
from meshkit.launch_plan import JOB_ID_ENV, TOKEN_ENV

# Reads the agent's program (10-digit length, then the bytes: agent_source()) from stdin and runs
# it. Kept free of quotes that a remote shell would mangle; it is quoted as one word anyway.
BOOTSTRAP = (
    "import os\n"
    "def r(n):\n"
    "    b = b''\n"
    "    while len(b) < n:\n"
    "        c = os.read(0, n - len(b))\n"
    "        if not c:\n"
    "            raise SystemExit(1)\n"
    "        b += c\n"
    "    return b\n"
    "exec(compile(r(int(r(10))), 'meshkit-launch-agent', 'exec'))\n"
)
MODULE_UTILS_DIR = Path(agent_sources.__file__).parent
# Seconds every host's preflight may take (its `python -m` probe alone may take 60 s).
PREFLIGHT_TIMEOUT = 90.0
TAIL_LINES = 20
# Input for the ranks is read from the launcher's stdin only while every host's unsent data is
# below this: a host that does not take its input holds the broadcast up, never the launcher.
HIGH_WATER = 1 << 20
# After a stop, seconds (beyond the grace) a host's agent gets to report its ranks' ends before
# its connection is killed; then a few more before the launcher stops waiting on it at all.
STOP_SLACK = 10.0
ABANDON_AFTER_KILL = 3.0
# At most this much of the output waits for a terminal that does not take it (a paused pager);
# beyond it lines are left out there (the logs keep every one) until it catches up.
TERMINAL_LIMIT = 1 << 20
WRITE_BATCH = 1 << 16


def heartbeat_interval(host_timeout: float) -> float:
    """Seconds between heartbeats, both ways: four chances within the host timeout, at most 5 s."""
    return max(0.05, min(5.0, host_timeout / 4))


def agent_source() -> bytes:
    """The program the bootstrap runs on a host: module_utils/agent_sources.py, then its run() with
    the sources of the agent's parts (agent_sources.AGENT_PARTS), read from this collection: the host
    imports every part from them, never from a collection of its own."""
    parts = {name: (MODULE_UTILS_DIR / f"{name}.py").read_text(encoding="utf-8") for name in agent_sources.AGENT_PARTS}
    program = (MODULE_UTILS_DIR / "agent_sources.py").read_text(encoding="utf-8")
    return f"{program}\nraise SystemExit(run({parts!r}))\n".encode()


def agent_input(first_line: bytes = b"") -> bytes:
    """What a host's bootstrap reads: the program's length (10 digits), the program, then
    ``first_line`` (the agent's first message: its job, a preflight or a check)."""
    program = agent_source()
    return f"{len(program):010d}".encode() + program + first_line


def agent_argv(connection: dict[str, Any], python: str) -> list[str]:
    """The command that starts the agent bootstrap on a host.

    ``connection``: {"kind": "local"}, {"kind": "nsenter", "pid": holder pid} (the lab's
    namespaces), or {"kind": "ssh", "host", "port", "user", "key", "args": [ssh options]}.
    """
    local = [*become_argv(connection), python, "-u", "-c", BOOTSTRAP]
    kind = connection.get("kind")
    if kind == "local":
        return local
    if kind == "nsenter":
        return [*nsenter_argv(connection), *local]
    if kind == "ssh":
        # ssh hands the remote side one string, which the login shell splits again.
        return [*ssh_argv(connection), shlex.join(local)]
    raise ValueError(f"unknown connection kind {kind!r}")


@dataclass
class HostJob:
    """One host's share: how to reach it and what to run there."""

    host: str
    argv: list[str]  # from agent_argv()
    job_dir: str  # on the host
    ranks: list[dict[str, Any]]  # {"rank", "argv", "env", "cwd"}
    files: dict[str, str] = field(default_factory=dict)  # written into job_dir before any rank starts


def log_name(rank: int, driver: str = "mpirun") -> str:
    return f"{driver}.log" if rank < 0 else f"rank-{rank}.log"


@dataclass
class RankState:
    rank: int
    host: str
    argv: list[str]
    state: str = "starting"  # running, ok, failed, stopped, timeout, lost
    pid: int | None = None
    code: int | None = None
    signal: int | None = None
    error: str | None = None
    fault: str | None = None  # why the launcher failed it while it ran (Lines.fault())
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    partial: str = ""
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    partial_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    # Rank -1: the one process meshkit starts that starts every rank (mpirun, or srun under Slurm).
    driver: str = "mpirun"

    @property
    def label(self) -> str:
        """ "rank N", or the driver's name ("mpirun", "srun") for the one process that starts every rank (rank -1)."""
        return self.driver if self.rank < 0 else f"rank {self.rank}"

    def describe(self) -> str:
        if self.error:
            return self.error
        if self.signal is not None:
            name = signal.Signals(self.signal).name if self.signal in signal.Signals._value2member_map_ else self.signal
            return f"killed by {name}"
        return f"exit code {self.code}"


@dataclass
class JobResult:
    ok: bool
    reason: str  # why it ended: "every rank exited 0", "rank 5 (node3) failed: exit code 3", "timeout after 10 s", ...
    ranks: list[RankState]
    wall: float
    all_running: float | None  # seconds from the launch until every rank had started
    log_dir: Path
    leftovers: dict[str, list[int]]  # per host: pids the agent had to kill after the ranks ended
    host_errors: dict[str, str]
    # Ranks whose output came through another's (MPI: mpirun's tagged stream): rank -> (host, last lines).
    rank_output: dict[int, tuple[str, list[str]]] = field(default_factory=dict)

    @property
    def failed(self) -> list[RankState]:
        return [r for r in self.ranks if r.state in ("failed", "lost")]

    def summary(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "wall_s": round(self.wall, 3),
            "all_running_s": None if self.all_running is None else round(self.all_running, 3),
            "log_dir": str(self.log_dir),
            "host_errors": self.host_errors,
            "leftovers": self.leftovers,
            "ranks": [
                {
                    "rank": r.rank,
                    "host": r.host,
                    "state": r.state,
                    "exit_code": r.code,
                    "signal": r.signal,
                    "error": r.error,
                    "seconds": None
                    if r.started_at is None or r.ended_at is None
                    else round(r.ended_at - r.started_at, 3),
                    "last_lines": list(r.tail),
                }
                for r in self.ranks
            ],
            **(
                {
                    "rank_output": [
                        {"rank": rank, "host": host, "last_lines": tail}
                        for rank, (host, tail) in sorted(self.rank_output.items())
                    ]
                }
                if self.rank_output
                else {}
            ),
        }

    def table(self) -> list[str]:
        """One line per rank, failures first."""
        order = {"failed": 0, "lost": 1, "timeout": 2, "stopped": 3, "ok": 4}
        lines = []
        for r in sorted(self.ranks, key=lambda r: (order.get(r.state, 5), r.rank)):
            took = "" if r.started_at is None or r.ended_at is None else f"  {r.ended_at - r.started_at:.1f} s"
            what = "exit code 0" if r.state == "ok" else r.describe()
            name = f"{r.driver:<10}" if r.rank < 0 else f"rank {r.rank:>3} "
            lines.append(f"{name}{r.host:<12} {r.state:<8} {what}{took}")
        return lines


def host_jobs(
    job: dict[str, Any],
    connections: dict[str, dict[str, Any]],
    secret_values: Mapping[str, str],
    host_timeout: float | None = None,
) -> list[HostJob]:
    """One HostJob per host of the job, ranks with their environment: the plan's, with the values
    of the job's secrets put in (``secret_values``, from launch_plan.secret_values(): the job token
    MESHCCL_TOKEN, every rank of every runtime, and the user's secrets). Those values go to the
    hosts in the agents' input (never a command line) and are written nowhere. An ssh connection
    gets keepalives and a connect timeout within ``host_timeout``."""
    values = with_secrets(job, secret_values)
    out = []
    for host in dict.fromkeys(r["host"] for r in job["ranks"]):
        conn = connections[host]
        if host_timeout is not None:
            conn = dict(conn, host_timeout=host_timeout)
        ranks = []
        for r in job["ranks"]:
            if r["host"] != host:
                continue
            env = {JOB_ID_ENV: str(job["job_id"]), **r["env"], **values}
            spec = {"rank": r["rank"], "argv": r["argv"], "env": env, "cwd": r.get("cwd")}
            if r.get("path_prepend"):
                spec["path_prepend"] = r["path_prepend"]
            ranks.append(spec)
        out.append(
            HostJob(
                host,
                agent_argv(conn, conn.get("python") or "python3"),
                job["job_dir"],
                ranks,
                job["files"].get(host, {}),
            )
        )
    return out


def with_secrets(job: dict[str, Any], secret_values: Mapping[str, str]) -> dict[str, str]:
    """What every rank's environment gets over the plan's <hidden>: the values of the job's
    secrets (the token always). ValueError when a secret of the job has no value here."""
    names = [TOKEN_ENV, *(n for n in job.get("secret_env") or [] if n != TOKEN_ENV)]
    missing = [n for n in names if not isinstance(secret_values.get(n), str)]
    if missing:
        raise ValueError(f"job {job['job_id']}: no value for {', '.join(missing)}")
    return {n: secret_values[n] for n in names}


# A line to show: (the rank it belongs to, or None for the launched process's own words (mpirun's);
# that rank's host; the text).
Shown = tuple[int | None, str, str]


class Lines:
    """Which rank each output line belongs to, and how it is shown (``[rank|host] text``). Here a
    rank's line is its own; launch_mpi.Lines takes mpirun's tagged stream apart per MPI rank (the
    launcher then keeps each such rank's own log and last lines) and watches mpirun's own words
    for an error it does not recover from (fault())."""

    def split(self, rank: RankState, line: str) -> list[Shown]:
        return [(rank.rank, rank.host, line)]

    def finish(self) -> list[Shown]:
        """What is still held back at the end (a rank's last line without its newline)."""
        return []

    def fault(self, now: float) -> tuple[int, str] | None:
        """(rank, why) when a running rank must be failed now; checked on every pass of the loop."""
        return None


class Terminal:
    """The launch's output on a terminal, a pipe or a pager, written by a thread of its own: a
    terminal that does not take it (a paused ``| less``, Ctrl-S) never holds the launcher up, so
    the timeout, Ctrl-C, heartbeats and fail-fast go on. At most ``limit`` bytes wait for it (twice
    that for the launcher's own events); beyond, lines are left out here, and once it has taken
    what waits a notice says how many (the logs keep every line). ``write(text, event)`` does the
    writing, adding the newline (it may block; ``text`` may hold several lines of output, an
    event is always one); ``close()`` waits until everything kept was written."""

    def __init__(
        self,
        write: Callable[[str, bool], None],
        *,
        lines: bool = True,
        limit: int = TERMINAL_LIMIT,
        log: str = "the logs",
    ) -> None:
        self.write = write
        self.show_lines = lines
        self.limit = limit
        self.log = log
        self.queue: collections.deque[tuple[str, bool]] = collections.deque()
        self.queued = 0  # bytes (about) waiting
        self.behind = False  # leaving lines out until what waits is written
        self.dropped = 0  # lines left out since the last notice
        self.dropped_total = 0
        self.closing = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="meshkit-terminal", daemon=True)
        self.thread.start()

    def line(self, text: str) -> None:
        if self.show_lines:
            self._put(text, False)

    def event(self, text: str) -> None:
        self._put(text, True)

    def _put(self, text: str, event: bool) -> None:
        size = len(text) + 1
        with self.cond:
            if self.closing:
                return
            if event:
                fits = self.queued + size <= 2 * self.limit
            else:
                fits = not self.behind and self.queued + size <= self.limit
            if not fits:
                self.behind = True
                self.dropped += 1
                return
            self.queue.append((text, event))
            self.queued += size
            self.cond.notify()

    def notice(self, count: int) -> str:
        return f"the terminal did not keep up: {count} lines of output not shown here (every line is in {self.log})"

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not (self.behind and self.dropped) and not self.closing:
                    self.cond.wait()
                if self.queue:
                    text, event = self.queue.popleft()
                    self.queued -= len(text) + 1
                    # Lines that wait go out together (one write, not one per line).
                    while not event and self.queue and not self.queue[0][1] and len(text) < WRITE_BATCH:
                        more = self.queue.popleft()[0]
                        self.queued -= len(more) + 1
                        text += "\n" + more
                elif self.behind and self.dropped:
                    # Caught up: say what was left out, then show lines again.
                    text, event = self.notice(self.dropped), True
                    self.dropped_total += self.dropped
                    self.dropped, self.behind = 0, False
                else:
                    return  # closing, and nothing left
            with contextlib.suppress(OSError, ValueError):  # the terminal is gone (`| head`): the logs have it
                self.write(text, event)

    def close(self) -> None:
        """Write what waits (the job is over: this may wait for the terminal), then stop."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.thread.join()


class _Host:
    def __init__(self, job: HostJob, proc: subprocess.Popen) -> None:
        self.job = job
        self.proc = proc
        self.buf = bytearray()  # what came from the agent, up to its last whole line
        self.out = bytearray()  # what the host has not taken yet (written as its pipe takes it)
        self.writing = False  # its stdin registered with the selector for writing
        self.input_closed = False  # its stdin is gone (EPIPE): nothing more can be sent
        self.stdin_paused = False  # its agent asked for no more of the ranks' input for now
        self.stderr = collections.deque(maxlen=TAIL_LINES)
        self.bye = False
        self.closed_out = False
        self.error: str | None = None
        self.left: list[int] = []
        self.heard_at = time.monotonic()  # the last time anything came from the host
        self.killed_at: float | None = None  # its connection was killed (SIGKILL)
        self.abandoned = False  # no longer waited on: its connection was killed and stayed open

    @property
    def done(self) -> bool:
        return self.abandoned or (self.closed_out and self.proc.poll() is not None)


class Launcher:
    """Runs one job on every host and supervises it; ``run()`` returns when nothing is left."""

    def __init__(
        self,
        hosts: list[HostJob],
        job_id: str,
        log_dir: Path,
        *,
        timeout: float | None = None,
        grace: float = 3.0,
        stdin: TextIO | None = None,
        on_line: Callable[[RankState, str], None] | None = None,
        on_event: Callable[[str], None] | None = None,
        partial_flush: float | None = None,
        host_timeout: float | None = None,
        lines: Lines | None = None,
        terminal: Terminal | None = None,
    ) -> None:
        """``on_line(rank, line)`` and ``on_event(text)`` are called in the launcher's loop: they
        must not block. ``terminal`` shows the output (``lines`` says how) without ever holding
        the loop up (see Terminal); the logs are written whatever it does."""
        self.hosts_spec = hosts
        self.job_id = job_id
        self.log_dir = Path(log_dir)
        self.timeout = timeout
        self.grace = grace
        # A host not heard from for this long is lost (and its agent stops its ranks).
        self.host_timeout = float(host_timeout or DEFAULT_HOST_TIMEOUT)
        self.heartbeat = heartbeat_interval(self.host_timeout)
        self.stdin = stdin
        self.on_line = on_line or (lambda _r, _line: None)
        self.on_event = on_event or (lambda _text: None)
        self.lines = lines or Lines()
        self.terminal = terminal
        # Interactive use: show a line without its newline (a pdb prompt) after this many seconds.
        self.partial_flush = partial_flush
        self.ranks: dict[int, RankState] = {}
        for hj in hosts:
            for spec in hj.ranks:
                self.ranks[spec["rank"]] = RankState(
                    spec["rank"], hj.host, list(spec["argv"]), driver=spec.get("driver") or "mpirun"
                )
        self.stopping: str | None = None
        self.stop_sent_at: float | None = None
        self.killed_connections = False
        self.first_failure: RankState | None = None

    # --- logs -------------------------------------------------------------------------------------

    def _open_logs(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.rank_logs = {
            r: open(self.log_dir / log_name(r, state.driver), "w", encoding="utf-8", errors="replace")  # noqa: SIM115
            for r, state in self.ranks.items()
        }
        self.combined = open(self.log_dir / "output.log", "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        # Ranks whose lines come through another's (MPI ranks, in mpirun's output): log, host, last lines.
        self.sub_logs: dict[int, TextIO] = {}
        self.sub_output: dict[int, tuple[str, collections.deque]] = {}

    def _close_logs(self) -> None:
        for handle in [*self.rank_logs.values(), *self.sub_logs.values()]:
            handle.close()
        self.combined.close()

    def _event(self, text: str) -> None:
        self.on_event(text)
        if self.terminal is not None:
            self.terminal.event(text)

    def _emit(self, rank: RankState, line: str) -> None:
        rank.tail.append(line)
        self.combined.write(f"[{rank.rank}|{rank.host}] {line}\n")
        self._show(rank.label, rank.rank, self.lines.split(rank, line))
        self.on_line(rank, line)

    def _show(self, label: str, own: int | None, parts: list[Shown]) -> None:
        for number, host, text in parts:
            if number is not None and number != own:
                self._sub_line(number, host, text)
            if self.terminal is not None:
                self.terminal.line(f"[{label}] {text}" if number is None else f"[{number}|{host}] {text}")

    def _sub_line(self, number: int, host: str, text: str) -> None:
        """A line of a rank that speaks through another process (an MPI rank through mpirun):
        kept in its own log on the controller, and its last lines for the summary."""
        if number not in self.sub_logs:
            self.sub_logs[number] = open(  # noqa: SIM115
                self.log_dir / log_name(number), "w", encoding="utf-8", errors="replace", buffering=1
            )
            self.sub_output[number] = (host, collections.deque(maxlen=TAIL_LINES))
        self.sub_logs[number].write(text + "\n")
        self.sub_output[number][1].append(text)

    def _output(self, rank: RankState, raw: str) -> None:
        # The agent sends bytes as surrogate-escaped text, chunk by chunk; a character split
        # between two chunks is put together here.
        self._output_text(rank, rank.decoder.decode(raw.encode("utf-8", "surrogateescape")))

    def _output_text(self, rank: RankState, text: str) -> None:
        self.rank_logs[rank.rank].write(text)
        self.rank_logs[rank.rank].flush()
        text = rank.partial + text
        *lines, rank.partial = text.split("\n")
        for line in lines:
            self._emit(rank, line.rstrip("\r"))
        rank.partial_at = time.monotonic()

    def _flush_partials(self, force: bool = False) -> None:
        now = time.monotonic()
        for rank in self.ranks.values():
            if rank.partial and (
                force or (self.partial_flush is not None and now - rank.partial_at >= self.partial_flush)
            ):
                line, rank.partial = rank.partial, ""
                self._emit(rank, line)

    # --- the job ------------------------------------------------------------------------------------

    def _connect_hosts(self, first_line: Callable[[HostJob], bytes]) -> None:
        """Start every host's connection and send it the agent's program and ``first_line``."""
        program = agent_input()
        self.hosts: list[_Host] = []
        for hj in self.hosts_spec:
            proc = subprocess.Popen(
                hj.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C reaches the launcher, which stops the job in order
            )
            host = _Host(hj, proc)
            self.hosts.append(host)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                os.set_blocking(stream.fileno(), False)
            for stream in (proc.stdout, proc.stderr):
                self.sel.register(stream, selectors.EVENT_READ, host)
            self._queue(host, program + first_line(hj))

    def preflight(self, specs: dict[str, dict[str, Any]], timeout: float = PREFLIGHT_TIMEOUT) -> dict[str, Any]:
        """launch.yml's preflight on the connections the ranks then use, before anything starts:
        each host's agent checks its host (agent_preflight.check_host with ``specs[host]``), answers
        and waits for the job. Returns {host: what its preflight found}; a host that could not
        answer has that as its problem. run() then sends the job over the same connections, or
        close() ends them with nothing started."""
        self.sel = selectors.DefaultSelector()
        self._connect_hosts(lambda hj: (json.dumps({"preflight": specs[hj.host]}) + "\n").encode())
        answers: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < len(self.hosts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in self.sel.select(min(left, 0.05)):
                if isinstance(key.data, tuple):
                    self._flush(key.data[1])
                    continue
                host, stream = key.data, key.fileobj
                try:
                    chunk = os.read(stream.fileno(), 1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if stream is host.proc.stderr:
                    if not chunk:
                        self.sel.unregister(stream)
                    host.stderr.extend(line for line in chunk.decode(errors="replace").splitlines() if line.strip())
                    continue
                if not chunk:
                    self.sel.unregister(stream)
                    host.closed_out = True
                    if host.job.host not in answers:
                        # What the connection said last (ssh's own complaint) is on its stderr.
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            host.proc.wait(2.0)
                        with contextlib.suppress(OSError):  # BlockingIOError included: nothing more now
                            while chunk := os.read(host.proc.stderr.fileno(), 1 << 16):
                                host.stderr.extend(x for x in chunk.decode(errors="replace").splitlines() if x.strip())
                        tail = " / ".join(list(host.stderr)[-3:]) or "no output"
                        answers[host.job.host] = f"its connection ended ({tail})"
                    continue
                host.heard_at = time.monotonic()
                host.buf += chunk
                while (end := host.buf.find(b"\n")) >= 0:
                    line = bytes(host.buf[:end])
                    del host.buf[: end + 1]
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        host.stderr.append(line.decode(errors="replace"))  # a login banner
                        continue
                    if msg.get("t") == "preflight":
                        answers[host.job.host] = msg.get("result") or {}
                        break  # what follows is the job's (after run() sends it)
                    if msg.get("t") == "error":
                        answers[host.job.host] = str(msg.get("msg"))
        out: dict[str, Any] = {}
        for host in self.hosts:
            found = answers.get(host.job.host, f"no answer within {timeout:g} s")
            out[host.job.host] = found if isinstance(found, dict) else {"problems": [f"cannot be checked: {found}"]}
        return out

    def close(self) -> None:
        """End the connections preflight() opened, starting nothing: each agent sees the end of its
        input and exits; a connection still there after a few seconds is killed."""
        for host in getattr(self, "hosts", []):
            with contextlib.suppress(OSError):
                host.proc.stdin.close()
        deadline = time.monotonic() + 5.0
        for host in getattr(self, "hosts", []):
            try:
                host.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                host.proc.kill()
                host.proc.wait()
            for stream in (host.proc.stdout, host.proc.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.close()

    def _start_hosts(self) -> None:
        if getattr(self, "hosts", None) is None:
            self._connect_hosts(lambda _hj: b"")
        for host in self.hosts:
            hj = host.job
            host.heard_at = time.monotonic()  # (a preflight's answer may be long past)
            payload = {
                "job": self.job_id,
                "dir": hj.job_dir,
                "files": hj.files,
                "grace": self.grace,
                "stdin": self.stdin is not None,
                "ranks": hj.ranks,
                "host_timeout": self.host_timeout,
                "heartbeat": self.heartbeat,
            }
            if os.environ.get("MESHKIT_AGENT_PORTABLE") == "1":
                # Linux agents on macOS's way of finding a job's processes (ps only; docs/launch.md).
                payload["portable"] = True
            self._queue(host, (json.dumps(payload) + "\n").encode())

    # --- writing to hosts, never blocking -------------------------------------------------------

    def _queue(self, host: _Host, data: bytes) -> None:
        if host.input_closed or host.abandoned:
            return
        host.out += data
        self._flush(host)

    def _flush(self, host: _Host) -> None:
        """Write what the host's pipe takes now; the rest waits for the selector."""
        fd = host.proc.stdin.fileno() if not host.proc.stdin.closed else -1
        while host.out and fd >= 0:
            try:
                n = os.write(fd, host.out)
            except BlockingIOError:
                break
            except OSError:
                # The connection is gone (EPIPE): its agent stops its ranks by itself.
                host.out.clear()
                host.input_closed = True
                break
            del host.out[:n]
        want = bool(host.out) and not host.input_closed and fd >= 0
        if want != host.writing:
            if want:
                self.sel.register(host.proc.stdin, selectors.EVENT_WRITE, ("write", host))
            else:
                self.sel.unregister(host.proc.stdin)
            host.writing = want

    def _send(self, host: _Host, msg: dict[str, Any]) -> None:
        if host.proc.poll() is not None:
            return
        self._queue(host, (json.dumps(msg) + "\n").encode())

    def stop(self, why: str) -> None:
        """Stop every rank on every host (idempotent; the first reason is kept)."""
        if self.stopping is not None:
            return
        self.stopping = why
        self.stop_sent_at = time.monotonic()
        self._event(f"stopping every rank: {why}")
        for host in self.hosts:
            self._send(host, {"t": "stop", "why": why})

    def _check_faults(self) -> None:
        """A rank the output says is stuck for good (Lines.fault()) fails the job now."""
        if self.stopping is not None:
            return
        found = self.lines.fault(time.monotonic())
        if found is None:
            return
        rank = self.ranks.get(found[0])
        if rank is None or rank.state != "running":
            return
        rank.fault = found[1]
        if self.first_failure is None:
            self.first_failure = rank
        self._event(f"{rank.label} ({rank.host}) {rank.fault}")
        self.stop(f"{rank.label} ({rank.host}) {rank.fault}")

    def _rank_exit(self, msg: dict[str, Any]) -> None:
        rank = self.ranks.get(msg["r"])
        if rank is None:
            return
        rank.ended_at = time.monotonic()
        rank.code, rank.signal, rank.error = msg.get("code"), msg.get("sig"), msg.get("err")
        rest = rank.decoder.decode(b"", final=True)  # an incomplete character at the very end
        if rest:
            self._output_text(rank, rest)
        if rank.partial:
            line, rank.partial = rank.partial, ""
            self._emit(rank, line)
        if rank.fault:
            rank.state, rank.error = "failed", rank.fault
        elif rank.code == 0 and not rank.error:
            rank.state = "ok"
        elif msg.get("stopped") or (self.stopping is not None and rank.state == "running"):
            rank.state = "timeout" if self.stopping and self.stopping.startswith("timeout") else "stopped"
        else:
            rank.state = "failed"
            if self.first_failure is None:
                self.first_failure = rank
            self._event(f"{rank.label} ({rank.host}) failed: {rank.describe()}")
            self.stop(f"{rank.label} ({rank.host}) failed: {rank.describe()}")

    def _host_message(self, host: _Host, msg: dict[str, Any]) -> None:
        kind = msg.get("t")
        if kind == "out":
            self._output(self.ranks[msg["r"]], msg["d"])
        elif kind == "started":
            rank = self.ranks[msg["r"]]
            rank.state, rank.pid, rank.started_at = "running", msg["pid"], time.monotonic()
            if self.all_running is None and all(r.started_at is not None for r in self.ranks.values()):
                self.all_running = rank.started_at - self.t0
                what = self.ranks[-1].driver if -1 in self.ranks else f"all {len(self.ranks)} ranks"
                self._event(f"{what} running after {self.all_running:.2f} s")
        elif kind == "exit":
            self._rank_exit(msg)
        elif kind == "error":
            host.error = msg.get("msg")
            self._event(f"{host.job.host}: {host.error}")
            self.stop(f"{host.job.host}: {host.error}")
        elif kind == "bye":
            host.bye = True
            host.left = list(msg.get("left") or [])
        elif kind in ("stdin_pause", "stdin_resume"):
            # A rank there has (no longer) too much of its input unread: see _pace_stdin().
            host.stdin_paused = kind == "stdin_pause"
        # "hb": a heartbeat; hearing it (any bytes) is all it is for.

    def _read(self, stream: Any, host: _Host) -> None:
        try:
            chunk = os.read(stream.fileno(), 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk and stream is host.proc.stdout:
            host.heard_at = time.monotonic()  # the agent (stderr may be the local ssh talking)
        if not chunk:
            self.sel.unregister(stream)
            if stream is host.proc.stdout:
                host.closed_out = True
            return
        if stream is host.proc.stderr:
            self._stderr_text(host, chunk)
            return
        host.buf += chunk
        start = 0
        while (end := host.buf.find(b"\n", start)) >= 0:
            line, start = bytes(host.buf[start:end]), end + 1
            try:
                msg = json.loads(line)
            except ValueError:
                # Not the agent talking: a login banner or a shell's complaint.
                text = line.decode(errors="replace")
                host.stderr.append(text)
                self._event(f"{host.job.host}: {text}")
                continue
            self._host_message(host, msg)
        del host.buf[:start]

    def _stderr_text(self, host: _Host, chunk: bytes) -> None:
        for line in chunk.decode(errors="replace").splitlines():
            if line.strip():
                host.stderr.append(line)
                self._event(f"{host.job.host}: {line}")

    def _host_gone(self, host: _Host) -> None:
        """A connection ended: ranks it never reported on are lost."""
        lost = [r for r in self.ranks.values() if r.host == host.job.host and r.state in ("starting", "running")]
        if not lost:
            return
        detail = host.error or ("; ".join(list(host.stderr)[-3:]) or f"connection exited with {host.proc.returncode}")
        silent = time.monotonic() - host.heard_at
        if not host.error and silent > 2 * self.heartbeat:
            # ssh's keepalives ended it (its master says so on a stderr no longer ours to read).
            detail += f" after {silent:.0f} s without a word from its agent: a network partition, or the host hung"
        for rank in lost:
            rank.ended_at = time.monotonic()
            if self.stopping is not None and self.killed_connections and not host.error:
                rank.state, rank.error = "stopped", f"connection closed while stopping ({detail})"
            else:
                rank.state, rank.error = "lost", f"lost the host's agent: {detail}"
        if self.first_failure is None and self.stopping is None:
            self.first_failure = lost[0]
        self.stop(f"{host.job.host}: lost the connection ({detail})")

    def _drain_stderr(self, host: _Host) -> None:
        """Read what the connection said last (a host's watchdog reports there) before the
        host's end is judged; never waits (a persistent ssh master may hold stderr open)."""
        stream = host.proc.stderr
        while not stream.closed:
            try:
                chunk = os.read(stream.fileno(), 1 << 16)
            except OSError:  # BlockingIOError included: nothing more now
                return
            if not chunk:
                with contextlib.suppress(KeyError, ValueError):
                    self.sel.unregister(stream)
                return
            self._stderr_text(host, chunk)

    def _kill_connection(self, host: _Host) -> None:
        if host.killed_at is None:
            host.killed_at = time.monotonic()
            if host.proc.poll() is None:
                host.proc.kill()

    def _abandon(self, host: _Host) -> None:
        """Stop waiting on a host: its pipes are closed here, whatever still holds them there."""
        if host.abandoned:
            return
        host.abandoned = True
        host.out.clear()
        for stream in (host.proc.stdin, host.proc.stdout, host.proc.stderr):
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(stream)
            with contextlib.suppress(OSError):
                stream.close()
        host.writing = False
        self._host_gone(host)

    def _host_silent(self, host: _Host) -> None:
        """Nothing from the host for host_timeout seconds: a partition, or a hung host or connection."""
        host.error = f"no word from its agent for {self.host_timeout:g} s (a network partition, or the host hung)"
        self._event(
            f"{host.job.host}: {host.error}; its ranks there are stopped by its agent once it has not heard "
            f"from the launcher for {self.host_timeout:g} s"
        )
        self._host_gone(host)  # its ranks are lost; every other rank is stopped
        self._kill_connection(host)
        self._abandon(host)

    def _supervise_hosts(self, now: float) -> None:
        for host in self.hosts:
            if host.done:
                continue
            if host.closed_out and host.proc.poll() is not None:
                continue
            if now - host.heard_at > self.host_timeout:
                self._host_silent(host)
            elif host.killed_at is not None and now - host.killed_at > ABANDON_AFTER_KILL:
                # Killed, yet its output stays open (a process beyond the one the launcher started
                # holds it): nothing more will come that the launcher can wait for.
                host.error = host.error or "its connection did not close after it was killed"
                self._abandon(host)

    def _stdin_ready(self) -> None:
        try:
            data = os.read(self.stdin.fileno(), 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(self.stdin)
            self.stdin_done = True
            for host in self.hosts:
                self._send(host, {"t": "stdin_eof"})
            return
        text = data.decode("utf-8", "surrogateescape")
        for host in self.hosts:
            self._send(host, {"t": "stdin", "d": text})

    def _pace_stdin(self) -> None:
        """Read the launcher's stdin only while every host takes its input (see HIGH_WATER) and
        no agent has asked for a pause (a rank there has too much of it unread: a rank that never
        reads its stdin holds the broadcast up, never the launcher or the agent's memory)."""
        if self.stdin is None or self.stdin_done:
            return
        full = self.stopping is not None or any(
            len(h.out) > HIGH_WATER or h.stdin_paused for h in self.hosts if not h.done
        )  # (once stopping, no rank wants more)
        if full and not self.stdin_paused:
            self.sel.unregister(self.stdin)
            self.stdin_paused = True
        elif not full and self.stdin_paused:
            self.sel.register(self.stdin, selectors.EVENT_READ, "stdin")
            self.stdin_paused = False

    def _heartbeats(self, now: float) -> None:
        if now - self.beat_at < self.heartbeat:
            return
        self.beat_at = now
        for host in self.hosts:
            if not host.done and len(host.out) <= HIGH_WATER:
                self._send(host, {"t": "hb"})

    def run(self) -> JobResult:
        self.t0 = time.monotonic()
        self.all_running: float | None = None
        if getattr(self, "hosts", None) is None:  # else preflight() connected them, with its selector
            self.sel = selectors.DefaultSelector()
        self.stdin_done = self.stdin_paused = False
        self.beat_at = self.t0
        self._open_logs()
        interrupted = False
        previous = signal.getsignal(signal.SIGINT)
        if previous is not None and threading_main():
            signal.signal(signal.SIGINT, lambda _s, _f: self._interrupt())
        try:
            self._start_hosts()
            if self.stdin is not None:
                self.sel.register(self.stdin, selectors.EVENT_READ, "stdin")
            for host in self.hosts:
                if host.error:
                    self.stop(f"{host.job.host}: {host.error}")
            # A host is done when its connection exited and its stdout closed (not stderr: an ssh
            # that started a persistent master leaves that master holding stderr open), or when
            # the launcher gave up on it (lost, or killed and still open).
            while not all(h.done for h in self.hosts):
                for key, _ in self.sel.select(0.05):
                    if key.data == "stdin":
                        self._stdin_ready()
                    elif isinstance(key.data, tuple):
                        self._flush(key.data[1])
                    elif not key.data.abandoned:
                        self._read(key.fileobj, key.data)
                now = time.monotonic()
                for host in self.hosts:
                    if not host.abandoned and host.closed_out and host.proc.poll() is not None:
                        self._drain_stderr(host)
                        self._host_gone(host)
                self._supervise_hosts(now)
                self._heartbeats(now)
                self._pace_stdin()
                self._flush_partials()
                self._check_faults()
                if self.timeout and self.stopping is None and now - self.t0 > self.timeout:
                    self.stop(f"timeout after {self.timeout:g} s")
                if self._interrupted and self.stopping is None:
                    interrupted = True
                    self.stop("interrupted (Ctrl-C)")
                if (
                    self.stop_sent_at is not None
                    and not self.killed_connections
                    and now - self.stop_sent_at > self.grace + STOP_SLACK
                ):
                    # Agents that do not finish stopping: closing their connections makes them
                    # SIGKILL what is left (end of input), and ssh goes with it.
                    self.killed_connections = True
                    for host in self.hosts:
                        if not host.done:
                            self._kill_connection(host)
            for host in self.hosts:
                self._host_gone(host)
        finally:
            if previous is not None and threading_main():
                signal.signal(signal.SIGINT, previous)
            for host in getattr(self, "hosts", []):
                if host.proc.poll() is None:
                    host.proc.kill()
                    host.proc.wait()
                for stream in (host.proc.stdin, host.proc.stdout, host.proc.stderr):
                    with contextlib.suppress(OSError, ValueError):
                        stream.close()
            self._flush_partials(force=True)
            self._show("", None, [part for part in self.lines.finish() if part[0] is not None])
            self._close_logs()
        return self._result(interrupted)

    _interrupted = False

    def _interrupt(self) -> None:
        self._interrupted = True

    def _result(self, interrupted: bool) -> JobResult:
        ranks = [self.ranks[r] for r in sorted(self.ranks)]
        ok = self.stopping is None and all(r.state == "ok" for r in ranks)
        if ok:
            reason = f"{self.ranks[-1].driver} exited 0" if -1 in self.ranks else f"all {len(ranks)} ranks exited 0"
        elif self.first_failure is not None:
            failed = [r for r in ranks if r.state in ("failed", "lost")]
            reason = "; ".join(f"{r.label} ({r.host}) {r.describe()}" for r in failed)
        else:
            reason = self.stopping or "stopped"
        result = JobResult(
            ok=ok,
            reason=reason if not interrupted else "interrupted (Ctrl-C)",
            ranks=ranks,
            wall=time.monotonic() - self.t0,
            all_running=self.all_running,
            log_dir=self.log_dir,
            leftovers={h.job.host: h.left for h in self.hosts if h.left},
            host_errors={
                h.job.host: h.error or "; ".join(h.stderr) for h in self.hosts if h.error or (h.stderr and not h.bye)
            },
            rank_output={number: (host, list(tail)) for number, (host, tail) in self.sub_output.items()},
        )
        (self.log_dir / "summary.json").write_text(json.dumps(result.summary(), indent=1) + "\n")
        return result


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
