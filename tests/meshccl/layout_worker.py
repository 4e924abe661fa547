"""One rank of a layout test job (tests/meshccl/test_layouts.py). Usage: layout_worker.py;
reads its rank and job from the environment like any meshccl program.

Runs large calls whose sizes are multiples of no segment size (nor of the ring's chunking), each
checked element by element on this rank: all_reduce of float32 and of int64 (sum, in place) and
of int32 (max, into another buffer), all_gather, reduce_scatter and broadcast (from the first
and the last rank).

Prints "LINKS {json}" (peer -> transport, as meshccl chose it) and "OK" on success; on a meshccl
error "ERROR <ExceptionType>: <message>" and exit 3; on a wrong result "WRONG <what>" and exit 4.

LAYOUT_HOST_ID, when set, stands in for this machine's host identity in torchrun's rendezvous
(meshccl.bootstrap.rendezvous.host_identity), so that ranks on this one machine can play ranks of
several hosts: those with equal ids share memory, the others talk TCP.
"""

from __future__ import annotations

import json
import os
import sys

import meshccl
import numpy as np
from meshccl.bootstrap import rendezvous

# Element counts: primes well away from any power of two, so that no call divides evenly into
# 64 KiB or 256 KiB segments, nor into equal per-rank chunks.
F32_COUNT = 1_048_573  # 4 MiB - 12 B
I64_COUNT = 393_209  # 3 MiB - 56 B
I32_COUNT = 393_203  # 1.5 MiB - 52 B
GATHER_COUNT = 262_139  # per rank, int32: 1 MiB - 20 B
SCATTER_COUNT = 131_071  # per rank, float64: 1 MiB - 8 B
BCAST_COUNT = 393_191  # float64, 3 MiB - 136 B


class Wrong(Exception):
    pass


def check(what: str, got: np.ndarray, want: np.ndarray) -> None:
    if got.shape != want.shape:
        raise Wrong(f"{what}: shape {got.shape}, expected {want.shape}")
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        raise Wrong(f"{what}: element {i} of {got.size} is {got[i]}, expected {want[i]} ({bad.size} wrong)")


def f32_of(rank: int, count: int) -> np.ndarray:
    # Small integers: every partial sum is exact in float32, whatever order ranks add in.
    return ((rank + 1) * (1 + np.arange(count, dtype=np.int64) % 1021)).astype(np.float32)


def i64_of(rank: int, count: int) -> np.ndarray:
    # Uses the high bits too: a block landing at the wrong offset or from the wrong rank shows.
    return np.arange(count, dtype=np.int64) * 7919 + (rank + 1) * (1 << 40) + rank * 3


def i32_of(rank: int, count: int) -> np.ndarray:
    return ((np.arange(count, dtype=np.int64) * 31 + rank * 977) % 100_003).astype(np.int32)


def run(comm: meshccl.Communicator) -> None:
    """Each call, then its result checked against what it must be (sums in closed form)."""
    n, r = comm.size, comm.rank
    tri = n * (n + 1) // 2  # sum of rank + 1 over all ranks

    x = f32_of(r, F32_COUNT)
    comm.all_reduce(x)
    check("all_reduce float32 sum", x, (tri * (1 + np.arange(F32_COUNT) % 1021)).astype(np.float32))

    x = i64_of(r, I64_COUNT)
    comm.all_reduce(x)
    check("all_reduce int64 sum", x, n * 7919 * np.arange(I64_COUNT, dtype=np.int64) + tri * (1 << 40) + 3 * (tri - n))

    x = i32_of(r, I32_COUNT)
    out = np.empty_like(x)
    comm.all_reduce(x, op="max", out=out)
    want = i32_of(0, I32_COUNT)
    for q in range(1, n):
        np.maximum(want, i32_of(q, I32_COUNT), out=want)
    check("all_reduce int32 max (out)", out, want)
    check("all_reduce int32 max: input untouched", x, i32_of(r, I32_COUNT))

    got = comm.all_gather(np.arange(GATHER_COUNT, dtype=np.int32) * 13 + r * 1_000_003)
    want = np.tile(np.arange(GATHER_COUNT, dtype=np.int32) * 13, n) + np.repeat(
        np.arange(n, dtype=np.int32) * 1_000_003, GATHER_COUNT
    )
    check("all_gather int32", got, want)

    part = comm.reduce_scatter(np.arange(n * SCATTER_COUNT, dtype=np.float64) * (r + 1) + r)
    mine = np.arange(r * SCATTER_COUNT, (r + 1) * SCATTER_COUNT, dtype=np.float64)
    check("reduce_scatter float64 sum", part, mine * tri + (tri - n))

    for root in sorted({0, n - 1}):
        payload = np.arange(BCAST_COUNT, dtype=np.float64) * 0.5 + root
        buf = payload.copy() if r == root else np.full(BCAST_COUNT, -1.0)
        comm.broadcast(buf, root=root)
        check(f"broadcast float64 from rank {root}", buf, payload)

    comm.barrier()


def main() -> int:
    fake_host = os.environ.get("LAYOUT_HOST_ID")
    if fake_host:
        rendezvous.host_identity = lambda: fake_host
    try:
        comm = meshccl.init()
        print("LINKS " + json.dumps({str(q): t for q, t in comm.transports.items()}, sort_keys=True), flush=True)
        try:
            run(comm)
        except Wrong as e:
            print(f"WRONG rank {comm.rank} of {comm.size}: {e}", flush=True)
            return 4
        comm.close()
    except meshccl.Error as e:
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        return 3
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
