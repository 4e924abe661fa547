"""Tables, ratios and the plot of bench/allreduce.py's results.

Sizes in bytes; times are seconds per all-reduce (median over rounds); bandwidths in GB/s of
1e9 bytes, busbw = algbw * 2(n-1)/n as nccl-tests (doc/PERFORMANCE.md) for all-reduce.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MESHCCL = ("meshccl", "meshccl-tcp")
TCP_PEERS = ("gloo", "mlx", "mpi-tcp")


def size_label(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B" if n < 1024 else f"{n / 1024:.1f}K"


def bus_factor(n: int) -> float:
    return 2 * (n - 1) / n


@dataclass
class Cell:
    """One library at one rank count and size: per-iteration time of every round."""

    library: str
    ranks: int
    nbytes: int
    iters: int = 0
    times: list[float] = field(default_factory=list)
    wrong: int | None = None

    @property
    def time(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    @property
    def busbw(self) -> float | None:
        t = self.time
        return self.nbytes / t / 1e9 * bus_factor(self.ranks) if t else None


@dataclass
class Results:
    mode: str  # loopback | lab
    sizes: list[int]
    ranks: list[int]
    libraries: list[str]
    cells: dict[tuple[str, int, int], Cell] = field(default_factory=dict)
    status: dict[tuple[str, int], str] = field(default_factory=dict)  # why a library did not run / stopped
    notes: dict[str, str] = field(default_factory=dict)  # how each library ran
    ceiling: list[dict[str, float]] = field(default_factory=list)  # loopback iperf3 samples (bytes/s)
    ceiling_error: str = ""
    links: list[dict[str, Any]] = field(default_factory=list)  # lab: per link and direction
    link_rate: float = 0.0  # lab: bytes/s of one cable, one direction
    shape: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    def cell(self, lib: str, n: int, size: int) -> Cell:
        return self.cells.setdefault((lib, n, size), Cell(lib, n, size))

    def libs_run(self, n: int) -> list[str]:
        return [lib for lib in self.libraries if any(self.cells.get((lib, n, s)) for s in self.sizes)]

    def ceilings(self) -> dict[str, float]:
        """Medians over the run's iperf3 samples: one way, and per direction with both at once."""
        if not self.ceiling:
            return {}
        return {
            "oneway": statistics.median(c["oneway"] for c in self.ceiling),
            "bidir": statistics.median((c["bidir_forward"] + c["bidir_reverse"]) / 2 for c in self.ceiling),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "shape": self.shape,
            "sizes": self.sizes,
            "ranks": self.ranks,
            "libraries": self.libraries,
            "params": self.params,
            "notes": self.notes,
            "status": [{"library": k[0], "ranks": k[1], "reason": v} for k, v in self.status.items()],
            "ceiling_samples_bytes_per_s": self.ceiling,
            "ceiling_error": self.ceiling_error,
            "links": self.links,
            "link_rate_bytes_per_s": self.link_rate,
            "cells": [
                {
                    "library": c.library,
                    "ranks": c.ranks,
                    "bytes": c.nbytes,
                    "iters": c.iters,
                    "times_s": c.times,
                    "median_time_s": c.time,
                    "busbw_GBps": c.busbw,
                    "wrong": c.wrong,
                }
                for c in self.cells.values()
            ],
        }


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _value(res: Results, lib: str, n: int, size: int, what: str) -> float | None:
    c = res.cells.get((lib, n, size))
    if c is None:
        return None
    return c.busbw if what == "busbw" else (c.time * 1e6 if c.time else None)


def markdown(res: Results) -> str:
    """The whole report: results per rank count, ratios, ceilings or link multiples, targets."""
    p = res.params
    lines = [
        f"# all-reduce float32 sum: {res.mode}"
        + (f" ({res.shape}, links {p.get('rate')})" if res.mode == "lab" else ""),
        "",
        f"Median over {p.get('rounds')} rounds; per round each library runs each size in turn (order rotated "
        f"every round). Time = wall time of k back-to-back all-reduces / k (k <= {p.get('iters')}, about "
        f"{p.get('budget')} s per size, after a barrier), averaged over ranks. busbw = algbw * 2(n-1)/n "
        "(nccl-tests), GB/s = 1e9 B/s.",
        "",
    ]
    if p.get("machine_note"):
        lines += [f"Machine: {p['machine_note']}", ""]
    for lib, note in res.notes.items():
        lines.append(f"- **{lib}**: {note}")
    for (lib, n), why in res.status.items():
        lines.append(f"- **{lib}** at {n} ranks: {why}")
    lines.append("")
    ceil = res.ceilings()
    if res.mode == "loopback":
        if ceil:
            lines += [
                f"Loopback TCP (iperf3, median of {len(res.ceiling)}): one way {ceil['oneway'] / 1e9:.2f} GB/s; "
                f"both directions at once {ceil['bidir'] / 1e9:.2f} GB/s per direction.",
                "",
            ]
        elif res.ceiling_error:
            lines += [f"Loopback TCP ceiling not measured: {res.ceiling_error}", ""]
    if res.links:
        lines += [f"Links (iperf3, every link both ways at once, limit {p.get('rate')}):", ""]
        rows = [[lk["link"], f"{lk['rate'] * 8 / 1e9:.3f}", f"{lk['rate'] / res.link_rate:.0%}"] for lk in res.links]
        lines += [*_table(["link", "Gbit/s", "of limit"], rows), ""]
    for n in res.ranks:
        libs = res.libs_run(n)
        if not libs:
            continue
        lines += [f"## {n} ranks", "", "busbw (GB/s):", ""]
        rows = [[size_label(s)] + [_fmt(_value(res, lib, n, s, "busbw"), ".3f") for lib in libs] for s in res.sizes]
        lines += [*_table(["size", *libs], rows), "", "time per all-reduce (µs):", ""]
        rows = [[size_label(s)] + [_fmt(_value(res, lib, n, s, "time"), ".1f") for lib in libs] for s in res.sizes]
        lines += [*_table(["size", *libs], rows), ""]
        wrong = [
            f"{c.library} {size_label(c.nbytes)}: {c.wrong}" for c in res.cells.values() if c.ranks == n and c.wrong
        ]
        lines += [f"Checked results: {'WRONG values: ' + ', '.join(wrong) if wrong else 'all exact'}.", ""]
        lines += _ratios(res, n, libs, ceil)
    lines += _latency(res)
    lines += _targets(res, ceil)
    return "\n".join(lines) + "\n"


def _latency(res: Results) -> list[str]:
    """Time of the smallest size (4 KiB by default), every library at every rank count."""
    ranks = [n for n in res.ranks if res.libs_run(n)]
    if not ranks:
        return []
    small = res.sizes[0]
    rows = [
        [lib] + [_fmt(_value(res, lib, n, small, "time"), ".1f") for n in ranks]
        for lib in res.libraries
        if any(res.cells.get((lib, n, small)) for n in ranks)
    ]
    head = ["library", *[f"{n} ranks" for n in ranks]]
    return [f"## Latency: {size_label(small)} all-reduce (µs)", "", *_table(head, rows), ""]


def _ratios(res: Results, n: int, libs: list[str], ceil: dict[str, float]) -> list[str]:
    out = []
    for me in (m for m in MESHCCL if m in libs):
        others = [lib for lib in libs if lib not in MESHCCL]
        extra: list[tuple[str, float]] = []
        if res.mode == "loopback" and ceil:
            extra = [("iperf one way", ceil["oneway"]), ("iperf per dir. (both ways)", ceil["bidir"])]
        elif res.mode == "lab" and res.link_rate:
            extra = [("link rate", res.link_rate)]
        if not others and not extra:
            continue
        head = ["size", *[f"÷ {o}" for o in others], *[f"÷ {name}" for name, _ in extra]]
        rows = []
        for s in res.sizes:
            mine = _value(res, me, n, s, "busbw")
            row = [size_label(s)]
            for o in others:
                theirs = _value(res, o, n, s, "busbw")
                row.append(_fmt(mine / theirs if mine and theirs else None, ".2f"))
            for _, bw in extra:
                row.append(_fmt(mine * 1e9 / bw if mine else None, ".2f"))
            rows.append(row)
        out += [f"{me} busbw ÷ each (> 1: {me} is faster; ÷ a ceiling: fraction of it):", ""]
        out += [*_table(head, rows), ""]
    if res.mode == "lab" and res.link_rate:
        out += ["busbw as a multiple of the link rate, every library:", ""]
        rows = [
            [size_label(s)] + [_fmt(_mult(_value(res, lib, n, s, "busbw"), res.link_rate), ".2f") for lib in libs]
            for s in res.sizes
        ]
        out += [*_table(["size", *libs], rows), ""]
    return out


def _mult(busbw: float | None, rate: float) -> float | None:
    return busbw * 1e9 / rate if busbw else None


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def _targets(res: Results, ceil: dict[str, float]) -> list[str]:
    """The issue's targets, each with the figures it was judged on."""
    out = ["## Targets (issue 5)", ""]
    big = [s for s in res.sizes if s >= 1 << 20]

    def bw(lib: str, n: int, s: int) -> float:
        return _value(res, lib, n, s, "busbw") or 0.0

    def us(lib: str, n: int, s: int) -> float:
        return _value(res, lib, n, s, "time") or 0.0

    if res.mode == "lab":
        goal = {"ring": 1.7, "mesh": 2.4}.get(res.shape)
        n = res.ranks[0]
        for lib in res.libs_run(n):
            mults = [(s, bw(lib, n, s) * 1e9 / res.link_rate) for s in big if bw(lib, n, s)]
            if not mults:
                continue
            best = max(m for _, m in mults)
            text = ", ".join(f"{size_label(s)} {m:.2f}x" for s, m in mults)
            line = f"- {lib}: busbw / link rate at >= 1 MiB: {text} (best {best:.2f}x)"
            if lib == "meshccl" and goal:
                line += f"; target >= {goal}x: {_verdict(best >= goal)}"
            out.append(line)
        return [*out, ""]

    small = res.sizes[0]
    mid = [s for s in res.sizes if s >= 64 << 10]
    run2, run4 = res.libs_run(2), res.libs_run(4)
    me = "meshccl-tcp"
    peers = [p for p in TCP_PEERS if p in run2]
    if me in run2 and peers:
        misses = [
            f"{size_label(s)} vs {p} ({bw(me, 2, s):.2f} < {bw(p, 2, s):.2f})"
            for s in mid
            for p in peers
            if bw(p, 2, s) and bw(me, 2, s) < bw(p, 2, s)
        ]
        out.append(
            f"- 2 ranks, TCP: {me} busbw >= every TCP peer ({', '.join(peers)}) at every size >= 64 KiB: "
            f"{_verdict(not misses)}" + (f" (short: {'; '.join(misses)})" if misses else "")
        )
    if me in run2 and ceil and big:
        frac, at = max((bw(me, 2, s) * 1e9 / ceil["bidir"], s) for s in big)
        out.append(
            f"- 2 ranks, TCP: {me} >= 90 % of the both-ways loopback ceiling ({ceil['bidir'] / 1e9:.2f} GB/s "
            f"per direction): best {frac:.0%} at {size_label(at)}: {_verdict(frac >= 0.9)}"
        )
    if us(me, 2, small) and us("mpi-tcp", 2, small):
        a, b = us(me, 2, small), us("mpi-tcp", 2, small)
        out.append(
            f"- 2 ranks, TCP: {me} {size_label(small)} time <= Open MPI TCP's: {a:.1f} us vs {b:.1f} us: "
            f"{_verdict(a <= b)}"
        )
    shm_sizes = [s for s in res.sizes if (1 << 20) <= s <= (64 << 20)]
    if "meshccl" in run2 and "mpi-shm" in run2 and shm_sizes:
        misses = [size_label(s) for s in shm_sizes if bw("meshccl", 2, s) < bw("mpi-shm", 2, s)]
        out.append(
            "- 2 ranks, one host: meshccl busbw >= Open MPI shared memory at 1-64 MiB: "
            f"{_verdict(not misses)}" + (f" (short at {', '.join(misses)})" if misses else "")
        )
    if us("meshccl", 2, small):
        t = us("meshccl", 2, small)
        out.append(f"- 2 ranks, one host: meshccl {size_label(small)} <= 5 us: {t:.1f} us: {_verdict(t <= 5)}")
    if "gloo" in run4:
        for lib in (m for m in MESHCCL if m in run4):
            ratios = [(s, bw(lib, 4, s) / bw("gloo", 4, s)) for s in big if bw(lib, 4, s) and bw("gloo", 4, s)]
            if ratios:
                text = ", ".join(f"{size_label(s)} {r:.2f}x" for s, r in ratios)
                worst = min(r for _, r in ratios)
                out.append(f"- 4 ranks: {lib} >= 1.5x Gloo at >= 1 MiB: {text}: {_verdict(worst >= 1.5)}")
    return [*out, ""]


def plot(res: Results, path: Path) -> str:
    """busbw against size, one line per library, one panel per rank count; '' or why not drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e}); pip install -r bench/requirements.txt"
    panels = [n for n in res.ranks if res.libs_run(n)]
    if not panels:
        return "nothing to plot"
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    lab = res.mode == "lab" and res.link_rate > 0
    ceil = res.ceilings()
    for ax, n in zip(axes[0], panels, strict=True):
        for lib in res.libs_run(n):
            pts = [(s, _value(res, lib, n, s, "busbw")) for s in res.sizes]
            pts = [(s, (v * 1e9 / res.link_rate) if lab else v) for s, v in pts if v is not None]
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", label=lib)
        if lab:
            ax.axhline(1.0, color="grey", linestyle=":", label="1x link rate")
            goal = {"ring": 1.7, "mesh": 2.4}.get(res.shape)
            if goal:
                ax.axhline(goal, color="grey", linestyle="--", label=f"target {goal}x")
            ax.set_ylabel("busbw / link rate")
            ax.set_title(f"lab {res.shape}, {n} hosts, links {res.params.get('rate')}")
        else:
            if ceil:
                ax.axhline(ceil["oneway"] / 1e9, color="grey", linestyle=":", label="iperf3 one way")
                ax.axhline(ceil["bidir"] / 1e9, color="grey", linestyle="--", label="iperf3 per dir., both ways")
            ax.set_ylabel("busbw (GB/s)")
            ax.set_title(f"{n} ranks, loopback")
        ax.set_xscale("log", base=2)
        ax.set_xticks(res.sizes)
        ax.set_xticklabels([size_label(s) for s in res.sizes])
        ax.set_xlabel("message size (float32 sum)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("all-reduce busbw (median over rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""
