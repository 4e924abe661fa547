"""bench/ddp.py end to end on this machine: DDP over Gloo, meshccl (same-host transport) and
meshccl over TCP, real ranks, a tiny model cut into several buckets, one short run.

A benchmark asserts no timing; this checks that every job trained, every figure the report is
made of was measured, and that the bench's own correctness checks hold: every rank of a job ends
with the same parameters bit for bit, and meshccl's match Gloo's after the same steps on the same
data up to float32 summation order (the bound of tests/meshccl/test_torch_backend.py, 1e-5).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DDP = REPO / "bench" / "ddp.py"
LIBS = ("gloo", "meshccl", "meshccl-tcp")


def test_loopback_ddp_bench_three_ranks(tmp_path: Path) -> None:
    argv = [sys.executable, str(DDP), "loopback", "--ranks", "3", "--libs", ",".join(LIBS)]
    # 32 -> 64 -> 64 -> 64 -> 10: 10,954 parameters; a 10 kB bucket cap gives DDP several buckets.
    argv += ["--inputs", "32", "--width", "64", "--depth", "4", "--classes", "10", "--batch", "8"]
    argv += ["--bucket-mb", "0.01", "-r", "2", "--steps", "3", "-w", "2", "--compute-steps", "1"]
    argv += ["--bucket-iters", "1", "--lr", "0.05", "--timeout", "120", "--out", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    data = json.loads((tmp_path / "ddp-loopback.json").read_text())
    assert data["status"] == {}, data["status"]
    assert data["params"]["parameters"] == 32 * 64 + 64 + 2 * (64 * 64 + 64) + 64 * 10 + 10
    assert sum(data["bucket_numel"]) == data["params"]["parameters"]
    assert len(data["bucket_numel"]) >= 3
    assert len(data["rounds"]) == 2
    for lib in LIBS:
        med = data["medians"][lib]
        for metric in ("step", "fb", "opt", "ar_busy", "ar_span", "compute", "alone"):
            assert med[metric] is not None and med[metric] > 0, (lib, metric, med)
        assert med["ar_busy"] <= med["ar_span"] + 1e-9
        for r in data["rounds"]:
            assert len(r[lib]["bucket_ddp"]) == len(r[lib]["bucket_alone"]) == len(data["bucket_numel"])
            assert [len(steps) for steps in r[lib]["per_rank_step_s"]] == [3, 3, 3]
        check = data["parameter_check"][lib]
        assert check["ranks_identical"], (lib, check)
        assert check["steps"] == 2 + 3 + 1 + 3  # warm-up, round 1, one warm-up step, round 2
        if lib != "gloo":
            assert check["max_abs_diff_vs_gloo"] <= 1e-5, (lib, check)

    text = (tmp_path / "ddp-loopback.md").read_text()
    assert "| step time |" in text
    assert "gloo ÷ meshccl | gloo ÷ meshccl-tcp |" in text
    assert "Gloo's shared-memory all-reduce:" in text
    assert done.stdout == text + "\n"  # the report is also printed
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "ddp-loopback.png").stat().st_size > 10_000
    else:
        assert "no plot: matplotlib is not installed" in done.stderr


def test_a_job_that_cannot_start_is_named_and_the_other_still_runs(tmp_path: Path) -> None:
    """meshccl's ranks refuse a bad setting at start-up: the report names the job and the rank's
    own error; Gloo's job still trains and is reported."""
    argv = [sys.executable, str(DDP), "loopback", "--ranks", "2", "--libs", "gloo,meshccl", "--width", "16"]
    argv += ["--inputs", "8", "--depth", "2", "--classes", "2", "--batch", "2", "-r", "1", "--steps", "1", "-w", "1"]
    argv += ["--start-timeout", "60", "--out", str(tmp_path)]
    env = {**os.environ, "MESHCCL_TIMEOUT": "soon"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "ddp-loopback.json").read_text())
    assert list(data["status"]) == ["meshccl"]
    assert "not run" in data["status"]["meshccl"]
    assert "MESHCCL_TIMEOUT='soon' is not a valid float" in data["status"]["meshccl"]
    assert data["medians"]["gloo"]["step"] > 0
    assert "meshccl" not in data["medians"]
    assert "- **meshccl**: not run:" in done.stdout
