#!/usr/bin/env python3
"""PyTorch's own distributed tests (tests/meshccl/torch_suite.py) against meshccl and Gloo, side by side.

Each backend runs the same tests in its own pytest process (BACKEND and WORLD_SIZE in the environment, a fresh job
token for meshccl), with a JUnit report; by default (--gates gloo) the suite's gates open for meshccl where they open
for Gloo (torch_suite.py says how, and names the tests left out). Then one table per test: what Gloo did, what
meshccl did, why a test was skipped or failed. A test Gloo passes and meshccl does not is a regression (exit status
1); so is any failure of a test with --expect-pass.

  .venv/bin/python tests/meshccl/torch_suite_run.py                       # every CPU test, WORLD_SIZE=2, both
  .venv/bin/python tests/meshccl/torch_suite_run.py -n 8 -k "group"       # the group tests at 8 ranks
  .venv/bin/python tests/meshccl/torch_suite_run.py --backends meshccl --select make-test --expect-pass

Output (--out, .cache/torch-suite/): <backend>-w<N>.xml (pytest's JUnit report), suite-w<N>.md (the table, also
printed) and suite-w<N>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SUITE = HERE / "torch_suite.py"

# What `make test` runs (tests/meshccl/test_torch_suite.py), about 2 minutes here: all_reduce (sync, async,
# complex, a full group), broadcast, reduce, all_gather and all_gather_coalesced, gather, scatter, barrier,
# send/recv, isend/irecv and DDP on CPU, and what the suite keeps for Gloo by name - each a test Gloo passes at
# WORLD_SIZE=2. Not here: what the suite runs only for MPI (CPU all_to_all), only on CUDA, or only at other world
# sizes (the *_group tests need 8 ranks). The whole suite: `make torch-suite`.
SELECTIONS = {
    "make-test": [
        "test_all_reduce_sum",
        "test_all_reduce_sum_async",
        "test_all_reduce_sum_complex",
        "test_all_reduce_full_group_max",
        "test_broadcast",
        "test_broadcast_full_group",
        "test_reduce_sum_twice",
        "test_reduce_full_group_min",
        "test_all_gather",
        "test_all_gather_full_group",
        "test_all_gather_coalesced_simple",
        "test_all_gather_coalesced_with_empty",
        "test_gather",
        "test_scatter",
        "test_scatter_full_group",
        "test_barrier_full_group",
        "test_send_recv",
        "test_isend",
        "test_irecv",
        "test_get_rank_size_full_group",
        "test_DistributedDataParallelCPU",
        # What the suite keeps for Gloo by name (gates opened as for Gloo): tags, any source, sparse, coalesced
        # all_reduce, a barrier's timeout, the group's monitored_barrier, object collectives.
        "test_send_recv_with_tag",
        "test_batch_isend_irecv_gloo_tags",
        "test_send_recv_any_source",
        "test_sparse_all_reduce_sum",
        "test_all_reduce_coalesced_sum",
        "test_barrier_timeout_full_group",
        "test_monitored_barrier_gloo_rank_0_timeout",
        "test_all_gather_object_default_pg",
        "test_scatter_object_list",
    ]
}


LEFT_OUT = "left out for meshccl: "  # how torch_suite.py's LEFT_OUT skips begin


def say(text: str) -> None:
    print(f"torch-suite: {text}", file=sys.stderr, flush=True)


def run_backend(
    backend: str, world: int, keyword: str | None, tests: list[str], out: Path, timeout: float, gates: str = "gloo"
) -> Path:
    """pytest of the suite for one backend; its JUnit report."""
    report = out / f"{backend}-w{world}.xml"
    report.unlink(missing_ok=True)
    where = [f"{SUITE}::TestDistBackendWithSpawn::{name}" for name in tests] or [str(SUITE)]
    argv = [sys.executable, "-m", "pytest", *where, "-q", "-p", "no:cacheprovider", "--junitxml", str(report)]
    argv += ["-o", "junit_family=xunit1", "-o", "addopts="]
    if keyword:
        argv += ["-k", keyword]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHCCL_") and k not in ("COLUMNS", "LINES")}
    env.update(
        BACKEND=backend,
        WORLD_SIZE=str(world),
        SUITE_GATES=gates,
        MESHCCL_TOKEN=secrets.token_hex(32),
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PYTHONWARNINGS="ignore::FutureWarning,ignore::DeprecationWarning",
    )
    shown = f"{len(tests)} tests" if tests else SUITE.name
    say(f"{backend}, WORLD_SIZE={world}: pytest {shown}{' -k ' + repr(keyword) if keyword else ''} ...")
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, cwd=REPO, timeout=timeout, check=False, capture_output=True, text=True)
    took = time.monotonic() - t0
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    say(f"{backend}, WORLD_SIZE={world}: {tail} ({took:.0f} s)")
    if not report.exists():
        raise SystemExit(
            f"torch-suite: pytest wrote no report for {backend}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return report


def outcomes(report: Path) -> dict[str, dict[str, Any]]:
    """test name -> {outcome: passed|failed|skipped, seconds, why}."""
    found: dict[str, dict[str, Any]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "")
        seconds = float(case.get("time") or 0)
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                why = reason(node.get("message") or "", node.text or "")
                break
        found[name] = {"outcome": outcome, "seconds": round(seconds, 2), "why": why[:300]}
    return found


def reason(message: str, text: str) -> str:
    """The line that says why: for a spawned rank's failure, the first error a rank raised (pytest's "E   ..." lines
    after "Process N exited with error code"), else the report's first line."""
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    ranks = [e for e in errors if e and not e.startswith(("RuntimeError: Process", "Process "))]
    if ranks:
        return ranks[0]
    return next((line.strip() for line in (message or text).splitlines() if line.strip()), "")


def table(results: dict[str, dict[str, dict[str, Any]]], world: int, gates: str = "gloo") -> str:
    backends = list(results)
    names = sorted({name for found in results.values() for name in found})
    lines = [f"# PyTorch's distributed suite (_DistTestBase), WORLD_SIZE={world}, gates as for {gates}", ""]
    lines += ["| backend | passed | failed | skipped | seconds |", "|---|---|---|---|---|"]
    for b in backends:
        count = {k: sum(1 for r in results[b].values() if r["outcome"] == k) for k in ("passed", "failed", "skipped")}
        seconds = sum(r["seconds"] for r in results[b].values())
        lines.append(f"| {b} | {count['passed']} | {count['failed']} | {count['skipped']} | {seconds:.0f} |")
    left = {n: r["why"] for n, r in results.get("meshccl", {}).items() if r["why"].startswith(LEFT_OUT)}
    if left:
        lines += ["", "Left out for meshccl (torch_suite.LEFT_OUT), and why:", ""]
        lines += [f"- {name}: {why[len(LEFT_OUT) :]}" for name, why in sorted(left.items())]
    lines += ["", "Tests whose outcome differs between the backends, or that failed:", ""]
    lines += ["| test | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    for name in names:
        cells = [results[b].get(name, {"outcome": "-", "why": ""}) for b in backends]
        if len({c["outcome"] for c in cells}) > 1 or any(c["outcome"] == "failed" for c in cells):
            shown = [
                c["outcome"] + (f": {c['why'][:140]}" if c["outcome"] != "passed" and c["why"] else "") for c in cells
            ]
            lines.append(f"| {name} | " + " | ".join(s.replace("|", "/") for s in shown) + " |")
    return "\n".join(lines) + "\n"


def regressions(results: dict[str, dict[str, dict[str, Any]]], expect_pass: bool) -> list[str]:
    mesh = results.get("meshccl", {})
    bad = []
    for name, r in mesh.items():
        gloo = results.get("gloo", {}).get(name)
        if r["why"].startswith(LEFT_OUT):  # named in torch_suite.LEFT_OUT, with why: not a regression
            continue
        if gloo and gloo["outcome"] == "passed" and r["outcome"] != "passed":
            bad.append(f"{name}: Gloo passed, meshccl {r['outcome']}: {r['why']}")
        elif expect_pass and r["outcome"] != "passed":
            bad.append(f"{name}: meshccl {r['outcome']}: {r['why']}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="gloo,meshccl", help="comma list, run in this order (gloo,meshccl)")
    ap.add_argument("-n", "--world-size", type=int, default=2, help="ranks per test (2)")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression over the suite's test names")
    ap.add_argument("--select", choices=sorted(SELECTIONS), help="a named selection of tests (make-test)")
    ap.add_argument(
        "--gates",
        choices=("gloo", "own"),
        default="gloo",
        help="gloo: the suite's gates open for meshccl where they open for Gloo (default); own: its verdict for "
        "a backend named meshccl",
    )
    ap.add_argument("--expect-pass", action="store_true", help="any meshccl test not passed fails the run")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per backend's run (3600)")
    ap.add_argument("--out", type=Path, default=REPO / ".cache" / "torch-suite", help="(.cache/torch-suite)")
    args = ap.parse_args(argv)
    if args.world_size < 2:
        ap.error("-n: the suite needs 2 ranks or more")
    backends = [b for b in args.backends.split(",") if b]
    if not backends or any(b not in ("gloo", "meshccl") for b in backends):
        ap.error(f"--backends {args.backends!r}: gloo and/or meshccl")
    args.out.mkdir(parents=True, exist_ok=True)
    tests = SELECTIONS.get(args.select or "", [])
    results = {
        b: outcomes(run_backend(b, args.world_size, args.keyword, tests, args.out, args.timeout, args.gates))
        for b in backends
    }
    if tests:
        for b, found in results.items():
            missing = [t for t in tests if t not in found]
            if missing:
                raise SystemExit(f"torch-suite: {b} ran no test named {', '.join(missing)} (renamed in this torch?)")
    text = table(results, args.world_size, "Gloo" if args.gates == "gloo" else "each backend's own name")
    stem = args.out / f"suite-w{args.world_size}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)
    bad = regressions(results, args.expect_pass)
    for line in bad:
        say(f"REGRESSION {line}")
    say(f"wrote {stem.with_suffix('.md')} and .json")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
