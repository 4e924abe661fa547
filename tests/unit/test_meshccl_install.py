"""meshccl's install modules: the controller's build id (meshccl_wheel) and the host side's
checks (meshccl_venv). The install itself runs on the lab (tests/integration/test_launch.py and
the molecule scenario)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import meshccl_build
from ansible_collections.meshkit.cluster.plugins.modules import meshccl_venv, meshccl_wheel

from .module_harness import patch_exits, run_module

SOURCE = Path(__file__).parents[2] / "collective"


def test_build_id_follows_the_sources_not_the_build_directories(tmp_path):
    src = tmp_path / "collective"
    shutil.copytree(SOURCE, src, ignore=shutil.ignore_patterns("build", "__pycache__"))
    first = meshccl_build.build_id(str(src), ["numpy==2.0.0"])
    assert first == meshccl_build.build_id(str(src), ["numpy==2.0.0"])
    (src / "build" / "x").mkdir(parents=True)
    (src / "build" / "x" / "CMakeCache.txt").write_text("anything")
    assert meshccl_build.build_id(str(src), ["numpy==2.0.0"]) == first
    assert meshccl_build.build_id(str(src), ["numpy==2.1.0"]) != first
    (src / "src" / "extra.cpp").write_text("// a change\n")
    assert meshccl_build.build_id(str(src), ["numpy==2.0.0"]) != first


def test_bare_requirements_are_pinned_to_the_controllers_versions():
    pinned = meshccl_build.pinned(["numpy", "pip>=20", "surely-not-installed-pkg"])
    assert pinned[0].startswith("numpy==") and pinned[1:] == ["pip>=20", "surely-not-installed-pkg"]


def test_wheel_check_mode_reports_a_build_without_building(tmp_path, monkeypatch):
    patch_exits(monkeypatch)
    ok, out = run_module(meshccl_wheel, {"source": str(SOURCE), "dest": str(tmp_path / "wh")}, check=True)
    assert ok and out["changed"] is True and out["wheels"] == [] and len(out["build"]) == 16, out
    assert not (tmp_path / "wh").exists()


def test_wheel_source_without_pyproject_is_named(tmp_path, monkeypatch):
    patch_exits(monkeypatch)
    ok, out = run_module(meshccl_wheel, {"source": str(tmp_path), "dest": str(tmp_path / "wh")})
    assert not ok and f"source={tmp_path}: no pyproject.toml" in out["msg"]


@pytest.fixture
def venv_module(monkeypatch):
    patch_exits(monkeypatch)

    def run(check: bool = False, **args):
        return run_module(meshccl_venv, args, check=check)

    return run


def test_query_of_a_missing_environment_changes_nothing(tmp_path, venv_module):
    ok, out = venv_module(path=str(tmp_path / "venv"), build="b1", state="query")
    assert ok and out == out | {"changed": False, "current": False, "installed": None}
    assert not (tmp_path / "venv").exists()


def test_wheels_for_another_python_are_refused_before_anything_is_made(tmp_path, venv_module):
    house = tmp_path / "wheels"
    house.mkdir()
    (house / "meshccl-0.1.0-cp27-cp27mu-linux_x86_64.whl").write_bytes(b"not used")
    ok, out = venv_module(path=str(tmp_path / "venv"), build="b1", wheelhouse=str(house))
    assert not ok
    assert "was built for cp27, this host's" in out["msg"] and "meshkit_meshccl_python" in out["msg"], out
    assert not (tmp_path / "venv").exists()


def test_check_mode_says_what_it_would_install(tmp_path, venv_module):
    ok, out = venv_module(check=True, path=str(tmp_path / "venv"), build="b1", wheelhouse=str(tmp_path))
    assert ok and out["changed"] is True and "would install meshccl b1" in out["msg"]
    assert not (tmp_path / "venv").exists()


def test_an_empty_wheelhouse_is_named(tmp_path, venv_module):
    ok, out = venv_module(path=str(tmp_path / "venv"), build="b1", wheelhouse=str(tmp_path / "none"))
    assert not ok and "no wheels there" in out["msg"]
