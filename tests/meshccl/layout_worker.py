"""One rank of a layout test job (tests/meshccl/test_layouts.py). Usage: layout_worker.py;
reads its rank and job from the environment like any meshccl program.

Runs large calls whose sizes are multiples of no segment size (nor of the ring's chunking), each
checked element by element on this rank: all_reduce of float32 and of int64 (sum, in place) and
of int32 (max, into another buffer), all_gather, reduce_scatter and broadcast (from the first
and the last rank).

Prints "LINKS {json}" (peer -> transport, as meshccl chose it) and "OK" on success; on a meshccl
error "ERROR <ExceptionType>: <message>" and exit 3; on a wrong result "WRONG <what>" and exit 4.

LAYOUT_HOST_ID, when set, stands in for this machine's host identity in torchrun's rendezvous
(meshccl.bootstrap.host_identity), so that ranks on this one machine can play ranks of several
hosts: those with equal ids share memory, the others talk TCP.
"""

from __future__ import annotations

import json
import os
import sys

import meshccl
import numpy as np
from meshccl import bootstrap

# Element counts: primes well away from any power of two, so that no call divides evenly into
# 64 KiB or 256 KiB segments, nor into equal per-rank chunks.
F32_COUNT = 1_048_573  # 4 MiB - 12 B
I64_COUNT = 655_357  # 5 MiB - 24 B
I32_COUNT = 786_431  # 3 MiB - 4 B
GATHER_COUNT = 262_139  # per rank, int32
SCATTER_COUNT = 196_597  # per rank, float64
BCAST_COUNT = 917_503  # float64, 7 MiB - 8 B


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
    i = np.arange(count, dtype=np.int64)
    return i * 7919 + (rank + 1) * (1 << 40) + rank * 3


def i32_of(rank: int, count: int) -> np.ndarray:
    return ((np.arange(count, dtype=np.int64) * 31 + rank * 977) % 100_003).astype(np.int32)


def run(comm: meshccl.Communicator) -> None:
    n, r = comm.size, comm.rank
    ranks = range(n)

    count = F32_COUNT
    x = f32_of(r, count)
    comm.all_reduce(x)
    check("all_reduce float32 sum", x, sum(f32_of(q, count).astype(np.int64) for q in ranks).astype(np.float32))

    count = I64_COUNT
    x = i64_of(r, count)
    comm.all_reduce(x)
    check("all_reduce int64 sum", x, sum(i64_of(q, count) for q in ranks))

    count = I32_COUNT
    x = i32_of(r, count)
    out = np.empty_like(x)
    comm.all_reduce(x, op="max", out=out)
    check("all_reduce int32 max (out)", out, np.max(np.stack([i32_of(q, count) for q in ranks]), axis=0))
    check("all_reduce int32 max: input untouched", x, i32_of(r, count))

    count = GATHER_COUNT
    blocks = [(np.arange(count, dtype=np.int32) * 13 + q * 1_000_003) for q in ranks]
    got = comm.all_gather(blocks[r])
    check("all_gather int32", got, np.concatenate(blocks))

    count = SCATTER_COUNT
    full = [np.arange(n * count, dtype=np.float64) * (q + 1) + q for q in ranks]
    part = comm.reduce_scatter(full[r])
    check("reduce_scatter float64 sum", part, sum(full)[r * count : (r + 1) * count])

    count = BCAST_COUNT
    for root in sorted({0, n - 1}):
        payload = np.arange(count, dtype=np.float64) * 0.5 + root
        buf = payload.copy() if r == root else np.full(count, -1.0)
        comm.broadcast(buf, root=root)
        check(f"broadcast float64 from rank {root}", buf, payload)

    comm.barrier()


def main() -> int:
    fake_host = os.environ.get("LAYOUT_HOST_ID")
    if fake_host:
        bootstrap.host_identity = lambda: fake_host
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
