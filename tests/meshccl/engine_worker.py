"""One rank of a test job for the communicator's engine: threads, async calls, abort, Ctrl-C,
close during a call, batched sends and receives. Usage: engine_worker.py SCENARIO.

Prints OK on success. A meshccl error is printed as "ERROR <type> at <monotonic>: <message>"
(exit 3), KeyboardInterrupt as "INTERRUPTED at <monotonic>" (exit 4). The times are
CLOCK_MONOTONIC, the clock the test reads too. MESHCCL_GATE (a path): rank 1 waits for that
file before it enters the call, and a rank that failed waits for it before it exits."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path

import meshccl
import numpy as np

BIG = (32 << 20) // 4  # float32 elements: large calls cross many segments and the shm ring


def say(line: str) -> None:
    print(line, flush=True)


def wait_gate() -> None:
    gate = Path(os.environ["MESHCCL_GATE"])
    while not gate.exists():
        time.sleep(0.01)  # the gate is created by the test once the others have reported


def hold() -> None:
    """With a gate, a rank that has failed stays alive until it opens, as a supervised job's ranks
    do: a late rank then finds the ABORT, not a connection reset by an exited process."""
    if "MESHCCL_GATE" in os.environ:
        wait_gate()


def check_sum(what: str, x: np.ndarray, n: int, scale: float) -> None:
    want = scale * n * (n + 1) / 2
    bad = np.nonzero(x != want)[0]
    if bad.size:
        raise AssertionError(f"{what}: element {bad[0]} is {x[bad[0]]}, expected {want} ({bad.size} wrong)")


def threads_own(comm: meshccl.Communicator) -> None:
    """Two threads, each with its own communicator (a second job on the second hostfile)."""
    env = dict(os.environ, MESHCCL_HOSTFILE=os.environ["MESHCCL_HOSTFILE2"])
    other = meshccl.init(env)
    errors: list[BaseException] = []

    def work(c: meshccl.Communicator, scale: float) -> None:
        try:
            n, r = c.size, c.rank
            for i, count in enumerate([1, 1000, 70_001, BIG // 4, 5, BIG // 2] * 3):
                x = np.full(count, (r + 1) * scale * (i + 1), dtype=np.float32)
                c.all_reduce(x)
                check_sum(f"comm {scale} call {i}", x, n, scale * (i + 1))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(c, s)) for c, s in ((comm, 1.0), (other, 3.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    other.close()
    if errors:
        raise errors[0]


def threads_shared(comm: meshccl.Communicator) -> None:
    """One communicator, two threads calling at once (blocking and async). Every call has the same
    shape and inputs that depend on the rank only, so however the two threads' calls interleave
    on each rank, each call meets a like call on the other ranks and the result is exact."""
    n, r = comm.size, comm.rank
    errors: list[BaseException] = []

    def work(which: int) -> None:
        try:
            for i in range(40):
                x = np.full(300_001, r + 1, dtype=np.float32)  # large calls: many segments each
                if (i + which) % 2:
                    comm.all_reduce(x, async_op=True).wait()
                else:
                    comm.all_reduce(x)
                check_sum(f"thread {which} call {i}", x, n, 1.0)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def asynchronous(comm: meshccl.Communicator) -> None:
    """Many calls queued at once, then waited on in reverse: each exact, run in order."""
    n, r = comm.size, comm.rank
    xs = [np.full(c, (r + 1) * (k + 1), dtype=np.float64) for k, c in enumerate([3, BIG // 4, 100, 65_537, 1])]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    gathered = comm.all_gather(np.full(5, r, dtype=np.int32), async_op=True)
    works.append(comm.barrier(async_op=True))
    for w in reversed(works):
        assert w.wait(timeout=60), "an async all_reduce did not end within 60 s"
    for k, x in enumerate(xs):
        check_sum(f"async call {k}", x, n, float(k + 1))
    gathered.wait()
    assert gathered.result.tolist() == [q for q in range(n) for _ in range(5)], gathered.result
    assert comm.pending == 0


def ring_shift(comm: meshccl.Communicator) -> None:
    """Send right, receive left in one batch (large: would deadlock as two blocking calls)."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    out = np.full(BIG, r, dtype=np.int32)
    got = np.empty(BIG, dtype=np.int32)
    small = np.empty(3, dtype=np.float64)
    comm.exchange(sends=[(out, right), (np.full(3, r * 0.5), left)], recvs=[(got, left), (small, right)])
    assert (got == left).all(), got[:4]
    assert (small == right * 0.5).all(), small


def messages(comm: meshccl.Communicator) -> None:
    """Tagged messages through the Python API: rank 0 takes rank 1's tags last first (sizes differ, so a wrong match
    cannot pass), then every other rank's message from any rank, async, and says who sent each."""
    n, r = comm.size, comm.rank
    sizes = {1: 7, 2: 40_000, 3: BIG}
    if r == 1:
        comm.messages(sends=[(np.full(k, tag, dtype=np.int32), 0, tag) for tag, k in sizes.items()])
    elif r == 0:
        for tag in (3, 2, 1):
            got = np.full(sizes[tag], -1, dtype=np.int32)
            sources = comm.messages(recvs=[(got, 1, tag)])
            assert list(sources) == [1] and (got == tag).all(), (tag, list(sources), got[:4])
    if r != 0:
        comm.messages(sends=[(np.full(5, 100 + r, dtype=np.float64), 0, 9)])
    else:
        seen = []
        for _ in range(n - 1):
            got = np.empty(5, dtype=np.float64)
            work = comm.messages(recvs=[(got, None, 9)], async_op=True)
            work.wait()
            (src,) = work.result
            assert (got == 100 + src).all(), (src, got)
            seen.append(src)
        assert sorted(seen) == list(range(1, n)), seen
    comm.barrier()  # every message taken: the pair's collectives go on


def repeatable(comm: meshccl.Communicator) -> None:
    """Floating-point sums of the same inputs, called again and again: every call gives the same
    bits on every rank (each chunk is reduced by one rank in one fixed order, whatever order the
    contributions arrive in)."""
    r = comm.rank
    x = np.random.default_rng(r).standard_normal(1_500_007).astype(np.float32) * 10 ** (r % 3)
    first = None
    for i in range(6):
        y = x.copy()
        comm.all_reduce(y)
        if first is None:
            first = y
        elif not np.array_equal(first.view(np.uint32), y.view(np.uint32)):
            bad = int(np.count_nonzero(first.view(np.uint32) != y.view(np.uint32)))
            raise AssertionError(f"call {i}: {bad} elements differ in their bits from call 0")
    digest = np.frombuffer(hashlib.sha256(first.tobytes()).digest()[:8], dtype=np.int64).copy()
    every = comm.all_gather(digest)
    assert (every == every[0]).all(), f"ranks hold different sums: {every}"


def blocked(comm: meshccl.Communicator, how: str) -> None:
    """Rank 1 stays out until the gate opens; ranks 0 and 2 block in a large all_reduce. On rank 0
    `how` ends the call: abort() or close() from another thread, or Ctrl-C (the test sends
    SIGINT once rank 0 prints CALLING)."""
    r = comm.rank
    if r == 1:
        wait_gate()
        comm.all_reduce(np.ones(BIG, dtype=np.float32))
        return
    x = np.ones(BIG, dtype=np.float32)
    if r == 0 and how in ("abort", "close"):

        def end() -> None:
            while comm.pending == 0:  # the call has started (queued or running)
                time.sleep(0.01)
            time.sleep(0.3)  # let it block in the network: the point is to end a blocked call
            say(f"ENDING at {time.monotonic()}")
            comm.abort("the test aborts rank 0") if how == "abort" else comm.close()

        threading.Thread(target=end).start()  # not a daemon: the interpreter waits for it at exit
    if how == "sigint_wait" and r == 0:
        work = comm.all_reduce(x, async_op=True)
        say(f"CALLING at {time.monotonic()}")
        work.wait()
    else:
        say(f"CALLING at {time.monotonic()}")
        comm.all_reduce(x)
    raise AssertionError("the blocked call returned")


def main() -> int:
    scenario = sys.argv[1]
    try:
        comm = meshccl.init()
        if scenario == "threads_own":
            threads_own(comm)
        elif scenario == "threads_shared":
            threads_shared(comm)
        elif scenario == "async":
            asynchronous(comm)
        elif scenario == "repeatable":
            repeatable(comm)
        elif scenario == "ring_shift":
            ring_shift(comm)
        elif scenario == "messages":
            messages(comm)
        elif scenario in ("abort", "close", "sigint", "sigint_wait"):
            blocked(comm, scenario)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        comm.close()
    except meshccl.Error as e:
        say(f"ERROR {type(e).__name__} at {time.monotonic()}: {e}")
        hold()
        return 3
    except KeyboardInterrupt:
        say(f"INTERRUPTED at {time.monotonic()}")
        hold()
        return 4
    say("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
