# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The controller side of a launch: one agent per host, supervised together, failing fast.

Each host's agent (module_utils/launch_agent.py) is started over that host's connection: its
source goes down the connection's stdin, then the host's share of the job. From then on the
connection carries the ranks' output up and stop / stdin messages down. The first rank that
exits non-zero (or a host whose connection drops) stops every rank on every host; so do the
overall timeout and Ctrl-C. A host's agent also stops its ranks by itself when its connection
closes, so a killed controller leaves nothing behind either.

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ansible_collections.meshkit.cluster.plugins.module_utils.launch_connection import nsenter_argv, ssh_argv

# Reads the agent's source (10-digit length, then the bytes) from stdin and runs it. Kept free of
# quotes that a remote shell would mangle; it is quoted as one word anyway.
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
AGENT_SOURCE = Path(__file__).with_name("launch_agent.py")
TAIL_LINES = 20


def agent_argv(connection: dict[str, Any], python: str) -> list[str]:
    """The command that starts the agent bootstrap on a host.

    ``connection``: {"kind": "local"}, {"kind": "nsenter", "pid": holder pid} (the lab's
    namespaces), or {"kind": "ssh", "host", "port", "user", "key", "args": [ssh options]}.
    """
    local = [python, "-u", "-c", BOOTSTRAP]
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


def log_name(rank: int) -> str:
    return "mpirun.log" if rank < 0 else f"rank-{rank}.log"


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
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    partial: str = ""
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    partial_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None

    @property
    def label(self) -> str:
        """ "rank N", or "mpirun" for the one process of an MPI job meshkit itself starts (rank -1)."""
        return "mpirun" if self.rank < 0 else f"rank {self.rank}"

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
        }

    def table(self) -> list[str]:
        """One line per rank, failures first."""
        order = {"failed": 0, "lost": 1, "timeout": 2, "stopped": 3, "ok": 4}
        lines = []
        for r in sorted(self.ranks, key=lambda r: (order.get(r.state, 5), r.rank)):
            took = "" if r.started_at is None or r.ended_at is None else f"  {r.ended_at - r.started_at:.1f} s"
            what = "exit code 0" if r.state == "ok" else r.describe()
            name = "mpirun    " if r.rank < 0 else f"rank {r.rank:>3} "
            lines.append(f"{name}{r.host:<12} {r.state:<8} {what}{took}")
        return lines


def host_jobs(job: dict[str, Any], connections: dict[str, dict[str, Any]], token: str) -> list[HostJob]:
    """One HostJob per host of the job, ranks with their environment (and the job token)."""
    out = []
    for host in dict.fromkeys(r["host"] for r in job["ranks"]):
        conn = connections[host]
        ranks = []
        for r in job["ranks"]:
            if r["host"] != host:
                continue
            env = dict(r["env"])
            if job["runtime"] == "meshccl":
                env["MESHCCL_TOKEN"] = token
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


class _Host:
    def __init__(self, job: HostJob, proc: subprocess.Popen) -> None:
        self.job = job
        self.proc = proc
        self.buf = b""
        self.stderr = collections.deque(maxlen=TAIL_LINES)
        self.bye = False
        self.closed_out = False
        self.error: str | None = None
        self.left: list[int] = []


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
    ) -> None:
        self.hosts_spec = hosts
        self.job_id = job_id
        self.log_dir = Path(log_dir)
        self.timeout = timeout
        self.grace = grace
        self.stdin = stdin
        self.on_line = on_line or (lambda _r, _line: None)
        self.on_event = on_event or (lambda _text: None)
        # Interactive use: show a line without its newline (a pdb prompt) after this many seconds.
        self.partial_flush = partial_flush
        self.ranks: dict[int, RankState] = {}
        for hj in hosts:
            for spec in hj.ranks:
                self.ranks[spec["rank"]] = RankState(spec["rank"], hj.host, list(spec["argv"]))
        self.stopping: str | None = None
        self.stop_sent_at: float | None = None
        self.killed_connections = False
        self.first_failure: RankState | None = None

    # --- logs -------------------------------------------------------------------------------------

    def _open_logs(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.rank_logs = {
            r: open(self.log_dir / log_name(r), "w", encoding="utf-8", errors="replace")  # noqa: SIM115
            for r in self.ranks
        }
        self.combined = open(self.log_dir / "output.log", "w", encoding="utf-8", errors="replace")  # noqa: SIM115

    def _close_logs(self) -> None:
        for handle in self.rank_logs.values():
            handle.close()
        self.combined.close()

    def _emit(self, rank: RankState, line: str) -> None:
        rank.tail.append(line)
        self.combined.write(f"[{rank.rank}|{rank.host}] {line}\n")
        self.on_line(rank, line)

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

    def _start_hosts(self) -> None:
        source = AGENT_SOURCE.read_bytes()
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
            payload = {
                "job": self.job_id,
                "dir": hj.job_dir,
                "files": hj.files,
                "grace": self.grace,
                "stdin": self.stdin is not None,
                "ranks": hj.ranks,
            }
            data = f"{len(source):010d}".encode() + source + (json.dumps(payload) + "\n").encode()
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except OSError as exc:
                host.error = f"cannot reach the host's agent: {exc}"
            for stream in (proc.stdout, proc.stderr):
                os.set_blocking(stream.fileno(), False)
                self.sel.register(stream, selectors.EVENT_READ, host)

    def _send(self, host: _Host, msg: dict[str, Any]) -> None:
        if host.proc.poll() is not None or host.proc.stdin.closed:
            return
        try:
            host.proc.stdin.write((json.dumps(msg) + "\n").encode())
            host.proc.stdin.flush()
        except OSError:
            pass  # the connection is gone; its agent stops its ranks by itself

    def stop(self, why: str) -> None:
        """Stop every rank on every host (idempotent; the first reason is kept)."""
        if self.stopping is not None:
            return
        self.stopping = why
        self.stop_sent_at = time.monotonic()
        self.on_event(f"stopping every rank: {why}")
        for host in self.hosts:
            self._send(host, {"t": "stop", "why": why})

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
        if rank.code == 0 and not rank.error:
            rank.state = "ok"
        elif msg.get("stopped") or (self.stopping is not None and rank.state == "running"):
            rank.state = "timeout" if self.stopping and self.stopping.startswith("timeout") else "stopped"
        else:
            rank.state = "failed"
            if self.first_failure is None:
                self.first_failure = rank
            self.on_event(f"{rank.label} ({rank.host}) failed: {rank.describe()}")
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
                what = "mpirun" if -1 in self.ranks else f"all {len(self.ranks)} ranks"
                self.on_event(f"{what} running after {self.all_running:.2f} s")
        elif kind == "exit":
            self._rank_exit(msg)
        elif kind == "error":
            host.error = msg.get("msg")
            self.on_event(f"{host.job.host}: {host.error}")
            self.stop(f"{host.job.host}: {host.error}")
        elif kind == "bye":
            host.bye = True
            host.left = list(msg.get("left") or [])

    def _read(self, stream: Any, host: _Host) -> None:
        try:
            chunk = os.read(stream.fileno(), 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self.sel.unregister(stream)
            if stream is host.proc.stdout:
                host.closed_out = True
            return
        if stream is host.proc.stderr:
            for line in chunk.decode(errors="replace").splitlines():
                if line.strip():
                    host.stderr.append(line)
                    self.on_event(f"{host.job.host}: {line}")
            return
        host.buf += chunk
        while b"\n" in host.buf:
            line, host.buf = host.buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                # Not the agent talking: a login banner or a shell's complaint.
                text = line.decode(errors="replace")
                host.stderr.append(text)
                self.on_event(f"{host.job.host}: {text}")
                continue
            self._host_message(host, msg)

    def _host_gone(self, host: _Host) -> None:
        """A connection ended: ranks it never reported on are lost."""
        lost = [r for r in self.ranks.values() if r.host == host.job.host and r.state in ("starting", "running")]
        if not lost:
            return
        detail = host.error or ("; ".join(list(host.stderr)[-3:]) or f"connection exited with {host.proc.returncode}")
        for rank in lost:
            rank.ended_at = time.monotonic()
            if self.stopping is not None and self.killed_connections:
                rank.state, rank.error = "stopped", f"connection closed while stopping ({detail})"
            else:
                rank.state, rank.error = "lost", f"lost the host's agent: {detail}"
        if self.first_failure is None and self.stopping is None:
            self.first_failure = lost[0]
        self.stop(f"{host.job.host}: lost the connection ({detail})")

    def _stdin_ready(self) -> None:
        data = os.read(self.stdin.fileno(), 65536)
        if not data:
            self.sel.unregister(self.stdin)
            for host in self.hosts:
                self._send(host, {"t": "stdin_eof"})
            return
        text = data.decode("utf-8", "surrogateescape")
        for host in self.hosts:
            self._send(host, {"t": "stdin", "d": text})

    def run(self) -> JobResult:
        self.t0 = time.monotonic()
        self.all_running: float | None = None
        self.sel = selectors.DefaultSelector()
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
            # A host is done when its connection exited and its stdout closed. Not stderr: an ssh
            # that started a persistent master leaves that master holding stderr open.
            while any(h.proc.poll() is None or not h.closed_out for h in self.hosts):
                for key, _ in self.sel.select(0.05):
                    if key.data == "stdin":
                        self._stdin_ready()
                    else:
                        self._read(key.fileobj, key.data)
                for host in self.hosts:
                    if host.closed_out and host.proc.poll() is not None:
                        self._host_gone(host)
                self._flush_partials()
                now = time.monotonic()
                if self.timeout and self.stopping is None and now - self.t0 > self.timeout:
                    self.stop(f"timeout after {self.timeout:g} s")
                if self._interrupted and self.stopping is None:
                    interrupted = True
                    self.stop("interrupted (Ctrl-C)")
                if (
                    self.stop_sent_at is not None
                    and not self.killed_connections
                    and now - self.stop_sent_at > self.grace + 10
                ):
                    # Agents that do not finish stopping: closing their connections makes them
                    # SIGKILL what is left (end of input), and ssh goes with it.
                    self.killed_connections = True
                    for host in self.hosts:
                        if host.proc.poll() is None:
                            host.proc.kill()
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
                    with contextlib.suppress(OSError):
                        stream.close()
            self._flush_partials(force=True)
            self._close_logs()
        return self._result(interrupted)

    _interrupted = False

    def _interrupt(self) -> None:
        self._interrupted = True

    def _result(self, interrupted: bool) -> JobResult:
        ranks = [self.ranks[r] for r in sorted(self.ranks)]
        ok = self.stopping is None and all(r.state == "ok" for r in ranks)
        if ok:
            reason = "mpirun exited 0" if -1 in self.ranks else f"all {len(ranks)} ranks exited 0"
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
        )
        (self.log_dir / "summary.json").write_text(json.dumps(result.summary(), indent=1) + "\n")
        return result


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# Environment variables whose values never reach a log or a summary.
SECRET_ENV = ("MESHCCL_TOKEN",)


def redact(env: dict[str, str]) -> dict[str, str]:
    return {k: ("<hidden>" if k in SECRET_ENV else v) for k, v in env.items()}
