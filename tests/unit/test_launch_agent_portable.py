"""The launch agent's portable mode (the code path macOS takes: no /proc, no prctl, ps only), run on
this machine with MESHKIT_AGENT_PORTABLE=1, with real processes.

A rank leaves a family (tests/unit/programs_agent/family.py): children and a grandchild in its
process group, a bare orphan in its group, a daemon (double fork + setsid, its environment kept),
a session leader and its child (both without environment) and a process that left the group with
setpgid. After a stop, after the agent is SIGKILLed, after the connection's stdin closes and after
the connection's process dies, nothing of the job is left, and processes that are not the job's
(another session, another job's mark) are never signalled. An audit hook inside the agent (and its
watchdog) records every /proc access and every ctypes call: in the portable mode there is none.
Liveness is asked of ps (and kill(pid, 0)), never of /proc, so this file runs unchanged on a Mac.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import agent_procs
from ansible_collections.meshkit.cluster.plugins.module_utils.agent_procs import PortableJob, Proc, parse_ps

from meshkit.launcher import BOOTSTRAP, agent_input

HERE = Path(__file__).parent
FAMILY = HERE / "programs_agent" / "family.py"
FIXTURES = HERE.parent / "fixtures" / "macos_ps"
ROLES = ("child", "grandchild", "group-orphan", "daemon", "leader", "leader-kid", "pgid-leaver")
LINUX = sys.platform.startswith("linux")
# The agent runs under whatever Python a host has (stock macOS: 3.9): MESHKIT_TEST_AGENT_PYTHON picks it.
AGENT_PYTHON = os.environ.get("MESHKIT_TEST_AGENT_PYTHON") or sys.executable

# Put in front of the launcher's bootstrap: records, in the file $MESHKIT_TEST_AUDIT, every /proc
# path the agent (or its watchdog, a fork of it) opens or lists and every ctypes call (prctl).
AUDIT = r"""
import os, sys
_audit_fd = os.open(os.environ["MESHKIT_TEST_AUDIT"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
def _audit(event, args):
    what = None
    if event in ("open", "os.listdir", "os.scandir") and args and str(args[0]).startswith("/proc"):
        what = f"{event} {args[0]}"
    elif event.startswith("ctypes."):
        what = event
    if what:
        os.write(_audit_fd, f"{os.getpid()} {what}\n".encode())
sys.addaudithook(_audit)
"""


# --- helpers: ps, never /proc ---------------------------------------------------------------------


def ps_of(pid: int, field: str) -> str | None:
    """One ps field of ``pid`` (None when there is no such process)."""
    out = subprocess.run(["ps", "-o", f"{field}=", "-p", str(pid)], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def alive(pid: int) -> bool:
    """There, and not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = ps_of(pid, "stat")
    return stat is not None and not stat.startswith("Z")


def wait_for(what: str, condition: Callable[[], bool], within: float = 15.0) -> float:
    """Seconds until ``condition`` held; the test fails after ``within``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            pytest.fail(f"not within {within:g} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - started


class Job:
    """One agent started as the launcher starts it (through its bootstrap), in the portable mode, with
    an audit hook; ``wrapped``: through a go-between process (the connection's process) that can be
    killed while the agent's stdin stays open."""

    def __init__(self, tmp: Path, ranks: int = 2, *, portable: bool = True, wrapped: bool = False) -> None:
        self.tmp = tmp
        self.id = f"portable-{uuid.uuid4().hex}"
        self.pids_dir = tmp / "pids"
        self.pids_dir.mkdir(parents=True)
        self.audit = tmp / "audit.log"
        self.audit.touch()
        self.job_dir = tmp / "job"
        env = {k: v for k, v in os.environ.items() if k != agent_procs.PORTABLE_ENV}
        env["MESHKIT_TEST_AUDIT"] = str(self.audit)
        if portable:
            env[agent_procs.PORTABLE_ENV] = "1"
        agent = [AGENT_PYTHON, "-u", "-c", AUDIT + BOOTSTRAP]
        read_fd, self.write_fd = os.pipe()
        if wrapped:
            go_between = "import subprocess, sys; sys.exit(subprocess.Popen(sys.argv[1:]).wait())"
            argv = [sys.executable, "-c", go_between, *agent]
        else:
            argv = agent
        # Unbuffered: select() and communicate() look at the descriptor, so nothing may wait in a
        # Python buffer that readline() filled (a last message would be lost).
        self.proc = subprocess.Popen(
            argv, stdin=read_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0
        )
        os.close(read_fd)
        specs = [
            {"rank": r, "argv": [sys.executable, str(FAMILY), str(self.pids_dir), *(["ignore-term"] if r else [])],
             "env": {"MESHKIT_TEST_ID": self.id, "MESHKIT_RANK": str(r)}, "cwd": None}
            for r in range(ranks)
        ]  # fmt: skip
        job = {"job": self.id, "dir": str(self.job_dir), "files": {}, "grace": 0.5, "stdin": False, "ranks": specs}
        os.write(self.write_fd, agent_input((json.dumps(job) + "\n").encode()))
        self.ranks = ranks
        self.messages: list[dict[str, Any]] = []

    def send(self, **msg: Any) -> None:
        os.write(self.write_fd, (json.dumps(msg) + "\n").encode())

    def close_stdin(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def read_until(self, done: Callable[[dict[str, Any]], bool], within: float = 20.0) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if not select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                break
            line = self.proc.stdout.readline()
            if not line:
                break
            self.messages.append(json.loads(line))
            if done(self.messages[-1]):
                return
        pytest.fail(f"the agent did not say it within {within:g} s: {self.messages}")

    def wait_up(self) -> None:
        """Every rank said "up": its whole family is there."""
        ups: set[int] = set()
        self.read_until(lambda m: m["t"] == "out" and "up" in m["d"] and len(ups.add(m["r"]) or ups) == self.ranks)

    def rank_pids(self) -> list[int]:
        return [m["pid"] for m in self.messages if m["t"] == "started"]

    def family(self) -> dict[str, int]:
        """role-rank -> pid of every member the ranks left."""
        return {p.stem: int(p.read_text()) for p in self.pids_dir.glob("*.pid")}

    def everything(self) -> dict[str, int]:
        out = self.family()
        out.update({f"rank-{i}": pid for i, pid in enumerate(self.rank_pids())})
        return out

    def marked(self) -> list[int]:
        """Processes whose environment has this test's id (ps's own view, where it shows environments)."""
        flag = "-E" if sys.platform == "darwin" else "e"
        argv = ["ps", "-A", "-ww", "-o", "pid=", "-o", "command=", flag]
        out = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
        needle = f"MESHKIT_TEST_ID={self.id}"
        return [int(line.split()[0]) for line in out.splitlines() if needle in line.split()]

    def finish(self, within: float = 20.0) -> int:
        self.close_stdin()
        try:
            out, err = self.proc.communicate(timeout=within)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            pytest.fail(f"the agent's connection did not end within {within:g} s")
        self.messages += [json.loads(line) for line in out.decode().splitlines()]
        self.stderr = err.decode()
        return self.proc.returncode

    def kill_everything(self) -> None:
        """Whatever is still there after the test (by the pids it wrote), so that nothing outlives it."""
        self.close_stdin()
        for pid in [*self.everything().values(), *self.marked()]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()

    def agent_log(self) -> str:
        path = self.job_dir / "agent.log"
        return path.read_text() if path.exists() else ""


@pytest.fixture
def strangers() -> Iterator[list[subprocess.Popen]]:
    """Processes that are not the job's: one in a session of its own, one carrying another job's mark."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    procs = [
        subprocess.Popen(["sleep", "600"], start_new_session=True, env=env),
        subprocess.Popen(
            ["sleep", "600"], start_new_session=True, env={**env, "MESHKIT_JOB_MARK": "1-0123456789abcdef"}
        ),
    ]
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    made: list[Job] = []

    def make(**kw: Any) -> Job:
        made.append(Job(tmp_path / f"job{len(made)}", **kw))
        return made[-1]

    yield make
    for one in made:
        one.kill_everything()


def nothing_left(job: Job, strangers: list[subprocess.Popen], within: float = 15.0) -> float:
    """Every process of the job gone (seconds it took), the strangers untouched, and the agent and its
    watchdog never touched /proc or ctypes."""
    everything = job.everything()
    assert len(everything) == job.ranks * (len(ROLES) + 1), everything

    def done() -> bool:
        return not any(alive(pid) for pid in everything.values()) and not job.marked()

    started = time.monotonic()
    while not done():
        if time.monotonic() - started > within:
            left = [k for k, pid in everything.items() if alive(pid)]
            pytest.fail(f"still there after {within:g} s: {left}; agent.log:\n{job.agent_log()}")
        time.sleep(0.02)
    took = time.monotonic() - started
    for proc in strangers:
        assert proc.poll() is None, f"a process that is not the job's was signalled: {proc.args}"
    assert job.audit.read_text() == "", f"the portable mode used /proc or ctypes:\n{job.audit.read_text()}"
    return took


# --- ps output ---------------------------------------------------------------------------------


def test_recorded_macos_ps_j_is_read_and_a_group_number_alone_ties_nothing() -> None:
    tree = parse_ps((FIXTURES / "ps_j_tree_watch_top.txt").read_text())
    assert sorted(tree) == [27655, 27672, 27673, 27674]
    assert tree[27673] == Proc(27673, 27672, 27655, "S+", "", "/bin/bash -c watch top >top.log")
    assert tree[27674].command == "watch top" and tree[27672].command == "..../exe/main"
    # Below `go run` (as if it were the agent): its binary, bash and watch, by parent pid.
    assert PortableJob(27655, "m").members(tree, set())[0] == {27672, 27673, 27674}

    orphan = parse_ps((FIXTURES / "ps_j_orphan_watch_top.txt").read_text())
    assert orphan == {24324: Proc(24324, 1, 24303, "S", "", "watch top")}
    # Re-parented to launchd: not below anything of the job any more. Its old group number alone is
    # not enough for the watchdog (the number may be another's by now); the agent, which has watched
    # the group without a gap, trusts it; a process seen before by pid and start time would be the job's.
    job = PortableJob(24303, "m")
    assert job.members(orphan, {24303}) == (set(), set())
    assert job.members(orphan, {24303}, trust_groups=True) == ({24324}, {24303})


def test_the_agents_own_ps_columns_on_macos_synthetic() -> None:
    table = parse_ps((FIXTURES / "ps_agent_columns_E_SYNTHETIC.txt").read_text())
    assert len(table) == 12
    assert table[4110].start == "Tue Sep 2 10:15:05 2025" and table[4110].stat == "Ss"
    assert table[4110].command.startswith("/Users/ml/venv/bin/python train.py MESHKIT_RANK=0 ")
    assert table[4112] == Proc(4112, 4111, 4110, "Z", "", "<defunct>")  # a zombie; no start ("-")
    mark = "4102-9f3c2a71d0e4b6a8"
    # The agent (4105, child of its watchdog 4102): its rank and the rank's child by the tree; the
    # daemon re-parented to launchd by its mark; /bin/sleep 4125 (no environment shown: a restricted
    # binary) by the rank's group. Not: the zombie, the watchdog, the sleep of another session, the
    # other job (another mark).
    agent = PortableJob(4105, mark, {4102})
    assert agent.members(table, {4110}) == ({4110, 4111, 4120, 4125}, {4110})
    # The watchdog after the agent's death, the rank an orphan now: found by its mark, its group with it.
    orphaned = {pid: proc._replace(ppid=1) if pid == 4110 else proc for pid, proc in table.items() if pid != 4105}
    assert PortableJob(4102, mark, {4105}).members(orphaned, {4110}) == ({4110, 4111, 4120, 4125}, {4110})
    # A process seen before keeps its identity (pid and start); the same pid started at another time
    # is another process, never signalled.
    known = PortableJob(4102, "", {4105})
    known.known = {4130: "Tue Sep 2 10:15:07 2025", 5000: "Tue Sep 2 10:59:59 2025"}
    assert known.members(table, set()) == ({4130}, set())


def test_ps_here_gives_this_process_its_parent_group_and_start() -> None:
    table = agent_procs.ps_table(environment=True)
    assert table is not None
    me = table[os.getpid()]
    assert (me.ppid, me.pgid) == (os.getppid(), os.getpgrp())
    assert len(me.start.split()) == 5 and me.start.split()[0] in agent_procs.WEEKDAYS, me
    assert str(Path(sys.executable).name) in me.command or "pytest" in me.command
    if os.environ.get("PATH"):
        assert f"PATH={os.environ['PATH']}" in me.command.split()  # the environment after the command


# --- the tracker with real processes: an orphan it saw stays the job's ------------------------------

ORPHANING = r"""
import os, sys, time
where = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    open(f"{where}/mid.pid", "w").write(str(os.getpid()))
    if os.fork() == 0:
        open(f"{where}/bare.pid", "w").write(str(os.getpid()))
        os.execve("/bin/sleep" if os.path.exists("/bin/sleep") else "/usr/bin/sleep", ["sleep", "600"], {})
    while not os.path.exists(f"{where}/go"):
        time.sleep(0.01)
    os._exit(0)
time.sleep(600)
"""


def test_an_orphan_seen_before_is_still_the_jobs_and_nothing_else_is(
    tmp_path: Path, strangers: list[subprocess.Popen]
) -> None:
    """A root (standing for the agent) whose child, in a session of its own, starts a grandchild with
    no environment, then exits: the grandchild is re-parented to init/launchd. Seen once before that,
    it is still the job's by pid and start time and is killed; the strangers are not."""
    root = subprocess.Popen([sys.executable, "-c", ORPHANING, str(tmp_path)], start_new_session=True)
    try:
        pids = [tmp_path / "mid.pid", tmp_path / "bare.pid"]
        wait_for("the child and the bare grandchild", lambda: all(p.exists() and p.read_text() for p in pids))
        mid, bare = (int(p.read_text()) for p in pids)
        job = PortableJob(root.pid, "no-mark-here")
        seen = job.track(set())
        assert seen is not None and {mid, bare} <= set(seen[0]), seen
        (tmp_path / "go").write_text("")
        wait_for("the grandchild re-parented", lambda: ps_of(bare, "ppid") not in (None, str(mid)))
        # Without what was seen before, nothing ties it to the job any more: no mark, not below the root.
        assert bare not in PortableJob(root.pid, "no-mark-here").members(agent_procs.ps_table() or {}, set())[0]
        killed = job.sweep(set())
        assert killed is not None and bare in killed, killed
        wait_for("the orphan gone", lambda: not alive(bare))
        assert all(proc.poll() is None for proc in strangers)
    finally:
        root.kill()
        root.wait()
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((tmp_path / "bare.pid").read_text()), signal.SIGKILL)


# --- the agent, end to end ------------------------------------------------------------------------


def test_a_stop_leaves_nothing_of_the_job(job: Callable[..., Job], strangers: list[subprocess.Popen]) -> None:
    one = job()
    one.wait_up()
    one.send(t="stop", why="test")
    one.read_until(lambda m: m["t"] == "bye")
    took = nothing_left(one, strangers)
    bye = one.messages[-1]
    family = one.family()
    out_of_groups = {
        family[f"{role}-{r}"] for role in ("daemon", "leader", "leader-kid", "pgid-leaver") for r in (0, 1)
    }
    assert out_of_groups <= set(bye["left"]), (bye, family)  # swept by the agent, not by the groups' signals
    exits = {m["r"]: m for m in one.messages if m["t"] == "exit"}
    assert exits[0]["sig"] == signal.SIGTERM and exits[1]["sig"] == signal.SIGKILL  # rank 1 ignores SIGTERM
    assert one.finish() == 0
    assert "processes found through ps only" in one.agent_log()
    assert "watchdog killed" not in one.agent_log(), one.agent_log()  # it ended in order: nothing left for it
    print(f"stop: nothing left at the first check after the agent's bye ({took:.2f} s, its ps runs included)")


def test_a_killed_agent_leaves_nothing_of_the_job(job: Callable[..., Job], strangers: list[subprocess.Popen]) -> None:
    """No PR_SET_PDEATHSIG: the ranks outlive the agent for as long as the watchdog takes to sweep."""
    one = job()
    one.wait_up()
    agent = int(ps_of(one.rank_pids()[0], "ppid") or 0)
    assert agent and int(ps_of(agent, "ppid") or 0) == one.proc.pid  # the agent is the watchdog's child
    killed_at = time.monotonic()
    os.kill(agent, signal.SIGKILL)
    took = nothing_left(one, strangers)
    gone_after = time.monotonic() - killed_at
    assert one.finish() == 128 + signal.SIGKILL  # the watchdog says how the agent ended
    assert f"meshkit agent (pid {agent}) killed by SIGKILL; its watchdog killed" in one.stderr, one.stderr
    assert "killed by SIGKILL" in one.agent_log()
    print(f"agent SIGKILL to nothing left: {gone_after:.2f} s (checked {took:.2f} s)")
    assert gone_after < 10


def test_the_end_of_the_connection_leaves_nothing_of_the_job(
    job: Callable[..., Job], strangers: list[subprocess.Popen]
) -> None:
    one = job()
    one.wait_up()
    closed_at = time.monotonic()
    assert one.finish() == 0  # stdin closed: the agent stops the job and ends in order
    ended = time.monotonic() - closed_at
    nothing_left(one, strangers, within=0.5)  # already so when the agent has ended
    assert "end of input from the controller: stopping every rank" in one.agent_log()
    assert "watchdog killed" not in one.agent_log(), one.agent_log()
    print(f"end of input to the agent's exit, nothing of the job left: {ended:.2f} s")


def test_a_connection_whose_process_dies_leaves_nothing_of_the_job(
    job: Callable[..., Job], strangers: list[subprocess.Popen]
) -> None:
    """The connection's process (here a go-between, as sshd's session would be) dies while the agent's
    stdin stays open (this test holds the pipe): the watchdog sees its parent gone and stops the job."""
    one = job(wrapped=True)
    one.wait_up()
    watchdog = int(ps_of(int(ps_of(one.rank_pids()[0], "ppid") or 0), "ppid") or 0)
    assert int(ps_of(watchdog, "ppid") or 0) == one.proc.pid
    os.kill(one.proc.pid, signal.SIGKILL)
    one.proc.wait()
    took = nothing_left(one, strangers)
    wait_for("the watchdog gone", lambda: not alive(watchdog))
    log = one.agent_log()
    assert f"the connection's process (pid {one.proc.pid}) is gone: stopping the job" in log, log
    assert "watchdog killed" not in log, log  # the agent stopped the job itself and ended in order
    print(f"connection's process killed to nothing left: {took:.2f} s")


NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


@pytest.mark.skipif(not (LINUX and os.access(NS_LAST_PID, os.W_OK)), reason="needs Linux's ns_last_pid (root)")
def test_a_rank_pid_taken_again_within_the_second_is_never_signalled(tmp_path: Path) -> None:
    """A rank that exits at once; its pid is taken by another process (new session, no mark) before the
    agent ends, most likely within the same second (same start time to ps): the agent forgot the rank
    when it reaped it, so the newcomer survives the agent's sweep."""
    id_ = f"portable-{uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if k != agent_procs.PORTABLE_ENV}
    env[agent_procs.PORTABLE_ENV] = "1"
    pidfile = tmp_path / "rank.pid"
    rank = {"rank": 0, "argv": ["sh", "-c", f"echo $$ > {pidfile}; head -c 300000 /dev/zero | tr '\\0' x; echo"],
            "env": {"MESHKIT_TEST_ID": id_}, "cwd": None}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-u", "-c", BOOTSTRAP], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    assert proc.stdin is not None
    job = {"job": id_, "dir": str(tmp_path / "job"), "files": {}, "grace": 0.5, "stdin": False, "ranks": [rank]}
    proc.stdin.write(agent_input((json.dumps(job) + "\n").encode()))
    proc.stdin.flush()
    taker = None
    try:
        wait_for("the rank's pid", lambda: pidfile.exists() and pidfile.read_text().strip() != "")
        pid = int(pidfile.read_text())
        log = tmp_path / "job" / "agent.log"
        wait_for("the rank reaped", lambda: f"rank 0 (pid {pid}): its process group is empty" in log.read_text())
        for _ in range(20):
            NS_LAST_PID.write_text(str(pid - 1))
            candidate = subprocess.Popen(["sleep", "60"], start_new_session=True, env={"PATH": env["PATH"]})
            if candidate.pid == pid:
                taker = candidate
                break
            candidate.kill()
            candidate.wait()
        assert taker is not None, f"pid {pid} was taken by another process first"
        proc.communicate(timeout=20)  # its stdin closed: it ends
        assert proc.returncode == 0
        assert taker.poll() is None, "the agent signalled a process that only reused a rank's pid"
    finally:
        if taker is not None:
            taker.kill()
            taker.wait()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not LINUX, reason="the Linux mode exists on Linux only")
def test_the_audit_sees_proc_and_prctl_in_the_linux_mode(job: Callable[..., Job]) -> None:
    """The check the portable tests rest on can fail: the same job in the Linux mode uses both."""
    one = job(ranks=1, portable=False)
    one.wait_up()
    one.send(t="stop", why="test")
    assert one.finish() == 0
    seen = one.audit.read_text()
    assert "ctypes.dlopen" in seen and "/proc" in seen, seen
    assert "processes found through /proc, subreapers" in one.agent_log()
