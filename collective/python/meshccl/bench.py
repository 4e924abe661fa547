"""meshccl-bench: an nccl-tests-style sweep of one collective over a range of sizes.

Run it as every rank of a job (it reads its rank like any meshccl program), or let it start
the ranks itself on this machine with ``--local N``. Columns and bus-bandwidth factors are
nccl-tests' own (size, count, type, redop, root, then time/algbw/busbw/#wrong out of place and
in place); correctness is checked in separate, untimed iterations against values every rank
computes itself, wrong elements are summed over ranks, and any wrong value makes the exit
status non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

import meshccl
from meshccl.bootstrap import one_host_hostfile

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv")
NP_TYPES = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "bfloat16": np.uint16,  # bit patterns, reinterpreted by meshccl
    "int8": np.int8,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def bus_factor(coll: str, n: int) -> float:
    if coll == "all_reduce":
        return 2 * (n - 1) / n
    if coll in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def sizes(args: argparse.Namespace) -> list[int]:
    out, s = [], args.minbytes
    while s <= args.maxbytes:
        out.append(s)
        s = s + args.stepbytes if args.stepbytes else int(s * args.stepfactor)
        if not args.stepbytes and args.stepfactor <= 1:
            break
    return out


def values(rank: int, count: int, offset: int = 0) -> np.ndarray:
    """Small integers: exact in every dtype and in every partial sum of up to 8 ranks."""
    i = np.arange(offset, offset + count, dtype=np.int64)
    return (rank + 1) * (1 + i % 5)


def encode(v: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return v.astype(NP_TYPES[dtype])


def reduce_all(op: str, n: int, count: int, offset: int = 0) -> np.ndarray:
    stack = np.stack([values(r, count, offset) for r in range(n)])
    return {"sum": stack.sum(0), "prod": stack.prod(0), "min": stack.min(0), "max": stack.max(0)}[op]


class Case:
    """One collective at one size: buffers, the timed call, the check."""

    def __init__(self, comm: meshccl.Communicator, coll: str, nbytes: int, dtype: str, op: str, root: int):
        self.comm, self.coll, self.dtype, self.op, self.root = comm, coll, dtype, op, root
        self.n, self.rank = comm.size, comm.rank
        esize = np.dtype(NP_TYPES[dtype]).itemsize
        per_rank = nbytes // esize // (self.n if coll in ("all_gather", "reduce_scatter") else 1)
        self.count = per_rank
        t = NP_TYPES[dtype]
        if coll == "all_reduce":
            self.src, self.dst = np.empty(per_rank, t), np.empty(per_rank, t)
        elif coll == "all_gather":
            self.src, self.dst = np.empty(per_rank, t), np.empty(per_rank * self.n, t)
        elif coll == "reduce_scatter":
            self.src, self.dst = np.empty(per_rank * self.n, t), np.empty(per_rank, t)
        else:
            self.src, self.dst = np.empty(per_rank, t), np.empty(per_rank, t)
        self.size_bytes = max(self.src.nbytes, self.dst.nbytes)
        self.elements = max(self.src.size, self.dst.size)
        self.dt = "bfloat16" if dtype == "bfloat16" else None

    def fill(self, in_place: bool) -> None:
        if self.coll == "all_gather" and in_place:
            self.dst[self.rank * self.count : (self.rank + 1) * self.count] = encode(
                values(self.rank, self.count), self.dtype
            )
        elif self.coll == "broadcast":
            self.src[:] = encode(values(self.rank, self.count), self.dtype)
        else:
            self.src[:] = encode(values(self.rank, self.src.size), self.dtype)

    def run(self, in_place: bool) -> None:
        c, dt = self.comm, self.dt
        if self.coll == "all_reduce":
            c.all_reduce(self.src, op=self.op, out=None if in_place else self.dst, dtype=dt)
        elif self.coll == "all_gather":
            own = self.dst[self.rank * self.count : (self.rank + 1) * self.count] if in_place else self.src
            c.all_gather(own, out=self.dst, dtype=dt)
        elif self.coll == "reduce_scatter":
            out = self.src[self.rank * self.count : (self.rank + 1) * self.count] if in_place else self.dst
            c.reduce_scatter(self.src, out=out, op=self.op, dtype=dt)
        elif self.coll == "broadcast":
            c.broadcast(self.src, root=self.root, dtype=dt)
        else:  # sendrecv: to the right, from the left, even ranks send first
            right, left = (self.rank + 1) % self.n, (self.rank - 1) % self.n
            if self.rank % 2 == 0:
                c.send(self.src, right, dtype=dt)
                c.recv(self.dst, left, dtype=dt)
            else:
                c.recv(self.dst, left, dtype=dt)
                c.send(self.src, right, dtype=dt)

    def wrong(self, in_place: bool) -> int:
        n, r, k = self.n, self.rank, self.count
        if self.coll == "all_reduce":
            got, want = (self.src if in_place else self.dst), reduce_all(self.op, n, k)
        elif self.coll == "all_gather":
            got, want = self.dst, np.concatenate([values(q, k) for q in range(n)])
        elif self.coll == "reduce_scatter":
            got = self.src[r * k : (r + 1) * k] if in_place else self.dst
            want = reduce_all(self.op, n, n * k)[r * k : (r + 1) * k]
        elif self.coll == "broadcast":
            got, want = self.src, values(self.root, k)
        else:
            got, want = self.dst, values((r - 1) % n, k)
        return int(np.count_nonzero(got != encode(want, self.dtype)))


def timed(case: Case, in_place: bool, iters: int, comm: meshccl.Communicator) -> float:
    comm.barrier()
    t0 = time.perf_counter()
    for _iteration in range(iters):
        case.run(in_place)
    elapsed = (time.perf_counter() - t0) / iters
    avg = comm.all_reduce(np.array([elapsed], np.float64))
    return float(avg[0]) / comm.size


def checked(case: Case, in_place: bool, iters: int, comm: meshccl.Communicator) -> int:
    bad = 0
    for _iteration in range(iters):
        case.fill(in_place)
        case.run(in_place)
        bad += case.wrong(in_place)
    return int(comm.all_reduce(np.array([bad], np.int64))[0])


def bench(args: argparse.Namespace) -> int:
    comm = meshccl.init()
    n, rank = comm.size, comm.rank
    out = sys.stdout if rank == 0 else open(os.devnull, "w")  # noqa: SIM115
    coll = args.collective
    print(
        f"# meshccl-bench {coll}: minBytes {args.minbytes} maxBytes {args.maxbytes} "
        + (f"step: {args.stepbytes}(bytes)" if args.stepbytes else f"step: {args.stepfactor}(factor)")
        + f" warmup iters: {args.warmup_iters} iters: {args.iters} check iters: {args.check_iters}",
        file=out,
    )
    print(
        f"# Using devices: {n} ranks ({comm.plan.source}), rank 0 pid {os.getpid()} on {socket.gethostname()}", file=out
    )
    info = comm.info()
    build = info["build"]
    print(
        f"# Transport: {info['transport'] or 'none'}, single copy {'on' if info['single_copy'] else 'off'}"
        f" (build: {build['system']}{', portable' if build['portable'] else ''},"
        f" single copy {'built' if build['single_copy'] else 'not built'})",
        file=out,
    )
    print("#", file=out)
    head = f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>5}"
    half = f" {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
    print(f"# {'':>45} {'out-of-place':^32} {'in-place':^32}", file=out)
    print(head + half + half, file=out)
    print(
        f"# {'(B)':>10} {'(elements)':>12} {'':>21}" + f" {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}" * 2, file=out
    )
    rows: list[dict[str, Any]] = []
    total_wrong = 0
    factor = bus_factor(coll, n)
    cases = [Case(comm, coll, s, args.datatype, args.op, args.root) for s in sizes(args)]
    for case in cases:  # warm-up over all sizes, as nccl-tests does
        case.fill(False)
        for _iteration in range(args.warmup_iters):
            case.run(False)
    for case in cases:
        row: dict[str, Any] = {
            "size": case.size_bytes,
            "count": case.elements,
            "type": args.datatype,
            "redop": args.op if coll in ("all_reduce", "reduce_scatter") else "none",
            "root": args.root if coll == "broadcast" else -1,
        }
        line = f"  {row['size']:>10} {row['count']:>12} {row['type']:>8} {row['redop']:>6} {row['root']:>5}"
        for place, in_place in (("out_of_place", False), ("in_place", True)):
            if coll == "sendrecv" and in_place:
                line += f" {'n/a':>9} {'n/a':>7} {'n/a':>7} {'n/a':>6}"
                continue
            case.fill(in_place)
            t = timed(case, in_place, args.iters, comm)
            wrong = checked(case, in_place, args.check_iters, comm) if args.check_iters else 0
            total_wrong += wrong
            algbw = case.size_bytes / t / 1e9 if t > 0 else 0.0
            busbw = algbw * factor
            row[place] = {"time_us": t * 1e6, "algbw": algbw, "busbw": busbw, "wrong": wrong}
            line += f" {t * 1e6:>9.1f} {algbw:>7.3f} {busbw:>7.3f} {wrong:>6}"
        rows.append(row)
        print(line, file=out, flush=True)
    busbws = [r["out_of_place"]["busbw"] for r in rows]
    avg = sum(busbws) / len(busbws) if busbws else 0.0
    print(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}", file=out)
    print(f"# Avg bus bandwidth    : {avg:.4f}", file=out)
    print("#", file=out, flush=True)
    if args.json and rank == 0:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"collective": coll, "ranks": n, "source": comm.plan.source, "params": vars(args), "rows": rows},
                f,
                indent=2,
            )
    comm.close()
    return 1 if total_wrong else 0


def local(args: argparse.Namespace, argv: list[str]) -> int:
    """Starts args.local ranks on this machine (loopback, every pair linked) running this tool."""
    n = args.local
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    hostfile = one_host_hostfile(n, base)
    rest = [a for i, a in enumerate(argv) if a != "--local" and (i == 0 or argv[i - 1] != "--local")]
    rest = [a for a in rest if not a.startswith("--local=")]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "meshccl.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(hostfile, f)
        # A fresh job token and id for the ranks it starts (never printed): a local run is a
        # job like any other, and a process that merely reaches its ports cannot join it.
        env = {
            **os.environ,
            "MESHCCL_HOSTFILE": path,
            "MESHCCL_TOKEN": secrets.token_hex(32),
            "MESHCCL_JOB_ID": f"meshccl-bench-local-{os.getpid()}-{secrets.token_hex(4)}",
        }
        env.pop("MESHCCL_ALLOW_NO_TOKEN", None)
        procs = [
            subprocess.Popen([sys.executable, "-m", "meshccl.bench", *rest], env={**env, "MESHCCL_RANK": str(r)})
            for r in range(n)
        ]
        codes = [p.wait() for p in procs]
    return max(codes, key=abs) if any(codes) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="meshccl-bench", description=__doc__.split("\n\n", maxsplit=1)[0])
    p.add_argument("collective", nargs="?", default="all_reduce", choices=COLLECTIVES)
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), help="smallest size (K/M/G suffixes)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"), help="largest size")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="multiply the size by this each step")
    p.add_argument("-i", "--stepbytes", type=parse_size, default=0, help="add this many bytes each step instead")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed warm-up iterations")
    p.add_argument("-c", "--check_iters", type=int, default=1, help="checked (untimed) iterations; 0: no check")
    p.add_argument("-o", "--op", default="sum", choices=sorted(meshccl.OPS))
    p.add_argument("-d", "--datatype", default="float32", choices=list(NP_TYPES))
    p.add_argument("-r", "--root", type=int, default=0, help="broadcast root")
    p.add_argument("-J", "--json", help="write the results as JSON to this file (rank 0)")
    p.add_argument("--local", type=int, help="start this many ranks on this machine and run in each")
    args = p.parse_args(argv)
    if args.minbytes <= 0 or args.maxbytes < args.minbytes:
        p.error("need 0 < minbytes <= maxbytes")
    if args.iters < 1:
        p.error("-n must be >= 1")
    if args.local:
        return local(args, argv)
    try:
        return bench(args)
    except meshccl.Error as e:
        print(f"meshccl-bench: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
