"""PyTorch's own distributed tests against a backend, as PyTorch runs them for Gloo.

The suite ships in the torch wheel (torch.testing._internal.distributed.distributed_test, class
DistributedTest._DistTestBase). PyTorch's test/distributed/test_distributed_spawn.py runs it by deriving a class
from TestDistBackend and _DistTestBase, with BACKEND and WORLD_SIZE in the environment; every test spawns
WORLD_SIZE processes, which meet through the suite's own file:// store. This module is that class, for
BACKEND=gloo or BACKEND=meshccl. It is not collected by a plain `pytest tests/` (its name): the driver
tests/meshccl/torch_suite_run.py runs it, one backend at a time, and compares.

Nothing is skipped here by name. The suite decides at import which tests a backend runs, from the module global
BACKEND (decorators such as `skip_but_pass_in_sandcastle_if(BACKEND != "gloo", ...)`). Two ways for meshccl
(SUITE_GATES in the environment):

- "gloo" (the driver's default): the suite is imported as for Gloo, so every gate opens where it opens for Gloo,
  then BACKEND is set back to "meshccl" before any test runs: init_process_group, the tests' own run-time checks
  and the spawned ranks all see meshccl. meshccl meets every test Gloo meets, including those the suite keeps for
  Gloo by name (timeouts, all_reduce_coalesced, tags, sparse all_reduce, the object collectives).
- "own": meshccl is added to the suite's feature sets for what it implements (DistTestCases.backend_feature:
  "plugin" - a backend registered with torch.distributed; "ddp"; "subgroup"), and every other gate is the
  suite's verdict for a backend named meshccl.

Four tests pick a code path in their bodies by the backend's name (BODY_AS_GLOO, with why): under "gloo" gates
their bodies see "gloo" too. The tests torch itself refuses for a backend other than Gloo are named, with torch's
reason, in LEFT_OUT below: meshccl skips them saying so, and the driver prints them in its table.
"""

from __future__ import annotations

import functools
import os
import secrets
import sys
import unittest
from collections.abc import Callable
from typing import Any

if "BACKEND" not in os.environ or "WORLD_SIZE" not in os.environ:
    raise RuntimeError(
        "tests/meshccl/torch_suite.py needs BACKEND (gloo or meshccl) and WORLD_SIZE (2 or more) in the environment: "
        "run it through tests/meshccl/torch_suite_run.py"
    )
# Every spawned rank imports this module again and must find the same token (meshccl refuses a peer without it).
# The driver sets one per run; a direct pytest run gets one here, inherited by the ranks it spawns.
os.environ.setdefault("MESHCCL_TOKEN", secrets.token_hex(32))
os.environ.setdefault("TEMP_DIR", os.environ.get("TMPDIR", "/tmp"))

import torch.distributed as dist
from torch.testing._internal.common_distributed import DistTestCases

BACKEND = os.environ["BACKEND"]
GATES = os.environ.get("SUITE_GATES", "own")
if GATES not in ("gloo", "own"):
    raise RuntimeError(f"SUITE_GATES={GATES!r}: 'gloo' (open every gate Gloo's opens) or 'own'")
if BACKEND == "meshccl":
    import meshccl.torch  # noqa: F401 - registers the "meshccl" backend with torch.distributed

    # Before distributed_test is imported: its decorators read these sets when its classes are made.
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("meshccl")

from torch.testing._internal.common_utils import run_tests  # noqa: E402 - after the feature sets

# The decorators run once, at this import, with BACKEND read from the environment: under "gloo" gates they see
# Gloo's name, and the module's BACKEND (what init_process_group and the tests' bodies read) is ours again after.
if GATES == "gloo":
    os.environ["BACKEND"] = "gloo"
try:
    from torch.testing._internal.distributed import distributed_test
finally:
    os.environ["BACKEND"] = BACKEND
distributed_test.BACKEND = BACKEND
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

if not dist.is_available():
    sys.exit("torch.distributed is not available in this torch")


# Tests whose bodies (not their gates) pick a code path by the backend's name, where meshccl, a CPU backend like
# Gloo, belongs on Gloo's: under SUITE_GATES=gloo their bodies see BACKEND "gloo"; the process group is meshccl's.
BODY_AS_GLOO = {
    name: 'builds its CPU model only `if BACKEND == "mpi" or BACKEND == "gloo"` (else none: UnboundLocalError)'
    for name in (
        "test_accumulate_gradients_no_sync",
        "test_accumulate_gradients_no_sync_grad_is_view",
        "test_accumulate_gradients_no_sync_allreduce_hook",
        "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    )
}


def _body_as_gloo(name: str) -> Callable[[Any], Any]:
    base = getattr(DistributedTest._DistTestBase, name)

    @functools.wraps(base)
    def test(self: Any) -> Any:
        distributed_test.BACKEND = "gloo"  # what the body compares; the group was made with meshccl
        try:
            return base(self)
        finally:
            distributed_test.BACKEND = BACKEND

    return test


# Tests torch itself refuses for any backend but Gloo (torch.distributed.monitored_barrier raises "monitored_barrier
# is only implemented for GLOO backend." for every other backend, before any backend is called): under SUITE_GATES=gloo
# meshccl skips them with "left out for meshccl: <why>", and the driver's table names them. (The suite's
# test_monitored_barrier_gloo_rank_0_timeout calls the group's own method, which meshccl has: it runs. The
# allreduce_hang ones need GPUs and call a Gloo group's, not meshccl's.)
_MONITORED = "torch refuses monitored_barrier for every backend but Gloo (distributed_c10d.monitored_barrier)"
LEFT_OUT = {
    name: _MONITORED
    for name in (
        "test_monitored_barrier_gloo",
        "test_monitored_barrier_gloo_subgroup",
        "test_monitored_barrier_failure_order",
        "test_monitored_barrier_wait_all_ranks",
    )
}


def _left_out(name: str, why: str) -> Callable[[Any], Any]:
    @unittest.skip(f"left out for meshccl: {why}")
    def test(self: Any) -> None:
        raise AssertionError(f"{name} is left out")

    test.__name__ = name
    return test


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if BACKEND != "gloo" and GATES == "gloo":
    for _name in BODY_AS_GLOO:
        setattr(TestDistBackendWithSpawn, _name, _body_as_gloo(_name))
    for _name, _why in LEFT_OUT.items():
        setattr(TestDistBackendWithSpawn, _name, _left_out(_name, _why))


if __name__ == "__main__":
    run_tests()
