# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The per-host supervisor of a launch: starts this host's ranks and stops them all on command.

The controller (module_utils/launcher.py) runs it on every host over the host's connection
(ssh, or nsenter on the lab) and talks to it through the connection's stdin and stdout, one
JSON object per line. Standard library only: it runs under whatever Python the host has; the
controller sends its source over the connection, so hosts need no copy of meshkit.

Controller -> agent (stdin):
  1. the job: {"job", "dir", "files": {name: text}, "grace", "stdin": bool,
     "ranks": [{"rank", "argv", "env", "cwd"}]}
  2. then any number of {"t": "stdin", "d": text}, {"t": "stdin_eof"}, {"t": "stop", "why": text}.
  End of input (the controller or its connection is gone) stops the job like "stop".

Agent -> controller (stdout):
  {"t": "started", "r", "pid"}; {"t": "out", "r", "d"}; {"t": "exit", "r", "code", "sig", "err",
  "stopped"}; {"t": "error", "msg"}; {"t": "bye", "left": [pids killed after the ranks ended]}.

Stopping is SIGTERM to each rank's process group, SIGKILL to what is left after ``grace``
seconds, then (Linux) SIGKILL to any other descendant: the agent is a child subreaper, so a
rank's daemonised children are re-parented to it and cannot escape. Ranks get
PR_SET_PDEATHSIG, so even a killed agent takes its ranks with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TAIL_POLL = 0.02


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die_with_agent() -> None:
    # Runs in the child between fork and exec.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _reap() -> None:
    """Collect every exited child (ranks' orphans re-parented here die as zombies of the agent)."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (Linux /proc; empty elsewhere)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] != b"Z":
            out.append(int(name))
    return out


class Rank:
    def __init__(self, spec: dict, log_dir: str) -> None:
        self.rank: int = spec["rank"]
        self.proc: subprocess.Popen | None = None
        self.log = open(os.path.join(log_dir, f"rank-{self.rank}.log"), "ab")  # noqa: SIM115
        self.eof = False
        self.reported = False
        self.stopped = False
        self.exited_at: float | None = None
        self.stdin_pending = b""  # broadcast input this rank has not read yet
        self.stdin_eof = False  # close its stdin once the pending input is written


class Agent:
    def __init__(self, out_fd: int = 1, in_fd: int = 0) -> None:
        self.out_fd = out_fd
        self.in_fd = in_fd
        self.inbuf = b""
        self.ranks: list[Rank] = []
        self.sel = selectors.DefaultSelector()
        self.stopping_since: float | None = None
        self.killed = False

    # --- talking to the controller ------------------------------------------------------------

    def send(self, **msg: object) -> None:
        data = (json.dumps(msg) + "\n").encode()
        while data:
            try:
                n = os.write(self.out_fd, data)
            except BlockingIOError:
                time.sleep(0.001)
                continue
            except OSError:
                # The controller is gone: nobody to tell; stopping follows from the closed stdin.
                return
            data = data[n:]

    def read_line(self) -> dict | None:
        """One whole line of input, blocking (used before the job starts)."""
        while b"\n" not in self.inbuf:
            chunk = os.read(self.in_fd, 65536)
            if not chunk:
                return None
            self.inbuf += chunk
        line, self.inbuf = self.inbuf.split(b"\n", 1)
        return json.loads(line)

    # --- the job --------------------------------------------------------------------------------

    def start(self, job: dict) -> None:
        os.makedirs(job["dir"], mode=0o700, exist_ok=True)
        for name, text in job.get("files", {}).items():
            path = os.path.join(job["dir"], name)
            with open(path + ".tmp", "w") as handle:
                handle.write(text)
            os.replace(path + ".tmp", path)
        self.grace = float(job.get("grace", 3.0))
        interactive = bool(job.get("stdin"))
        for spec in job["ranks"]:
            rank = Rank(spec, job["dir"])
            self.ranks.append(rank)
            env = dict(os.environ)
            env.update(spec.get("env", {}))
            if spec.get("path_prepend"):
                env["PATH"] = os.pathsep.join([*spec["path_prepend"], env.get("PATH", os.defpath)])
            try:
                rank.proc = subprocess.Popen(
                    spec["argv"],
                    env=env,
                    cwd=spec.get("cwd") or None,
                    stdin=subprocess.PIPE if interactive else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_agent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
                )
            except (OSError, ValueError, TypeError) as exc:
                # OSError: no such program or working directory (filename says which); ValueError /
                # TypeError: an argument or variable Popen refuses (a NUL byte, not a string).
                rank.proc = None
                rank.eof = True
                rank.reported = True
                if isinstance(exc, OSError):
                    why = f"{exc.filename or spec['argv'][0]}: {exc.strerror}"
                else:
                    why = f"cannot start {spec['argv'][0]}: {exc}"
                self.send(t="exit", r=rank.rank, code=127, sig=None, err=why)
                continue
            if rank.proc.stdin:
                os.set_blocking(rank.proc.stdin.fileno(), False)
            os.set_blocking(rank.proc.stdout.fileno(), False)
            self.sel.register(rank.proc.stdout, selectors.EVENT_READ, rank)
            self.send(t="started", r=rank.rank, pid=rank.proc.pid)

    def on_input(self) -> None:
        try:
            chunk = os.read(self.in_fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self.sel.unregister(self.in_fd)
            self.stop()
            return
        self.inbuf += chunk
        self.handle_lines()

    def handle_lines(self) -> None:
        while b"\n" in self.inbuf:
            line, self.inbuf = self.inbuf.split(b"\n", 1)
            msg = json.loads(line)
            kind = msg.get("t")
            if kind == "stop":
                self.stop()
            elif kind == "stdin":
                self.to_ranks(msg["d"].encode("utf-8", "surrogateescape"))
            elif kind == "stdin_eof":
                for rank in self.ranks:
                    rank.stdin_eof = True
                    self.feed(rank)

    def to_ranks(self, data: bytes) -> None:
        for rank in self.ranks:
            if rank.proc and rank.proc.stdin and not rank.proc.stdin.closed:
                rank.stdin_pending += data
                self.feed(rank)

    def feed(self, rank: Rank) -> None:
        """Write what a rank's stdin can take now, never blocking: a rank that does not read
        its input must not stop the agent from forwarding output or stopping the job."""
        stdin = rank.proc.stdin if rank.proc else None
        if stdin is None or stdin.closed:
            rank.stdin_pending = b""
            return
        while rank.stdin_pending:
            try:
                n = os.write(stdin.fileno(), rank.stdin_pending)
            except BlockingIOError:
                return
            except OSError:
                rank.stdin_pending = b""  # it closed its stdin or is gone; its exit is reported as usual
                break
            rank.stdin_pending = rank.stdin_pending[n:]
        if rank.stdin_eof:
            with contextlib.suppress(OSError):
                stdin.close()

    def on_output(self, rank: Rank) -> None:
        try:
            chunk = os.read(rank.proc.stdout.fileno(), 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            rank.eof = True
            self.sel.unregister(rank.proc.stdout)
            rank.proc.stdout.close()
            return
        rank.log.write(chunk)
        rank.log.flush()
        self.send(t="out", r=rank.rank, d=chunk.decode("utf-8", "surrogateescape"))

    def stop(self) -> None:
        if self.stopping_since is not None:
            return
        self.stopping_since = time.monotonic()
        for rank in self.ranks:
            if rank.proc and rank.proc.returncode is None and rank.proc.poll() is None:
                rank.stopped = True
                self._signal_group(rank, signal.SIGTERM)

    def _signal_group(self, rank: Rank, sig: int) -> None:
        try:
            os.killpg(rank.proc.pid, sig)
        except OSError:
            with contextlib.suppress(OSError):
                rank.proc.send_signal(sig)

    def reap(self) -> None:
        for rank in self.ranks:
            if rank.reported or rank.proc is None:
                continue
            code = rank.proc.poll()
            if code is None:
                continue
            # A rank that exited may leave output in its pipe (or a child holding it open):
            # report the exit once the pipe is drained, or after a short wait.
            if rank.exited_at is None:
                rank.exited_at = time.monotonic()
            if not rank.eof and time.monotonic() - rank.exited_at < 0.5:
                continue
            if not rank.eof:
                self.sel.unregister(rank.proc.stdout)
                rank.proc.stdout.close()
                rank.eof = True
            rank.reported = True
            rank.log.close()
            self.send(
                t="exit",
                r=rank.rank,
                code=code if code >= 0 else None,
                sig=-code if code < 0 else None,
                err=None,
                stopped=rank.stopped,
            )

    def escalate(self) -> None:
        if self.stopping_since is None or self.killed:
            return
        if time.monotonic() - self.stopping_since >= self.grace:
            self.killed = True
            for rank in self.ranks:
                if rank.proc and rank.proc.poll() is None:
                    self._signal_group(rank, signal.SIGKILL)

    def sweep(self) -> list[int]:
        """Kill whatever the ranks left running (re-parented to this subreaper); their pids."""
        left: set[int] = set()
        for _ in range(50):
            _reap()
            pids = _children(os.getpid())
            if not pids:
                break
            left.update(pids)
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        return sorted(left)

    def run(self) -> int:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        job = self.read_line()
        if job is None:
            return 1
        try:
            self.start(job)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            self.send(t="error", msg=f"cannot start the job: {exc}")
            self.stop()
        os.set_blocking(self.in_fd, False)
        self.sel.register(self.in_fd, selectors.EVENT_READ, None)
        self.handle_lines()  # lines that came in with the job line
        while not all(r.reported for r in self.ranks):
            for key, _ in self.sel.select(TAIL_POLL):
                if key.data is None:
                    self.on_input()
                else:
                    self.on_output(key.data)
            for rank in self.ranks:
                if rank.stdin_pending:
                    self.feed(rank)
            self.reap()
            self.escalate()
        self.send(t="bye", left=self.sweep())
        return 0


def main() -> int:
    # A rank that closed its stdin must not kill the agent when input is broadcast (EPIPE is
    # handled where it happens); the ranks themselves get the default back from Popen.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # SIGTERM/SIGHUP to the agent (sshd closing the session) stop the job like end of input.
    agent = Agent()

    def _stop(_sig: int, _frame: object) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
