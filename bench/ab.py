#!/usr/bin/env python3
"""A/B: this checkout against another revision, on the same machine in the same hour, interleaved.

This machine's speed drifts from day to day (shared/LAB-NOTES.md, 2026-11-28), so a change is judged against its
base measured beside it, never against a reference file of another day. The base revision is checked out in a
temporary git worktree (the shared virtual environment, its own code first on PYTHONPATH); then, for --rounds
rounds, each tree runs the same benchmarks, the order swapped every round (A B, B A, ...):

  scale      bench/scale.py --sizes SIZES --tree TREE: that tree's setup.yml's first run on a fresh lab ring, the
             no-change run, launch.yml (every check, a trivial program, 2 ranks per host). The labs are built by
             this checkout for both trees: the fixture is held equal, only the measured playbooks and code differ
  launch     bench/launch.py -r 1 of that tree on one lab ring of --launch-hosts hosts converged once (by this
             checkout's setup.yml): `meshkit launch` from the remembered plan, `--recheck`, launch.yml, mpirun

  .venv/bin/python bench/ab.py --base 4bc008d                      # sizes 4,16, 2 rounds (root)
  .venv/bin/python bench/ab.py --base main~3 --sizes 4 --rounds 3 --skip launch

Output: --out (bench/results/ab/): each run's own results and logs, ab.json (every figure) and ab.md (per measure:
both trees' runs, their medians, change/base), also printed. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "bench"))
from lab import ansible_env  # noqa: E402

from meshkit import lab_claims  # noqa: E402 - this checkout's, whatever PYTHONPATH says

SCALE_STEPS = {"setup_first": "setup.yml first run", "setup_again": "no-change run", "launch": "launch.yml"}
LAUNCH_VARIANTS = ("meshkit launch", "meshkit launch --recheck", "launch.yml", "host checks", "launcher only")
OCTETS = range(200, 150, -1)  # scale.py takes 202-248, the tests 1 upwards


def say(text: str) -> None:
    print(f"ab: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def base_tree(rev: str) -> Iterator[Path]:
    sha = subprocess.run(["git", "-C", str(HERE), "rev-parse", rev], capture_output=True, text=True, check=True)
    where = Path(tempfile.mkdtemp(prefix="meshkit-ab-")) / "base"
    subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(where), sha.stdout.strip()], check=True)
    (where / ".venv").symlink_to(HERE / ".venv")
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(where)], check=False)
        shutil.rmtree(where.parent, ignore_errors=True)


def run(argv: list[str], tree: Path, log: Path, cwd: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.run(argv, env=ansible_env(tree), cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False)
    return proc.returncode


def scale_round(who: str, tree: Path, rnd: int, args: argparse.Namespace) -> dict[str, Any]:
    out = args.out / f"scale-{who}-r{rnd}"
    say(f"round {rnd}: {who}: bench/scale.py --sizes {args.sizes} ...")
    argv = [sys.executable, str(HERE / "bench" / "scale.py"), "--sizes", args.sizes, "--label", f"{who}-r{rnd}"]
    argv += ["--out", str(out), "--name-prefix", f"ab{who[0]}", "--tree", str(tree)]
    rc = run(argv, HERE, out / "scale.log", HERE)
    data = json.loads((out / "scale.json").read_text()) if (out / "scale.json").exists() else {}
    figures = {}
    for size in data.get("sizes_run", []):
        for step, record in (size.get("runs") or {}).items():
            changed = sum(h.get("changed", 0) for h in (record.get("recap") or {}).values())
            figures[f"{size['hosts']}:{step}"] = {"wall_s": record.get("wall_s"), "failed": record.get("failed"),
                                                  "changed": changed}  # fmt: skip
    say(f"round {rnd}: {who}: exit {rc}; " + ", ".join(f"{k} {v['wall_s']} s" for k, v in figures.items()))
    return {"rc": rc, "figures": figures}


@contextlib.contextmanager
def launch_lab(args: argparse.Namespace, work: Path) -> Iterator[Path]:
    """One lab ring, converged by this checkout's setup.yml from ``work`` (so its artifacts, and both trees'
    launches, use ``work``/artifacts)."""
    subnet = lab_claims.first_free(OCTETS)
    if subnet is None:
        raise SystemExit("ab: no free 198.19.x.0/24 for the launch lab")
    name = f"abl{args.launch_hosts}"
    variables = ["-e", f"lab_name={name}", "-e", f"lab_size={args.launch_hosts}", "-e", "lab_shape=ring",
                 "-e", f"lab_mgmt_subnet={subnet}"]  # fmt: skip
    lab = HERE / "playbooks" / "lab.yml"
    try:
        if run(["ansible-playbook", str(lab), *variables], HERE, work / "lab-up.log", HERE) != 0:
            raise SystemExit(f"ab: the launch lab did not build; see {work / 'lab-up.log'}")
        inventory = HERE / "inventory" / f"{name}.yml"
        if run(["ansible-playbook", "-i", str(inventory), str(HERE / "setup.yml")], HERE, work / "setup.log", work):
            raise SystemExit(f"ab: setup.yml failed on the launch lab; see {work / 'setup.log'}")
        yield inventory
    finally:
        run(["ansible-playbook", str(lab), *variables, "-e", "lab_state=absent"], HERE, work / "lab-down.log", HERE)
        lab_claims.release(subnet)


def launch_round(who: str, tree: Path, rnd: int, inventory: Path, work: Path, args: argparse.Namespace) -> dict:
    out = args.out / f"launch-{who}-r{rnd}"
    say(f"round {rnd}: {who}: bench/launch.py -r 1 ...")
    argv = [sys.executable, str(tree / "bench" / "launch.py"), "-i", str(inventory), "-r", "1", "--out", str(out)]
    rc = run(argv, tree, out / "launch.log", work)
    data = json.loads((out / "launch.json").read_text()) if (out / "launch.json").exists() else {}
    samples = {name: values for name, values in (data.get("samples") or {}).items() if name in LAUNCH_VARIANTS}
    say(f"round {rnd}: {who}: exit {rc}; " + ", ".join(f"{k} {v}" for k, v in samples.items()))
    return {"rc": rc, "samples": samples}


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def report(data: dict[str, Any]) -> str:
    lines = [
        f"# A/B: {data['change']} against {data['base']} ({data['date']}, {data['rounds']} rounds, interleaved)",
        "",
        "Each cell: every round's figure in seconds, then the median; change/base is the ratio of the medians.",
        "",
        "| measure | base | change | change/base |",
        "|---|---|---|---|",
    ]
    keys: list[str] = []
    for who in ("base", "change"):
        for rnd in data["scale"][who]:
            keys += [k for k in rnd["figures"] if k not in keys]
    for key in keys:
        hosts, step = key.split(":")
        cells, medians = [], []
        for who in ("base", "change"):
            values = [rnd["figures"].get(key, {}).get("wall_s") for rnd in data["scale"][who]]
            changed = [rnd["figures"].get(key, {}).get("changed") for rnd in data["scale"][who]]
            m = median(values)
            medians.append(m)
            shown = ", ".join("-" if v is None else f"{v:.1f}" for v in values)
            note = f" (changed {', '.join(map(str, changed))})" if step == "setup_again" else ""
            cells.append(f"{shown}; **{m:.1f}**{note}" if m is not None else "failed")
        ratio = f"{medians[1] / medians[0]:.2f}" if None not in medians and medians[0] else "-"
        lines.append(f"| {hosts} hosts, {SCALE_STEPS.get(step, step)} | {cells[0]} | {cells[1]} | {ratio} |")
    for name in LAUNCH_VARIANTS:
        cells, medians = [], []
        for who in ("base", "change"):
            values = [v for rnd in data["launch"].get(who, []) for v in rnd["samples"].get(name, [])]
            m = median(values)
            medians.append(m)
            cells.append(f"{', '.join(f'{v:.2f}' for v in values)}; **{m:.2f}**" if m is not None else "-")
        if medians == [None, None]:
            continue
        ratio = f"{medians[1] / medians[0]:.2f}" if None not in medians and medians[0] else "-"
        lines.append(f"| {data['launch_hosts']} hosts x 2 ranks, {name} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the revision to compare against (a commit, branch or tag)")
    ap.add_argument("--sizes", default="4,16", help="scale.py's lab sizes (4,16)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each runs both trees, the order swapped (2)")
    ap.add_argument("--launch-hosts", type=int, default=4, help="hosts of the launch benchmark's lab ring (4)")
    ap.add_argument("--skip", choices=["scale", "launch"], action="append", default=[], help="leave a benchmark out")
    ap.add_argument("--out", type=Path, default=HERE / "bench" / "results" / "ab", help="(bench/results/ab)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        say("the labs need root (network namespaces, one sshd per host)")
        return 2
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "-C", str(HERE), "describe", "--always", "--dirty"], capture_output=True, text=True,
                          check=False)  # fmt: skip
    data: dict[str, Any] = {"base": args.base, "change": head.stdout.strip(), "date": time.strftime("%Y-%m-%d %H:%M"),
                            "rounds": args.rounds, "sizes": args.sizes, "launch_hosts": args.launch_hosts,
                            "scale": {"base": [], "change": []}, "launch": {"base": [], "change": []}}  # fmt: skip
    with base_tree(args.base) as base:
        trees = {"base": base, "change": HERE}
        order = ["base", "change"]
        if "scale" not in args.skip:
            for rnd in range(1, args.rounds + 1):
                for who in order if rnd % 2 else order[::-1]:
                    data["scale"][who].append(scale_round(who, trees[who], rnd, args))
                (args.out / "ab.json").write_text(json.dumps(data, indent=1) + "\n")
        if "launch" not in args.skip:
            work = args.out / "launch-work"
            work.mkdir(exist_ok=True)
            with launch_lab(args, work) as inventory:
                for rnd in range(1, args.rounds + 1):
                    for who in order if rnd % 2 else order[::-1]:
                        data["launch"][who].append(launch_round(who, trees[who], rnd, inventory, work, args))
    (args.out / "ab.json").write_text(json.dumps(data, indent=1) + "\n")
    text = report(data)
    (args.out / "ab.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
