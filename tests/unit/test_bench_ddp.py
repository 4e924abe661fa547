"""bench/ddp.py's arithmetic and report, on made-up figures (no processes, no lab).

The end-to-end run (real ranks, Gloo and meshccl) is tests/meshccl/test_bench_ddp.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import ddp  # noqa: E402
import ddp_worker  # noqa: E402


def test_union_of_bucket_intervals() -> None:
    ev = [(0, 0.0, 1.0, 1), (1, 0.5, 2.0, 1), (2, 3.0, 3.5, 1), (3, 3.2, 3.4, 1)]
    assert ddp_worker._union(ev) == pytest.approx(2.5)  # [0, 2] and [3, 3.5]
    assert ddp_worker._union([]) == 0.0


def test_parameter_count_matches_the_model() -> None:
    cfg = {"inputs": 16, "width": 32, "depth": 3, "classes": 5, "seed": 1}
    model = ddp_worker.build_model(cfg)
    assert (
        ddp_worker.parameter_count(cfg)
        == sum(p.numel() for p in model.parameters())
        == 16 * 32 + 32 + 32 * 32 + 32 + 32 * 5 + 5
    )
    default = {"inputs": 1024, "width": 2048, "depth": 5, "classes": 1000}
    assert 10e6 <= ddp_worker.parameter_count(default) <= 25e6  # the 10-25 M


def _round(step: float, busy: float, alone: float) -> dict[str, Any]:
    return {
        "step": step,
        "fb": step * 0.9,
        "opt": step * 0.1,
        "ar_busy": busy,
        "ar_span": busy,
        "compute": 0.2,
        "exposed": step * 0.9 - 0.2,
        "alone": alone,
        "bucket_ddp": [busy * 0.6, busy * 0.4],
        "bucket_issued": [0.1, 0.3],
        "bucket_alone": [alone * 0.6, alone * 0.4],
        "loss": 6.9,
    }


def _run(shape: str, gloo_busy: float, mesh_busy: float) -> ddp.Run:
    model = {"inputs": 1024, "width": 2048, "depth": 5, "classes": 1000, "batch": 32, "bucket_mb": 25, "lr": 0.01}
    model |= {"seed": 1, "threads": 1}
    params = {"rounds": 3, "steps": 10, "warmup": 3, "compute_steps": 5, "bucket_iters": 3, "rate": "1gbit"}
    params["parameters"] = ddp_worker.parameter_count(model)
    run = ddp.Run("lab", 4, ["gloo", "meshccl"], model, params, shape=shape, link_rate=1e9 / 8)
    run.buckets = [10_000_000, 6_000_000]
    for i in range(3):  # round 2 is an outlier for both: the medians must ignore it
        k = 3.0 if i == 1 else 1.0
        run.rounds.append({"gloo": _round(1.4 * k, gloo_busy * k, 0.84 * k), "meshccl": _round(1.0, mesh_busy, 0.36)})
    run.check = {
        "gloo": {"steps": 30, "ranks_identical": True, "sha256_rank0": "a"},
        "meshccl": {"steps": 30, "ranks_identical": True, "sha256_rank0": "b", "max_abs_diff_vs_gloo": 3e-9},
    }
    run.check["meshccl"]["max_abs_param"] = 0.03
    return run


def test_report_medians_ratios_and_targets() -> None:
    run = _run("mesh", gloo_busy=0.9, mesh_busy=0.4)
    assert run.median("gloo", "ar_busy") == pytest.approx(0.9)
    text = ddp.markdown(run)
    assert "| step time | 1400.0 | 1000.0 | 1.40 |" in text
    assert "| gradient all-reduce in DDP: time any bucket is in flight | 900.0 | 400.0 | 2.25 |" in text
    # busbw alone = 64e6 B / 0.36 s * 1.5 / 125e6 B/s
    assert (
        f"| all-reduce alone: busbw ÷ link rate | {64e6 / 0.84 * 1.5 / 125e6:.2f} | {64e6 / 0.36 * 1.5 / 125e6:.2f} |"
        in text
    )
    assert (
        "- meshccl gradient all-reduce in DDP: 900.0 ms (Gloo) / 400.0 ms = 2.25x; target >= 2.0x on the mesh: met"
        in text
    )
    assert (
        "- meshccl gradient all-reduce alone: 840.0 ms (Gloo) / 360.0 ms = 2.33x; target >= 2.0x on the mesh: met"
        in text
    )
    assert "meshccl step time: 1400.0 ms (Gloo) / 1000.0 ms = 1.40x (no target)" in text
    assert "max |parameter - Gloo's| = 3e-09" in text
    data = run.to_json()
    assert data["medians"]["meshccl"]["ar_busy"] == pytest.approx(0.4)


def test_report_says_not_met_on_the_ring() -> None:
    text = ddp.markdown(_run("ring", gloo_busy=0.9, mesh_busy=0.7))
    assert "= 1.29x; target >= 1.5x on the ring: NOT met" in text


def test_ranks_that_disagree_fail_the_run() -> None:
    run = _run("mesh", 0.9, 0.4)
    assert not ddp._bad_check(run)
    run.check["meshccl"]["ranks_identical"] = False
    assert ddp._bad_check(run)
    assert "every rank's parameters DIFFER" in ddp.markdown(run)


def test_gloo_shm_scan(tmp_path: Path) -> None:
    lib = tmp_path / "libtorch_cpu.so"
    lib.write_bytes(b"\0" * 100 + b"gloo ring allreduce" + b"\0" * 100)
    found, why = ddp.gloo_shm_in_torch(tmp_path)
    assert not found
    assert "no 'shm_allreduce_buffer'" in why
    # The mark straddling the scanner's 16 MiB chunks is still found.
    cut = (1 << 24) - 5
    lib.write_bytes(b"\0" * cut + b"shm_allreduce_buffer_%d" + b"\0" * 10)
    assert ddp.gloo_shm_in_torch(tmp_path)[0]
    assert not ddp.gloo_shm_in_torch(tmp_path / "missing")[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["lab", "--libs", "gloo,mpi"], "unknown or unsupported in lab mode: mpi"),
        (["loopback", "--ranks", "1"], "at least 2 ranks"),
        (["lab", "-w", "0"], "-w must be >= 1"),
        (["lab", "--rate", "fast"], "'fast' is not a rate"),
    ],
)
def test_bad_arguments_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        ddp.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
