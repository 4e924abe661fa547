"""The communicator's engine, in real jobs on this machine: several threads, async calls, batched
sends and receives, abort() from another thread, Ctrl-C and close() during a call. Each case
runs over shared memory (every rank on one host) and over TCP (every rank its own "host", cabled
in a full mesh over loopback addresses), since the two wait for data differently."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.meshccl import helpers as h

WORKER = Path(__file__).with_name("engine_worker.py")
MESH3 = [(1, 2), (1, 3), (2, 3)]


def hostfile(tmp: Path, transport: str, n: int, tag: str = "") -> Path:
    sub = tmp / f"{transport}{tag}"
    sub.mkdir()
    if transport == "shm":
        return h.loopback_hostfile(sub, n)
    pairs = [(a, b) for a in range(1, n + 1) for b in range(a + 1, n + 1)]
    return h.meshccl_hostfile(sub, pairs, n)


def spawn(n: int, scenario: str, env_of) -> list[subprocess.Popen]:
    return h.spawn(n, scenario, env_of, worker=WORKER)


def env_for(path: Path, **extra: str):
    return lambda r: {"MESHCCL_RANK": str(r), "MESHCCL_HOSTFILE": str(path), **extra}


def all_ok(results: list[tuple[int, str, str]]) -> None:
    for r, (code, out, err) in enumerate(results):
        assert code == 0 and out.strip().endswith("OK"), f"rank {r}: rc {code}\n{out}\n{err}"


@pytest.fixture(params=["shm", "tcp"])
def transport(request) -> str:
    return request.param


def test_two_threads_each_with_its_own_communicator(tmp_path, transport):
    first = hostfile(tmp_path, transport, 2)
    second = hostfile(tmp_path, transport, 2, "-second")
    all_ok(h.finish(spawn(2, "threads_own", env_for(first, MESHCCL_HOSTFILE2=str(second))), timeout=120))


def test_one_communicator_shared_by_two_threads_blocking_and_async(tmp_path, transport):
    all_ok(h.finish(spawn(3, "threads_shared", env_for(hostfile(tmp_path, transport, 3))), timeout=120))


def test_async_calls_queue_in_order_and_complete(tmp_path, transport):
    all_ok(h.finish(spawn(3, "async", env_for(hostfile(tmp_path, transport, 3))), timeout=120))


def test_a_ring_shift_in_one_exchange_does_not_deadlock(tmp_path, transport):
    all_ok(h.finish(spawn(3, "ring_shift", env_for(hostfile(tmp_path, transport, 3))), timeout=120))


def test_tagged_messages_match_their_receives_in_any_order_and_from_any_rank(tmp_path, transport):
    all_ok(h.finish(spawn(3, "messages", env_for(hostfile(tmp_path, transport, 3))), timeout=120))


def test_float_sums_are_bit_identical_call_after_call_and_on_every_rank(tmp_path, transport):
    # Four ranks, a full mesh: the direct algorithm, where contributions arrive in any order.
    all_ok(h.finish(spawn(4, "repeatable", env_for(hostfile(tmp_path, transport, 4))), timeout=120))


def read_until(proc: subprocess.Popen, pattern: str, deadline: float) -> tuple[re.Match[str], str]:
    """Lines of proc's stdout up to the first that matches (the worker flushes every line)."""
    seen = ""
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
        m = re.search(pattern, line)
        if m:
            return m, seen
    raise AssertionError(f"no line matching {pattern!r} before the deadline; output so far:\n{seen}")


def blocked_job(tmp_path: Path, transport: str, scenario: str):
    gate = tmp_path / "gate"
    # A call timeout far beyond the test's deadline: only the abort can end the blocked calls.
    env = env_for(hostfile(tmp_path, transport, 3), MESHCCL_GATE=str(gate), MESHCCL_TIMEOUT="600")
    return spawn(3, scenario, env), gate


def late_rank_fails(result: tuple[int, str, str], reason: str) -> None:
    """Rank 1 enters the call after the others ended it. It gets the ABORT where rank 0 was not
    in the middle of a frame to it (with single copy only small frames went its way); where
    rank 0 had filled the TCP socket buffers or the shared-memory ring to rank 1 (rank 1 was not
    reading), no ABORT can follow on that stream, and rank 1 meets its end instead. Either way
    it fails, naming the abort or the peer."""
    code, out, err = result
    assert code == 3 and re.search(r"^ERROR (AbortedError|PeerError) ", out, re.M), f"rank 1: {out}\n{err}"
    if "ERROR AbortedError" in out:
        assert reason in out, out


def finish_blocked(procs, gate: Path, first: str) -> list[tuple[int, str, str]]:
    """Ranks 0 and 2 report how their call ended (and stay alive); then rank 1 enters its call
    and meets the ABORT, and every rank exits."""
    early = {r: read_until(procs[r], r"^(ERROR|INTERRUPTED) ", time.monotonic() + 30)[1] for r in (0, 2)}
    gate.touch()
    results = h.finish(procs, timeout=30)
    early[0] = first + early[0]
    return [(code, early.get(r, "") + out, err) for r, (code, out, err) in enumerate(results)]


@pytest.mark.parametrize("how", ["abort", "close"])
def test_abort_or_close_from_another_thread_ends_a_blocked_call_on_every_rank(tmp_path, transport, how):
    procs, gate = blocked_job(tmp_path, transport, how)
    m, first = read_until(procs[0], r"ENDING at ([\d.]+)", time.monotonic() + 60)
    ended_at = float(m.group(1))
    results = finish_blocked(procs, gate, first)
    reason = "the test aborts rank 0" if how == "abort" else "the communicator was closed during a call"
    for r in (0, 2):  # in the call when the abort came
        code, out, err = results[r]
        assert code == 3 and "ERROR AbortedError" in out and reason in out, f"rank {r}: rc {code}\n{out}\n{err}"
    late_rank_fails(results[1], reason)
    # Ranks 0 and 2 were blocked in the call: they end when the abort reaches them, not at the
    # call timeout (600 s) nor the test's deadline.
    for r in (0, 2):
        at = float(re.search(r"ERROR AbortedError at ([\d.]+)", results[r][1]).group(1))
        assert at - ended_at < 20, f"rank {r} ended {at - ended_at:.2f} s after the abort"


@pytest.mark.parametrize("scenario", ["sigint", "sigint_wait"])
def test_ctrl_c_during_a_long_call_raises_within_a_second_and_aborts_the_peers(tmp_path, transport, scenario):
    procs, gate = blocked_job(tmp_path, transport, scenario)
    _, first = read_until(procs[0], r"CALLING at", time.monotonic() + 60)
    read_until(procs[2], r"CALLING at", time.monotonic() + 60)
    time.sleep(0.3)  # the call is under way (blocked on rank 1): Ctrl-C must end a waiting call
    sent = time.monotonic()
    procs[0].send_signal(signal.SIGINT)
    results = finish_blocked(procs, gate, first)
    code, out, err = results[0]
    m = re.search(r"INTERRUPTED at ([\d.]+)", out)
    assert code == 4 and m, f"rank 0: rc {code}\n{out}\n{err}"
    assert float(m.group(1)) - sent < 1.0, f"KeyboardInterrupt {float(m.group(1)) - sent:.3f} s after SIGINT"
    code, out, err = results[2]
    assert code == 3 and "ERROR AbortedError" in out and "interrupted (Ctrl-C)" in out, f"rank 2: {out}\n{err}"
    late_rank_fails(results[1], "interrupted (Ctrl-C)")
