# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The per-host supervisor of a launch: starts this host's ranks and stops them all on command.

The controller (the meshkit package's launcher.py) runs it on every host over the host's connection
(ssh, or nsenter on the lab) and talks to it through the connection's stdin and stdout, one
JSON object per line. Standard library only: it runs under whatever Python the host has; the
controller sends the sources of its parts over the connection (agent_sources), so hosts need no
copy of meshkit. The parts: this supervisor (Agent, Rank, main), agent_preflight (the check of the
host before a launch), host_facts (what the host says setup.yml left), port_rules (which ports may
be cables), agent_jobdir (the job's directory), agent_procs (the job's processes) and
agent_watchdog (nothing of the job outlives a killed agent).

Controller -> agent (stdin):
  0. before the job, a preflight: {"preflight": {...}} (agent_preflight.check_host()'s spec);
     the agent answers {"t": "preflight", "result": check_host()'s "preflight"} and waits for the
     job (1.); the end of input instead (the launch was refused) ends it, starting nothing.
     Or instead of a job, a check: {"check": {...}} (see check_host()); the agent answers
     {"t": "checked", "preflight": {...}, "facts": {...}} and exits, starting nothing. A check may
     carry collection module_utils' sources ("modules", see agent_sources) for checks that need them.
  1. the job: {"job", "dir", "files": {name: text}, "grace", "stdin": bool, "host_timeout",
     "heartbeat", "ranks": [{"rank", "argv", "env", "cwd"}]}
  2. then any number of {"t": "stdin", "d": text}, {"t": "stdin_eof"}, {"t": "stop", "why": text},
     {"t": "hb"} (a heartbeat).
  End of input (the controller or its connection is gone) stops the job like "stop"; so does no
  word from the controller for ``host_timeout`` seconds (a partition closes nothing).

Agent -> controller (stdout, written without ever blocking: a controller that does not take its
output holds the ranks' output up, never the agent):
  {"t": "started", "r", "pid"}; {"t": "out", "r", "d"}; {"t": "exit", "r", "code", "sig", "err",
  "stopped"}; {"t": "error", "msg"}; {"t": "hb"} every ``heartbeat`` seconds; {"t": "bye", "left":
  [pids killed after the ranks ended]}.

The job's directory (``<state_dir>/jobs/<job id>``) is made 0700 and the login user's own, inside
a parent every user may write to (sticky, like /tmp): see agent_jobdir. The ranks run as the user
the connection logged in as.

Stopping is SIGTERM to each rank's process group, SIGKILL to what is left after ``grace``
seconds, then SIGKILL to whatever else of the job is left. The process the connection started
becomes a watchdog once the job is read: it forks, the child is the agent, and the watchdog
waits for it; when the agent ends any way but in order (even SIGKILL) the watchdog kills what is
left of the job (agent_watchdog). Every rank's environment carries the job's random
``MESHKIT_JOB_MARK``. How the rest of the job is found depends on the platform
(agent_procs.platform_mode()):

- Linux ("linux"): the agent and the watchdog are child subreapers, so every orphan of the job
  (a daemon: double fork, setsid) is re-parented to them and cannot leave the tree; ranks get
  PR_SET_PDEATHSIG, so a killed agent takes its ranks with it; /proc gives the tree, the groups
  and every process's environment (job_processes(), sweep_job()).
- macOS, and Linux with MESHKIT_AGENT_PORTABLE=1 in the agent's environment (or "portable": true
  in the job) ("portable"): no subreaper, no PR_SET_PDEATHSIG, no /proc; ``ps`` alone
  (PortableJob). The agent looks at its job every TRACK_EVERY seconds (and before it stops it)
  and remembers each process of it by pid and start time, telling the watchdog; an orphan
  re-parented to init/launchd is still known by both. A process is the job's when it descends
  from the agent (or watchdog), was seen as the job's with the same start time, carries the
  mark (where ps shows environments: procps ``e``; macOS ``-E``, which shows nothing for
  Apple's restricted platform binaries), descends from one of those, or shares a rank's process
  group with one of those. Ranks die with a killed agent through the watchdog's sweep. The
  watchdog also stops the job when its own parent (the connection's process) is gone. What a
  portable host cannot catch: a process that left the ranks' groups and the tree (double fork,
  setsid) before any look at the job, and carries no visible mark (it cleared its environment,
  or on macOS it is a restricted binary); a pid reused within the same second is taken for
  the process it replaced (start times have one-second resolution).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import selectors
import signal
import subprocess
import time

from ansible_collections.meshkit.cluster.plugins.module_utils.agent_jobdir import (
    JobDirError,
    job_directory,
    job_file,
    log_line,
    user_label,
    write_job_file,
)
from ansible_collections.meshkit.cluster.plugins.module_utils.agent_preflight import check_host
from ansible_collections.meshkit.cluster.plugins.module_utils.agent_procs import (
    PR_SET_CHILD_SUBREAPER,
    TRACK_EVERY,
    PortableJob,
    child_pids,
    die_with_agent,
    group_alive,
    platform_mode,
    prctl,
    reap_children,
)
from ansible_collections.meshkit.cluster.plugins.module_utils.agent_watchdog import watchdog

TAIL_POLL = 0.02

# While this much output waits for the controller, the ranks' output is not read (their pipes
# then fill and they wait): the agent's memory stays bounded and it never blocks.
HIGH_WATER = 1 << 20
# Broadcast input a rank has not read yet, at most (about): beyond it the agent asks the controller
# to pause the ranks' input ("stdin_pause") until every rank is below it again ("stdin_resume").
# What was already on its way still arrives, so a rank's backlog stays within this plus what the
# controller had sent (its own high-water mark, 1 MiB) plus the connection's buffers.
STDIN_CAP = 1 << 20
DRAIN_AT_EXIT = 5.0  # seconds the agent waits for its last messages to be taken before it exits
JOB_WAIT = 120.0  # seconds the agent waits for its job after its source


class Rank:
    def __init__(self, spec: dict, dir_fd: int) -> None:
        self.rank: int = spec["rank"]
        self.proc: subprocess.Popen | None = None
        self.log = job_file(dir_fd, f"rank-{self.rank}.log", "ab")
        self.eof = False
        self.reading = False  # its output registered with the selector
        self.reported = False
        self.stopped = False
        self.group_gone = False  # its process group is empty (the watchdog was told)
        self.exited_at: float | None = None
        self.stdin_pending = bytearray()  # broadcast input this rank has not read yet (see STDIN_CAP)
        self.stdin_eof = False  # close its stdin once the pending input is written


class Agent:
    def __init__(self, out_fd: int = 1, in_fd: int = 0) -> None:
        self.out_fd = out_fd
        self.in_fd = in_fd
        self.inbuf = bytearray()
        self.outbuf = bytearray()  # messages the controller has not taken yet
        self.out_blocking = True  # until the job runs: the check answers with one blocking write
        self.writing = False
        self.silenced = False  # the controller is unreachable: messages are dropped, not kept
        self.ranks: list[Rank] = []
        self.sel = selectors.DefaultSelector()
        self.stopping_since: float | None = None
        self.killed = False
        self.host_timeout: float | None = None
        self.heartbeat = 5.0
        self.heard_at = self.beat_at = time.monotonic()
        self.watch_fd: int | None = None  # the pipe to the watchdog
        self.mark = ""
        self.dir_fd: int | None = None  # the job's directory: every file of the job is made relative to it
        self.log_fd: int | None = None  # its agent.log (O_APPEND), shared with the watchdog
        self.job: dict | None = None
        self.stdin_paused = False  # the controller was asked to pause the ranks' input
        self.ps_failed = False
        self.portable = False  # ps only: no prctl, no /proc (see platform_mode()); set once the job is read
        self.job_procs: PortableJob | None = None  # the portable mode's view of the job's processes
        self.tracked_at = 0.0  # when the portable mode last looked at the job's processes
        self.tracking = False
        self.stop_requested = False  # the portable mode: a signal asked to stop (the main loop stops)

    # --- talking to the controller ------------------------------------------------------------

    def send(self, **msg: object) -> None:
        if self.silenced:
            return
        self.outbuf += (json.dumps(msg) + "\n").encode()
        self.flush()

    def flush(self) -> None:
        """Write what the controller's pipe takes now, never waiting (once the job runs)."""
        while self.outbuf:
            try:
                n = os.write(self.out_fd, self.outbuf)
            except BlockingIOError:
                break
            except OSError:
                # The controller is gone: nobody to tell; stopping follows from the closed stdin.
                self.outbuf.clear()
                self.silenced = True
                break
            del self.outbuf[:n]
        if self.out_blocking:
            return
        want = bool(self.outbuf)
        if want != self.writing:
            if want:
                self.sel.register(self.out_fd, selectors.EVENT_WRITE, "out")
            else:
                self.sel.unregister(self.out_fd)
            self.writing = want

    def drain(self, within: float) -> None:
        """At the end: give the last messages ``within`` seconds to be taken."""
        deadline = time.monotonic() + within
        while self.outbuf and not self.silenced and time.monotonic() < deadline:
            self.sel.select(0.05)
            self.flush()

    def read_line(self, within: float = JOB_WAIT) -> dict | None:
        """One whole line of input (used before the job starts); None at end of input or after
        ``within`` seconds without it."""
        deadline = time.monotonic() + within
        while b"\n" not in self.inbuf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.in_fd], [], [], left)[0]:
                return None
            chunk = os.read(self.in_fd, 65536)
            if not chunk:
                return None
            self.inbuf += chunk
        end = self.inbuf.index(b"\n")
        line = bytes(self.inbuf[:end])
        del self.inbuf[: end + 1]
        return json.loads(line)

    def note(self, text: str) -> None:
        """A line in the host's own agent.log (the controller may not be there to hear it)."""
        log_line(self.log_fd, text)

    def tell_watchdog(self, text: str) -> None:
        if self.watch_fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(self.watch_fd, text.encode())  # a few bytes into a pipe it always reads

    # --- the job --------------------------------------------------------------------------------

    def open_job_directory(self, job: dict) -> int:
        """The job's directory (see job_directory()) and its agent.log, both held open: nothing
        the agent or its watchdog writes there later goes by path. Returns the directory's fd."""
        dir_fd = job_directory(job["dir"])
        try:
            self.log_fd = os.open(
                "agent.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                dir_fd=dir_fd,
            )  # fmt: skip
        except OSError:
            os.close(dir_fd)
            raise
        self.dir_fd = dir_fd
        return dir_fd

    def start(self, job: dict) -> None:
        dir_fd = self.dir_fd if self.dir_fd is not None else self.open_job_directory(job)
        for name, text in job.get("files", {}).items():
            write_job_file(dir_fd, name, text)
        self.grace = float(job.get("grace", 3.0))
        interactive = bool(job.get("stdin"))
        how = "ps only (no /proc, no subreaper, no PR_SET_PDEATHSIG)" if self.portable else "/proc, subreapers"
        self.note(
            f"job {job.get('job')}: starting {len(job['ranks'])} ranks as {user_label()}; processes found through {how}"
        )
        for spec in job["ranks"]:
            rank = Rank(spec, dir_fd)
            self.ranks.append(rank)
            env = dict(os.environ)
            env.update(spec.get("env", {}))
            env["MESHKIT_JOB_MARK"] = self.mark
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
                    preexec_fn=None if self.portable else die_with_agent,  # noqa: PLW1509
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
            self.tell_watchdog(f"+{rank.proc.pid}\n")
            if rank.proc.stdin:
                os.set_blocking(rank.proc.stdin.fileno(), False)
            os.set_blocking(rank.proc.stdout.fileno(), False)
            self.read_from(rank, True)
            self.send(t="started", r=rank.rank, pid=rank.proc.pid)
        self.track()  # the ranks (and what they started already) known by their start times at once

    def read_from(self, rank: Rank, on: bool) -> None:
        """Read a rank's output (or not, while the controller does not take it)."""
        on = on and not rank.eof
        if on != rank.reading:
            if on:
                self.sel.register(rank.proc.stdout, selectors.EVENT_READ, rank)
            else:
                self.sel.unregister(rank.proc.stdout)
            rank.reading = on

    def pace(self) -> None:
        full = len(self.outbuf) > HIGH_WATER
        for rank in self.ranks:
            if rank.proc is not None:
                self.read_from(rank, not full)

    def on_input(self) -> None:
        try:
            chunk = os.read(self.in_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.sel.unregister(self.in_fd)
            self.note("end of input from the controller: stopping every rank")
            self.stop()
            return
        self.heard_at = time.monotonic()
        self.inbuf += chunk
        self.handle_lines()

    def handle_lines(self) -> None:
        start = 0
        while True:
            end = self.inbuf.find(b"\n", start)
            if end < 0:
                break
            line, start = bytes(self.inbuf[start:end]), end + 1
            msg = json.loads(line)
            kind = msg.get("t")
            if kind == "stop":
                self.note(f"stop from the controller: {msg.get('why')}")
                self.stop()
            elif kind == "stdin":
                self.to_ranks(msg["d"].encode("utf-8", "surrogateescape"))
            elif kind == "stdin_eof":
                for rank in self.ranks:
                    rank.stdin_eof = True
                    self.feed(rank)
            # "hb": the controller's heartbeat; hearing it is all it is for.
        del self.inbuf[:start]

    def to_ranks(self, data: bytes) -> None:
        for rank in self.ranks:
            if rank.proc and rank.proc.stdin and not rank.proc.stdin.closed:
                rank.stdin_pending += data
                self.feed(rank)
        self.pace_stdin()

    def pace_stdin(self) -> None:
        """Ask the controller to pause the ranks' input while a rank has more than STDIN_CAP of it
        unread, and to go on once every rank is below it: the agent itself keeps reading its
        connection (stop and heartbeats must get through), so its memory stays bounded only if
        the controller stops sending."""
        over = any(len(rank.stdin_pending) > STDIN_CAP for rank in self.ranks)
        if over != self.stdin_paused:
            self.stdin_paused = over
            self.send(t="stdin_pause" if over else "stdin_resume")

    def feed(self, rank: Rank) -> None:
        """Write what a rank's stdin can take now, never blocking: a rank that does not read
        its input must not stop the agent from forwarding output or stopping the job."""
        stdin = rank.proc.stdin if rank.proc else None
        if stdin is None or stdin.closed:
            rank.stdin_pending.clear()
            return
        while rank.stdin_pending:
            try:
                n = os.write(stdin.fileno(), rank.stdin_pending)
            except BlockingIOError:
                return
            except OSError:
                rank.stdin_pending.clear()  # it closed its stdin or is gone; its exit is reported as usual
                break
            del rank.stdin_pending[:n]
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
            self.read_from(rank, False)
            rank.eof = True
            rank.proc.stdout.close()
            return
        rank.log.write(chunk)
        rank.log.flush()
        self.send(t="out", r=rank.rank, d=chunk.decode("utf-8", "surrogateescape"))

    def stop(self) -> None:
        self.stop_requested = False
        if self.stopping_since is not None:
            return
        # The portable mode: everything of the job there now is known before the ranks' groups are
        # signalled (a rank's child in a session of its own is an orphan once the rank is gone).
        self.track()
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

    def check_controller(self) -> None:
        """Heartbeats: say we are here; stop the ranks when the controller has not been heard
        from for host_timeout seconds (a partition drops traffic without closing anything)."""
        now = time.monotonic()
        if now - self.beat_at >= self.heartbeat:
            self.beat_at = now
            if len(self.outbuf) <= HIGH_WATER:
                self.send(t="hb")
        if self.host_timeout and not self.silenced and now - self.heard_at > self.host_timeout:
            self.silenced = True
            self.outbuf.clear()
            self.flush()
            self.pace()
            self.note(f"no word from the controller for {self.host_timeout:g} s: stopping every rank of this host")
            self.stop()

    def reap(self) -> None:
        for rank in self.ranks:
            if rank.proc is None:
                continue
            if rank.reported:
                self.group_check(rank)
                continue
            code = rank.proc.poll()
            if code is None:
                continue
            if rank.exited_at is None:
                # Reaped just now: its group number is free from here on. Look at the group at
                # once, before anything else can take that number. Its pid too: forgotten at once
                # (a pid taken again within the same second would otherwise look the same).
                self.group_check(rank)
                self.forget(rank.proc.pid)
            # A rank that exited may leave output in its pipe (or a child holding it open):
            # report the exit once the pipe is drained, or after 0.5 s of reading it (time while
            # the controller holds its output up does not count).
            if rank.exited_at is None or (not rank.reading and not rank.eof):
                rank.exited_at = time.monotonic()
            if not rank.eof and (not rank.reading or time.monotonic() - rank.exited_at < 0.5):
                continue
            if not rank.eof:
                self.read_from(rank, False)
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

    def group_check(self, rank: Rank) -> bool:
        """Whether a reported rank's process group is known to be empty; the first time it is seen
        empty the watchdog is told ("-PID"): its number may be used again, so it must not be
        signalled any more."""
        if rank.proc is None or rank.group_gone:
            return True
        if group_alive(rank.proc.pid):
            return False
        rank.group_gone = True
        self.tell_watchdog(f"-{rank.proc.pid}\n")
        self.note(f"rank {rank.rank} (pid {rank.proc.pid}): its process group is empty")
        return True

    def confirm_groups(self, within: float = 2.0) -> bool:
        """At the end, once sweep() has run: every rank's process group seen empty and the watchdog
        told so. Nothing is signalled by group number here (the number of an empty group may be
        another's): what the ranks left is the agent's own children, swept again while waiting.
        False if a group is still not empty after ``within`` seconds (the watchdog then sweeps)."""
        deadline = time.monotonic() + within
        while True:
            alive = [rank for rank in self.ranks if not self.group_check(rank)]
            if not alive:
                return True
            if time.monotonic() > deadline:
                self.note(f"process groups still not empty at the end: {[r.proc.pid for r in alive if r.proc]}")
                return False
            self.sweep()
            time.sleep(0.01)

    def escalate(self) -> None:
        if self.stopping_since is None or self.killed:
            return
        if time.monotonic() - self.stopping_since >= self.grace:
            self.killed = True
            for rank in self.ranks:
                if rank.proc and rank.proc.poll() is None:
                    self._signal_group(rank, signal.SIGKILL)

    def live_groups(self) -> set[int]:
        """The ranks' process groups not yet seen empty (each looked at now)."""
        return {rank.proc.pid for rank in self.ranks if rank.proc is not None and not self.group_check(rank)}

    def track(self) -> None:
        """The portable mode: look at the job's processes, remember each by pid and start time and
        tell the watchdog ("~PID START", "!PID" for each gone), so that an orphan of the job
        re-parented to init/launchd is still known as the job's (PortableJob)."""
        if self.job_procs is None or self.tracking:
            return
        self.tracking = True
        try:
            self.tracked_at = time.monotonic()
            seen = self.job_procs.track(self.live_groups(), trust_groups=True)
            if seen is None:
                if not self.ps_failed:
                    self.ps_failed = True
                    self.note("ps cannot be run: only the ranks' process groups can be stopped")
                return
            new, gone = seen
            for pid, start in new.items():
                self.tell_watchdog(f"~{pid} {start}\n")
            for pid in gone:
                self.tell_watchdog(f"!{pid}\n")
        finally:
            self.tracking = False

    def forget(self, pid: int) -> None:
        """The portable mode: ``pid`` is known to be gone (a rank reaped): never the job's again."""
        if self.job_procs is not None and self.job_procs.known.pop(pid, None) is not None:
            self.tell_watchdog(f"!{pid}\n")

    def sweep(self) -> list[int]:
        """Kill whatever the ranks left running (re-parented to this subreaper; in the portable mode
        what PortableJob finds); their pids."""
        if self.job_procs is not None:
            reap_children()
            return self.job_procs.sweep(self.live_groups(), trust_groups=True, within=2.0) or []
        left: set[int] = set()
        for _attempt in range(50):
            reap_children()
            pids = child_pids(os.getpid())
            if not pids:
                break
            left.update(pids)
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        return sorted(left)

    def fork_watchdog(self) -> None:
        """From here on this process is the watchdog (it never returns from here) and its child
        the agent: the agent may be killed, the watchdog then kills what is left of the job."""
        self.mark = f"{os.getpid()}-{secrets.token_hex(8)}"
        try:
            read_fd, write_fd = os.pipe()
            pid = os.fork()
        except OSError as exc:
            self.note(f"no watchdog ({exc}): a killed agent may leave ranks' children behind")
            return
        if pid == 0:
            os.close(read_fd)
            self.watch_fd = write_fd
            os.set_blocking(write_fd, False)
            return
        os.close(write_fd)
        self.sel.close()
        # The controller's connection belongs to the agent: its end of input and end of output
        # follow the agent's, not this process's.
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, self.in_fd)
        os.dup2(devnull, self.out_fd)
        os.close(devnull)
        if not self.portable:
            prctl(PR_SET_CHILD_SUBREAPER, 1)
        code = watchdog(pid, read_fd, self.mark, self.log_fd, portable=self.portable)
        os._exit(code)

    def run(self) -> int:
        job = self.read_line()
        if job is None:
            return 1
        if "check" in job:
            try:
                self.send(**check_host(job["check"]))
            except Exception as exc:
                self.send(t="error", msg=f"cannot check the host: {exc!r}")
            return 0
        if "preflight" in job:
            # The launch's preflight, on the connection the job then comes over: the answer, then the
            # job, or the end of input when any host's preflight refused it (nothing starts).
            try:
                self.send(t="preflight", result=check_host(job["preflight"])["preflight"])
            except Exception as exc:
                self.send(t="error", msg=f"cannot check the host: {exc!r}")
                return 1
            job = self.read_line()
            if job is None:
                return 0
        self.job = job
        self.portable = platform_mode() == "portable" or job.get("portable") is True
        # Before the watchdog exists, so that it writes to the same agent.log descriptor; on a
        # failure start() tries again and reports it.
        with contextlib.suppress(OSError, KeyError, TypeError, ValueError, JobDirError):
            self.open_job_directory(job)
        self.fork_watchdog()
        if self.portable:
            # Its parent is the watchdog (or, without one, the connection's process): never the job's.
            self.job_procs = PortableJob(os.getpid(), self.mark, {os.getppid()})
        else:
            prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.host_timeout = float(job["host_timeout"]) if job.get("host_timeout") else None
        self.heartbeat = float(job.get("heartbeat") or 5.0)
        self.heard_at = self.beat_at = time.monotonic()
        os.set_blocking(self.out_fd, False)
        self.out_blocking = False
        try:
            self.start(job)
        except (OSError, KeyError, TypeError, ValueError, JobDirError) as exc:
            self.send(t="error", msg=f"cannot start the job: {exc}")
            self.stop()
        os.set_blocking(self.in_fd, False)
        self.sel.register(self.in_fd, selectors.EVENT_READ, None)
        self.flush()
        self.handle_lines()  # lines that came in with the job line
        while not all(r.reported for r in self.ranks):
            if self.stop_requested:
                self.stop()
            for key, _events in self.sel.select(TAIL_POLL):
                if key.data is None:
                    self.on_input()
                elif key.data == "out":
                    self.flush()
                else:
                    self.on_output(key.data)
            for rank in self.ranks:
                if rank.stdin_pending:
                    self.feed(rank)
            self.pace_stdin()
            self.check_controller()
            self.pace()
            self.reap()
            self.escalate()
            if self.job_procs is not None and time.monotonic() - self.tracked_at >= TRACK_EVERY:
                self.track()
        left = self.sweep()
        in_order = self.confirm_groups()
        self.send(t="bye", left=left)
        self.drain(DRAIN_AT_EXIT)
        if in_order:
            # Every rank reported, what they left killed, every group seen empty: nothing for the
            # watchdog to do (it signals nothing after this and an exit 0).
            self.tell_watchdog("=\n")
        return 0


def main() -> int:
    # A rank that closed its stdin must not kill the agent when input is broadcast (EPIPE is
    # handled where it happens); the ranks themselves get the default back from Popen.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # SIGTERM/SIGHUP to the agent (sshd closing the session) stop the job like end of input.
    agent = Agent()

    def _stop(_sig: int, _frame: object) -> None:
        if agent.portable:
            # Stopped from the main loop: it looks at the job first (ps), which a handler must not do
            # while the main loop may be in the middle of a look.
            agent.stop_requested = True
        else:
            agent.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    return agent.run()


if __name__ == "__main__":  # where the collection is installed; the launcher runs agent_sources.run()
    raise SystemExit(main())
