#!/usr/bin/env python3
"""DDP training side by side: PyTorch DistributedDataParallel on CPU over Gloo and over meshccl.

The same model (an MLP of about 17 M float32 parameters by default), the same synthetic data and
the same seed train in two jobs that differ in one word, ``init_process_group("gloo")`` against
``init_process_group("meshccl")``. Both jobs are started once and stay connected; round after
round each job trains a few steps in turn (the order rotated every round), then each runs the
same steps without all-reduce (compute alone), then each all-reduces the same gradient buckets
outside DDP, so load changes on the machine hit both alike. Figures are medians over rounds.

Two modes:

- ``lab --shape mesh|ring``: meshkit's rate-limited lab (4 hosts, one rank each, cables limited
  by tc tbf), built, converged by setup.yml, checked with iperf3 and removed at the end whatever
  happens (bench/lab.py);
- ``loopback``: every rank on this machine (Gloo over 127.0.0.1; meshccl's same-host transport,
  and meshccl over TCP between loopback addresses); also says whether this torch's Gloo has the
  shared-memory all-reduce for ranks of one host.

Output: bench/results/ddp-<mode>[-<shape>].{md,json,png}. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import netcheck
from allreduce import free_ports, job_id, machine_note, meshccl_tcp_hostfile, terminate_as_interrupt, write_json
from jobs import Control, Job, JobError, Launch, Proc
from lab import Lab, LabError, parse_rate

BENCH_DIR = Path(__file__).resolve().parent
WORKER = BENCH_DIR / "ddp_worker.py"
LOOPBACK_LIBS = ("gloo", "meshccl", "meshccl-tcp")
LAB_LIBS = ("gloo", "meshccl")
BACKEND = {"gloo": "gloo", "meshccl": "meshccl", "meshccl-tcp": "meshccl"}
# The targets: meshccl's gradient all-reduce at least this many times faster than Gloo's.
TARGETS = {"mesh": 2.0, "ring": 1.5}
# What gloo/allreduce_shm.cc (pytorch/gloo PR #458) names its buffers; absent from a build without it.
GLOO_SHM_MARK = b"shm_allreduce_buffer"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- results ---------------------------------------------------------------------------------

# Per round and library, seconds unless named otherwise; every figure is a mean over ranks.
METRICS = {
    "step": "step time",
    "fb": "forward + backward (DDP waits for the last bucket)",
    "opt": "optimizer step",
    "ar_busy": "gradient all-reduce in DDP: time any bucket is in flight",
    "ar_span": "gradient all-reduce in DDP: first bucket issued to last done",
    "compute": "forward + backward alone (no_sync: no all-reduce)",
    "exposed": "all-reduce not hidden by compute: forward + backward - alone",
    "alone": "the same buckets all-reduced outside DDP, one after another",
}


@dataclass
class Run:
    mode: str  # loopback | lab
    ranks: int
    libs: list[str]
    model: dict[str, Any]
    params: dict[str, Any]
    shape: str = ""
    link_rate: float = 0.0  # lab: bytes/s of one cable, one direction
    notes: dict[str, str] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    links: list[dict[str, Any]] = field(default_factory=list)
    rounds: list[dict[str, dict[str, Any]]] = field(default_factory=list)  # [round][lib] -> figures
    buckets: list[int] = field(default_factory=list)  # elements per DDP bucket, in DDP's order
    check: dict[str, Any] = field(default_factory=dict)  # parameters after training, compared
    gloo_shm: str = ""  # whether this torch's Gloo has the shared-memory all-reduce

    def series(self, lib: str, metric: str) -> list[float]:
        return [r[lib][metric] for r in self.rounds if lib in r and metric in r[lib]]

    def median(self, lib: str, metric: str) -> float | None:
        s = self.series(lib, metric)
        return statistics.median(s) if s else None

    def libs_run(self) -> list[str]:
        return [lib for lib in self.libs if self.series(lib, "step")]

    def grad_bytes(self) -> int:
        return 4 * sum(self.buckets)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "shape": self.shape,
            "ranks": self.ranks,
            "libraries": self.libs,
            "model": self.model,
            "params": self.params,
            "link_rate_bytes_per_s": self.link_rate,
            "links": self.links,
            "notes": self.notes,
            "status": self.status,
            "gloo_shm": self.gloo_shm,
            "bucket_numel": self.buckets,
            "metrics": METRICS,
            "rounds": self.rounds,
            "medians": {lib: {m: self.median(lib, m) for m in (*METRICS, "loss")} for lib in self.libs_run()},
            "parameter_check": self.check,
        }


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def per_rank_mean(replies: list[dict[str, Any]], key: str) -> float:
    """Mean over ranks of each rank's mean over its steps."""
    return mean([mean(r[key]) for r in replies])


# --- how each library's ranks are started ------------------------------------------------------


def worker_argv(backend: str, ctl: str, job: str, prefix: list[str] | None = None) -> list[str]:
    return [*(prefix or []), sys.executable, str(WORKER), "--backend", backend, "--ctl", ctl, "--job", job]


def model_env(args: argparse.Namespace, rank: int, size: int, store: str) -> dict[str, str]:
    return {
        "BENCH_RANK": str(rank),
        "BENCH_SIZE": str(size),
        "BENCH_STORE": store,
        "BENCH_MODEL": json.dumps(args.model),
    }


def loopback_launch(lib: str, n: int, ctl: str, job: str, tmp: Path, args: argparse.Namespace) -> Launch:
    store = f"127.0.0.1:{free_ports(1)}"
    if lib == "gloo":
        # As torchrun would start n ranks on one host: LOCAL_WORLD_SIZE = n, MASTER_ADDR/PORT set
        # (the conditions under which a Gloo with the shared-memory all-reduce takes it).
        host, port = store.split(":")
        env = {"GLOO_SOCKET_IFNAME": "lo", "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": host, "MASTER_PORT": port}
        procs = [
            Proc(worker_argv("gloo", ctl, job), {**env, **model_env(args, r, n, store), "LOCAL_RANK": str(r)})
            for r in range(n)
        ]
        return Launch(lib, n, job, procs, "init_process_group('gloo'), GLOO_SOCKET_IFNAME=lo, as torchrun on one host")
    from meshccl.bootstrap import one_host_hostfile  # a missing meshccl fails these libraries only

    port = free_ports(n)
    data = one_host_hostfile(n, port) if lib == "meshccl" else meshccl_tcp_hostfile(n, port)
    path = write_json(tmp / f"{job}.meshccl.json", data)
    env = {"MESHCCL_HOSTFILE": path, "MESHCCL_TOKEN": secrets.token_hex(16)}
    procs = [
        Proc(worker_argv("meshccl", ctl, job), {**env, **model_env(args, r, n, store), "MESHCCL_RANK": str(r)})
        for r in range(n)
    ]
    note = (
        "init_process_group('meshccl'), hostfile with one host: meshccl's same-host transport"
        if lib == "meshccl"
        else "init_process_group('meshccl'), every rank its own host cabled over 127.64.x.y addresses: TCP"
    )
    return Launch(lib, n, job, procs, note)


def lab_launch(lib: str, lab: Lab, ctl: str, job: str, port: int, args: argparse.Namespace) -> Launch:
    ranks = lab.ranks()
    n = len(ranks)
    # The rendezvous (a TCPStore: a few small messages at the start) on rank 0's management
    # address, as torchrun's MASTER_ADDR usually is; the gradients go over the cables.
    store = f"{lab.meshccl['hosts'][ranks[0]['host']]['management']}:{port}"
    if lib == "gloo":
        procs = [
            Proc(
                worker_argv("gloo", ctl, job, lab.prefix(r["host"])),
                {**model_env(args, r["rank"], n, store), "GLOO_SOCKET_IFNAME": r["links"][0]["port"]},
            )
            for r in ranks
        ]
        return Launch(lib, n, job, procs, "")
    env = {"MESHCCL_HOSTFILE": str(lab.hostfiles / "meshccl.json"), "MESHCCL_TOKEN": secrets.token_hex(16)}
    procs = [
        Proc(
            worker_argv("meshccl", ctl, job, lab.prefix(r["host"])),
            {**env, **model_env(args, r["rank"], n, store), "MESHCCL_RANK": str(r["rank"])},
        )
        for r in ranks
    ]
    return Launch(
        lib, n, job, procs, "init_process_group('meshccl'), meshkit's meshccl.json (every cable of every host)"
    )


def start_jobs(launches: list[Launch], ctl: Control, logdir: Path, run: Run, timeout: float) -> list[Job]:
    jobs = []
    for launch in launches:
        job = Job(launch, logdir / f"{launch.label}-{launch.ranks}.log")
        say(f"starting {launch.label} with {launch.ranks} ranks ...")
        try:
            job.start(ctl, timeout)
        except JobError as e:
            run.status[launch.label] = f"not run: {e}"
            say(f"  {launch.label}: NOT RUN: {e}")
            job.stop(grace=2)
            continue
        note = launch.note or run.notes.get(launch.label, "")
        if job.info:
            note += f" ({job.info})"
        run.notes[launch.label] = note
        jobs.append(job)
    return jobs


# --- the interleaved measurement ----------------------------------------------------------------


def command(job: Job, run: Run, msg: dict[str, Any], timeout: float, where: str) -> list[dict[str, Any]] | None:
    """Every rank's reply, or None when the job failed (then it is stopped and left out)."""
    try:
        replies = job.command(msg, timeout)
        bad = [r["error"] for r in replies if "error" in r]
        if bad:
            raise JobError(bad[0])
        return replies
    except JobError as e:
        job.error = str(e)
        run.status[job.label] = f"stopped at {where}: {e}"
        say(f" FAILED: {e}")
        job.stop(grace=2)
        return None


def measure(run: Run, jobs: list[Job], args: argparse.Namespace) -> None:
    for rnd in range(args.rounds):
        shift = rnd % max(1, len(jobs))
        order = jobs[shift:] + jobs[:shift]
        figures: dict[str, dict[str, Any]] = {job.label: {} for job in jobs}
        run.rounds.append(figures)
        head = f"[round {rnd + 1}/{args.rounds}]"
        warmup = args.warmup if rnd == 0 else 1
        for job in order:
            if job.error:
                continue
            say(f"{head} {job.label:<11} train {warmup} + {args.steps} steps ...")
            replies = command(
                job, run, {"cmd": "train", "steps": args.steps, "warmup": warmup}, args.timeout, f"round {rnd + 1}"
            )
            if replies is None:
                continue
            f = figures[job.label]
            for key in ("step", "fb", "opt", "ar_busy", "ar_span", "ar_sum"):
                f[key] = per_rank_mean(replies, f"{key}_s")
            f["loss"] = mean([r["loss"] for r in replies])
            f["steps_done"] = replies[0]["steps_done"]
            f["per_rank_step_s"] = [r["step_s"] for r in replies]
            f["per_rank_ar_busy_s"] = [r["ar_busy_s"] for r in replies]
            for key in ("bucket_ddp_s", "bucket_issued_s"):
                f[key.removesuffix("_s")] = [mean(list(col)) for col in zip(*(r[key] for r in replies), strict=True)]
            run.buckets = replies[0]["bucket_numel"]
            say(
                f"{head} {job.label:<11} step {f['step'] * 1e3:8.1f} ms  all-reduce in DDP {f['ar_busy'] * 1e3:8.1f} ms"
                f"  loss {f['loss']:.4f}"
            )
        for job in order:
            if job.error or args.compute_steps < 1:
                continue
            replies = command(job, run, {"cmd": "compute", "steps": args.compute_steps}, args.timeout, "compute")
            if replies is None:
                continue
            f = figures[job.label]
            f["compute"] = per_rank_mean(replies, "fb_s")
            if "fb" in f:
                f["exposed"] = f["fb"] - f["compute"]
            say(f"{head} {job.label:<11} forward + backward alone {f['compute'] * 1e3:8.1f} ms")
        for job in order:
            if job.error or args.bucket_iters < 1:
                continue
            replies = command(job, run, {"cmd": "buckets", "iters": args.bucket_iters}, args.timeout, "buckets")
            if replies is None:
                continue
            f = figures[job.label]
            f["alone"] = per_rank_mean(replies, "pass_s")
            f["bucket_alone"] = [mean(list(col)) for col in zip(*(r["bucket_s"] for r in replies), strict=True)]
            say(f"{head} {job.label:<11} buckets all-reduced alone {f['alone'] * 1e3:8.1f} ms per step")


def compare_parameters(run: Run, jobs: list[Job], tmp: Path, args: argparse.Namespace) -> None:
    """Every rank of a job must hold the same parameters (bit for bit); across libraries, the same
    steps on the same data must give the same parameters up to float32 summation order."""
    live = [job for job in jobs if not job.error]
    saved: dict[str, Path] = {}
    for job in live:
        path = tmp / f"{job.label}.params.pt"
        replies = command(job, run, {"cmd": "params", "save": str(path)}, args.timeout, "the parameter check")
        if replies is None:
            continue
        digests = {r["sha256"] for r in replies}
        run.check[job.label] = {
            "steps": replies[0]["steps_done"],
            "ranks_identical": len(digests) == 1,
            "sha256_rank0": replies[0]["sha256"],
        }
        saved[job.label] = path
    if "gloo" in saved:
        import torch

        ref = torch.load(saved["gloo"])
        scale = float(ref.abs().max())
        for lib, path in saved.items():
            if lib == "gloo" or run.check[lib]["steps"] != run.check["gloo"]["steps"]:
                continue
            diff = float((torch.load(path) - ref).abs().max())
            run.check[lib]["max_abs_diff_vs_gloo"] = diff
            run.check[lib]["max_abs_param"] = scale
    for p in saved.values():
        p.unlink(missing_ok=True)


# --- report -------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f}"


def _table(head: list[str], rows: list[list[str]], align: str = "---:") -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(align for _ in head) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def busbw_multiple(run: Run, seconds: float | None) -> float | None:
    """busbw of the gradient all-reduce (all buckets, in `seconds`) as a multiple of the link rate."""
    if not seconds or not run.link_rate:
        return None
    return run.grad_bytes() / seconds * 2 * (run.ranks - 1) / run.ranks / run.link_rate


def markdown(run: Run) -> str:
    p, m = run.params, run.model
    title = f"lab {run.shape}, {run.ranks} hosts, links {p.get('rate')}" if run.mode == "lab" else "loopback"
    libs = run.libs_run()
    lines = [
        f"# DDP training, Gloo vs meshccl: {title}",
        "",
        f"Model: MLP {m['inputs']} → {m['width']} x {m['depth'] - 1} → {m['classes']} (ReLU), "
        f"{p['parameters'] / 1e6:.1f} M float32 parameters; batch {m['batch']} per rank, synthetic data, "
        f"cross-entropy, SGD (lr {m['lr']}, momentum 0.9); DDP on CPU with bucket_cap_mb={m['bucket_mb']}: "
        f"{len(run.buckets)} buckets, {_mib(run.grad_bytes())} of gradients per step "
        f"({', '.join(_mib(4 * b) for b in run.buckets)}). {run.ranks} ranks, {m['threads']} intra-op thread(s) "
        "each.",
        "",
        f"Median over {p['rounds']} rounds. Per round each library in turn (order rotated every round) trains "
        f"{p['steps']} timed steps (after {p['warmup']} warm-up steps in the first round, 1 in later ones), then "
        f"each runs {p['compute_steps']} forward + backward passes without all-reduce, then each all-reduces the "
        f"same buckets outside DDP {p['bucket_iters']} times. Every figure is a mean over steps and ranks.",
        "",
        "How the gradient all-reduce is timed: a DDP comm hook that does what DDP's default all-reduce hook "
        "does (divide the bucket by the world size, `all_reduce(async_op=True)`, return its future) and "
        "time-stamps each bucket when issued and when its future completes. *All-reduce in DDP* is the time "
        "during which at least one bucket was in flight (the union of those intervals; it overlaps the backward "
        "pass, and on this machine shares its CPUs); *alone* is the same bucket sizes all-reduced with blocking "
        "`dist.all_reduce`, one after another, outside DDP with nothing else running in the job.",
        "",
    ]
    if p.get("machine_note"):
        lines += [f"Machine: {p['machine_note']}", ""]
    for lib, note in run.notes.items():
        lines.append(f"- **{lib}**: {note}")
    for lib, why in run.status.items():
        lines.append(f"- **{lib}**: {why}")
    if run.gloo_shm:
        lines.append(f"- Gloo's shared-memory all-reduce: {run.gloo_shm}")
    lines.append("")
    if run.links:
        lines += [f"Links (iperf3, every link both ways at once, limit {p.get('rate')}):", ""]
        rows = [[lk["link"], f"{lk['rate'] * 8 / 1e9:.3f}", f"{lk['rate'] / run.link_rate:.0%}"] for lk in run.links]
        lines += [*_table(["link", "Gbit/s", "of limit"], rows), ""]
    if not libs:
        return "\n".join([*lines, "No library produced figures.", ""])
    me = [lib for lib in libs if lib != "gloo"]
    ratio_cols = [f"gloo ÷ {lib}" for lib in me] if "gloo" in libs else []
    lines += ["## Per step (ms, median over rounds)", ""]
    rows = []
    for key, what in METRICS.items():
        vals = {lib: run.median(lib, key) for lib in libs}
        row = [what, *[_ms(vals[lib]) for lib in libs]]
        if ratio_cols:
            g = vals["gloo"]
            row += [f"{g / vals[lib]:.2f}" if g and vals[lib] and vals[lib] > 0 else "—" for lib in me]
        rows.append(row)
    sps = {lib: run.ranks * m["batch"] / s for lib in libs if (s := run.median(lib, "step"))}
    row = ["samples/s, all ranks", *[f"{sps[lib]:.1f}" if lib in sps else "—" for lib in libs]]
    if ratio_cols:
        row += [f"{sps[lib] / sps['gloo']:.2f}" if lib in sps and "gloo" in sps else "—" for lib in me]
    rows.append(row)
    if run.link_rate:
        row = ["all-reduce alone: busbw ÷ link rate"]
        row += [f"{x:.2f}" if (x := busbw_multiple(run, run.median(lib, "alone"))) else "—" for lib in libs]
        if ratio_cols:
            row += ["" for _ in me]
        rows.append(row)
    lines += [*_table(["", *libs, *ratio_cols], rows), ""]
    if ratio_cols:
        lines += ["gloo ÷ meshccl > 1: meshccl is faster (for samples/s: meshccl's ÷ gloo's).", ""]
    lines += _rounds_table(run, libs)
    lines += _bucket_table(run, libs)
    lines += _check_lines(run)
    lines += _targets(run, libs)
    return "\n".join(lines) + "\n"


def _rounds_table(run: Run, libs: list[str]) -> list[str]:
    head = ["round", *[f"{lib} step" for lib in libs], *[f"{lib} all-reduce in DDP" for lib in libs]]
    rows = []
    for i, r in enumerate(run.rounds):
        rows.append(
            [str(i + 1)]
            + [_ms(r.get(lib, {}).get("step")) for lib in libs]
            + [_ms(r.get(lib, {}).get("ar_busy")) for lib in libs]
        )
    return ["Every round (ms):", "", *_table(head, rows), ""]


def _bucket_table(run: Run, libs: list[str]) -> list[str]:
    if not run.buckets:
        return []

    def med(lib: str, key: str, i: int) -> str:
        vals = [r[i] for r in run.series(lib, key) if len(r) > i]
        return _ms(statistics.median(vals)) if vals else "—"

    head = ["bucket", "size", *[f"{lib} {what}" for lib in libs for what in ("issued at", "in DDP", "alone")]]
    rows = [
        [
            str(i),
            _mib(4 * numel),
            *[med(lib, key, i) for lib in libs for key in ("bucket_issued", "bucket_ddp", "bucket_alone")],
        ]
        for i, numel in enumerate(run.buckets)
    ]
    return [
        "Each bucket (ms, median over rounds; DDP's order: bucket 0 holds the last layers' gradients and is ready "
        "first). *Issued at*: when the hook issued its all-reduce, counted from the step's start; *in DDP*: issue to "
        "completion during training; *alone*: all-reduced outside DDP:",
        "",
        *_table(head, rows),
        "",
    ]


def _check_lines(run: Run) -> list[str]:
    if not run.check:
        return []
    out = ["Parameters after training:", ""]
    for lib, c in run.check.items():
        same = "identical" if c["ranks_identical"] else "DIFFER"
        text = f"- {lib}: {c['steps']} steps; every rank's parameters {same}"
        if "max_abs_diff_vs_gloo" in c:
            text += (
                f"; max |parameter - Gloo's| = {c['max_abs_diff_vs_gloo']:.3g} (largest |parameter| "
                f"{c['max_abs_param']:.3g})"
            )
        out.append(text)
    return [*out, ""]


def _targets(run: Run, libs: list[str]) -> list[str]:
    if "gloo" not in libs or len(libs) < 2:
        return []
    goal = TARGETS.get(run.shape) if run.mode == "lab" else None
    out = ["## Gradient all-reduce and step time against Gloo", ""]
    for lib in (x for x in libs if x != "gloo"):
        for key, what in (("ar_busy", "in DDP"), ("alone", "alone")):
            g, me = run.median("gloo", key), run.median(lib, key)
            if not g or not me:
                continue
            line = f"- {lib} gradient all-reduce {what}: {g * 1e3:.1f} ms (Gloo) / {me * 1e3:.1f} ms = {g / me:.2f}x"
            if goal:
                line += f"; target >= {goal}x on the {run.shape}: {'met' if g / me >= goal else 'NOT met'}"
            out.append(line)
        g, me = run.median("gloo", "step"), run.median(lib, "step")
        if g and me:
            out.append(f"- {lib} step time: {g * 1e3:.1f} ms (Gloo) / {me * 1e3:.1f} ms = {g / me:.2f}x (no target)")
    return [*out, ""]


def plot(run: Run, path: Path) -> str:
    """Bars of the per-step figures (median, whiskers min-max over rounds) and every round's step and
    all-reduce time; '' or why it was not drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e}); pip install -r bench/requirements.txt"
    libs = run.libs_run()
    if not libs:
        return "nothing to plot"
    keys = ["step", "ar_busy", "alone", "compute", "exposed"]
    labels = ["step", "all-reduce\nin DDP", "all-reduce\nalone", "fwd+bwd\nalone", "exposed\nall-reduce"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(libs)
    for i, lib in enumerate(libs):
        xs, ys, lo, hi = [], [], [], []
        for j, key in enumerate(keys):
            s = run.series(lib, key)
            if not s:
                continue
            med = statistics.median(s) * 1e3
            xs.append(j + (i - (len(libs) - 1) / 2) * width)
            ys.append(med)
            lo.append(med - min(s) * 1e3)
            hi.append(max(s) * 1e3 - med)
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=lib)
        ax.bar_label(bars, fmt="%.0f", fontsize="x-small", padding=2)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("ms per step (median; whiskers: min-max over rounds)")
    title = f"lab {run.shape}, {run.ranks} hosts, links {run.params.get('rate')}" if run.mode == "lab" else "loopback"
    ax.set_title(f"DDP, {run.params['parameters'] / 1e6:.1f} M parameters: {title}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    for lib in libs:
        rounds = range(1, len(run.rounds) + 1)
        step = [r.get(lib, {}).get("step") for r in run.rounds]
        busy = [r.get(lib, {}).get("ar_busy") for r in run.rounds]
        (line,) = ax2.plot(rounds, [s * 1e3 if s else None for s in step], marker="o", label=f"{lib} step")
        ax2.plot(
            rounds,
            [b * 1e3 if b else None for b in busy],
            marker="x",
            linestyle="--",
            color=line.get_color(),
            label=f"{lib} all-reduce in DDP",
        )
    ax2.set_xticks(range(1, len(run.rounds) + 1))
    ax2.set_xlabel("round")
    ax2.set_ylabel("ms per step")
    ax2.set_title("every round (interleaved)")
    ax2.set_ylim(bottom=0)
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize="small")
    ratios = []
    for lib in (x for x in libs if x != "gloo" and "gloo" in libs):
        parts = []
        for key, what in (("ar_busy", "all-reduce in DDP"), ("alone", "alone"), ("step", "step")):
            g, me = run.median("gloo", key), run.median(lib, key)
            if g and me:
                parts.append(f"{what} {g / me:.2f}x")
        if parts:
            ratios.append(f"gloo ÷ {lib}: " + ", ".join(parts))
    if ratios:
        fig.suptitle("; ".join(ratios), fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""


def finish(run: Run, out: Path, name: str, started: float) -> None:
    run.params["duration_s"] = round(time.monotonic() - started, 1)
    load = os.getloadavg()
    run.params["machine_note"] = (
        f"{run.params.get('machine_note', '')}, {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end"
    )
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(run)
    (out / f"{name}.md").write_text(text)
    write_json(out / f"{name}.json", run.to_json())
    why = plot(run, out / f"{name}.png")
    print(text)
    say(f"wrote {out / (name + '.md')}, {out / (name + '.json')}" + ("" if why else f", {out / (name + '.png')}"))
    if why:
        say(f"no plot: {why}")
    say(f"took {run.params['duration_s']:.0f} s")


# --- Gloo's shared-memory all-reduce -------------------------------------------------------------


def gloo_shm_in_torch(libdir: Path | None = None) -> tuple[bool, str]:
    """Whether this torch's Gloo was built with gloo/allreduce_shm.cc (pytorch/gloo PR #458, 2025-08):
    the name it gives its buffers is a string in the library Gloo is linked into (libtorch_cpu)."""
    if libdir is None:
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return False, "torch is not installed"
        libdir = Path(spec.origin).parent / "lib"
    libs = sorted(libdir.glob("libtorch_cpu.*")) or sorted(libdir.glob("libtorch.*"))
    if not libs:
        return False, f"no libtorch_cpu in {libdir}"
    mark = GLOO_SHM_MARK.decode()
    for lib in libs:
        with open(lib, "rb") as f:
            tail = b""
            while chunk := f.read(1 << 24):
                if GLOO_SHM_MARK in tail + chunk:
                    return True, f"{lib.name} contains '{mark}' (gloo/allreduce_shm.cc)"
                tail = chunk[-(len(GLOO_SHM_MARK) - 1) :]
    return False, (
        f"not in this torch: {libs[0].name} has no '{mark}' (the name gloo/allreduce_shm.cc, pytorch/gloo PR #458, "
        "gives its buffers; that path is taken when LOCAL_WORLD_SIZE equals the group size)"
    )


# --- modes ----------------------------------------------------------------------------------------


def new_run(args: argparse.Namespace, mode: str, ranks: int) -> Run:
    from ddp_worker import parameter_count

    keep = ("rounds", "steps", "warmup", "compute_steps", "bucket_iters", "timeout", "libs")
    params = {k: getattr(args, k) for k in keep}
    params["parameters"] = parameter_count(args.model)
    params["machine_note"] = machine_note()
    return Run(mode, ranks, list(args.libs), dict(args.model), params)


def run_jobs(run: Run, launches: list[Launch], ctl: Control, logdir: Path, tmp: Path, args: argparse.Namespace) -> None:
    jobs = start_jobs(launches, ctl, logdir, run, args.start_timeout)
    try:
        if jobs:
            measure(run, jobs, args)
            compare_parameters(run, jobs, tmp, args)
    finally:
        for job in jobs:
            job.stop(grace=5)


def run_loopback(args: argparse.Namespace) -> int:
    started = time.monotonic()
    run = new_run(args, "loopback", args.ranks)
    has_shm, why = gloo_shm_in_torch()
    run.gloo_shm = ("present: " if has_shm else "") + why
    say(f"Gloo's shared-memory all-reduce: {run.gloo_shm}")
    tmp = Path(tempfile.mkdtemp(prefix="mkddp-"))
    logdir = args.out / "logs" / "ddp-loopback"
    logdir.mkdir(parents=True, exist_ok=True)
    ctl = Control(tmp / "ctl.sock")
    rc = 0
    try:
        with terminate_as_interrupt():
            launches = []
            for lib in args.libs:
                try:
                    launches.append(loopback_launch(lib, args.ranks, ctl.path, job_id(lib, args.ranks), tmp, args))
                except ImportError as e:
                    run.status[lib] = f"not run: {e}"
            run_jobs(run, launches, ctl, logdir, tmp, args)
    except KeyboardInterrupt:
        say("interrupted: stopping the jobs; the results so far are written")
        run.params["interrupted"] = True
        rc = 130
    finally:
        ctl.close()
        shutil.rmtree(tmp, ignore_errors=True)
    finish(run, args.out, "ddp-loopback", started)
    return rc or (1 if _bad_check(run) else 0)


def run_lab(args: argparse.Namespace) -> int:
    started = time.monotonic()
    rate_bits = parse_rate(args.rate)
    run = new_run(args, "lab", args.size)
    run.shape, run.link_rate = args.shape, rate_bits / 8
    run.params.update({"rate": args.rate, "shape": args.shape, "lab_name": args.lab_name, "subnet": args.subnet})
    missing = [t for t in ("ip", "tc", "iperf3") if not shutil.which(t)]
    if os.geteuid() != 0 or missing:
        say("the lab needs root" + (f" and {', '.join(missing)}" if missing else "") + " (network namespaces, tc)")
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="mkddp-"))
    logdir = args.out / "logs" / f"ddp-lab-{args.shape}"
    logdir.mkdir(parents=True, exist_ok=True)
    lab = Lab(args.lab_name, args.shape, args.size, args.rate, args.subnet, logdir / "lab.log", tmp / "artifacts")
    lab.log.write_text("")
    ctl = Control(tmp / "ctl.sock")
    rc = 0
    try:
        with terminate_as_interrupt():
            say(f"building lab {args.lab_name}: {args.size}-host {args.shape}, links {args.rate} (log {lab.log}) ...")
            t0 = time.monotonic()
            lab.up()
            say(f"  lab built and converged by setup.yml in {time.monotonic() - t0:.0f} s")
            check_links(lab, run, args)
            if "gloo" in args.libs:
                how = lab.add_gloo_routes()
                run.notes["gloo"] = (
                    "init_process_group('gloo'), GLOO_SOCKET_IFNAME = each rank's first cable port; Gloo needs every "
                    f"rank to reach every other: {how}"
                )
                say(f"  gloo: {how}")
            launches = [
                lab_launch(lib, lab, ctl.path, job_id(lib, args.size), 29710 + i, args)
                for i, lib in enumerate(args.libs)
            ]
            run_jobs(run, launches, ctl, logdir, tmp, args)
    except KeyboardInterrupt:
        say("interrupted: removing the lab; the results so far are written")
        run.params["interrupted"] = True
        rc = 130
    except (LabError, netcheck.IperfError, OSError, subprocess.SubprocessError) as e:
        say(f"lab run failed: {e}")
        run.params["error"] = str(e)
        rc = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the clean-up (and the lab's removal) is never cut short
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
    finish(run, args.out, f"ddp-lab-{args.shape}", started)
    return rc or (1 if _bad_check(run) else 0)


def _bad_check(run: Run) -> bool:
    """Ranks of one job that disagree on their parameters: DDP itself went wrong."""
    return any(not c["ranks_identical"] for c in run.check.values())


def check_links(lab: Lab, run: Run, args: argparse.Namespace) -> None:
    """iperf3 on every link, both directions, all at once (as bench/allreduce.py does)."""
    flows = [
        netcheck.Flow(
            f"{link.host}:{link.port} -> {link.peer_end}",
            link.peer_address,
            5300 + i,
            lab.prefix(link.peer_host),
            link.address,
            lab.prefix(link.host),
        )
        for i, link in enumerate(lab.links())
    ]
    say(f"checking {len(flows)} link directions at once with iperf3 ({args.iperf_time:g} s) ...")
    netcheck.run_flows(flows, args.iperf_time)
    slow = 0
    for f in flows:
        frac = f.rate / run.link_rate
        slow += frac < 0.9
        run.links.append({"link": f.name, "rate": f.rate})
        say(
            f"  {f.name:<24} {f.rate * 8 / 1e9:6.3f} Gbit/s  {frac:5.0%} of {args.rate}"
            + ("  SLOW" if frac < 0.9 else "")
        )
    if slow:
        say(f"  WARNING: {slow} link direction(s) below 90 % of {args.rate} with every link busy: try a lower --rate")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/ddp.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    sub = p.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-r", "--rounds", type=int, default=5, help="rounds; figures are medians over them (5)")
    common.add_argument("--steps", type=int, default=10, help="timed training steps per library and round (10)")
    common.add_argument("-w", "--warmup", type=int, default=3, help="untimed steps before the first round's (3)")
    common.add_argument("--compute-steps", type=int, default=5, help="forward+backward passes without all-reduce (5)")
    common.add_argument("--bucket-iters", type=int, default=3, help="passes over the buckets outside DDP (3)")
    common.add_argument("--width", type=int, default=2048, help="MLP hidden width (2048)")
    common.add_argument("--depth", type=int, default=5, help="MLP linear layers (5: 16.7 M parameters)")
    common.add_argument("--inputs", type=int, default=1024, help="input features (1024)")
    common.add_argument("--classes", type=int, default=1000, help="output classes (1000)")
    common.add_argument("--batch", type=int, default=32, help="samples per rank and step (32)")
    common.add_argument("--bucket-mb", type=float, default=25, help="DDP bucket_cap_mb (25, DDP's default)")
    common.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (0.01)")
    common.add_argument("--seed", type=int, default=1, help="model and data seed (1)")
    common.add_argument("--threads", type=int, help="torch intra-op threads per rank (CPUs / ranks, at least 1)")
    common.add_argument("--timeout", type=float, default=600, help="seconds a command may take before a job fails")
    common.add_argument("--start-timeout", type=float, default=120, help="seconds for a job's ranks to start")
    common.add_argument("--out", type=Path, default=BENCH_DIR / "results", help="output directory (bench/results)")
    lp = sub.add_parser("loopback", parents=[common], help="every rank on this machine")
    lp.add_argument("--libs", default=",".join(LOOPBACK_LIBS), help=f"comma list from {','.join(LOOPBACK_LIBS)}")
    lp.add_argument("--ranks", type=int, default=4, help="ranks (4)")
    lb = sub.add_parser("lab", parents=[common], help="meshkit's rate-limited lab (root)")
    lb.add_argument("--shape", choices=("ring", "mesh"), default="mesh")
    lb.add_argument("--size", type=int, default=4, help="hosts, one rank each (4)")
    lb.add_argument("--rate", default="1gbit", help="tc rate of every cable end (1gbit)")
    lb.add_argument("--libs", default=",".join(LAB_LIBS), help=f"comma list from {','.join(LAB_LIBS)}")
    lb.add_argument("--lab-name", default="mkddp", help="lab name: namespaces <name>-node<i> (mkddp)")
    lb.add_argument("--subnet", default="198.19.201.0/24", help="lab management subnet (198.19.201.0/24)")
    lb.add_argument("--iperf-time", type=float, default=2, help="seconds per iperf3 measurement (2)")
    args = p.parse_args(argv)
    allowed = LOOPBACK_LIBS if args.mode == "loopback" else LAB_LIBS
    args.libs = [x for x in args.libs.split(",") if x]
    bad = [x for x in args.libs if x not in allowed]
    if bad or not args.libs:
        p.error(f"--libs: unknown or unsupported in {args.mode} mode: {', '.join(bad)} (from {', '.join(allowed)})")
    if min(args.rounds, args.steps, args.width, args.depth, args.inputs, args.classes, args.batch) < 1:
        p.error("-r, --steps, --width, --depth, --inputs, --classes, --batch must be >= 1")
    if args.warmup < 1:
        p.error("-w must be >= 1 (DDP builds its buckets in the first step)")
    ranks = args.ranks if args.mode == "loopback" else args.size
    if ranks < 2:
        p.error("at least 2 ranks")
    threads = args.threads or max(1, (os.cpu_count() or 1) // ranks)
    args.model = {
        "inputs": args.inputs,
        "width": args.width,
        "depth": args.depth,
        "classes": args.classes,
        "batch": args.batch,
        "bucket_mb": args.bucket_mb,
        "lr": args.lr,
        "seed": args.seed,
        "threads": threads,
    }
    args.out = args.out.resolve()
    if args.mode == "loopback":
        return run_loopback(args)
    try:
        parse_rate(args.rate)
    except ValueError as e:
        p.error(str(e))
    return run_lab(args)


if __name__ == "__main__":
    sys.exit(main())
