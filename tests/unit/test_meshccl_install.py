"""meshccl's install: the build id, the host facts, how hosts are grouped and who builds for whom
(on recorded facts of a RHEL 9 host with Python 3.9, a Mac, the lab's hosts and this controller), the
refusals, and the host side's checks. The builds and installs themselves run on the lab
(tests/integration/test_launch.py: two hosts built on a host from the sdist, two from the controller)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.meshkit.cluster.plugins.action import meshccl_wheel as meshccl_wheel_action
from ansible_collections.meshkit.cluster.plugins.module_utils import meshccl_build
from ansible_collections.meshkit.cluster.plugins.modules import (
    meshccl_host_build,
    meshccl_host_facts,
    meshccl_venv,
)

from meshkit import meshccl_wheel
from meshkit.inventory_schema import validate_hosts

from .module_harness import patch_exits, run_action, run_module

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


def test_wheel_check_mode_reports_a_build_without_building(tmp_path):
    ok, out = run_action(meshccl_wheel_action, {"source": str(SOURCE), "dest": str(tmp_path / "wh")}, check=True)
    assert ok and out["changed"] is True and out["wheels"] == [] and len(out["build"]) == 16, out
    assert not (tmp_path / "wh").exists()


def test_wheel_source_without_pyproject_is_named(tmp_path):
    ok, out = run_action(meshccl_wheel_action, {"source": str(tmp_path), "dest": str(tmp_path / "wh")})
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


# ---------------------------------------------------------------------------------------------
# Groups, builders and refusals, on recorded facts (tests/fixtures/host_facts/SOURCES.md)

FACTS = Path(__file__).parents[1] / "fixtures" / "host_facts"
CONTROLLER_REC = json.loads((FACTS / "controller_debian12_venv_meshccl_host_facts.json").read_text())
LAB_NODE = json.loads((FACTS / "lab_debian12_node3_meshccl_host_facts.json").read_text())
RHEL9 = json.loads((FACTS / "rhel9.2_x86_64_setup_facts_SUBSET.json").read_text())
MAC = json.loads((FACTS / "macos10.15.5_macbookpro14_3_setup_facts_SUBSET.json").read_text())
BUILD = "0123456789abcdef"
LINUX_TOOLS = {"cxx": "/usr/bin/c++", "cmake": "/usr/bin/cmake", "cmake_version": "3.26.5", "openssl": True}
MAC_CLT = {"cxx": "/usr/bin/c++", "developer_dir": "/Library/Developer/CommandLineTools", "openssl": True}


def from_setup(
    facts: dict[str, Any],
    *,
    python: str | None = None,
    libc: dict[str, str] | None = None,
    tools: dict[str, Any] | None = None,
    build_on: str = "controller",
) -> dict[str, Any]:
    """A meshccl_host_facts record from recorded `ansible -m setup` facts: the fields the grouping uses
    (system, machine, macOS version, package manager, the Python) taken as recorded; ``python`` replaces
    the recorded interpreter's version where the test says why; glibc and tools are not in setup facts."""
    darwin = facts["ansible_system"] == "Darwin"
    return {
        "system": facts["ansible_system"],
        "machine": facts.get("ansible_machine") or facts["ansible_architecture"],
        "os_version": facts["ansible_distribution_version"] if darwin else "",
        "libc": None if darwin else libc,
        "pkg_mgr": facts["ansible_pkg_mgr"],
        "python": {
            "path": "/usr/bin/python3" if python else facts["ansible_python"]["executable"],
            "version": python or facts["ansible_python_version"],
            "implementation": {"cpython": "CPython"}[facts["ansible_python"]["type"]],
            "python_h": True,
            "error": None,
        },
        "tools": {"cxx": None, "cmake": None, "cmake_version": None, "openssl": None, "developer_dir": None}
        | (tools or {}),
        "installed": None,
        "venv_python": None,
        "build_on": build_on,
    }


def lab(name: str, build_on: str = "controller", **changes: Any) -> dict[str, Any]:
    return copy.deepcopy(LAB_NODE) | {"installed": None, "venv_python": None, "build_on": build_on} | changes


def grouped(records: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    groups, problems = meshccl_build.plan(
        records, {h: r["build_on"] for h, r in records.items()}, CONTROLLER_REC, BUILD
    )
    return {g["name"]: g for g in groups}, problems


def test_the_build_id_is_the_same_whatever_platform_computes_it(monkeypatch):
    first = meshccl_build.build_id(str(SOURCE), ["numpy==2.0.0"])
    monkeypatch.setattr(sys, "version_info", (3, 9, 6, "final", 0))
    monkeypatch.setattr(sys, "platform", "darwin")
    assert meshccl_build.build_id(str(SOURCE), ["numpy==2.0.0"]) == first


def test_a_python_39_host_is_grouped_and_built_on_its_first_host_not_refused():
    """Two RHEL 9 hosts (recorded: /usr/bin/python3 3.9.16) beside lab hosts, with a 3.11 controller."""
    rhel = from_setup(RHEL9, libc={"name": "glibc", "version": "2.34"}, tools=LINUX_TOOLS)
    assert meshccl_build.platform_label(rhel) == "linux-x86_64-cp39-glibc2.34"
    groups, problems = grouped({"node1": lab("node1"), "rhel1": rhel, "rhel2": copy.deepcopy(rhel)})
    assert problems == []
    assert set(groups) == {"controller-linux-x86_64-cp311-glibc2.36", "linux-x86_64-cp39-glibc2.34"}
    ours = groups["linux-x86_64-cp39-glibc2.34"]
    assert ours["hosts"] == ["rhel1", "rhel2"] and ours["builder"] == "rhel1" and ours["where"] == "group"
    assert groups["controller-linux-x86_64-cp311-glibc2.36"]["hosts"] == ["node1"]
    assert meshccl_build.builder_problems(ours, {"rhel1": rhel, "rhel2": rhel}, CONTROLLER_REC) == []
    # Its numpy comes from wheels for its own platform and Python.
    assert meshccl_build.pip_platforms(rhel)[:2] == ["manylinux_2_34_x86_64", "manylinux_2_33_x86_64"]
    assert "manylinux2014_x86_64" in meshccl_build.pip_platforms(rhel)
    assert meshccl_build.marker_environment(rhel)["python_version"] == "3.9"


def test_a_mac_with_the_stock_python_39_is_its_own_group_built_on_the_mac():
    """The recorded Mac with the Command Line Tools' /usr/bin/python3 (3.9.6) and Homebrew's CMake."""
    mac = from_setup(MAC, python="3.9.6", tools=MAC_CLT | {"cmake": "/usr/local/bin/cmake", "cmake_version": "3.27.0"})
    groups, problems = grouped({"mac1": mac, "mac2": copy.deepcopy(mac)})
    assert problems == []
    (group,) = groups.values()
    assert group["name"] == "darwin-x86_64-cp39-macos10.15" and group["builder"] == "mac1"
    assert meshccl_build.pip_platforms(mac) == ["macosx_10_15_x86_64"]


def test_a_mac_without_the_command_line_tools_is_refused_by_name_with_xcode_select_install():
    mac = from_setup(MAC, python="3.9.6")  # no developer directory: xcode-select -p failed
    groups, problems = grouped({"studio1": mac})
    (group,) = groups.values()
    assert problems == [] and group["builder"] is None
    (why,) = meshccl_build.builder_problems(group, {"studio1": mac}, CONTROLLER_REC)
    assert why.startswith("studio1 must build meshccl (darwin-x86_64-cp39-macos10.15)"), why
    assert "no a C++ compiler (the Xcode Command Line Tools), CMake" in why, why
    assert "install: xcode-select --install && brew install cmake" in why, why  # the recorded Mac has Homebrew


def test_the_compiler_less_mac_is_refused_before_anything_is_built(tmp_path):
    mac = from_setup(MAC, python="3.9.6") | {"build_on": "controller"}
    node = lab("node1")
    dest = tmp_path / "cache"
    ok, out = run_action(
        meshccl_wheel_action, {"source": str(SOURCE), "dest": str(dest), "hosts": {"node1": node, "mac1": mac}}
    )
    assert not ok
    assert out["msg"].startswith("meshccl cannot be installed; nothing was built or changed:"), out["msg"]
    assert "mac1 must build meshccl" in out["msg"] and "xcode-select --install" in out["msg"], out["msg"]
    assert not dest.exists()  # not even the controller's own group was built


def test_the_recorded_mac_python_38_is_refused_naming_the_way_out():
    mac = from_setup(MAC, tools=MAC_CLT)
    _groups, problems = grouped({"balsa": mac})
    assert problems == [
        "balsa: its /usr/local/Cellar/ansible/2.9.7/libexec/bin/python3.8 is Python 3.8.2; meshccl needs 3.9 or "
        "later: install one and set meshkit_meshccl_python to it"
    ]


def test_a_linux_host_without_compiler_or_headers_gets_its_package_managers_command():
    rhel = from_setup(RHEL9, libc={"name": "glibc", "version": "2.34"}, tools={"openssl": False})
    rhel["python"]["python_h"] = False
    groups, _ = grouped({"rhel1": rhel})
    (why,) = meshccl_build.builder_problems(next(iter(groups.values())), {"rhel1": rhel}, CONTROLLER_REC)
    assert why.endswith("install: sudo dnf install gcc-c++ cmake python3-devel openssl-devel"), why
    node = lab("node1", build_on="host", tools={"cxx": None, "cmake": "/usr/bin/cmake", "cmake_version": "3.10.2"})
    assert meshccl_build.missing_tools(node) == ["a C++ compiler", "CMake 3.18 or later (it has 3.10.2)"]
    assert meshccl_build.install_command(node, meshccl_build.missing_tools(node)) == "sudo apt-get install g++ cmake"


def test_build_on_modes_on_the_lab_hosts():
    hosts = {f"node{i}": lab(f"node{i}") for i in range(1, 5)}
    groups, _ = grouped(hosts)
    assert [(g["builder"], g["hosts"]) for g in groups.values()] == [("controller", list(hosts))]
    # group: node3 and node4 are their own group even though the controller's platform serves them.
    hosts["node3"]["build_on"] = hosts["node4"]["build_on"] = "group"
    groups, _ = grouped(hosts)
    assert [(g["where"], g["builder"], g["hosts"]) for g in groups.values()] == [
        ("controller", "controller", ["node1", "node2"]),
        ("group", "node3", ["node3", "node4"]),
    ]
    # host: every such host builds its own.
    hosts["node3"]["build_on"] = hosts["node4"]["build_on"] = "host"
    groups, _ = grouped(hosts)
    assert [(g["name"], g["builder"]) for g in groups.values()][1:] == [
        ("linux-x86_64-cp311-glibc2.36-node3", "node3"),
        ("linux-x86_64-cp311-glibc2.36-node4", "node4"),
    ]
    # controller, where the controller cannot serve: the group's first host that can build.
    older = {f"old{i}": lab(f"old{i}", libc={"name": "glibc", "version": "2.31"}) for i in range(1, 3)}
    older["old1"]["tools"] = older["old1"]["tools"] | {"cxx": None}
    groups, _ = grouped(older)
    assert [(g["name"], g["builder"]) for g in groups.values()] == [("linux-x86_64-cp311-glibc2.31", "old2")]


def test_current_hosts_need_nothing_and_another_venv_python_is_not_current():
    hosts = {"node1": lab("node1", installed=BUILD, venv_python="3.11"), "node2": lab("node2", installed=BUILD)}
    groups, _ = grouped(hosts)
    assert next(iter(groups.values()))["needs"] == ["node2"]  # node2's environment: made by no known Python


def test_the_controller_serves_newer_glibc_and_macos_not_older():
    rec = copy.deepcopy(CONTROLLER_REC)
    assert meshccl_build.serves(rec, lab("n", libc={"name": "glibc", "version": "2.39"}))
    assert not meshccl_build.serves(rec, lab("n", libc={"name": "glibc", "version": "2.31"}))
    assert not meshccl_build.serves(rec, lab("n", libc={"name": "musl", "version": ""}))
    assert not meshccl_build.serves(rec, lab("n", python=LAB_NODE["python"] | {"version": "3.12.1"}))
    mac14 = {
        "system": "Darwin",
        "machine": "arm64",
        "os_version": "14.5",
        "python": {"version": "3.9.6", "implementation": "CPython"},
    }
    assert meshccl_build.serves(mac14, mac14 | {"os_version": "15.1"})
    assert not meshccl_build.serves(mac14, mac14 | {"os_version": "13.6"})
    assert meshccl_build.pip_platforms(mac14) == ["macosx_14_0_arm64"]


def test_dependencies_are_resolved_for_the_target_python_not_the_controllers():
    """pip download --python-version evaluates markers for the running interpreter; meshkit does it for
    the host. The Requires-Dist lines are scikit-build-core 1.1.2's METADATA, verbatim."""
    requires = [
        "exceptiongroup>=1.0; python_version < '3.11'",
        "packaging>=23.2",
        "pathspec>=0.12.0",
        "tomli>=1.2.2; python_version < '3.11'",
        "typing-extensions>=4; python_version < '3.11'",
        "hatchling>=1.24; extra == 'hatchling'",
        "setuptools>=45; (python_version == '3.9') and extra == 'setuptools'",
        "cmake; (sys_platform != 'win32') and extra == 'wheels'",
    ]
    py39 = from_setup(RHEL9, libc={"name": "glibc", "version": "2.34"})
    assert meshccl_wheel.wanted(requires, meshccl_build.marker_environment(py39)) == [
        "exceptiongroup>=1.0", "packaging>=23.2", "pathspec>=0.12.0", "tomli>=1.2.2", "typing-extensions>=4"
    ]  # fmt: skip
    assert meshccl_wheel.wanted(requires, meshccl_build.marker_environment(CONTROLLER_REC)) == [
        "packaging>=23.2", "pathspec>=0.12.0"
    ]  # fmt: skip


def test_check_mode_says_what_would_be_built_where_and_builds_nothing(tmp_path):
    hosts = {f"node{i}": lab(f"node{i}", build_on="group" if i > 2 else "controller") for i in range(1, 5)}
    dest = tmp_path / "cache"
    ok, out = run_action(meshccl_wheel_action, {"source": str(SOURCE), "dest": str(dest), "hosts": hosts}, check=True)
    assert ok and out["changed"] is True, out
    assert out["summary"] == [
        f"node1, node2 (linux-x86_64-cp311-glibc2.36): meshccl {out['build']} would build on the controller; "
        "to install on node1, node2 from its wheels (its interpreter or environment path was not read)",
        f"node3, node4 (linux-x86_64-cp311-glibc2.36): meshccl {out['build']} would build on node3 (from the source "
        "distribution); to install on node3, node4 from its wheels (its wheel is built on node3)",
    ]
    # The one archive each host would get (none is made in check mode).
    assert {h: (v["ship"], Path(v["archive"]).name) for h, v in out["hosts"].items()} == {
        h: ("wheels", "wheelhouse.tar") for h in hosts
    }
    assert {h: (v["build_here"], v["install"]) for h, v in out["hosts"].items()} == {
        "node1": (False, True), "node2": (False, True), "node3": (True, True), "node4": (False, True)
    }  # fmt: skip
    assert not dest.exists()


def test_a_group_wheelhouse_without_the_hosts_meshccl_wheel_is_not_completed(tmp_path):
    staging, path = tmp_path / ".grp-x", tmp_path / "grp"
    staging.mkdir()
    (staging / "numpy-2.0.2-cp39-cp39-macosx_14_0_arm64.whl").write_bytes(b"x")
    (staging / meshccl_wheel.PENDING).write_text("{}")
    group = {"name": "grp", "builder": "mac1", "hosts": ["mac1", "mac2"], "staging": str(staging), "path": str(path)}
    ok, out = run_action(
        meshccl_wheel_action, {"source": str(SOURCE), "dest": str(tmp_path), "phase": "finish", "groups": [group]}
    )
    assert not ok and out["msg"].startswith("mac1 built no meshccl-0.1.0 wheel for mac1, mac2"), out
    assert not path.exists()
    (staging / "meshccl-0.1.0-cp39-cp39-macosx_14_0_arm64.whl").write_bytes(b"y")
    ok, out = run_action(
        meshccl_wheel_action, {"source": str(SOURCE), "dest": str(tmp_path), "phase": "finish", "groups": [group]}
    )
    assert ok and out["changed"] and json.loads((path / meshccl_wheel.MARK).read_text())["built_on"] == "mac1"


def test_host_facts_of_this_machine_and_of_a_missing_python(monkeypatch):
    """The real probe, run on this machine's python3 (the lab hosts' Python)."""
    patch_exits(monkeypatch)
    ok, out = run_module(meshccl_host_facts, {"python": "python3", "build_on": "group"})
    assert ok and out["changed"] is False and out["build_on"] == "group", out
    assert out["system"] == os.uname().sysname and out["python"]["version"].startswith("3.")
    assert out["libc"]["name"] == "glibc" and out["tools"]["cmake_version"], out
    ok, out = run_module(meshccl_host_facts, {"python": "/nonexistent/python3.9"})
    assert ok and out["python"]["error"] == "/nonexistent/python3.9 not found", out
    problems = meshccl_build.python_problem(out)
    assert problems == "/nonexistent/python3.9 not found: set meshkit_meshccl_python to a Python 3.9 or later there"


def test_host_build_refuses_without_a_compiler_naming_the_command(tmp_path, monkeypatch):
    patch_exits(monkeypatch)
    record = lab("node1", tools=LAB_NODE["tools"] | {"cxx": None})
    monkeypatch.setattr(meshccl_host_build, "gather", lambda _python: record)
    ok, out = run_module(meshccl_host_build, {"kit": str(tmp_path / "kit"), "dest": str(tmp_path / "out")})
    assert not ok and out["msg"] == "cannot build meshccl here: no a C++ compiler; install: sudo apt-get install g++"


def test_the_inventory_option_is_checked_naming_host_and_values():
    normalised, problems = validate_hosts({"node1": {"meshkit_meshccl_build_on": "everywhere"}, "node2": {}})
    assert len(problems) == 1 and problems[0].startswith("node1: meshkit_meshccl_build_on = 'everywhere'"), problems
    assert "use controller (" in problems[0] and "group (" in problems[0] and "host (" in problems[0], problems
    normalised, problems = validate_hosts({"node1": {"meshkit_meshccl_build_on": "group"}})
    assert problems == [] and normalised["node1"]["meshkit_meshccl_build_on"] == "group"


def test_two_runs_building_one_wheelhouse_at_once_build_it_once_outside_the_source_tree(tmp_path, monkeypatch):
    # Two setup.yml runs (or two test labs) on one controller with a cold cache: pip built both in the source tree's
    # own build directory at once, and one failed ("file failed to open for writing"). Now the second waits for the
    # first and takes what it published; pip builds in the cache, never in the source tree (it may be read-only).
    import subprocess
    import threading
    import time

    calls: list[list[str]] = []
    building = threading.Semaphore(1)

    def fake_run(argv, cwd=None, env=None):
        calls.append(argv)
        out = argv[argv.index("-w" if "wheel" in argv else "-d") + 1]
        if "wheel" in argv:
            assert building.acquire(blocking=False), "two pip builds at once"
            time.sleep(0.3)
            Path(out, "meshccl-0.1.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"w")
            building.release()
        else:
            Path(out, "pip-24.0-py3-none-any.whl").write_bytes(b"p")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(meshccl_wheel, "run", fake_run)
    path = tmp_path / "wheels" / "0123456789abcdef" / "controller-linux"
    results: list[list[str]] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                meshccl_wheel.build_here(str(SOURCE), str(path), "0.1.0", [], None, {"build": "0123456789abcdef"})
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wheels = ["meshccl-0.1.0-cp311-cp311-linux_x86_64.whl", "pip-24.0-py3-none-any.whl"]
    assert results == [wheels, wheels]
    pip_wheel = [argv for argv in calls if "wheel" in argv]
    assert len(pip_wheel) == 1, calls
    build_dir = next(a for a in pip_wheel[0] if a.startswith("build-dir="))
    assert Path(build_dir.removeprefix("build-dir=")).parent == tmp_path / "wheels" / ".build"
    assert sorted(os.listdir(path)) == sorted([*wheels, meshccl_wheel.MARK])
