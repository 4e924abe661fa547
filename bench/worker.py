"""One rank of one library's all-reduce job, driven by bench/allreduce.py.

The rank sets its library up from the environment, connects to the driver's control socket
(a UNIX socket on the shared filesystem, so ranks inside lab namespaces reach it too) and then
does what the driver says, one JSON line at a time:

- ``{"cmd": "run", "bytes": S, "iters": k, "warmup": w, "check": bool}``: w untimed
  all-reduces, a barrier, k timed back-to-back all-reduces of S bytes of float32 (sum), then,
  if asked, one checked all-reduce; replies ``{"elapsed": seconds for the k, "wrong": n}``.
- ``{"cmd": "quit"}``: tears the library down and exits.

Between commands every rank blocks in a read of its control socket, never inside a collective,
so an idle job costs no CPU while another library is measured (an MPI rank waiting in a
collective would busy-poll a core).

Every library runs the same loop; only the four operations below differ. The timed buffer is
zero-filled (sums stay 0.0: no overflow, no denormals), the checked one holds small integers
whose sum every rank computes itself, exactly as meshccl-bench does.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

Buffer = Any


class Library:
    """What a benchmark needs from a library: rank, size, buffers, all-reduce, barrier."""

    name = ""
    rank = 0
    size = 1
    info = ""  # how it runs, for the report (rank 0's is shown)

    def buffer(self, values: np.ndarray) -> Buffer:
        """A library buffer holding `values` (float32)."""
        raise NotImplementedError

    def all_reduce(self, buf: Buffer) -> Buffer:
        """Sum over ranks; returns the buffer holding the result (in place where the API allows)."""
        raise NotImplementedError

    def numpy(self, result: Buffer) -> np.ndarray:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Meshccl(Library):
    name = "meshccl"

    def __init__(self) -> None:
        import meshccl

        self.comm = meshccl.init()
        self.rank, self.size = self.comm.rank, self.comm.size
        transport = getattr(self.comm, "transport", None)  # meshccl builds with shared memory have it
        if transport is not None:
            kinds = sorted({t for p in range(self.size) if p != self.rank and (t := transport(p))})
            self.info = f"rank 0 reaches its peers over: {', '.join(kinds)}"

    def buffer(self, values: np.ndarray) -> Buffer:
        return np.array(values, np.float32)

    def all_reduce(self, buf: Buffer) -> Buffer:
        self.comm.all_reduce(buf)
        return buf

    def numpy(self, result: Buffer) -> np.ndarray:
        return result

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        self.comm.close()


class Gloo(Library):
    """PyTorch's Gloo process group; rendezvous at GLOO_MASTER (host:port), interface from
    GLOO_SOCKET_IFNAME (read by torch itself)."""

    name = "gloo"

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.size = int(os.environ["BENCH_RANK"]), int(os.environ["BENCH_SIZE"])
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{os.environ['GLOO_MASTER']}",
            rank=self.rank,
            world_size=self.size,
            timeout=timedelta(seconds=300),
        )

    def buffer(self, values: np.ndarray) -> Buffer:
        return self.torch.from_numpy(np.array(values, np.float32))

    def all_reduce(self, buf: Buffer) -> Buffer:
        self.dist.all_reduce(buf)
        return buf

    def numpy(self, result: Buffer) -> np.ndarray:
        return result.numpy()

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()


class Mlx(Library):
    """MLX's ring backend from MLX_RANK + MLX_HOSTFILE. all_sum is out of place (MLX arrays are
    immutable) and lazy: every call is evaluated before the next."""

    name = "mlx"

    def __init__(self) -> None:
        import mlx.core as mx

        self.mx = mx
        self.group = mx.distributed.init(backend="ring", strict=True)
        self.rank, self.size = self.group.rank(), self.group.size()
        self.token = mx.zeros(1, dtype=mx.float32)

    def buffer(self, values: np.ndarray) -> Buffer:
        x = self.mx.array(np.asarray(values, np.float32))
        self.mx.eval(x)
        return x

    def all_reduce(self, buf: Buffer) -> Buffer:
        y = self.mx.distributed.all_sum(buf, group=self.group)
        self.mx.eval(y)
        return y

    def numpy(self, result: Buffer) -> np.ndarray:
        return np.asarray(result)

    def barrier(self) -> None:  # MLX has no barrier: a one-element all_sum does the same
        self.mx.eval(self.mx.distributed.all_sum(self.token, group=self.group))


class Mpi(Library):
    """Open MPI through mpi4py (transport chosen by mpirun's --mca btl)."""

    name = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def buffer(self, values: np.ndarray) -> Buffer:
        return np.array(values, np.float32)

    def all_reduce(self, buf: Buffer) -> Buffer:
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return buf

    def numpy(self, result: Buffer) -> np.ndarray:
        return result

    def barrier(self) -> None:
        self.comm.Barrier()


LIBRARIES: dict[str, Callable[[], Library]] = {"meshccl": Meshccl, "gloo": Gloo, "mlx": Mlx, "mpi": Mpi}


def check_values(rank: int, count: int) -> np.ndarray:
    """Small integers: exact in float32 and in every partial sum."""
    return ((rank + 1) * (1 + np.arange(count, dtype=np.int64) % 5)).astype(np.float32)


def run(lib: Library, nbytes: int, iters: int, warmup: int, check: bool, cache: dict[int, Buffer]) -> dict[str, Any]:
    count = max(1, nbytes // 4)
    if count not in cache:
        cache.clear()  # one size at a time: memory stays one buffer per rank
        cache[count] = lib.buffer(np.zeros(count, np.float32))
    buf = cache[count]
    for _ in range(warmup):
        lib.all_reduce(buf)
    lib.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        lib.all_reduce(buf)
    elapsed = time.perf_counter() - t0
    wrong = None
    if check:
        n = lib.size
        want = (n * (n + 1) // 2) * (1 + np.arange(count, dtype=np.int64) % 5)
        got = lib.numpy(lib.all_reduce(lib.buffer(check_values(lib.rank, count))))
        wrong = int(np.count_nonzero(got != want.astype(np.float32)))
    return {"elapsed": elapsed, "wrong": wrong}


def serve(lib: Library, ctl: str, job: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(ctl)
    f = sock.makefile("rw", encoding="utf-8")
    hello = {"job": job, "rank": lib.rank, "size": lib.size, "pid": os.getpid(), "info": lib.info}
    f.write(json.dumps(hello) + "\n")
    f.flush()
    cache: dict[int, Buffer] = {}
    for line in f:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        reply = run(lib, msg["bytes"], msg["iters"], msg["warmup"], msg["check"], cache)
        f.write(json.dumps(reply) + "\n")
        f.flush()
    cache.clear()
    lib.close()
    sock.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", required=True, choices=sorted(LIBRARIES))
    p.add_argument("--ctl", required=True, help="the driver's control socket")
    p.add_argument("--job", required=True, help="job id to present to the driver")
    args = p.parse_args()
    try:
        lib = LIBRARIES[args.lib]()
    except Exception as e:  # reported by the driver from this process's stderr
        print(f"worker {args.lib}: cannot set up: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 3
    serve(lib, args.ctl, args.job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
