"""PyTorch's own distributed tests against a backend, as PyTorch runs them for Gloo.

The suite ships in the torch wheel (torch.testing._internal.distributed.distributed_test, class
DistributedTest._DistTestBase). PyTorch's test/distributed/test_distributed_spawn.py runs it by deriving a class
from TestDistBackend and _DistTestBase, with BACKEND and WORLD_SIZE in the environment; every test spawns
WORLD_SIZE processes, which meet through the suite's own file:// store. This module is that class, for
BACKEND=gloo or BACKEND=meshccl. It is not collected by a plain `pytest tests/` (its name): the driver
tests/meshccl/torch_suite_run.py runs it, one backend at a time, and compares.

Nothing is skipped here by name. meshccl is added to the suite's own feature sets for what it implements
(DistTestCases.backend_feature: "plugin" - a backend registered with torch.distributed; "ddp"; "subgroup"), so the
suite's gates treat it as they treat Gloo there. Tests the suite itself gates to Gloo by name stay gated, and the
driver's table counts them.
"""

from __future__ import annotations

import os
import secrets
import sys

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

if os.environ["BACKEND"] == "meshccl":
    import meshccl.torch  # noqa: F401 - registers the "meshccl" backend with torch.distributed

    # Before distributed_test is imported: its decorators read these sets when its classes are made.
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("meshccl")

from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

if not dist.is_available():
    sys.exit("torch.distributed is not available in this torch")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
