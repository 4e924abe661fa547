"""The launcher with real processes: every "host" is this machine (the local connection), each with its
own agent and job directory. Fail fast, SIGTERM then SIGKILL after the grace, daemonised children swept
up, the timeout, a program that is missing, stdin broadcast and a prompt without its newline, a host
whose agent dies, and no process of a job left anywhere afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from meshkit import launch_plan, launcher
from meshkit.launcher import (
    BOOTSTRAP,
    HostJob,
    JobResult,
    Launcher,
    RankState,
    Terminal,
    agent_argv,
    agent_input,
    host_jobs,
)
from meshkit.topology import Observation, build_plan

LOCAL = agent_argv({"kind": "local"}, sys.executable)
SLEEP = ["sleep", "60"]
HOSTS = ("hostA", "hostB")


def job_pids(job_id: str) -> list[int]:
    """Processes on this machine whose environment has MESHKIT_JOB_ID=job_id."""
    needle = f"MESHKIT_JOB_ID={job_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                environ = handle.read()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(name))
    return found


def settled(job_id: str, within: float = 3.0) -> list[int]:
    """The job's processes still there after a short settling time (a SIGKILL takes a moment to land)."""
    deadline = time.monotonic() + within
    while (pids := job_pids(job_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


@pytest.fixture
def job_id() -> Iterator[str]:
    """A unique job id; whatever still carries it after the test is killed."""
    ident = f"test-{uuid.uuid4().hex}"
    yield ident
    for pid in job_pids(ident):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def hosts_for(
    tmp_path: Path,
    job_id: str,
    argvs: list[list[str]],
    *,
    argv: dict[str, list[str]] | None = None,
    env: dict[str, str] | None = None,
) -> list[HostJob]:
    """Two local hosts of two ranks each: ranks 0, 1 on hostA and 2, 3 on hostB, running argvs[rank]."""
    out = []
    for i, host in enumerate(HOSTS):
        ranks = [
            {
                "rank": rank,
                "argv": argvs[rank],
                "env": {"MESHKIT_JOB_ID": job_id, "MESHKIT_RANK": str(rank), **(env or {})},
                "cwd": None,
            }
            for rank in (2 * i, 2 * i + 1)
        ]
        out.append(HostJob(host, (argv or {}).get(host, LOCAL), str(tmp_path / "jobs" / host), ranks))
    return out


def launch(
    tmp_path: Path, job_id: str, argvs: list[list[str]], *, hosts: list[HostJob] | None = None, **kw: Any
) -> JobResult:
    kw.setdefault("grace", 1.0)
    hosts = hosts if hosts is not None else hosts_for(tmp_path, job_id, argvs)
    return Launcher(hosts, job_id, tmp_path / "logs", **kw).run()


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def states(result: JobResult) -> list[tuple[int, str, str]]:
    return [(r.rank, r.host, r.state) for r in result.ranks]


def test_every_rank_exits_0_with_logs_and_lines(tmp_path: Path, job_id: str) -> None:
    lines: list[str] = []
    events: list[str] = []

    def on_line(rank: RankState, line: str) -> None:
        lines.append(f"[{rank.rank}|{rank.host}] {line}")

    argv = sh('echo "hello from $MESHKIT_RANK"; echo "second $MESHKIT_RANK" >&2')
    result = launch(tmp_path, job_id, [argv] * 4, on_line=on_line, on_event=events.append)
    assert result.ok, result.summary()
    assert result.reason == "all 4 ranks exited 0"
    assert states(result) == [(0, "hostA", "ok"), (1, "hostA", "ok"), (2, "hostB", "ok"), (3, "hostB", "ok")]
    assert all(r.code == 0 and r.signal is None and r.pid for r in result.ranks)
    assert result.all_running is not None and result.all_running < 30
    assert result.wall < 30
    assert result.leftovers == {} and result.host_errors == {}
    assert any(e.startswith("all 4 ranks running after") for e in events)
    table = result.table()
    assert len(table) == 4 and all(" ok " in line and "exit code 0" in line for line in table)

    logs = tmp_path / "logs"
    for rank in range(4):
        host = HOSTS[rank // 2]
        text = (logs / f"rank-{rank}.log").read_text()
        assert f"hello from {rank}\n" in text and f"second {rank}\n" in text  # stderr goes with stdout
        assert f"[{rank}|{host}] hello from {rank}" in lines
        assert f"[{rank}|{host}] second {rank}" in lines
        # The agent keeps its own copy in the host's job directory.
        assert f"hello from {rank}" in (tmp_path / "jobs" / host / f"rank-{rank}.log").read_text()
    combined = (logs / "output.log").read_text().splitlines()
    assert sorted(combined) == sorted(lines)
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["ok"] is True
    assert [(r["rank"], r["state"], r["exit_code"]) for r in summary["ranks"]] == [(i, "ok", 0) for i in range(4)]
    assert summary["ranks"][3]["last_lines"] == ["hello from 3", "second 3"]
    assert settled(job_id) == []


def test_files_are_written_into_the_job_directory_before_ranks_start(tmp_path: Path, job_id: str) -> None:
    hosts = hosts_for(tmp_path, job_id, [sh('cat "$MESHKIT_RANK.txt"')] * 4)
    for hj in hosts:
        hj.files = {f"{r['rank']}.txt": f"file for {r['rank']} on {hj.host}\n" for r in hj.ranks}
        for r in hj.ranks:
            r["cwd"] = hj.job_dir
    result = launch(tmp_path, job_id, [], hosts=hosts)
    assert result.ok, result.summary()
    assert [r.tail[-1] for r in result.ranks] == [f"file for {i} on {HOSTS[i // 2]}" for i in range(4)]
    assert (tmp_path / "jobs" / "hostB" / "3.txt").read_text() == "file for 3 on hostB\n"
    assert oct((tmp_path / "jobs" / "hostA").stat().st_mode & 0o777) == oct(0o700)


def test_first_failure_stops_every_rank_on_every_host(tmp_path: Path, job_id: str) -> None:
    argvs = [SLEEP, SLEEP, sh("sleep 0.3; echo bye; exit 3"), SLEEP]
    running: list[int] = []
    result = launch(tmp_path, job_id, argvs, on_line=lambda _rank, _line: running.extend(job_pids(job_id)))
    assert not result.ok
    assert len(running) >= 3  # the scan sees the job's processes while they run
    assert result.wall < 30
    failed = result.ranks[2]
    assert (failed.state, failed.code, failed.signal, failed.error) == ("failed", 3, None, None)
    assert list(failed.tail) == ["bye"]
    for rank in (0, 1, 3):
        r = result.ranks[rank]
        assert (r.state, r.signal, r.code) == ("stopped", signal.SIGTERM, None), r
    assert result.failed == [failed]
    assert result.reason == "rank 2 (hostB) exit code 3"
    assert result.table()[0].startswith("rank   2 hostB        failed   exit code 3")
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["ok"] is False
    assert [r["state"] for r in summary["ranks"]] == ["stopped", "stopped", "failed", "stopped"]
    assert settled(job_id) == []


def test_a_rank_ignoring_sigterm_is_killed_after_the_grace(tmp_path: Path, job_id: str) -> None:
    # The ignored SIGTERM is inherited by sleep too: only SIGKILL ends either.
    argvs = [sh('trap "" TERM; sleep 60'), SLEEP, SLEEP, sh("sleep 0.3; exit 1")]
    result = launch(tmp_path, job_id, argvs, grace=0.5)
    assert not result.ok
    assert result.wall < 30
    stubborn = result.ranks[0]
    assert (stubborn.state, stubborn.signal) == ("stopped", signal.SIGKILL)
    assert stubborn.describe() == "killed by SIGKILL"
    assert (result.ranks[1].state, result.ranks[1].signal) == ("stopped", signal.SIGTERM)
    assert (result.ranks[3].state, result.ranks[3].code) == ("failed", 1)
    assert settled(job_id) == []


def test_a_daemonised_child_is_swept_up_and_named(tmp_path: Path, job_id: str) -> None:
    # The rank starts a sleep in its own session, prints its pid and exits 0, leaving it behind.
    daemon = [
        sys.executable,
        "-c",
        "import subprocess; p = subprocess.Popen(['sleep', '60'], start_new_session=True,"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)",
    ]
    argvs = [["true"], ["true"], ["true"], daemon]
    result = launch(tmp_path, job_id, argvs)
    assert result.ok, result.summary()  # a leftover is swept, not a failure
    pid = int(result.ranks[3].tail[-1])
    assert result.leftovers == {"hostB": [pid]}
    assert json.loads((tmp_path / "logs" / "summary.json").read_text())["leftovers"] == {"hostB": [pid]}
    assert settled(job_id) == []


def test_a_daemonised_child_holding_the_output_is_swept_up(tmp_path: Path, job_id: str) -> None:
    argvs = [sh("(setsid sleep 60 &); echo started; exit 0"), ["true"], ["true"], ["true"]]
    result = launch(tmp_path, job_id, argvs)
    assert result.ok, result.summary()
    assert result.ranks[0].tail[-1] == "started"
    assert list(result.leftovers) == ["hostA"]
    assert len(result.leftovers["hostA"]) == 1
    assert settled(job_id) == []


def test_timeout_stops_every_rank(tmp_path: Path, job_id: str) -> None:
    result = launch(tmp_path, job_id, [SLEEP, SLEEP, SLEEP, ["true"]], timeout=1)
    assert not result.ok
    assert result.reason.startswith("timeout")
    assert result.reason == "timeout after 1 s"
    assert result.wall < 30
    assert [r.state for r in result.ranks] == ["timeout", "timeout", "timeout", "ok"]
    assert result.failed == []
    assert settled(job_id) == []


def test_a_missing_program_fails_its_rank_with_127(tmp_path: Path, job_id: str) -> None:
    missing = str(tmp_path / "no-such-program")
    result = launch(tmp_path, job_id, [SLEEP, [missing, "--arg"], SLEEP, SLEEP])
    assert not result.ok
    assert result.wall < 30
    rank = result.ranks[1]
    assert (rank.state, rank.code) == ("failed", 127)
    assert rank.error is not None and missing in rank.error
    assert rank.pid is None
    assert [result.ranks[i].state for i in (0, 2, 3)] == ["stopped"] * 3
    assert missing in result.reason
    assert result.all_running is None  # one rank never ran
    assert settled(job_id) == []


def pipe() -> tuple[BinaryIO, int]:
    """(the launcher's stdin: the read end, the write end's fd)."""
    read_fd, write_fd = os.pipe()
    return open(read_fd, "rb", buffering=0), write_fd


def test_stdin_is_broadcast_to_every_rank(tmp_path: Path, job_id: str) -> None:
    stdin, write_fd = pipe()
    os.write(write_fd, b"hello\n")
    os.close(write_fd)
    with stdin:
        result = launch(tmp_path, job_id, [sh('read line; echo "got $line"; cat')] * 4, stdin=stdin, timeout=30)
    assert result.ok, result.summary()  # `cat` ends: the end of stdin reaches every rank
    for rank in range(4):
        assert "got hello\n" in (tmp_path / "logs" / f"rank-{rank}.log").read_text()
        assert list(result.ranks[rank].tail) == ["got hello"]


def test_a_rank_that_never_reads_its_stdin_does_not_hold_up_the_job(tmp_path: Path, job_id: str) -> None:
    # 1 MiB of input, far beyond a pipe's 64 KiB, for ranks that never read it: the agents keep
    # forwarding output and still stop the job at once when rank 3 fails.
    stdin, write_fd = pipe()
    writer = threading.Thread(target=lambda: (os.write(write_fd, b"x" * (1 << 20)), os.close(write_fd)))
    writer.start()
    argvs = [sh("echo up; sleep 60")] * 3 + [sh("echo up; sleep 1; exit 3")]
    started = time.monotonic()
    with stdin:
        result = launch(tmp_path, job_id, argvs, stdin=stdin)
    writer.join(timeout=30)
    assert time.monotonic() - started < 10, "stopping waited for the stuck stdin (grace + 10 s)"
    assert [r.state for r in result.ranks] == ["stopped", "stopped", "stopped", "failed"]
    assert all(list(r.tail) == ["up"] for r in result.ranks)
    assert settled(job_id) == []


def test_without_stdin_ranks_read_end_of_file(tmp_path: Path, job_id: str) -> None:
    result = launch(tmp_path, job_id, [sh('cat; echo "eof $MESHKIT_RANK"')] * 4, timeout=30)
    assert result.ok, result.summary()
    assert [r.tail[-1] for r in result.ranks] == [f"eof {i}" for i in range(4)]


def test_a_prompt_without_newline_shows_before_it_is_answered(tmp_path: Path, job_id: str) -> None:
    stdin, write_fd = pipe()
    seen: list[tuple[int, str]] = []
    answered = threading.Event()

    def on_line(rank: RankState, line: str) -> None:
        seen.append((rank.rank, line))
        if line == "(Pdb) " and not answered.is_set():
            answered.set()
            os.write(write_fd, b"continue\n")
            os.close(write_fd)

    argvs = [sh('printf "(Pdb) "; read x; echo "answer $x"')] * 4
    try:
        with stdin:
            result = launch(tmp_path, job_id, argvs, stdin=stdin, partial_flush=0.1, on_line=on_line, timeout=20)
    finally:
        if not answered.is_set():
            os.close(write_fd)
    assert answered.is_set()
    assert result.ok, result.summary()
    # The prompt came out on its own, before any rank had its answer.
    first_answer = next(i for i, (_, line) in enumerate(seen) if line.startswith("answer"))
    assert any(line == "(Pdb) " for _, line in seen[:first_answer])
    for rank in range(4):
        # A rank whose prompt was not shown yet when the answer came shows both on one line.
        assert any(r == rank and line.endswith("answer continue") for r, line in seen)
        assert (tmp_path / "logs" / f"rank-{rank}.log").read_text() == "(Pdb) answer continue\n"


def test_partial_line_without_flush_is_kept_until_the_rank_ends(tmp_path: Path, job_id: str) -> None:
    seen: list[tuple[int, str]] = []
    result = launch(
        tmp_path,
        job_id,
        [sh('printf "no newline $MESHKIT_RANK"')] * 4,
        on_line=lambda rank, line: seen.append((rank.rank, line)),
    )
    assert result.ok, result.summary()
    assert sorted(seen) == [(i, f"no newline {i}") for i in range(4)]


def test_a_host_whose_agent_dies_loses_its_ranks_and_stops_the_rest(tmp_path: Path, job_id: str) -> None:
    hosts = hosts_for(tmp_path, job_id, [SLEEP] * 4, argv={"hostB": ["sh", "-c", "exit 5"]})
    result = launch(tmp_path, job_id, [], hosts=hosts)
    assert not result.ok
    assert result.wall < 30
    assert states(result) == [
        (0, "hostA", "stopped"),
        (1, "hostA", "stopped"),
        (2, "hostB", "lost"),
        (3, "hostB", "lost"),
    ]
    assert all(r.error and r.error.startswith("lost the host's agent") for r in result.ranks[2:])
    assert [r.rank for r in result.failed] == [2, 3]
    assert "hostB" in result.reason
    assert settled(job_id) == []


def test_a_host_whose_connection_talks_nonsense(tmp_path: Path, job_id: str) -> None:
    # Reads all the launcher sends (so nothing is cut off), then answers with a banner instead of an agent.
    banner = [
        sys.executable,
        "-c",
        "import sys; n = int(sys.stdin.buffer.read(10)); sys.stdin.buffer.read(n); sys.stdin.buffer.readline();"
        " print('Welcome to hostB'); sys.stderr.write('oops\\n')",
    ]
    hosts = hosts_for(tmp_path, job_id, [SLEEP] * 4, argv={"hostB": banner})
    result = launch(tmp_path, job_id, [], hosts=hosts)
    assert not result.ok
    assert [r.state for r in result.ranks] == ["stopped", "stopped", "lost", "lost"]
    assert "Welcome to hostB" in result.host_errors["hostB"]
    assert settled(job_id) == []


def agent_alone(
    job_id: str, job_dir: Path, ranks: list[dict[str, Any]], *, stderr: int | None = None, **more: Any
) -> subprocess.Popen:
    """An agent started as the launcher starts it, given its job (``more``: further job fields);
    its stdin stays open."""
    # Unbuffered (bufsize=0): select() and communicate() read the descriptor, not readline()'s buffer.
    proc = subprocess.Popen(LOCAL, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, bufsize=0)
    job = {"job": job_id, "dir": str(job_dir), "files": {}, "grace": 0.5, "stdin": False, "ranks": ranks, **more}
    assert proc.stdin is not None
    proc.stdin.write(agent_input((json.dumps(job) + "\n").encode()))
    proc.stdin.flush()
    return proc


def finish(proc: subprocess.Popen, within: float = 10.0) -> list[dict[str, Any]]:
    """Close the agent's input (the controller is gone) and collect what it says until it ends."""
    try:
        out, _ = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the agent did not finish within {within:g} s of the end of its input")
    return [m for m in map(json.loads, out.decode().splitlines()) if m["t"] != "hb"]


def rank_spec(job_id: str, rank: int, argv: list[str], cwd: str | None = None) -> dict[str, Any]:
    return {"rank": rank, "argv": argv, "env": {"MESHKIT_JOB_ID": job_id}, "cwd": cwd}


def test_a_controller_that_goes_away_stops_the_ranks(tmp_path: Path, job_id: str) -> None:
    proc = agent_alone(job_id, tmp_path / "job", [rank_spec(job_id, 0, SLEEP)])
    messages = finish(proc)
    assert [m["t"] for m in messages] == ["started", "exit", "bye"]
    assert messages[1]["stopped"] is True and messages[1]["sig"] == signal.SIGTERM
    assert proc.returncode == 0
    assert settled(job_id) == []


def messages_until(proc: subprocess.Popen, done: Callable[[dict[str, Any]], bool], within: float = 10.0) -> list[dict]:
    """The agent's messages up to the first one ``done`` accepts (the test fails after ``within`` s)."""
    assert proc.stdout is not None
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(json.loads(line))
        if done(seen[-1]):
            return seen
    pytest.fail(f"the agent did not say it within {within:g} s: {seen}")


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def alive(pid: int) -> bool:
    """A process that is there and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] != b"Z"


# A rank that leaves a child and a grandchild in its process group, a daemon (double fork, setsid)
# and a daemon that also drops its environment (no marker: found only as a descendant), then waits.
FAMILY = r"""
import os, subprocess, sys, time
where = sys.argv[1]
subprocess.Popen(["sh", "-c", "sleep 600 & wait"])
for name, env in (("daemon", dict(os.environ)), ("bare", {})):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(f"{where}/{name}-{os.environ['MESHKIT_RANK']}.pid", "w") as handle:
                handle.write(str(os.getpid()))
            os.execve("/bin/sleep", ["sleep", "600"], env)
        os._exit(0)
while len([n for n in os.listdir(where) if n.endswith(f"-{os.environ['MESHKIT_RANK']}.pid")]) < 2:
    time.sleep(0.01)
print("up", flush=True)
time.sleep(600)
"""


def test_a_killed_agent_leaves_nothing_of_its_ranks(tmp_path: Path, job_id: str) -> None:
    """SIGKILL to the agent: its ranks die (PR_SET_PDEATHSIG), and its watchdog (the process the
    connection started, a subreaper) kills their children, grandchildren and daemons, even one
    without the job's environment."""
    pids = tmp_path / "pids"
    pids.mkdir()
    ranks = [
        {"rank": r, "argv": [sys.executable, "-c", FAMILY, str(pids)],
         "env": {"MESHKIT_JOB_ID": job_id, "MESHKIT_RANK": str(r)}, "cwd": None}
        for r in (0, 1)
    ]  # fmt: skip
    proc = agent_alone(job_id, tmp_path / "job", ranks, stderr=subprocess.PIPE)
    try:
        # Both ranks said "up" (an unbuffered print may send "up" and its newline apart).
        ups: set[int] = set()
        seen = messages_until(proc, lambda m: m["t"] == "out" and "up" in m["d"] and len(ups.add(m["r"]) or ups) == 2)
        rank_pids = [m["pid"] for m in seen if m["t"] == "started"]
        agent = parent_of(rank_pids[0])
        assert agent != proc.pid and parent_of(agent) == proc.pid  # the agent is the watchdog's child
        daemons = [int(p.read_text()) for p in pids.iterdir()]
        assert len(daemons) == 4 and all(alive(pid) for pid in daemons)
        assert len(job_pids(job_id)) == 2 * 4  # rank, sh, sleep, daemon; the bare daemon has no env
        killed_at = time.monotonic()
        os.kill(agent, signal.SIGKILL)
        left = settled(job_id, within=10)
        gone_after = time.monotonic() - killed_at
        assert left == [], left
        assert not any(alive(pid) for pid in daemons)
        code = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        _out, err = proc.communicate()
    assert code == 128 + signal.SIGKILL  # the watchdog reports how the agent ended
    text = err.decode()
    assert f"meshkit agent (pid {agent}) killed by SIGKILL; its watchdog killed" in text, text
    assert "killed by SIGKILL" in (tmp_path / "job" / "agent.log").read_text()
    print(f"agent SIGKILL to nothing left: {gone_after:.2f} s")
    assert gone_after < 5


def test_a_killed_watchdog_leaves_the_agent_in_charge(tmp_path: Path, job_id: str) -> None:
    """The process the connection started (the watchdog) killed: the agent still runs the job and
    stops it at the end of its input."""
    proc = agent_alone(job_id, tmp_path / "job", [rank_spec(job_id, 0, SLEEP)])
    messages_until(proc, lambda m: m["t"] == "started")
    proc.kill()
    messages = finish(proc)
    assert [m["t"] for m in messages] == ["exit", "bye"] and messages[0]["stopped"] is True
    assert settled(job_id) == []


def test_a_rank_that_cannot_be_started_still_lets_the_agent_finish(tmp_path: Path, job_id: str) -> None:
    # Popen refuses an argument with a NUL byte (ValueError, not OSError) after rank 0 has started.
    ranks = [rank_spec(job_id, 0, SLEEP), rank_spec(job_id, 1, ["sh", "-c", "echo a\0b"])]
    proc = agent_alone(job_id, tmp_path / "job", ranks)
    messages = finish(proc)
    assert messages[-1]["t"] == "bye"
    # The controller hears why rank 1 did not start: its exit, or the job's error.
    assert any(m["t"] == "error" or (m["t"] == "exit" and m["r"] == 1) for m in messages)
    assert settled(job_id) == []


def test_a_missing_working_directory_is_named(tmp_path: Path, job_id: str) -> None:
    gone = str(tmp_path / "gone")
    proc = agent_alone(job_id, tmp_path / "job", [rank_spec(job_id, 0, ["sh", "-c", "true"], cwd=gone)])
    messages = finish(proc)
    exits = [m for m in messages if m["t"] == "exit"]
    assert len(exits) == 1 and exits[0]["code"] != 0
    assert gone in exits[0]["err"], exits[0]["err"]


def test_stdin_for_a_rank_that_closed_its_stdin_does_not_kill_the_agent(tmp_path: Path, job_id: str) -> None:
    stdin, write_fd = pipe()

    def on_line(_rank: RankState, line: str) -> None:
        if line == "closed":  # rank 0 has closed its stdin; now the input comes
            os.write(write_fd, b"hello\n")
            os.close(write_fd)

    argvs = [sh("exec 0<&-; echo closed; sleep 0.5; echo done"), sh('read x; echo "got $x"'), ["true"], ["true"]]
    with stdin:
        result = launch(tmp_path, job_id, argvs, stdin=stdin, on_line=on_line, timeout=20)
    assert result.ok, result.summary()
    assert list(result.ranks[0].tail) == ["closed", "done"]
    assert list(result.ranks[1].tail) == ["got hello"]
    assert settled(job_id) == []


def test_a_character_split_across_reads_arrives_whole(tmp_path: Path, job_id: str) -> None:
    seen: list[str] = []
    # "é" is \303\251 in UTF-8: its two bytes come out 0.3 s apart, in two reads.
    split = sh("printf '\\303'; sleep 0.3; printf '\\251t\\n'")
    result = launch(tmp_path, job_id, [split, ["true"], ["true"], ["true"]], on_line=lambda _r, line: seen.append(line))
    assert result.ok, result.summary()
    assert seen == ["ét"]
    assert (tmp_path / "logs" / "rank-0.log").read_text(encoding="utf-8") == "ét\n"
    assert (tmp_path / "jobs" / "hostA" / "rank-0.log").read_bytes() == "ét\n".encode()


# ---- planning the hosts' shares ------------------------------------------------------------------


def test_agent_argv_local_and_nsenter() -> None:
    assert agent_argv({"kind": "local"}, "/usr/bin/python3") == ["/usr/bin/python3", "-u", "-c", BOOTSTRAP]
    ns = agent_argv({"kind": "nsenter", "pid": 1234}, "python3")
    assert ns == ["nsenter", "-t", "1234", "-n", "-m", "-u", "-i", "-p", "--", "python3", "-u", "-c", BOOTSTRAP]
    with pytest.raises(ValueError, match="unknown connection kind 'telnet'"):
        agent_argv({"kind": "telnet"}, "python3")


def test_agent_argv_ssh_quotes_the_remote_command_as_one_word_list() -> None:
    conn = {
        "kind": "ssh",
        "host": "10.9.0.3",
        "port": 2222,
        "user": "ops",
        "key": "/home/ops/.ssh/id_ed25519",
        "args": ["-o", "StrictHostKeyChecking=accept-new"],
    }
    argv = agent_argv(conn, "/opt/py 3/bin/python3")
    assert argv[:4] == ["ssh", "-T", "-o", "BatchMode=yes"]
    assert argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-l") + 1] == "ops"
    assert argv[argv.index("-i") + 1] == "/home/ops/.ssh/id_ed25519"
    # meshkit's keepalives and connect timeout, then Ansible's options (ssh takes an option's first
    # value: the launch's host timeout holds whatever ServerAlive settings ansible.cfg's ssh_args carry).
    assert argv[-10:-2] == [
        "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-o", "ConnectTimeout=20",
        "-o", "StrictHostKeyChecking=accept-new",
    ]  # fmt: skip
    assert argv[-2] == "10.9.0.3"
    assert shlex.split(argv[-1]) == ["/opt/py 3/bin/python3", "-u", "-c", BOOTSTRAP]
    bare = agent_argv({"kind": "ssh", "host": "node1", "host_timeout": 8}, "python3")
    assert bare == [
        "ssh", "-T", "-o", "BatchMode=yes",
        "-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3", "-o", "ConnectTimeout=8",
        "node1", shlex.join(["python3", "-u", "-c", BOOTSTRAP]),
    ]  # fmt: skip


def test_bootstrap_runs_the_agent_through_a_shell(tmp_path: Path, job_id: str) -> None:
    # What a remote login shell does with the ssh command: split it again, then run it.
    remote = agent_argv({"kind": "ssh", "host": "h"}, sys.executable)[-1]
    hosts = hosts_for(tmp_path, job_id, [["true"]] * 4, argv={"hostA": ["sh", "-c", remote]})
    result = launch(tmp_path, job_id, [], hosts=hosts)
    assert result.ok, result.summary()


def plan_of_ring() -> dict[str, Any]:
    obs = []
    for a, b, pa, pb in [(1, 2, "tb0", "tb0"), (2, 3, "tb1", "tb0"), (3, 1, "tb1", "tb1")]:
        obs.append(Observation(f"node{a}", pa, f"id-{a}-{pa}", [f"id-{b}-{pb}"]))
        obs.append(Observation(f"node{b}", pb, f"id-{b}-{pb}", [f"id-{a}-{pa}"]))
    return build_plan(["node1", "node2", "node3"], obs, "10.50.0.0/24", "", False).as_dict()


def test_host_jobs_group_ranks_by_host_and_add_the_job_token_to_every_runtime() -> None:
    plan = plan_of_ring()
    settings = launch_plan.validate({"program": "python3 t.py", "ranks_per_host": 2})
    job = launch_plan.build(plan, settings, job_id="j", state_dir="/s", cluster="c", ssh={}).as_dict()
    connections = {
        "node1": {"kind": "local", "python": "/usr/bin/python3"},
        "node2": {"kind": "nsenter", "pid": 7},
        "node3": {"kind": "ssh", "host": "10.9.0.3"},
    }
    shares = host_jobs(job, connections, {"MESHCCL_TOKEN": "sekret"})
    assert [hj.host for hj in shares] == list(dict.fromkeys(r["host"] for r in job["ranks"]))
    first = shares[0]
    assert first.argv == ["/usr/bin/python3", "-u", "-c", BOOTSTRAP]
    assert shares[1].argv[:3] == ["nsenter", "-t", "7"] and shares[1].argv[-4] == "python3"
    assert first.job_dir == "/s/jobs/j"
    assert [r["rank"] for r in first.ranks] == [0, 1]
    assert first.files == {"meshccl.json": job["files"][first.host]["meshccl.json"]}
    assert all(r["env"]["MESHCCL_TOKEN"] == "sekret" for hj in shares for r in hj.ranks)
    assert all(r["env"]["MESHCCL_JOB_ID"] == "j" for hj in shares for r in hj.ranks)
    assert job["ranks"][0]["env"]["MESHCCL_TOKEN"] == "<hidden>"  # the plan itself is not changed
    assert launch_plan.redact(first.ranks[0]["env"])["MESHCCL_TOKEN"] == "<hidden>"
    assert launch_plan.redact(first.ranks[0]["env"])["MESHCCL_RANK"] == "0"

    # Every runtime's ranks get the token and the job id (meshccl may run under any of them).
    for runtime in ("plain", "torch", "mlx"):
        other = launch_plan.build(
            plan, {**settings, "runtime": runtime}, job_id="j", state_dir="/s", cluster="c", ssh={}
        ).as_dict()
        envs = [r["env"] for hj in host_jobs(other, connections, {"MESHCCL_TOKEN": "t"}) for r in hj.ranks]
        assert len(envs) == 6 and all(e["MESHCCL_TOKEN"] == "t" and e["MESHCCL_JOB_ID"] == "j" for e in envs), runtime
    # A job without its token's value starts nothing.
    with pytest.raises(ValueError, match="no value for MESHCCL_TOKEN"):
        host_jobs(job, connections, {})


def test_a_planned_job_runs_end_to_end(tmp_path: Path, job_id: str) -> None:
    plan = plan_of_ring()
    settings = launch_plan.validate(
        {
            "program": ["sh", "-c", 'test -s "$MESHCCL_HOSTFILE" && echo "rank $MESHCCL_RANK of $MESHCCL_WORLD_SIZE"'],
            "ranks_per_host": 2,
        }
    )
    job = launch_plan.build(plan, settings, job_id=job_id, state_dir=str(tmp_path / "state"), cluster="c", ssh={})
    shares = host_jobs(
        job.as_dict(), {h: {"kind": "local", "python": sys.executable} for h in job.hosts()}, {"MESHCCL_TOKEN": "t"}
    )
    result = Launcher(shares, job_id, tmp_path / "logs", grace=1.0).run()
    assert result.ok, result.summary()
    assert [r.tail[-1] for r in result.ranks] == [f"rank {i} of 6" for i in range(6)]
    assert json.loads((tmp_path / "state" / "jobs" / job_id / "meshccl.json").read_text())["world_size"] == 6


# ---- a host that does not take what is sent, or says nothing ---------------------------------------


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging) when the block takes longer than ``seconds``: SIGALRM interrupts
    even a blocking write."""

    def _late(_sig: int, _frame: object) -> None:
        raise TimeoutError(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, _late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# A "host" whose connection never reads what is sent to it and never answers (its ssh wedged).
WEDGED = ["sleep", "600"]
BIG = {"big.bin": "x" * (4 << 20)}  # the job's files: far beyond what a pipe holds


def wedged_hosts(tmp_path: Path, job_id: str, argvs: list[list[str]]) -> list[HostJob]:
    hosts = hosts_for(tmp_path, job_id, argvs, argv={"hostB": WEDGED})
    hosts[1].files = dict(BIG)
    return hosts


def test_a_wedged_host_cannot_hold_up_the_job_timeout(
    tmp_path: Path, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host timeout is far away: only the job timeout, then killing the connection that does
    # not finish stopping, end the launch.
    monkeypatch.setattr(launcher, "STOP_SLACK", 1.0)
    started = time.monotonic()
    with within(30):
        result = launch(
            tmp_path, job_id, [], hosts=wedged_hosts(tmp_path, job_id, [SLEEP] * 4), timeout=1, host_timeout=600
        )
    took = time.monotonic() - started
    assert result.reason == "timeout after 1 s"
    assert [r.state for r in result.ranks] == ["timeout", "timeout", "stopped", "stopped"]
    assert all("connection closed while stopping" in (r.error or "") for r in result.ranks[2:])
    assert took < 1 + 1.0 + 1.0 + 5  # timeout + grace + slack, and a little
    assert settled(job_id) == []


def test_a_silent_host_is_lost_after_the_host_timeout_and_every_other_rank_stops(tmp_path: Path, job_id: str) -> None:
    events: list[str] = []
    started = time.monotonic()
    with within(30):
        result = launch(
            tmp_path,
            job_id,
            [],
            hosts=wedged_hosts(tmp_path, job_id, [SLEEP] * 4),
            host_timeout=2,
            on_event=events.append,
        )
    took = time.monotonic() - started
    assert not result.ok
    assert [r.state for r in result.ranks] == ["stopped", "stopped", "lost", "lost"]
    assert result.reason.startswith("rank 2 (hostB) lost the host's agent: no word from its agent for 2 s"), (
        result.reason
    )
    assert "hostB" in result.host_errors and "no word from its agent" in result.host_errors["hostB"]
    assert any(e.startswith("hostB: no word from its agent for 2 s") for e in events), events
    assert 2 <= took < 2 + 1.0 + 4  # the host timeout, the others' grace, and a little
    assert settled(job_id) == []


def test_ctrl_c_ends_a_launch_whose_host_takes_no_input(
    tmp_path: Path, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 MiB typed for the ranks: the wedged host takes none of it. Ctrl-C (SIGINT to the launcher)
    # once hostA's ranks are up still ends the launch.
    monkeypatch.setattr(launcher, "STOP_SLACK", 1.0)
    stdin, write_fd = pipe()

    def type_in() -> None:
        with contextlib.suppress(OSError):  # EPIPE: the launcher is done and its stdin closed
            os.write(write_fd, b"y" * (8 << 20))
        os.close(write_fd)

    writer = threading.Thread(target=type_in)
    writer.start()
    ups: list[int] = []

    def on_line(rank: RankState, line: str) -> None:
        ups.append(rank.rank)
        if len(ups) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    argvs = [sh("echo up; exec sleep 60")] * 4
    with stdin, within(30):
        result = launch(
            tmp_path, job_id, [], hosts=wedged_hosts(tmp_path, job_id, argvs), stdin=stdin, on_line=on_line,
            host_timeout=600,
        )  # fmt: skip
    writer.join(timeout=10)
    assert not writer.is_alive()
    assert result.reason == "interrupted (Ctrl-C)"
    assert [r.state for r in result.ranks[:2]] == ["stopped", "stopped"]
    assert result.wall < 1 + 1.0 + 5
    assert settled(job_id) == []


def test_an_agent_that_hears_nothing_stops_its_ranks(tmp_path: Path, job_id: str) -> None:
    """A partition closes nothing: the agent stops its ranks when the controller has been silent
    for host_timeout seconds, though its input stays open and nobody reads its output (a rank
    writing without pause fills that pipe: the agent must not block on it)."""
    ranks = [rank_spec(job_id, 0, SLEEP), rank_spec(job_id, 1, ["yes", "flood"])]
    proc = agent_alone(job_id, tmp_path / "job", ranks, host_timeout=1.5, heartbeat=0.3)
    try:
        started = time.monotonic()
        # Wait for the ranks to have started (their pids carry the job), then read nothing more.
        deadline = time.monotonic() + 10
        while len(job_pids(job_id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(job_pids(job_id)) == 2
        assert settled(job_id, within=10) == []
        took = time.monotonic() - started
        assert 1.5 <= took < 1.5 + 0.5 + 3, took  # the host timeout, the grace, a little
        log = (tmp_path / "job" / "agent.log").read_text()
        assert "no word from the controller for 1.5 s: stopping every rank of this host" in log, log
        assert proc.wait(timeout=15) == 0  # it ends by itself, its last messages dropped
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_an_agent_that_hears_heartbeats_keeps_its_ranks(tmp_path: Path, job_id: str) -> None:
    proc = agent_alone(job_id, tmp_path / "job", [rank_spec(job_id, 0, SLEEP)], host_timeout=1.0, heartbeat=0.25)
    assert proc.stdin is not None
    try:
        seen = messages_until(proc, lambda m: m["t"] == "started")
        until = time.monotonic() + 3
        while time.monotonic() < until:
            proc.stdin.write(b'{"t": "hb"}\n')
            proc.stdin.flush()
            time.sleep(0.2)
        assert len(job_pids(job_id)) == 1  # three host timeouts later, still running
        seen += messages_until(proc, lambda m: m["t"] == "hb")  # the agent's own heartbeat
    finally:
        messages = finish(proc)
    assert [m["t"] for m in seen[:1]] == ["started"]
    assert [m["t"] for m in messages] == ["exit", "bye"] and messages[0]["stopped"] is True
    assert settled(job_id) == []


# ---- ranks of a non-root login user --------------------------------------------------------------

NOBODY = 65534


def test_an_agent_keeps_writing_into_its_job_directory_after_it_was_swapped(tmp_path: Path, job_id: str) -> None:
    go = tmp_path / "go"
    rank = sh(f"echo first; while [ ! -e {go} ]; do sleep 0.02; done; echo second; exit 4")
    proc = agent_alone(job_id, tmp_path / "jobs" / "j1", [rank_spec(job_id, 0, rank)])
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    try:
        messages_until(proc, lambda m: m["t"] == "out" and "first" in m["d"])
        (tmp_path / "jobs" / "j1").rename(tmp_path / "jobs" / "moved")
        (tmp_path / "jobs" / "j1").symlink_to(decoy)
        go.touch()
        messages_until(proc, lambda m: m["t"] == "exit")
    finally:
        messages = finish(proc)
    assert messages[-1]["t"] == "bye"
    moved = tmp_path / "jobs" / "moved"
    assert (moved / "rank-0.log").read_text() == "first\nsecond\n"
    assert "job " in (moved / "agent.log").read_text()
    assert list(decoy.iterdir()) == []
    assert settled(job_id) == []


@pytest.fixture
def shared_state() -> Iterator[Path]:
    """A state directory another user can reach (pytest's own tmp_path is root's only)."""
    base = Path(tempfile.mkdtemp(prefix="meshkit-state-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def host_python_for(uid: int) -> str:
    """A Python another user may run (this venv's may live under /root)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        login = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        probe = subprocess.run([*login, candidate, "-c", ""], capture_output=True, check=False)
        if probe.returncode == 0:
            return candidate
    pytest.fail("no python3 that uid 65534 can run (/usr/bin/python3); install python3")


def as_nobody(tmp_path: Path, job_id: str, state: Path, argvs: list[list[str]]) -> list[HostJob]:
    login = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
    argv = [*login, host_python_for(NOBODY), "-u", "-c", BOOTSTRAP]
    hosts = hosts_for(tmp_path, job_id, argvs, argv={"hostA": argv, "hostB": argv})
    for hj in hosts:
        hj.job_dir = str(state / "jobs" / job_id / hj.host)  # each "host" its own (one machine)
        hj.files = {"hello.txt": f"for {hj.host}\n"}
    return hosts


def test_ranks_run_as_the_login_user_in_a_job_directory_of_their_own(
    tmp_path: Path, job_id: str, shared_state: Path
) -> None:
    # What setup.yml leaves: <state_dir> root's (0755), <state_dir>/jobs sticky and world-writable.
    (shared_state / "jobs").mkdir(mode=0o755)
    (shared_state / "jobs").chmod(0o1777)
    (shared_state / "jobs" / job_id).mkdir()  # the two "hosts" of this machine share a level
    (shared_state / "jobs" / job_id).chmod(0o1777)
    argvs = [sh('echo "uid $(id -u) $(cat hello.txt)"')] * 4
    hosts = as_nobody(tmp_path, job_id, shared_state, argvs)
    for hj in hosts:
        for r in hj.ranks:
            r["cwd"] = hj.job_dir
    result = launch(tmp_path, job_id, [], hosts=hosts)
    assert result.ok, result.summary()
    assert [r.tail[-1] for r in result.ranks] == [f"uid {NOBODY} for {HOSTS[i // 2]}" for i in range(4)]
    for i, host in enumerate(HOSTS):
        where = shared_state / "jobs" / job_id / host
        made = where.stat()
        assert (made.st_uid, made.st_mode & 0o7777) == (NOBODY, 0o700)
        for rank in (2 * i, 2 * i + 1):
            assert (where / f"rank-{rank}.log").stat().st_uid == NOBODY
    assert settled(job_id) == []


def test_a_jobs_directory_the_user_cannot_write_is_named_with_the_fix(
    tmp_path: Path, job_id: str, shared_state: Path
) -> None:
    # An older setup: <state_dir>/jobs root's, 0755.
    (shared_state / "jobs").mkdir(mode=0o755)
    (shared_state / "jobs").chmod(0o755)
    hosts = as_nobody(tmp_path, job_id, shared_state, [SLEEP] * 4)
    hosts[0].job_dir = str(shared_state / "jobs" / job_id)
    hosts[1].job_dir = str(shared_state / "jobs" / f"{job_id}-b")
    result = launch(tmp_path, job_id, [], hosts=hosts)
    assert not result.ok
    error = result.host_errors["hostA"]
    assert error.startswith(f"cannot start the job: cannot create {shared_state}/jobs/{job_id}: {shared_state}/jobs")
    assert f"is not writable by nobody (uid {NOBODY})" in error
    assert "run setup.yml, or as root: chmod 1777" in error
    assert [r.state for r in result.ranks] == ["lost", "lost", "lost", "lost"]
    assert settled(job_id) == []


# ---- a terminal that does not take the output (a paused `| less`) -------------------------------------


def blocked_terminal(limit: int) -> tuple[Terminal, threading.Event, list[tuple[str, bool]]]:
    """A Terminal whose writes wait until the returned event is set, as a paused pager's do."""
    gate = threading.Event()
    written: list[tuple[str, bool]] = []

    def write(text: str, event: bool) -> None:
        gate.wait()
        written.append((text, event))

    return Terminal(write, limit=limit, log="LOG"), gate, written


def test_a_terminal_that_takes_nothing_is_left_behind_then_told_what_it_missed() -> None:
    terminal, gate, written = blocked_terminal(limit=10_000)
    started = time.monotonic()
    for i in range(5000):
        terminal.line(f"line {i:05d} " + "x" * 80)
    terminal.event("stopping every rank: timeout after 1 s")
    assert time.monotonic() - started < 1.0  # never waits for the terminal
    assert terminal.dropped > 4800
    gate.set()
    deadline = time.monotonic() + 10
    while not any(event and text.startswith("the terminal did not keep up") for text, event in written):
        assert time.monotonic() < deadline, written
        time.sleep(0.01)
    terminal.line("after it caught up")
    terminal.close()
    shown = [line for text, event in written if not event for line in text.split("\n")]
    notice = next(text for text, event in written if event and text.startswith("the terminal"))
    missed = int(notice.split(": ")[1].split()[0])
    assert notice == f"the terminal did not keep up: {missed} lines of output not shown here (every line is in LOG)"
    assert len(shown) - 1 + missed == 5000
    assert shown[0].startswith("line 00000 ") and shown[-1] == "after it caught up"
    assert ("stopping every rank: timeout after 1 s", True) in written  # the launcher's own events have room


def test_a_paused_terminal_holds_up_neither_the_job_nor_its_heartbeats_nor_its_logs(
    tmp_path: Path, job_id: str
) -> None:
    """12000 lines for a terminal that takes nothing for the whole job: no host is lost (the host
    timeout, 1 s, passes several times over), the job timeout still ends it, every line is in the
    logs, and the terminal hears what it missed once it takes output again."""
    terminal, gate, written = blocked_terminal(limit=32 << 10)
    flood = 'i=0; while [ $i -lt 3000 ]; do echo "rank $MESHKIT_RANK line $i"; i=$((i+1)); done; '
    argvs = [sh(flood + "sleep 2")] * 3 + [sh(flood + "exec sleep 60")]
    try:
        with within(30):
            result = launch(tmp_path, job_id, argvs, timeout=4, host_timeout=1.0, terminal=terminal)
    finally:
        gate.set()
        terminal.close()
    assert result.reason == "timeout after 4 s", result.summary()
    assert [r.state for r in result.ranks] == ["ok", "ok", "ok", "timeout"]
    assert result.host_errors == {}
    assert result.wall < 4 + 1 + 3
    for rank in range(4):
        log = (tmp_path / "logs" / f"rank-{rank}.log").read_text().splitlines()
        assert log == [f"rank {rank} line {i}" for i in range(3000)]
    shown = [line for text, event in written if not event for line in text.split("\n")]
    missed = sum(int(t.split(": ")[1].split()[0]) for t, e in written if e and t.startswith("the terminal did not"))
    assert missed > 0 and len(shown) + missed == 12000
    assert ("stopping every rank: timeout after 4 s", True) in written
    assert settled(job_id) == []


# ---- broadcast input for a rank that does not read it ---------------------------------------------


def test_an_agent_asks_for_a_pause_while_a_rank_has_too_much_input_unread(tmp_path: Path, job_id: str) -> None:
    go = tmp_path / "go"
    reader = sh(f'while [ ! -e {go} ]; do sleep 0.02; done; wc -c; echo "read all"')
    proc = agent_alone(job_id, tmp_path / "job", [rank_spec(job_id, 0, reader)], stdin=True)
    assert proc.stdin is not None
    chunk = (json.dumps({"t": "stdin", "d": "y" * 65536}) + "\n").encode()
    sent = threading.Thread(target=lambda: (proc.stdin.write(chunk * 48), proc.stdin.flush()))  # 3 MiB
    sent.start()
    try:
        seen = messages_until(proc, lambda m: m["t"] == "stdin_pause")
        assert not any(m["t"] == "stdin_resume" for m in seen)
        go.touch()  # the rank reads now: below the cap again, the agent says so
        messages_until(proc, lambda m: m["t"] == "stdin_resume")
        sent.join(timeout=10)
        proc.stdin.write(b'{"t": "stdin_eof"}\n')
        proc.stdin.flush()
        out = messages_until(proc, lambda m: m["t"] == "exit")
    finally:
        messages = finish(proc)
    text = "".join(m["d"] for m in out if m["t"] == "out")
    assert text.split() == [str(48 * 65536), "read", "all"]
    assert messages[-1]["t"] == "bye"
    assert settled(job_id) == []


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_piped_input_for_a_rank_that_never_reads_keeps_every_process_bounded(tmp_path: Path, job_id: str) -> None:
    """`cat big | meshkit launch` with rank 0 never reading its stdin: its agent asks for a pause, so
    the launcher stops reading its input; the agent's memory stays within its cap and what was in
    flight, far below the 64 MiB offered."""
    stdin, write_fd = pipe()
    taken = [0]

    def offer() -> None:
        block = b"z" * (1 << 16)
        with contextlib.suppress(OSError):  # EPIPE once the launcher is done
            for _ in range(1024):
                taken[0] += os.write(write_fd, block)
        os.close(write_fd)

    writer = threading.Thread(target=offer)
    writer.start()
    agent: list[int] = []
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            if agent:
                with contextlib.suppress(OSError):
                    peak[0] = max(peak[0], rss_kib(agent[0]))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    argvs = [sh("echo $PPID; exec sleep 60")] + [sh("cat > /dev/null")] * 3
    try:
        with stdin:
            result = launch(tmp_path, job_id, argvs, stdin=stdin, timeout=4,
                            on_line=lambda rank, line: agent.append(int(line)) if rank.rank == 0 else None)  # fmt: skip
    finally:
        done.set()
        sampler.join()
        writer.join(timeout=30)
    assert result.reason == "timeout after 4 s", result.summary()
    assert agent and peak[0] > 0
    print(f"agent peak RSS {peak[0]} KiB; input taken {taken[0] >> 20} MiB of 64")
    assert taken[0] < 8 << 20, taken[0]  # paused: the rest waited in the pipe
    assert peak[0] < 64 << 10, peak[0]  # KiB
    assert settled(job_id) == []


NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def take_pid(pid: int, env: dict[str, str]) -> subprocess.Popen | None:
    """A new session leader (its process group number: ``pid``) with exactly that pid, through
    ns_last_pid; None when another process took it first."""
    for _ in range(20):
        NS_LAST_PID.write_text(str(pid - 1))
        proc = subprocess.Popen(["sleep", "60"], start_new_session=True, env=env)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def test_a_group_number_used_again_after_the_job_ended_is_not_signalled(tmp_path: Path, job_id: str) -> None:
    """The rank's process group is empty once it exited: its number may be another's before the agent
    exits (here while the agent waits for the controller to take its last 300 KB). The agent looks at
    the group the moment it reaps the rank and tells its watchdog the group is gone (agent.log says so;
    the number is taken only after that), and ends in order: the process now holding the number
    survives."""
    pidfile = tmp_path / "rank.pid"
    rank = sh(f"echo $$ > {pidfile}; head -c 300000 /dev/zero | tr '\\0' x; echo")
    proc = agent_alone(job_id, tmp_path / "job", [rank_spec(job_id, 0, rank)])
    taker = None
    try:
        deadline = time.monotonic() + 10
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pid = int(pidfile.read_text())
        seen = f"rank 0 (pid {pid}): its process group is empty"
        # Exited, reaped and its group seen empty by the agent, which now waits for us to read.
        while seen not in (tmp_path / "job" / "agent.log").read_text():
            assert time.monotonic() < deadline, "the rank did not end"
            time.sleep(0.01)
        assert not Path(f"/proc/{pid}").exists()
        taker = take_pid(pid, {"MESHKIT_JOB_ID": f"{job_id}-taker"})
        assert taker is not None, f"pid {pid} was taken by another process first"
        messages = finish(proc)
        assert [m["t"] for m in messages][-2:] == ["exit", "bye"]
        assert proc.returncode == 0
        assert taker.poll() is None, "the watchdog signalled a process group that was no longer the job's"
    finally:
        if taker is not None:
            taker.kill()
            taker.wait()
    assert "watchdog killed" not in (tmp_path / "job" / "agent.log").read_text()
    assert settled(job_id) == []


# ---- the preflight on the job's own connections (launch.yml's check_hosts) -------------------------


def preflight_spec(argv: list[str]) -> dict[str, Any]:
    return {"preflight": {"argv": argv, "ports": []}, "facts": False}


def test_the_preflight_answers_on_the_connections_the_job_then_runs_over(tmp_path: Path, job_id: str) -> None:
    """Every agent checks its host first and waits; the job then comes over the same connection."""
    events: list[str] = []
    hosts = hosts_for(tmp_path, job_id, [sh("echo rank $MESHKIT_RANK")] * 4)
    run = Launcher(hosts, job_id, tmp_path / "logs", grace=1.0, on_event=events.append)
    found = run.preflight({host: preflight_spec(["sh", "-c", "true"]) for host in HOSTS})
    assert set(found) == set(HOSTS)
    assert all(r["problems"] == [] and r["program"] == os.path.realpath(shutil.which("sh")) for r in found.values())
    assert not (tmp_path / "logs").exists() and not (tmp_path / "jobs").exists()  # nothing started yet
    agents = [host.proc.pid for host in run.hosts]
    result = run.run()
    assert result.ok, result.summary()
    assert [host.proc.pid for host in run.hosts] == agents  # no second connection
    assert (tmp_path / "logs" / "rank-3.log").read_text() == "rank 3\n"
    assert settled(job_id) == []


def test_a_refused_preflight_starts_nothing_and_leaves_no_agent(tmp_path: Path, job_id: str) -> None:
    hosts = hosts_for(tmp_path, job_id, [SLEEP] * 4)
    run = Launcher(hosts, job_id, tmp_path / "logs", grace=1.0)
    specs = {"hostA": preflight_spec(["sh"]), "hostB": preflight_spec([str(tmp_path / "missing")])}
    found = run.preflight(specs)
    assert found["hostA"]["problems"] == []
    assert found["hostB"]["problems"] == [f"program {tmp_path / 'missing'} not found, or not executable"]
    run.close()
    assert all(host.proc.poll() is not None for host in run.hosts)  # every agent ended with its input
    assert not (tmp_path / "logs").exists() and not (tmp_path / "jobs").exists()
    assert settled(job_id) == []


def test_a_host_that_cannot_answer_its_preflight_is_named(tmp_path: Path, job_id: str) -> None:
    broken = sh("echo 'ssh: connect to host hostB port 22: No route to host' >&2; exit 255")
    hosts = hosts_for(tmp_path, job_id, [SLEEP] * 4, argv={"hostB": broken})
    run = Launcher(hosts, job_id, tmp_path / "logs", grace=1.0)
    found = run.preflight({host: preflight_spec(["sh"]) for host in HOSTS})
    run.close()
    assert found["hostA"]["problems"] == []
    [problem] = found["hostB"]["problems"]
    assert problem == "cannot be checked: its connection ended (ssh: connect to host hostB port 22: No route to host)"
