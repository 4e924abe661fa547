#!/usr/bin/env python3
"""Collectives while other processes hold the cores: each call's time, and the CPU a waiting rank burns.

Training on CPU runs its collectives while compute threads keep every core busy. How a library
waits then decides both its latency (does the rank it waits for get a core?) and what it takes
from the compute (does a waiting rank spin?). A mean over a short burst hides both, so this
prints the distribution of single calls:

  .venv/bin/python bench/contention.py                      # 4 ranks, 4 KiB, 2 spinning processes
  .venv/bin/python bench/contention.py --busy 0 --late-ms 5 # rank 0 arrives 5 ms late to every call
  .venv/bin/python bench/contention.py --session job        # the job's ranks in a session of their own

For each library (meshccl over shared memory; Open MPI's shared memory through mpi4py, yielding
when idle as mpirun does when oversubscribed) the ranks run --calls all_reduce calls of --bytes
after a warm-up, each call timed alone. Reported: mean, p50/p90/p99/max of a call on rank 0,
the share of calls over 1 ms, and the CPU each waiting rank used per call (thread CPU time; with
--late-ms the ranks other than 0 wait for rank 0 in every call, so that figure is what waiting
costs). Libraries run one after the other with the same spinners; scheduler ticks (4 ms at
HZ=250) show up as steps in the tail. Where the ranks run matters: with autogroup scheduling
(Linux's default on desktops and this machine) each session is one group and groups share the
CPUs equally, so --session job (the job's ranks in a session of their own, as launchers start
them) and --session shared (beside the spinners, as compute threads share a rank's process)
read differently. A measurement, not a test: it exits 0 whatever it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def rank_main() -> int:
    """One rank: warm up, time each call, report to rank 0's stdout as one JSON line."""
    import numpy as np

    lib, calls, nbytes, late = (
        os.environ["CT_LIB"],
        int(os.environ["CT_CALLS"]),
        int(os.environ["CT_BYTES"]),
        float(os.environ["CT_LATE_MS"]) / 1e3,
    )
    x = np.ones(max(1, nbytes // 4), dtype=np.float32)
    if lib == "meshccl":
        import meshccl

        comm = meshccl.init()
        rank, size = comm.rank, comm.size

        def call() -> None:
            comm.all_reduce(x)

        def gather(v: list[float]) -> list[list[float]]:
            out = comm.all_gather(np.array(v, dtype=np.float64))
            return [list(r) for r in np.asarray(out).reshape(size, -1)]

    else:
        from mpi4py import MPI

        c = MPI.COMM_WORLD
        rank, size = c.rank, c.size
        y = np.empty_like(x)

        def call() -> None:
            c.Allreduce(x, y)

        def gather(v: list[float]) -> list[list[float]]:
            return c.allgather(v)

    for _ in range(50):
        call()
    times = []
    cpu0 = time.thread_time()
    for _ in range(calls):
        if late and rank == 0:
            time.sleep(late)
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    cpus = gather([(time.thread_time() - cpu0) / calls])
    if rank == 0:
        print("CT-RESULT " + json.dumps({"times": times, "cpu": [r[0] for r in cpus], "size": size}), flush=True)
    if lib == "meshccl":
        comm.close()
    return 0


@contextmanager
def spinners(n: int) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run_lib(lib: str, args: argparse.Namespace) -> dict[str, Any] | str:
    env = {
        **os.environ,
        "CT_LIB": lib,
        "CT_CALLS": str(args.calls),
        "CT_BYTES": str(args.bytes),
        "CT_LATE_MS": str(args.late_ms),
    }
    me = [sys.executable, os.path.abspath(__file__), "--rank"]
    with tempfile.TemporaryDirectory() as tmp:
        if lib == "meshccl":
            from meshccl.bootstrap import one_host_hostfile

            with socket.socket() as s:  # a free base port; ranks take base..base+n-1
                s.bind(("127.0.0.1", 0))
                base = s.getsockname()[1]
            path = os.path.join(tmp, "meshccl.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(one_host_hostfile(args.ranks, base), f)
            env.update({"MESHCCL_HOSTFILE": path, "MESHCCL_TOKEN": secrets.token_hex(32), "MESHCCL_JOB_ID": "ct"})
            if args.session == "job":  # one process in a new session starts every rank
                spawn = [sys.executable, os.path.abspath(__file__), "--spawn", str(args.ranks)]
                procs = [subprocess.Popen(spawn, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)]
            else:
                procs = [
                    subprocess.Popen(me, env={**env, "MESHCCL_RANK": str(r)}, stdout=subprocess.PIPE, text=True)
                    for r in range(args.ranks)
                ]
        else:
            if not shutil.which("mpirun"):
                return "mpirun is not installed"
            argv = ["mpirun", "-np", str(args.ranks), "--oversubscribe", "--bind-to", "none"]
            argv += ["--mca", "pml", "ob1", "--mca", "btl", "self,vader"]
            if os.geteuid() == 0:
                argv.append("--allow-run-as-root")
            procs = [
                subprocess.Popen(
                    argv + me, env=env, stdout=subprocess.PIPE, text=True, start_new_session=args.session == "job"
                )
            ]
        outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        return f"a rank failed (exit codes {[p.returncode for p in procs]})"
    for line in "".join(outs).splitlines():
        if line.startswith("CT-RESULT "):
            return json.loads(line[len("CT-RESULT ") :])
    return "no result line"


def summary(lib: str, r: dict[str, Any] | str, late: bool) -> str:
    if isinstance(r, str):
        return f"| {lib} | {r} |||||||"
    import numpy as np

    t = np.array(r["times"]) * 1e6
    waiting = r["cpu"][1:] if late else r["cpu"]
    return (
        f"| {lib} | {t.mean():.1f} | {np.percentile(t, 50):.1f} | {np.percentile(t, 90):.1f} | "
        f"{np.percentile(t, 99):.1f} | {t.max():.0f} | {np.mean(t > 1000) * 100:.1f} % | "
        f"{np.mean(waiting) * 1e6:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default="meshccl,mpi-shm", help="comma list from meshccl, mpi-shm (both)")
    p.add_argument("--ranks", type=int, default=4, help="ranks on this machine (4)")
    p.add_argument("--busy", type=int, default=2, help="processes spinning on the CPU meanwhile (2)")
    p.add_argument("--bytes", type=int, default=4096, help="all_reduce size in bytes (4096)")
    p.add_argument("--calls", type=int, default=1500, help="timed calls (1500)")
    p.add_argument("--late-ms", type=float, default=0.0, help="rank 0 sleeps this long before every call (0)")
    p.add_argument(
        "--session",
        choices=("shared", "job"),
        default="shared",
        help="shared: the ranks in this tool's session, beside the spinners (as compute threads share a rank's "
        "process); job: the job's ranks in a session of their own (so, with autogroup scheduling, a group of "
        "their own against the spinners' group), as bench/allreduce.py starts an mpirun job (shared)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds a library's run may take (600)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where contention-<stamp>.json goes (bench/results)")
    args = p.parse_args(argv)
    libs = [x for x in args.libs.split(",") if x]
    bad = [x for x in libs if x not in ("meshccl", "mpi-shm")]
    if bad or args.ranks < 2 or args.calls < 1 or args.busy < 0 or args.late_ms < 0:
        p.error(f"unknown libraries {bad}" if bad else "need --ranks >= 2, --calls >= 1, --busy >= 0, --late-ms >= 0")
    print(
        f"{args.ranks} ranks, all_reduce of {args.bytes} bytes, {args.calls} calls, {args.busy} spinning processes, "
        f"ranks in the {'job' if args.session == 'job' else 'shared'} session"
        + (f", rank 0 {args.late_ms:g} ms late to every call" if args.late_ms else ""),
        flush=True,
    )
    results: dict[str, Any] = {}
    with spinners(args.busy):
        for lib in libs:
            results[lib] = run_lib(lib, args)
    cpu_head = "CPU per call, waiting ranks (µs)" if args.late_ms else "CPU per call, mean of ranks (µs)"
    print(f"\n| library | mean µs | p50 | p90 | p99 | max | calls > 1 ms | {cpu_head} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for lib in libs:
        print(summary(lib, results[lib], bool(args.late_ms)))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"contention-{time.strftime('%Y%m%d-%H%M%S')}.json"
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out.write_text(json.dumps({"params": params, "results": results}) + "\n", encoding="utf-8")
    print(f"\nwrote {out}")
    return 0


def spawn_main(n: int) -> int:
    """--session job: start the n meshccl ranks from this process (the job's session) and wait."""
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--rank"], env={**os.environ, "MESHCCL_RANK": str(r)}
        )
        for r in range(n)
    ]
    codes = [p.wait() for p in procs]
    return max(codes, key=abs) if any(codes) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        sys.exit(rank_main())
    if sys.argv[1:2] == ["--spawn"]:
        sys.exit(spawn_main(int(sys.argv[2])))
    sys.exit(main())
