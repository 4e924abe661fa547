"""Which meshccl build these tests run, and what it says it selected.

`make meshccl-portable` (scripts/meshccl-portable) runs this suite against a build forced onto
the code paths macOS takes, first on PYTHONPATH, and sets MESHCCL_EXPECT_PORTABLE=1: then the
imported meshccl, and the one every worker process imports, must be that build, so the run
cannot silently test the virtual environment's Linux build. Without it, on Linux, they must be
Linux's own build (accept4, MSG_NOSIGNAL, single copy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import meshccl
import pytest

EXPECT_PORTABLE = os.environ.get("MESHCCL_EXPECT_PORTABLE") == "1"
SYSTEM = {"linux": "linux", "darwin": "macos"}.get(sys.platform, sys.platform)


def test_build_info_says_what_was_compiled():
    info = meshccl.build_info()
    assert set(info) == {
        "system",
        "portable",
        "single_copy",
        "sockets",
        "sigpipe",
        "shm_reserve",
        "shm_name_max",
        "crypto",
        "protocol_version",
        "abi_version",
    }
    assert info["system"] == SYSTEM
    assert info["shm_name_max"] == 30
    assert info["abi_version"] == 3
    assert info["protocol_version"] == meshccl._meshccl.PROTOCOL_VERSION
    assert info["crypto"]
    assert info is not meshccl.build_info()  # a copy: the caller may change it


@pytest.mark.skipif(sys.platform != "linux", reason="the two Linux builds; a Mac has one (build_info says macos)")
def test_the_build_under_test_is_the_one_this_run_asked_for():
    info = meshccl.build_info()
    if EXPECT_PORTABLE:
        # The macOS column of platform.h, as far as Linux can take it.
        assert info["portable"] is True, (meshccl.__file__, info)
        assert info["single_copy"] is False
        assert info["sockets"] == "fcntl"
        assert info["sigpipe"] == "sigmask"
    else:
        assert info["portable"] is False, (meshccl.__file__, info)
        assert info["single_copy"] is True
        assert info["sockets"] == "accept4"
        assert info["sigpipe"] == "MSG_NOSIGNAL"
    assert info["shm_reserve"] == "posix_fallocate"
    expected_dir = os.environ.get("MESHCCL_EXPECT_DIR")
    if expected_dir:
        assert os.path.realpath(meshccl.__file__).startswith(os.path.realpath(expected_dir) + os.sep), (
            meshccl.__file__,
            expected_dir,
        )


def test_worker_processes_import_the_same_build():
    # The jobs' ranks are new interpreters (tests/meshccl/worker.py): they must load the module
    # this process loaded, not another one on their path.
    done = subprocess.run(
        [sys.executable, "-c", "import json, meshccl; print(json.dumps([meshccl.__file__, meshccl.build_info()]))"],
        capture_output=True,
        text=True,
        check=False,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    assert done.returncode == 0, done.stderr
    where, info = json.loads(done.stdout)
    assert os.path.realpath(where) == os.path.realpath(meshccl.__file__)
    assert info == meshccl.build_info()
