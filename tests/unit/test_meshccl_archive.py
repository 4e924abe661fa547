"""meshccl's install as one archive per host (issue 23): a ready environment made on the controller with
the hosts' interpreter path and packed for the hosts' environment path, or the group's wheels as one tar;
unpacked on the host beside the old environment, checked, renamed into place, the old one kept on any
failure. Real environments made with this machine's own Python from a small wheel made here (no index);
the lab runs the real meshccl both ways (tests/integration/test_launch.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import meshccl_archive
from ansible_collections.meshkit.cluster.plugins.modules import meshccl_venv

from meshkit import meshccl_wheel

from .module_harness import patch_exits, run_module

BASE = getattr(sys, "_base_executable", None) or sys.executable
XY = f"{sys.version_info[0]}.{sys.version_info[1]}"
BUNDLED_PIP = sorted((Path(BASE).resolve().parents[1] / "lib" / f"python{XY}" / "ensurepip" / "_bundled").glob("pip-*"))


def fake_meshccl(dest: Path, version: str = "0.1.0") -> Path:
    """A pure-Python wheel named meshccl with a console script (meshccl-bench) that prints its path."""
    dist = f"meshccl-{version}.dist-info"
    files = {
        "meshccl/__init__.py": "import sys\n\ndef main():\n    print('fake meshccl in', sys.prefix)\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: meshccl\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/entry_points.txt": "[console_scripts]\nmeshccl-bench = meshccl:main\n",
    }
    wheel = dest / f"meshccl-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{dist}/RECORD", "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n")
    return wheel


@pytest.fixture(scope="module")
def house(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A controller group's wheelhouse: the fake meshccl and the pip this Python bundles."""
    if not BUNDLED_PIP:
        pytest.fail(f"no pip wheel bundled with {BASE} (ensurepip/_bundled)")
    path = tmp_path_factory.mktemp("cache") / "b1" / "controller-grp"
    path.mkdir(parents=True)
    fake_meshccl(path)
    (path / BUNDLED_PIP[0].name).write_bytes(BUNDLED_PIP[0].read_bytes())
    return path


@pytest.fixture(scope="module")
def made(house: Path):
    """The environment the controller makes for the group (once for this module's tests), build b1."""
    venv = meshccl_wheel.make_environment(group_of(house), BASE, "b1", str(house.parent))
    yield venv
    subprocess.run(["rm", "-rf", os.path.dirname(venv)], check=True)


def group_of(house: Path) -> dict:
    return {"name": house.name, "path": str(house), "built_on": "controller", "builder": "controller", "ready": True}


@pytest.fixture
def venv_module(monkeypatch):
    patch_exits(monkeypatch)

    def run(check: bool = False, diff: bool = False, **args):
        return run_module(meshccl_venv, {**args, "_ansible_diff": diff}, check=check)

    return run


def environment_archive(made: str, target: Path, build: str = "b1") -> Path:
    """The controller's side: the environment made with this machine's base Python, packed for ``target``
    (its manifest saying ``build``; the environment records b1)."""
    archive = Path(made).parent / f"environment-{len(os.listdir(Path(made).parent))}.tar.gz"
    manifest = {"build": build, "python": BASE, "tag": f"cp{XY.replace('.', '')}"}
    rewritten = meshccl_archive.pack_environment(made, str(archive), made, str(target), manifest)
    assert rewritten >= 3  # pyvenv.cfg, the activate scripts, the console scripts
    return archive


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: (tar.extractfile(m).read() if m.isreg() else b"") for m in tar.getmembers()}


def copy_of(archive: Path) -> str:
    """The archive as the action plugin leaves it on the host (the module removes it)."""
    copied = archive.with_name(f"copy-{archive.name}")
    copied.write_bytes(archive.read_bytes())
    return str(copied)


def siblings(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name != target.name)


def test_a_ready_environment_is_packed_for_the_hosts_path_and_works_there(tmp_path, house, made, venv_module):
    target = tmp_path / "host" / "meshccl"
    archive = environment_archive(made, target)
    packed = members(archive)
    assert next(iter(packed)) == meshccl_archive.MANIFEST
    manifest = json.loads(packed[meshccl_archive.MANIFEST])
    assert manifest | {"kind": "environment", "venv": str(target), "python": BASE} == manifest
    # Nothing that is read as text names the controller's staging directory; the scripts name the host's path.
    staging = str(Path(made).parent)
    assert not [n for n, data in packed.items() if staging.encode() in data and not n.endswith(".pyc")]
    assert packed["bin/meshccl-bench"].startswith(f"#!{target}/bin/python".encode())
    with tarfile.open(archive) as tar:
        assert {m.uid for m in tar.getmembers()} == {0}
        assert tar.getmember("bin/python3").issym() or tar.getmember("bin/python").issym()

    copied = tmp_path / "tmpdir" / "environment.tar.gz"
    copied.parent.mkdir()
    copied.write_bytes(archive.read_bytes())
    ok, out = venv_module(path=str(target), build="b1", archive=str(copied))
    assert ok and out["changed"] is True and out["method"] == "environment" and out["installed"] is None, out
    assert not copied.exists()  # the copied archive is removed
    assert siblings(target) == []  # no staging or old directory left beside it
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask  # as `python -m venv` leaves it: others may use it
    ran = subprocess.run([str(target / "bin" / "meshccl-bench")], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == f"fake meshccl in {target}"
    record = json.loads((target / "meshkit-meshccl.json").read_text())
    assert record["build"] == "b1" and record["built_on"] == "controller" and record["method"] == "environment"
    assert set(record["sha256"]) == {w.name for w in house.glob("*.whl")}
    assert f"{target}" in (target / "pyvenv.cfg").read_text()

    # Current: nothing copied or changed (the role does not even send the archive then).
    ok, out = venv_module(path=str(target), build="b1", archive=str(copied))
    assert ok and out["changed"] is False and out["current"] is True, out
    # Another build, in check mode with --diff: what would change, and nothing changes.
    ok, out = venv_module(check=True, diff=True, path=str(target), build="b2")
    assert ok and out["changed"] is True and "would install meshccl b2 (now: b1)" in out["msg"], out
    assert out["diff"]["before"] == "meshccl build b1\n" and out["diff"]["after"] == "meshccl build b2\n"
    assert json.loads((target / "meshkit-meshccl.json").read_text())["build"] == "b1"


def test_a_failed_install_leaves_the_old_environment_working(tmp_path, made, venv_module):
    target = tmp_path / "host" / "meshccl"
    good = environment_archive(made, target)
    ok, out = venv_module(path=str(target), build="b1", archive=str(good))
    assert ok, out
    inode = (target / "meshkit-meshccl.json").stat().st_ino
    # An archive that says build b2 but holds an environment recording b1: put in place, checked, refused.
    bad = environment_archive(made, target, build="b2")
    ok, out = venv_module(path=str(target), build="b2", archive=str(bad))
    assert not ok and "does not import from" in out["msg"] and "with build b2 recorded" in out["msg"], out
    assert (target / "meshkit-meshccl.json").stat().st_ino == inode  # the old one, renamed back
    assert json.loads((target / "meshkit-meshccl.json").read_text())["build"] == "b1"
    assert siblings(target) == []
    # An environment packed for another path, or made with an interpreter this host lacks: refused, unchanged.
    other = environment_archive(made, tmp_path / "elsewhere")
    ok, out = venv_module(path=str(target), build="b1x", archive=copy_of(other))
    assert not ok and "holds meshccl build b1, not b1x" in out["msg"], out
    ok, out = venv_module(path=str(tmp_path / "host" / "fresh"), build="b1", archive=copy_of(other))
    assert not ok and f"holds an environment for {tmp_path / 'elsewhere'}" in out["msg"], out
    assert not (tmp_path / "host" / "fresh").exists() and siblings(target) == []


def test_the_wheels_archive_makes_a_new_environment_with_pip(tmp_path, house, venv_module):
    tar = tmp_path / meshccl_archive.WHEELS_ARCHIVE
    meshccl_archive.pack_wheels(str(house), [w.name for w in house.glob("*.whl")], str(tar), {"build": "b1"})
    assert next(iter(members(tar))) == meshccl_archive.MANIFEST
    target = tmp_path / "host" / "meshccl"
    ok, out = venv_module(path=str(target), build="b1", archive=str(tar), python=BASE, built_on="node3")
    assert ok and out["changed"] is True and out["method"] == "wheels", out
    record = json.loads((target / "meshkit-meshccl.json").read_text())
    assert record["built_on"] == "node3" and record["method"] == "wheels"
    # Made beside it, then moved: its scripts name its own path, and they run.
    assert (target / "bin" / "meshccl-bench").read_text().startswith(f"#!{target}/bin/python")
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask
    ran = subprocess.run([str(target / "bin" / "meshccl-bench")], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == f"fake meshccl in {target}"
    assert siblings(target) == []


def test_an_archive_with_a_member_outside_its_directory_is_refused(tmp_path):
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        for name, data in ((meshccl_archive.MANIFEST, b"{}"), ("../outside", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "dest").mkdir()
    with pytest.raises(ValueError, match="refusing members outside"):
        meshccl_archive.extract(str(archive), str(tmp_path / "dest"))
    assert not (tmp_path / "outside").exists()
    with tarfile.open(tmp_path / "plain.tar", "w") as tar:
        tar.add(archive, arcname="x")
    with pytest.raises(ValueError, match="not a meshkit archive"):
        meshccl_archive.read_manifest(str(tmp_path / "plain.tar"))


def test_relocation_rewrites_text_and_never_a_binary():
    assert meshccl_archive.relocated(b"#!/s/venv/bin/python\n", "/s/venv", "/opt/m") == b"#!/opt/m/bin/python\n"
    assert meshccl_archive.relocated(b"\x7fELF\0/s/venv", "/s/venv", "/opt/m") is None
    assert meshccl_archive.relocated(b"nothing here", "/s/venv", "/opt/m") is None


def record(base: str, bin_dir: str = "/var/lib/meshkit/meshccl/bin", version: str | None = None) -> dict:
    version = version or ".".join(map(str, sys.version_info[:3]))
    return {"python": {"path": "python3", "version": version, "base_executable": base}, "bin": bin_dir}


def test_the_controller_ships_an_environment_only_where_it_has_the_hosts_interpreter():
    group, cache = {"builder": "controller", "unresolved": []}, {}
    target, why = meshccl_wheel.environment_for(record(BASE), group, cache)
    assert target == (BASE, "/var/lib/meshkit/meshccl") and why == ""
    assert meshccl_wheel.environment_for(record("/nonexistent/python3"), group, cache) == (
        None,
        "the controller has no Python at /nonexistent/python3",
    )
    target, why = meshccl_wheel.environment_for(record(BASE, version="3.1.0"), group, cache)
    assert target is None and why.endswith("the host's is CPython 3.1"), why
    # A wrapper (here: a virtual environment's python) is not what `python -m venv` links to.
    if sys.executable != BASE:
        target, why = meshccl_wheel.environment_for(record(sys.executable), group, cache)
        assert target is None and f"based on {BASE}" in why, why
    assert meshccl_wheel.environment_for(record(BASE), {"builder": "node3", "unresolved": []}, cache) == (
        None,
        "its wheel is built on node3",
    )
    assert meshccl_wheel.environment_for(record(BASE), {"builder": "controller", "unresolved": ["x==1"]}, cache)[1] == (
        "x==1 come from its own package index"
    )
    assert meshccl_wheel.environment_for({"python": {"path": "python3"}}, group, cache)[1] == (
        "its interpreter or environment path was not read"
    )
