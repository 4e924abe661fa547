#!/usr/bin/env python3
"""Side-by-side float32 sum all-reduce: meshccl, PyTorch Gloo, MLX ring and Open MPI.

Two modes:

- ``loopback`` (default): every library at each rank count (2 and 4) on this machine, and the
  loopback TCP ceiling (iperf3, one way and both ways at once) in the same run.
- ``lab``: meshkit's rate-limited lab (network namespaces, veth cables limited by tc tbf) as a
  ring or a full mesh; every link is checked with iperf3 at once first, busbw is reported as a
  multiple of the link rate. The lab is removed at the end, whatever happens.

Libraries run interleaved: every library is started once per rank count and stays connected;
then, round after round, each size is run by each library in turn (the order rotated every
round), so machine noise hits all of them alike. Figures are medians over rounds. See
bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import netcheck
from jobs import Control, Job, JobError, Launch, Proc, worker_argv
from lab import Lab, LabError, parse_rate
from report import Results, markdown, plot, size_label

LOOPBACK_LIBS = ("meshccl", "meshccl-tcp", "gloo", "mlx", "mpi-shm", "mpi-tcp")
LAB_LIBS = ("meshccl", "gloo", "mlx")
BENCH_DIR = Path(__file__).resolve().parent


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size like 4K, 64M or 4096") from None


def size_list(lo: int, hi: int, factor: float) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        if factor <= 1:
            break
        s = int(s * factor)
    return out


def free_ports(count: int) -> int:
    """A base port with base..base+count-1 free on loopback now, drawn below the kernel's
    ephemeral range so no connection's source port can take one before its rank binds it."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    draw = random.SystemRandom()
    for _ in range(500):
        base = draw.randrange(15000, max(ephemeral - count, 15001))
        try:
            for p in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no block of free ports on loopback")


def job_id(lib: str, n: int) -> str:
    """Unique per start, so a stray rank of an earlier job can never join a later one."""
    return f"{lib}-{n}-{secrets.token_hex(4)}"


def write_json(path: Path, data: Any) -> str:
    path.write_text(json.dumps(data, indent=1))
    return str(path)


# --- how each library is started ------------------------------------------------------------


def meshccl_tcp_hostfile(n: int, port: int) -> dict[str, Any]:
    """Every rank its own "host", every pair cabled over its own loopback addresses: TCP only.

    Rank a listens for rank b on 127.64.a.(b+1) (127/8 is all loopback on Linux).
    """
    hosts = [f"h{r}" for r in range(n)]
    ranks = []
    for a in range(n):
        links = [
            {
                "cable": f"h{min(a, b)}:lo{max(a, b)} <-> h{max(a, b)}:lo{min(a, b)}",
                "port": f"lo{b}",
                "address": f"127.64.{a}.{b + 1}",
                "peer_host": f"h{b}",
                "peer_address": f"127.64.{b}.{a + 1}",
                "network": f"127.64.{a}.{b + 1}/32",
                "ring": None,
            }
            for b in range(n)
            if b != a
        ]
        ranks.append({"rank": a, "host": hosts[a], "node_rank": a, "local_rank": 0, "port": port + a, "links": links})
    return {
        "format": "meshccl-hostfile",
        "version": 1,
        "world_size": n,
        "ranks_per_host": 1,
        "ring": hosts,
        "mesh": True,
        "hosts": {h: {"management": "127.0.0.1", "ranks": [r]} for r, h in enumerate(hosts)},
        "ranks": ranks,
    }


def mpi_missing() -> str:
    if not shutil.which("mpirun"):
        return "mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)"
    return ""


def mpirun_argv(n: int, btl: list[str], ctl: str, job: str) -> list[str]:
    argv = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", "--mca", "pml", "ob1"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    return argv + btl + worker_argv("mpi", ctl, job)


def loopback_launch(lib: str, n: int, ctl: str, job: str, tmp: Path) -> Launch:
    token = secrets.token_hex(16)
    if lib in ("meshccl", "meshccl-tcp"):
        from meshccl.bootstrap import one_host_hostfile  # here: a missing meshccl fails this library only

        port = free_ports(n)
        data = one_host_hostfile(n, port) if lib == "meshccl" else meshccl_tcp_hostfile(n, port)
        path = write_json(tmp / f"{job}.meshccl.json", data)
        env = {"MESHCCL_HOSTFILE": path, "MESHCCL_TOKEN": token}
        procs = [Proc(worker_argv("meshccl", ctl, job), {**env, "MESHCCL_RANK": str(r)}) for r in range(n)]
        note = (
            "ranks of one host (hostfile: one host, no cables): meshccl's same-host transport"
            if lib == "meshccl"
            else "every rank its own host, every pair cabled over its own 127.64.x.y addresses: TCP"
        )
        return Launch(lib, n, job, procs, note)
    if lib == "gloo":
        env = {"GLOO_MASTER": f"127.0.0.1:{free_ports(1)}", "GLOO_SOCKET_IFNAME": "lo", "BENCH_SIZE": str(n)}
        procs = [Proc(worker_argv("gloo", ctl, job), {**env, "BENCH_RANK": str(r)}) for r in range(n)]
        return Launch(lib, n, job, procs, "torch.distributed Gloo, GLOO_SOCKET_IFNAME=lo")
    if lib == "mlx":
        port = free_ports(n)
        path = write_json(tmp / f"{job}.mlx.json", [[f"127.0.0.1:{port + r}"] for r in range(n)])
        procs = [Proc(worker_argv("mlx", ctl, job), {"MLX_HOSTFILE": path, "MLX_RANK": str(r)}) for r in range(n)]
        return Launch(lib, n, job, procs, "mx.distributed ring backend, MLX_HOSTFILE on 127.0.0.1")
    if lib == "mpi-shm":
        btl = ["--mca", "btl", "self,vader"]
        note = "mpi4py, mpirun --mca pml ob1 --mca btl self,vader"
        return Launch(lib, n, job, [Proc(mpirun_argv(n, btl, ctl, job))], note, mpi_missing())
    if lib == "mpi-tcp":
        btl = ["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"]
        note = "mpi4py, mpirun --mca pml ob1 --mca btl self,tcp on lo"
        return Launch(lib, n, job, [Proc(mpirun_argv(n, btl, ctl, job))], note, mpi_missing())
    raise ValueError(lib)


def lab_launch(lib: str, lab: Lab, ctl: str, job: str) -> Launch:
    ranks = lab.ranks()
    n = len(ranks)
    if lib == "meshccl":
        env = {"MESHCCL_HOSTFILE": str(lab.hostfiles / "meshccl.json"), "MESHCCL_TOKEN": secrets.token_hex(16)}
        procs = [
            Proc(worker_argv("meshccl", ctl, job, lab.prefix(r["host"])), {**env, "MESHCCL_RANK": str(r["rank"])})
            for r in ranks
        ]
        return Launch(lib, n, job, procs, "meshkit's meshccl.json from setup.yml (every cable of every host)")
    if lib == "gloo":
        first = {r["rank"]: r["links"][0] for r in ranks}
        env = {"GLOO_MASTER": f"{first[0]['address']}:29700", "BENCH_SIZE": str(n)}
        procs = [
            Proc(
                worker_argv("gloo", ctl, job, lab.prefix(r["host"])),
                {**env, "BENCH_RANK": str(r["rank"]), "GLOO_SOCKET_IFNAME": first[r["rank"]]["port"]},
            )
            for r in ranks
        ]
        return Launch(lib, n, job, procs, "")
    if lib == "mlx":
        hosts = lab.mlx_rank_hosts()
        path = str(lab.hostfiles / "mlx-ring.json")
        procs = [
            Proc(worker_argv("mlx", ctl, job, lab.prefix(h)), {"MLX_HOSTFILE": path, "MLX_RANK": str(r)})
            for r, h in enumerate(hosts)
        ]
        return Launch(lib, n, job, procs, "meshkit's mlx-ring.json from setup.yml (ring backend)")
    raise ValueError(lib)


# --- the interleaved measurement ----------------------------------------------------------------


def measure(
    res: Results,
    jobs: list[Job],
    n: int,
    args: argparse.Namespace,
    between_rounds: Callable[[int], None] | None = None,
) -> None:
    """Rounds, then sizes, then libraries (rotated each round); records per-iteration times."""
    iters: dict[tuple[str, int], int] = {}
    for rnd in range(args.rounds):
        if between_rounds:
            between_rounds(rnd)
        shift = rnd % max(1, len(jobs))
        order = jobs[shift:] + jobs[:shift]
        for size in res.sizes:
            for job in order:
                if job.error:
                    continue
                where = f"[{n} ranks, round {rnd + 1}/{args.rounds}] {job.label:<11} {size_label(size):>5}"
                print(f"{where} ...", end="", file=sys.stderr, flush=True)
                cell = res.cell(job.label, n, size)
                try:
                    if (job.label, size) not in iters:
                        # First time at this size: warm up, time one call, check the result once.
                        probe = job.command(
                            {"cmd": "run", "bytes": size, "iters": 1, "warmup": args.warmup, "check": True},
                            args.timeout,
                        )
                        t1 = max(r["elapsed"] for r in probe)
                        wrong = sum(r["wrong"] or 0 for r in probe)
                        cell.wrong = wrong
                        if wrong:
                            say(f" {wrong} WRONG values summed over ranks")
                            print(f"{where} ...", end="", file=sys.stderr, flush=True)
                        iters[(job.label, size)] = max(1, min(args.iters, math.ceil(args.budget / max(t1, 1e-9))))
                        warm = 0
                    else:
                        warm = 1  # re-touch the buffer after the other sizes ran
                    k = iters[(job.label, size)]
                    replies = job.command(
                        {"cmd": "run", "bytes": size, "iters": k, "warmup": warm, "check": False}, args.timeout
                    )
                except JobError as e:
                    job.error = str(e)
                    res.status[(job.label, n)] = f"stopped at {size_label(size)}, round {rnd + 1}: {e}"
                    say(f" FAILED: {e}")
                    job.stop(grace=2)
                    continue
                t = sum(r["elapsed"] for r in replies) / len(replies) / k
                cell.iters = k
                cell.times.append(t)
                busbw = size / t / 1e9 * 2 * (n - 1) / n
                say(f" {t * 1e6:10.1f} us  busbw {busbw:7.3f} GB/s  (k={k})")


def start_jobs(launches: list[Launch], ctl: Control, logdir: Path, res: Results, timeout: float) -> list[Job]:
    jobs = []
    for launch in launches:
        job = Job(launch, logdir / f"{launch.label}-{launch.ranks}.log")
        say(f"starting {launch.label} with {launch.ranks} ranks ...")
        try:
            job.start(ctl, timeout)
        except JobError as e:
            job.error = str(e)
            res.status[(launch.label, launch.ranks)] = f"not run: {e}"
            say(f"  {launch.label}: NOT RUN: {e}")
            job.stop(grace=2)
            continue
        note = launch.note or res.notes.get(launch.label, "")
        if job.info:
            note += f" ({job.info})"
        if note:
            res.notes[launch.label] = note
        jobs.append(job)
    return jobs


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM/SIGHUP raise KeyboardInterrupt, so every cleanup below runs for them too."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def machine_note() -> str:
    load = os.getloadavg()
    return f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start"


def finish(res: Results, out: Path, name: str, started: float) -> None:
    res.params["duration_s"] = round(time.monotonic() - started, 1)
    load = os.getloadavg()
    res.params["machine_note"] = (
        f"{res.params.get('machine_note', '')}, {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end"
    )
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(res)
    (out / f"{name}.md").write_text(text)
    write_json(out / f"{name}.json", res.to_json())
    why = plot(res, out / f"{name}.png")
    print(text)
    say(f"wrote {out / (name + '.md')}, {out / (name + '.json')}" + ("" if why else f", {out / (name + '.png')}"))
    if why:
        say(f"no plot: {why}")
    say(f"took {res.params['duration_s']:.0f} s")


# --- modes ----------------------------------------------------------------------------------------


@contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """n processes that spin on the CPU (as training's compute threads do) until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    if spinners:
        say(f"{n} spinning processes hold the cores: pids {' '.join(str(s.pid) for s in spinners)}")
    try:
        yield
    finally:
        for s in spinners:
            s.kill()
            s.wait()


def run_loopback(args: argparse.Namespace) -> int:
    started = time.monotonic()
    res = Results("loopback", args.sizes, args.ranks, args.libs, params=common_params(args))
    res.params["machine_note"] = machine_note()
    res.params["busy"] = args.busy
    tmp = Path(tempfile.mkdtemp(prefix="mkbench-"))
    logdir = args.out / "logs" / "loopback"
    logdir.mkdir(parents=True, exist_ok=True)
    ctl = Control(tmp / "ctl.sock")
    jobs: list[Job] = []
    no_iperf = netcheck.available()
    if no_iperf:
        res.ceiling_error = no_iperf
        say(f"loopback ceiling: not measured: {no_iperf}")

    def ceiling(rnd: int) -> None:
        if no_iperf or res.ceiling_error:
            return
        say(f"[round {rnd + 1}] loopback TCP ceiling (iperf3, {args.iperf_time:g} s one way, then both ways) ...")
        try:
            c = netcheck.loopback_ceiling(args.iperf_time)
        except netcheck.IperfError as e:
            res.ceiling_error = str(e)
            say(f"  iperf3 failed: {e}")
            return
        res.ceiling.append(c)
        say(
            f"  one way {c['oneway'] / 1e9:.2f} GB/s; both ways {c['bidir_forward'] / 1e9:.2f} + "
            f"{c['bidir_reverse'] / 1e9:.2f} GB/s"
        )

    try:
        with terminate_as_interrupt():
            for n in args.ranks:
                launches = [loopback_launch(lib, n, ctl.path, job_id(lib, n), tmp) for lib in args.libs]
                jobs = start_jobs(launches, ctl, logdir, res, args.start_timeout)
                measure(res, jobs, n, args, ceiling)
                for job in jobs:
                    job.stop()
                jobs = []
    except KeyboardInterrupt:
        say("interrupted: stopping the jobs; the results so far are written")
        res.params["interrupted"] = True
    finally:
        for job in jobs:
            job.stop(grace=2)
        ctl.close()
        shutil.rmtree(tmp, ignore_errors=True)
    finish(res, args.out, f"loopback-busy{args.busy}" if args.busy else "loopback", started)
    return 130 if res.params.get("interrupted") else (1 if any(c.wrong for c in res.cells.values()) else 0)


def run_lab(args: argparse.Namespace) -> int:
    started = time.monotonic()
    rate_bits = parse_rate(args.rate)
    res = Results("lab", args.sizes, [args.size], args.libs, params=common_params(args))
    res.shape, res.link_rate = args.shape, rate_bits / 8
    res.params.update({"rate": args.rate, "shape": args.shape, "lab_name": args.lab_name, "subnet": args.subnet})
    res.params["machine_note"] = machine_note()
    missing = [t for t in ("ip", "tc", "iperf3") if not shutil.which(t)]
    if os.geteuid() != 0 or missing:
        say("the lab needs root" + (f" and {', '.join(missing)}" if missing else "") + " (network namespaces, tc)")
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="mkbench-"))
    logdir = args.out / "logs" / f"lab-{args.shape}"
    logdir.mkdir(parents=True, exist_ok=True)
    lab = Lab(args.lab_name, args.shape, args.size, args.rate, args.subnet, logdir / "lab.log", tmp / "artifacts")
    lab.log.write_text("")
    ctl = Control(tmp / "ctl.sock")
    jobs: list[Job] = []
    rc = 0
    try:
        with terminate_as_interrupt():
            say(f"building lab {args.lab_name}: {args.size}-host {args.shape}, links {args.rate} (log {lab.log}) ...")
            t0 = time.monotonic()
            lab.up()
            say(f"  lab built and converged by setup.yml in {time.monotonic() - t0:.0f} s")
            check_links(lab, res, args)
            if "gloo" in args.libs:
                how = lab.add_gloo_routes()
                res.notes["gloo"] = (
                    "torch.distributed Gloo, GLOO_SOCKET_IFNAME = each rank's first cable port; Gloo needs every "
                    f"rank to reach every other: {how}"
                )
                say(f"  gloo: {how}")
            launches = [lab_launch(lib, lab, ctl.path, job_id(lib, args.size)) for lib in args.libs]
            jobs = start_jobs(launches, ctl, logdir, res, args.start_timeout)
            measure(res, jobs, args.size, args)
    except KeyboardInterrupt:
        say("interrupted: removing the lab; the results so far are written")
        res.params["interrupted"] = True
        rc = 130
    except (LabError, netcheck.IperfError, OSError, subprocess.SubprocessError) as e:
        say(f"lab run failed: {e}")
        res.params["error"] = str(e)
        rc = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the clean-up (and the lab's removal) is never cut short
        for job in jobs:
            job.stop(grace=2)
        ctl.close()
        if lab.built:
            say(f"removing lab {args.lab_name} ...")
            try:
                lab.down()
            except LabError as e:
                say(
                    f"REMOVING THE LAB FAILED: {e}\n  remove it with: ansible-playbook playbooks/lab.yml "
                    f"-e lab_name={args.lab_name} -e lab_mgmt_subnet={args.subnet} -e lab_state=absent"
                )
                rc = rc or 1
        shutil.rmtree(tmp, ignore_errors=True)
    finish(res, args.out, f"lab-{args.shape}", started)
    if not rc and any(c.wrong for c in res.cells.values()):
        rc = 1
    return rc


def check_links(lab: Lab, res: Results, args: argparse.Namespace) -> None:
    """iperf3 on every link, both directions, all at once; prints each against the limit."""
    flows = []
    for i, link in enumerate(lab.links()):
        flows.append(
            netcheck.Flow(
                f"{link.host}:{link.port} -> {link.peer_end}",
                link.peer_address,
                5300 + i,
                lab.prefix(link.peer_host),
                link.address,
                lab.prefix(link.host),
            )
        )
    say(f"checking {len(flows)} link directions at once with iperf3 ({args.iperf_time:g} s) ...")
    netcheck.run_flows(flows, args.iperf_time)
    slow = 0
    for f in flows:
        frac = f.rate / res.link_rate
        slow += frac < 0.9
        res.links.append({"link": f.name, "rate": f.rate})
        say(
            f"  {f.name:<24} {f.rate * 8 / 1e9:6.3f} Gbit/s  {frac:5.0%} of {args.rate}"
            + ("  SLOW" if frac < 0.9 else "")
        )
    if slow:
        say(
            f"  WARNING: {slow} link direction(s) below 90 % of {args.rate} with every link busy: the CPU, not the "
            "cables, may limit the collectives; try a lower --rate"
        )


def common_params(args: argparse.Namespace) -> dict[str, Any]:
    keep = ("rounds", "iters", "warmup", "budget", "timeout", "libs", "minbytes", "maxbytes", "stepfactor")
    return {k: getattr(args, k) for k in keep}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/allreduce.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    sub = p.add_subparsers(dest="mode")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"), help="smallest size (4K)")
    common.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help="largest size (64M)")
    common.add_argument("-f", "--stepfactor", type=float, default=4, help="size factor between steps (4)")
    common.add_argument(
        "-n", "--iters", type=int, help="most timed iterations per size and round (loopback 50, lab 1000)"
    )
    common.add_argument("-w", "--warmup", type=int, default=5, help="warm-up iterations before a size's first run (5)")
    common.add_argument("-r", "--rounds", type=int, default=5, help="rounds; figures are medians over them (5)")
    common.add_argument(
        "--budget",
        type=float,
        help="seconds of timed calls per size and round, fewer iterations where calls are slow (loopback 0.5, lab 1; "
        "in the lab long enough that the token bucket's burst does not count)",
    )
    common.add_argument("--timeout", type=float, default=120, help="seconds a command may take before a job fails")
    common.add_argument("--start-timeout", type=float, default=90, help="seconds for a job's ranks to start")
    common.add_argument("--iperf-time", type=float, default=2, help="seconds per iperf3 measurement (2)")
    common.add_argument("--out", type=Path, default=BENCH_DIR / "results", help="output directory (bench/results)")
    lp = sub.add_parser("loopback", parents=[common], help="every library on this machine (default)")
    lp.add_argument("--libs", default=",".join(LOOPBACK_LIBS), help=f"comma list from {','.join(LOOPBACK_LIBS)}")
    lp.add_argument("--ranks", default="2,4", help="comma list of rank counts (2,4)")
    lp.add_argument(
        "--busy",
        type=int,
        default=0,
        help="processes spinning on the CPU for the whole run (0): collectives while training's compute threads hold "
        "the cores; results go to loopback-busy<N>.*",
    )
    lb = sub.add_parser("lab", parents=[common], help="meshkit's rate-limited lab (root)")
    lb.add_argument("--shape", choices=("ring", "mesh"), default="ring")
    lb.add_argument("--size", type=int, default=4, help="hosts, one rank each (4)")
    lb.add_argument("--rate", default="1gbit", help="tc rate of every cable end (1gbit)")
    lb.add_argument("--libs", default=",".join(LAB_LIBS), help=f"comma list from {','.join(LAB_LIBS)}")
    lb.add_argument("--lab-name", default="mkbench", help="lab name: namespaces <name>-node<i> (mkbench)")
    lb.add_argument("--subnet", default="198.19.200.0/24", help="lab management subnet (198.19.200.0/24)")
    args = p.parse_args(["loopback", *(argv if argv is not None else sys.argv[1:])] if _no_mode(argv) else argv)
    allowed = LOOPBACK_LIBS if args.mode == "loopback" else LAB_LIBS
    defaults = {"iters": 50, "budget": 0.5} if args.mode == "loopback" else {"iters": 1000, "budget": 1.0}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.libs = [x for x in args.libs.split(",") if x]
    bad = [x for x in args.libs if x not in allowed]
    if bad:
        p.error(f"unknown or unsupported in {args.mode} mode: {', '.join(bad)} (choose from {', '.join(allowed)})")
    if args.minbytes < 4 or args.maxbytes < args.minbytes:
        p.error("need 4 <= -b <= -e")
    if args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.budget <= 0:
        p.error("-n and -r must be >= 1, -w >= 0, --budget > 0")
    args.sizes = size_list(args.minbytes, args.maxbytes, args.stepfactor)
    args.out = args.out.resolve()
    if args.mode == "loopback":
        try:
            args.ranks = [int(x) for x in args.ranks.split(",") if x]
        except ValueError:
            p.error("--ranks takes a comma list of numbers")
        if not args.ranks or min(args.ranks) < 2:
            p.error("--ranks: every rank count must be >= 2")
        if args.busy < 0:
            p.error("--busy must be >= 0")
        with busy_cores(args.busy):
            return run_loopback(args)
    if args.size < 2:
        p.error("--size must be >= 2")
    try:
        parse_rate(args.rate)
    except ValueError as e:
        p.error(str(e))
    return run_lab(args)


def _no_mode(argv: list[str] | None) -> bool:
    args = sys.argv[1:] if argv is None else argv
    return not args or args[0] not in ("loopback", "lab", "-h", "--help")


if __name__ == "__main__":
    sys.exit(main())
