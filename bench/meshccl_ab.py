#!/usr/bin/env python3
"""meshccl A/B: the working tree's meshccl against another commit's, interleaved in one run.

This machine's absolute figures drift from day to day, so a change of shape proves it lost no speed only by a
ratio measured beside its base, in the same run. Both sides are built alike, outside the working tree:

  A (--ref)   `git worktree add --detach` of the commit into .cache/bench-ab/src-<sha12> (removed again after the
              build), its collective/ installed with pip into .cache/bench-ab/site-<sha12>
  B (work)    a snapshot of the working tree's collective/ (tracked and untracked files git does not ignore)
              in .cache/bench-ab/src-work-<hash12>, installed into .cache/bench-ab/site-work-<hash12>, where
              <hash12> is a hash of those files' names and contents

A site directory whose key (the commit or the contents, and the toolchain) is unchanged is reused (no build).
Then, for --rounds rounds, each rank count runs meshccl's own benchmark (`python -m meshccl.bench COLLECTIVE
--local N -b MIN -e MAX -f FACTOR --json ...`, the meshccl.bench of that side's build, PYTHONPATH=its site
directory) once per side, the order swapped every round (A B, B A, ...).

  .venv/bin/python bench/meshccl_ab.py --ref HEAD~1
  .venv/bin/python bench/meshccl_ab.py --ref main --ranks 2 --rounds 3 --min 64K --max 16M

Output: --out (bench/results/): ab-meshccl-<label>.md (also printed) and .json (every sample, the builds, the
settings), logs/ab-meshccl-<label>/ (each run's output, each build's log). Per rank count and size: both medians
over rounds, B/A, each round's B/A (min..max), each side's spread (max-min)/median, and `SLOWER` where B was slower
in every round and B/A - 1 exceeds the larger spread. A measurement, not a test: a slower B still exits 0; a failed
build or run does not.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
CACHE = HERE / ".cache" / "bench-ab"
PLACES = {"out_of_place": "out of place", "in_place": "in place"}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv")
STAMP = "bench-ab.json"  # written into a site directory once its build is complete and imports


def say(text: str) -> None:
    print(f"meshccl-ab: {text}", file=sys.stderr, flush=True)


def git(*args: str) -> str:
    proc = subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"meshccl-ab: git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def human(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


@dataclass
class Side:
    """One build: what it is, where it is installed, how long its build took (None: reused)."""

    name: str  # "A" or "B"
    label: str  # the commit's short sha, or "work"
    describe: str  # what it was built from, in words
    key: str  # the build's cache key
    site: Path
    build_s: float | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)


def build_env(root: Path) -> dict[str, str]:
    """The environment of a build: the Makefile's compiler cache, with paths hashed relative to the tree's root.

    Every tree (the worktree, the snapshot) has collective/ under its root and builds in collective/build/<tag>,
    as `make venv` does in the checkout, so the compiler sees the same relative paths and ccache hits across them.
    """
    env = dict(os.environ)
    if shutil.which("ccache"):
        env.update(
            CMAKE_C_COMPILER_LAUNCHER="ccache",
            CMAKE_CXX_COMPILER_LAUNCHER="ccache",
            CCACHE_BASEDIR=str(root),
            CCACHE_NOHASHDIR="true",
        )
    env.pop("PYTHONPATH", None)
    return env


def wait_group(proc: subprocess.Popen[bytes], timeout: float | None = None) -> int:
    """Waits for a child started in a session of its own; after a timeout or on Ctrl-C (or SIGTERM) kills its whole
    process group (the ranks it started, the compilers of pip's build). Its exit status; -1 after a timeout."""
    try:
        return proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if isinstance(e, KeyboardInterrupt):
            raise
        return -1


def install(root: Path, site: Path, key: str, describe: str, log: Path) -> float:
    """pip-installs root/collective into site (via a temporary directory, published once it imports)."""
    tmp = site.with_name(f"{site.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_dir = root / "collective" / "build" / "{wheel_tag}"
    argv = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--target",
        str(tmp),
        "--config-settings",
        f"build-dir={build_dir}",
        str(root / "collective"),
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with log.open("w") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        pip = subprocess.Popen(
            argv, env=build_env(root), cwd=root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = wait_group(pip)
        except KeyboardInterrupt:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    seconds = time.monotonic() - t0
    if returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"meshccl-ab: building {describe} failed (exit {returncode}); see {log}")
    check = subprocess.run(
        [sys.executable, "-c", "import meshccl, meshccl.bench; print(meshccl.__file__)"],
        env={**build_env(root), "PYTHONPATH": str(tmp)},
        cwd=tmp,
        capture_output=True,
        text=True,
        check=False,
    )
    where = Path(check.stdout.strip() or "?").resolve()
    if check.returncode != 0 or tmp.resolve() not in where.parents:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(
            f"meshccl-ab: the build of {describe} does not import from its own directory: "
            f"{where} {check.stderr.strip()[-500:]}"
        )
    stamp = {
        "key": key,
        "from": describe,
        "build_s": round(seconds, 1),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "python": sys.version.split()[0],
    }
    (tmp / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    shutil.rmtree(site, ignore_errors=True)
    tmp.rename(site)
    return seconds


def built(site: Path, key: str) -> bool:
    try:
        return json.loads((site / STAMP).read_text()).get("key") == key
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def worktree(sha: str) -> Iterator[Path]:
    """The commit checked out (detached) in .cache/bench-ab/src-<sha12>; removed and pruned afterwards."""
    where = CACHE / f"src-{sha[:12]}"
    git("worktree", "prune")
    registered = {
        Path(line.split(" ", 1)[1])
        for line in git("worktree", "list", "--porcelain").splitlines()
        if line.startswith("worktree ")
    }
    if where in registered and (where / ".git").exists() and git("-C", str(where), "rev-parse", "HEAD") == sha:
        say(f"reusing the worktree {where.relative_to(HERE)}")
    else:
        if where in registered:
            git("worktree", "remove", "--force", str(where))
        shutil.rmtree(where, ignore_errors=True)
        where.parent.mkdir(parents=True, exist_ok=True)
        git("worktree", "add", "--detach", "--quiet", str(where), sha)
    try:
        yield where
    finally:
        subprocess.run(
            ["git", "-C", str(HERE), "worktree", "remove", "--force", str(where)], capture_output=True, check=False
        )
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run(["git", "-C", str(HERE), "worktree", "prune"], check=False)


def work_files() -> dict[str, tuple[bytes, bool]]:
    """The working tree's collective/: every tracked or untracked, not ignored file, read once."""
    names = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "collective").split("\0")
    files: dict[str, tuple[bytes, bool]] = {}
    for name in sorted(set(filter(None, names))):
        path = HERE / name
        if path.is_file():  # a tracked file deleted in the working tree is not part of it
            files[name] = (path.read_bytes(), os.access(path, os.X_OK))
    return files


def content_key(files: dict[str, tuple[bytes, bool]]) -> str:
    h = hashlib.sha256()
    for name, (data, executable) in files.items():
        h.update(f"{name}\0{int(executable)}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:12]


def toolchain() -> str:
    """What else a build depends on: a site directory built with another Python, build backend or compiler is not
    reused (both sides are always built by the same toolchain)."""
    parts = [sys.version]
    for dist in ("scikit-build-core", "nanobind"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
    for tool in ("c++", "cmake", "ninja"):
        with contextlib.suppress(OSError):
            proc = subprocess.run([tool, "--version"], capture_output=True, text=True, check=False)
            parts.append(f"{tool} {proc.stdout.splitlines()[0] if proc.stdout else proc.returncode}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def prepare(args: argparse.Namespace, logs: Path) -> tuple[Side, Side]:
    sha = git("rev-parse", "--verify", f"{args.ref}^{{commit}}")
    head = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--", "collective"))
    tools = toolchain()
    a = Side("A", sha[:7], f"{args.ref} ({sha[:12]})", f"{sha} {tools}", CACHE / f"site-{sha[:12]}")
    if built(a.site, a.key):
        say(f"A: {a.describe}: reusing {a.site.relative_to(HERE)}")
    else:
        with worktree(sha) as tree:
            say(f"A: building {a.describe} (log: {logs / 'build-A.log'}) ...")
            a.build_s = install(tree, a.site, a.key, a.describe, logs / "build-A.log")
        say(f"A: built in {a.build_s:.0f} s")
    files = work_files()
    key = content_key(files)
    describe = f"working tree (HEAD {head[:7]}{', collective/ modified' if dirty else ''}; contents {key})"
    b = Side("B", "work", describe, f"{key} {tools}", CACHE / f"site-work-{key}")
    if built(b.site, b.key):
        say(f"B: {b.describe}: reusing {b.site.relative_to(HERE)}")
    else:
        snap = CACHE / f"src-work-{key}"
        shutil.rmtree(snap, ignore_errors=True)
        try:
            for name, (data, executable) in files.items():
                dest = snap / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
                if executable:
                    dest.chmod(0o755)
            say(f"B: building {b.describe} (log: {logs / 'build-B.log'}) ...")
            b.build_s = install(snap, b.site, b.key, b.describe, logs / "build-B.log")
        finally:
            shutil.rmtree(snap, ignore_errors=True)
        say(f"B: built in {b.build_s:.0f} s")
    return a, b


def parse_table(text: str) -> list[dict[str, Any]]:
    """meshccl.bench's nccl-tests-style table, for a build whose bench wrote no JSON."""
    rows = []
    for line in text.splitlines():
        cols = line.split()
        if len(cols) < 9 or line.lstrip().startswith("#") or not cols[0].isdigit():
            continue
        row: dict[str, Any] = {"size": int(cols[0])}
        for place, at in (("out_of_place", 5), ("in_place", 9)):
            with contextlib.suppress(IndexError, ValueError):
                row[place] = {"time_us": float(cols[at]), "wrong": int(cols[at + 3])}
        rows.append(row)
    return rows


def run_bench(side: Side, ranks: int, rnd: int, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    stem = f"{side.name}-n{ranks}-r{rnd}"
    json_path, log = logs / f"{stem}.json", logs / f"{stem}.log"
    json_path.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "meshccl.bench",
        args.collective,
        "--local",
        str(ranks),
        "-b",
        str(args.min),
        "-e",
        str(args.max),
        "-f",
        str(args.factor),
        "-n",
        str(args.iters),
        "-w",
        str(args.warmup),
        "-c",
        str(args.check_iters),
        "--json",
        str(json_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(side.site)}
    t0 = time.monotonic()
    with log.open("w") as out:
        out.write("$ PYTHONPATH=" + str(side.site) + " " + " ".join(argv) + "\n")
        out.flush()
        proc = subprocess.Popen(
            argv, env=env, cwd=side.site, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        rc = wait_group(proc, args.timeout)
        if rc == -1:
            out.write(f"\nmeshccl-ab: killed after {args.timeout} s\n")
    wall = time.monotonic() - t0
    if json_path.exists():
        rows = json.loads(json_path.read_text()).get("rows", [])
    else:
        rows = parse_table(log.read_text(errors="replace"))
    wrong = sum(r.get(p, {}).get("wrong", 0) for r in rows for p in PLACES)
    return {
        "side": side.name,
        "ranks": ranks,
        "round": rnd,
        "rc": rc,
        "wall_s": round(wall, 2),
        "wrong": wrong,
        "log": str(log.relative_to(HERE) if log.is_relative_to(HERE) else log),
        "times_us": {str(r["size"]): {p: r[p]["time_us"] for p in PLACES if p in r} for r in rows},
    }


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def analyse(a: Side, b: Side, args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for ranks in args.ranks:
        for place in PLACES:
            sizes = sorted(
                {
                    int(s)
                    for side in (a, b)
                    for r in side.runs
                    if r["ranks"] == ranks
                    for s, t in r["times_us"].items()
                    if place in t
                }
            )
            for size in sizes:

                def samples(side: Side, ranks: int = ranks, size: int = size, place: str = place) -> dict[int, float]:
                    return {
                        r["round"]: r["times_us"][str(size)][place]
                        for r in side.runs
                        if r["ranks"] == ranks and place in r["times_us"].get(str(size), {})
                    }

                sa, sb = samples(a), samples(b)
                if not sa or not sb:
                    continue
                ma, mb = statistics.median(sa.values()), statistics.median(sb.values())
                paired = [sb[k] / sa[k] for k in sorted(sa.keys() & sb.keys()) if sa[k] > 0]
                ratio = mb / ma if ma > 0 else float("nan")
                noise = max(spread(list(sa.values())), spread(list(sb.values())))
                # SLOWER: B slower in every round, and by more than either side's own spread (a spread needs two
                # rounds of each side); faster: the same the other way.
                verdict = ""
                if len(paired) > 1 and min(paired) > 1 and ratio - 1 > noise:
                    verdict = "SLOWER"
                elif len(paired) > 1 and max(paired) < 1 and 1 / ratio - 1 > noise:
                    verdict = "faster"
                out.append(
                    {
                        "ranks": ranks,
                        "place": place,
                        "size": size,
                        "a_us": sa,
                        "b_us": sb,
                        "a_median_us": ma,
                        "b_median_us": mb,
                        "ratio": ratio,
                        "paired_min": min(paired, default=None),
                        "paired_max": max(paired, default=None),
                        "spread_a": spread(list(sa.values())),
                        "spread_b": spread(list(sb.values())),
                        "verdict": verdict,
                    }
                )
    return out


def report(data: dict[str, Any], rows: list[dict[str, Any]], places: list[str]) -> str:
    s = data["settings"]
    a, b = data["sides"]["A"], data["sides"]["B"]

    def built_how(side: dict[str, Any]) -> str:
        return "reused" if side["build_s"] is None else f"built in {side['build_s']:.0f} s"

    lines = [
        f"# meshccl A/B: {s['collective']}, A = {a['describe']}, B = {b['describe']}",
        "",
        f"{data['date']}, {os.cpu_count()} CPUs, load average {data['load_start']} at the start, "
        f"{data['load_end']} at the end. {s['rounds']} rounds, interleaved (the order swapped every round); "
        f"`meshccl.bench {s['collective']} --local N -b {human(s['min'])} -e {human(s['max'])} -f {s['factor']:g} "
        f"-n {s['iters']} -w {s['warmup']} -c {s['check_iters']}` of each side's own build. "
        f"A: {built_how(a)}; B: {built_how(b)}.",
        "",
        "Time: meshccl.bench's time per call (mean over ranks), median over rounds. B/A: the ratio of the medians; "
        "per round: min..max of each round's B/A; spread: (max-min)/median of a side's rounds. SLOWER: B slower in "
        "every round and B/A - 1 above the larger spread (faster: the same the other way).",
    ]
    busy = float(data["load_start"].split()[0]) / (os.cpu_count() or 1)
    if busy >= 0.5:
        lines += [
            "",
            f"**The machine was busy before this run started (load average {busy:.1f} per CPU): other "
            "work shares the cores, and the figures carry its noise. Rerun on an idle machine before "
            "reading a ratio as a verdict.**",
        ]
    failed = [r for side in (a, b) for r in side["runs"] if r["rc"] != 0 or r["wrong"]]
    for r in failed:
        lines += [
            "",
            f"**{r['side']}, {r['ranks']} ranks, round {r['round']}: exit {r['rc']}, {r['wrong']} wrong "
            f"values; see {r['log']}**",
        ]
    for place in places:
        for ranks in s["ranks"]:
            part = [r for r in rows if r["ranks"] == ranks and r["place"] == place]
            if not part:
                continue
            lines += [
                "",
                f"## {ranks} ranks, {PLACES[place]}",
                "",
                "| size | A (us) | B (us) | B/A | per round | spread A | spread B | |",
                "|---:|---:|---:|---:|---:|---:|---:|---|",
            ]
            for r in part:
                per_round = "-" if r["paired_min"] is None else f"{r['paired_min']:.3f}..{r['paired_max']:.3f}"
                lines.append(
                    f"| {human(r['size'])} | {r['a_median_us']:.1f} | {r['b_median_us']:.1f} | "
                    f"{r['ratio']:.3f} | {per_round} | {r['spread_a']:.1%} | {r['spread_b']:.1%} | "
                    f"{r['verdict']} |"
                )
    slower = [r for r in rows if r["verdict"] == "SLOWER" and r["place"] in places]
    named = [f"{r['ranks']} ranks {human(r['size'])} {PLACES[r['place']]} ({r['ratio']:.3f})" for r in slower]
    lines += ["", "B slower than A beyond the spread: " + (", ".join(named) or "none")]
    if s["rounds"] < 2:
        lines.append("(one round: no spread, so no verdict; run at least 2 rounds, 5 for a verdict to rely on)")
    elif s["rounds"] < 3:
        lines.append("(two rounds: each spread rests on two samples per side, a rough bound)")
    return "\n".join(lines) + "\n"


def interrupted(signum: int, _frame: object) -> None:
    """SIGTERM ends the run as Ctrl-C does: the running benchmark is killed, the worktree and snapshot removed."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True, help="A: the commit to compare against (any commit-ish: HEAD~1, main)")
    ap.add_argument("--ranks", default="2,4", help="rank counts, comma list (2,4)")
    ap.add_argument("--min", type=parse_size, default=parse_size("4K"), help="smallest size, K/M/G (4K)")
    ap.add_argument("--max", type=parse_size, default=parse_size("64M"), help="largest size (64M)")
    ap.add_argument("--factor", type=float, default=4.0, help="factor between sizes (4)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; each runs both sides, the order swapped (5)")
    ap.add_argument("--collective", default="all_reduce", choices=COLLECTIVES, help="(all_reduce)")
    ap.add_argument("--iters", type=int, default=50, help="meshccl.bench -n: timed calls per size (50)")
    ap.add_argument("--warmup", type=int, default=5, help="meshccl.bench -w: warm-up calls (5)")
    ap.add_argument("--check-iters", type=int, default=1, help="meshccl.bench -c: checked calls, 0: none (1)")
    ap.add_argument(
        "--place",
        choices=["out_of_place", "in_place", "both"],
        default="both",
        help="which of meshccl.bench's timings to report (both)",
    )
    ap.add_argument("--label", help="names the results (default: the ref's short sha)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before one benchmark run is killed (600)")
    ap.add_argument("--out", type=Path, default=HERE / "bench" / "results", help="output directory (bench/results)")
    args = ap.parse_args(argv)
    try:
        args.ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--ranks: a comma list of integers, not {args.ranks!r}")
    if not args.ranks or min(args.ranks) < 1:
        ap.error("--ranks: at least one rank count, each >= 1")
    if args.min <= 0 or args.max < args.min or args.factor <= 1:
        ap.error("need 0 < --min <= --max and --factor > 1")
    if args.rounds < 1 or args.iters < 1:
        ap.error("--rounds and --iters must be >= 1")
    sha = git("rev-parse", "--verify", f"{args.ref}^{{commit}}")
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", args.label or sha[:7])
    out = args.out.resolve()
    logs = out / "logs" / f"ab-meshccl-{label}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    signal.signal(signal.SIGTERM, interrupted)
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    a, b = prepare(args, logs)
    places = list(PLACES) if args.place == "both" else [args.place]
    t0 = time.monotonic()
    for rnd in range(1, args.rounds + 1):
        for ranks in args.ranks:
            for side in (a, b) if rnd % 2 else (b, a):
                run = run_bench(side, ranks, rnd, args, logs)
                side.runs.append(run)
                first = next(iter(run["times_us"].values()), {}).get("out_of_place")
                say(
                    f"round {rnd}/{args.rounds}: {side.name} ({side.label}), {ranks} ranks: exit {run['rc']}, "
                    f"{len(run['times_us'])} sizes in {run['wall_s']:.1f} s"
                    + (f", smallest {first:.1f} us" if first is not None else "")
                )
    bench_s = time.monotonic() - t0
    rows = analyse(a, b, args)
    data: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_start": load_start,
        "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "bench_s": round(bench_s, 1),
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "ref_sha": sha, "label": label},
        "sides": {
            s.name: {
                "label": s.label,
                "describe": s.describe,
                "key": s.key,
                "site": str(s.site),
                "build_s": None if s.build_s is None else round(s.build_s, 1),
                "runs": s.runs,
            }
            for s in (a, b)
        },
        "results": rows,
    }
    text = report(data, rows, places)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ab-meshccl-{label}.md").write_text(text)
    (out / f"ab-meshccl-{label}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(text, end="")
    say(f"benchmark runs took {bench_s:.0f} s; wrote {out / f'ab-meshccl-{label}'}.{{md,json}}")
    failed = [r for s in (a, b) for r in s.runs if r["rc"] != 0 or r["wrong"]]
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        say("interrupted: the running build or benchmark killed, the worktree and snapshot removed")
        sys.exit(130)
