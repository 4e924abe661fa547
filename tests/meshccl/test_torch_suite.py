"""meshccl under PyTorch's own distributed tests: a selection of torch's _DistTestBase (torch_suite_run.SELECTIONS:
the collectives, p2p with tags and from any rank, sparse all_reduce, timeouts, object collectives, a full group and
DDP on CPU), run as PyTorch runs the suite for Gloo (tests/meshccl/torch_suite.py, every gate opened where it opens for
Gloo), at WORLD_SIZE=2. Every selected test passes under Gloo on this machine's CPU torch;
each must pass under meshccl. The whole suite against both backends, with its table: `make torch-suite`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from . import torch_suite_run


def test_torchs_own_tests_of_every_collective_groups_and_ddp_pass_under_meshccl(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, torch_suite_run.__file__, "--backends", "meshccl", "--select", "make-test",
         "--expect-pass", "--out", str(tmp_path), "--timeout", "900"],
        capture_output=True, text=True, timeout=1000, check=False,
    )  # fmt: skip
    shown = f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, shown
    found = json.loads((tmp_path / "suite-w2.json").read_text())["meshccl"]
    assert sorted(found) == sorted(torch_suite_run.SELECTIONS["make-test"]), shown
    assert {r["outcome"] for r in found.values()} == {"passed"}, shown
