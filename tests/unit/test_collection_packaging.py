"""The collection's packaging metadata: execution-environment.yml gives ansible-builder a build
context that carries the controller's Python and system packages and meshkit's wheel (with the
collection inside), and bindep.txt parses and names the right packages on each platform."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from bindep import depends
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# What the controller runs, per platform family (bindep.txt with no profile).
CONTROLLER_RPM = {
    "graphviz",
    "openssl-devel",
    "openssh-clients",
    "iproute",
    "cmake",
    "ninja-build",
    "gcc-c++",
    "python3.11-devel",
    "openmpi",
}
CONTROLLER_DPKG = {
    "graphviz",
    "libssl-dev",
    "openssh-client",
    "iproute2",
    "cmake",
    "ninja-build",
    "g++",
    "python3-dev",
    "python3",
    "python3-venv",
    "openmpi-bin",
}


def requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def by_name(lines: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in lines]
    return {r.name.lower(): r for r in reqs}


def ee_definition() -> dict[str, Any]:
    return yaml.safe_load((REPO / "execution-environment.yml").read_text())


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """meshkit's wheel built from the checkout as the EE file says, then ansible-builder's build
    context for it (no container engine involved)."""
    src = tmp_path_factory.mktemp("ee")
    for name in ("execution-environment.yml", "bindep.txt"):
        (src / name).write_bytes((REPO / name).read_bytes())
    wheel = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(src / "dist"), str(REPO)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert wheel.returncode == 0, wheel.stderr
    out = src / "context"
    create = subprocess.run(
        [
            str(BIN / "ansible-builder"),
            "create",
            "-f",
            str(src / "execution-environment.yml"),
            "--context",
            str(out),
            "--output-filename",
            "Containerfile",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert create.returncode == 0, create.stdout + create.stderr
    # A missing additional build file is only a warning to ansible-builder: here it is a failure.
    assert "No matches" not in create.stdout + create.stderr, create.stdout + create.stderr
    return out


def test_the_python_requirements_are_the_collections(context: Path) -> None:
    collection = requirement_lines(REPO / "requirements.txt")
    generated = by_name(requirement_lines(context / "_build" / "requirements.txt"))
    for line in collection:
        req = Requirement(line)
        assert req.name.lower() in generated, f"{req.name} (requirements.txt) is missing from the EE"
        assert generated[req.name.lower()].specifier == req.specifier, f"{req.name}: EE and requirements.txt differ"
    # meshccl's wheel is built on the controller without build isolation: its build backend is there.
    build = tomllib.loads((REPO / "collective" / "pyproject.toml").read_text())["build-system"]["requires"]
    for line in build:
        req = Requirement(line)
        assert generated[req.name.lower()].specifier == req.specifier, f"{req.name}: EE and meshccl's build differ"
    assert "numpy" in generated
    # The controller package asks for the same as the collection.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert sorted(project["dependencies"]) == sorted(collection)


def test_ansible_core_and_runner_are_pinned_as_requirements_txt(context: Path) -> None:
    pins = by_name(requirement_lines(REPO / "requirements.txt"))
    deps = ee_definition()["dependencies"]
    for key, name in (("ansible_core", "ansible-core"), ("ansible_runner", "ansible-runner")):
        assert Requirement(deps[key]["package_pip"]).specifier == pins[name].specifier, key
    containerfile = (context / "Containerfile").read_text()
    refs = re.search(r'^ARG ANSIBLE_INSTALL_REFS="(.*)"$', containerfile, re.M)
    assert refs is not None, containerfile
    assert {Requirement(r).name for r in refs.group(1).split()} == {"ansible-core", "ansible-runner"}


def test_the_system_packages_are_bindep_txt(context: Path) -> None:
    assert (context / "_build" / "bindep.txt").read_bytes() == (REPO / "bindep.txt").read_bytes()
    containerfile = (context / "Containerfile").read_text()
    # bindep.txt is read in the builder stage and installed in the final one.
    assert "--user-bindep=bindep.txt" in containerfile
    assert "RUN /output/scripts/install-from-bindep" in containerfile
    # ninja-build is in Stream 9's CRB.
    assert "config-manager --set-enabled crb" in containerfile
    assert 'ARG PYCMD="/usr/bin/python3.11"' in containerfile


def test_the_context_carries_meshkit_with_the_collection(context: Path) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    wheels = sorted((context / "_build" / "meshkit").glob("*.whl"))
    assert [w.name for w in wheels] == [f"meshkit-{version}-py3-none-any.whl"]
    with zipfile.ZipFile(wheels[0]) as whl:
        names = set(whl.namelist())
        galaxy = yaml.safe_load(whl.read("ansible_collections/meshkit/cluster/galaxy.yml"))
    assert "meshkit/cli.py" in names
    # The controller's code (the planner, the plan contract, the picture, the steps its action plugins run).
    for module in (REPO / "meshkit").glob("*.py"):
        assert f"meshkit/{module.name}" in names
    assert "ansible_collections/meshkit/cluster/meta/runtime.yml" in names
    for plugin in (REPO / "plugins").glob("*/*.py"):
        assert f"ansible_collections/meshkit/cluster/{plugin.relative_to(REPO)}" in names
    assert "ansible_collections/meshkit/cluster/plugins/plugin_utils/controller.py" in names
    assert galaxy == yaml.safe_load((REPO / "galaxy.yml").read_text())
    containerfile = (context / "Containerfile").read_text()
    assert "COPY _build/meshkit/ /tmp/meshkit-wheel/" in containerfile
    assert "pip install --no-cache-dir --no-index /tmp/meshkit-wheel/meshkit-*.whl" in containerfile


def bindep_packages(monkeypatch: pytest.MonkeyPatch, os_release: dict[str, str], profiles: list[str]) -> set[str]:
    """The packages bindep.txt asks for on a platform, with bindep's own platform detection."""
    for key, value in os_release.items():
        monkeypatch.setattr(depends.distro, key, lambda value=value: value)
    deps = depends.Depends((REPO / "bindep.txt").read_text())
    rules = deps.active_rules(profiles + deps.platform_profiles())
    return {rule[0] for rule in rules}


def test_bindep_names_the_controller_packages_on_the_ee_base_image(monkeypatch: pytest.MonkeyPatch) -> None:
    # quay.io/centos/centos:stream9, as bindep sees it in ansible-builder's builder stage.
    stream9 = {"id": "centos", "version": "9", "codename": "", "name": "CentOS Stream"}
    assert bindep_packages(monkeypatch, stream9, ["default"]) == CONTROLLER_RPM
    # The EE's Python is the one whose headers bindep.txt installs.
    interpreter = ee_definition()["dependencies"]["python_interpreter"]["package_system"]
    assert f"{interpreter}-devel" in CONTROLLER_RPM


def test_bindep_covers_what_make_deps_installs(monkeypatch: pytest.MonkeyPatch) -> None:
    bookworm = {"id": "debian", "version": "12", "codename": "bookworm", "name": "Debian GNU/Linux"}
    assert bindep_packages(monkeypatch, bookworm, ["default"]) == CONTROLLER_DPKG
    script = (REPO / "scripts" / "system-deps").read_text()
    listed = re.search(r"^packages=\((.*?)^\)", script, re.M | re.S)
    assert listed is not None
    system_deps = {word for line in listed.group(1).splitlines() for word in line.split("#", 1)[0].split()}
    assert "graphviz" in system_deps
    missing = system_deps - bindep_packages(monkeypatch, bookworm, ["default", "lab", "test"])
    assert not missing, f"scripts/system-deps installs {sorted(missing)}, bindep.txt does not list them"


def test_bindep_parses_bindep_txt() -> None:
    run = subprocess.run(
        [str(BIN / "bindep"), "-f", str(REPO / "bindep.txt"), "--profiles"], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    configuration = run.stdout.split("Configuration profiles:", 1)[1].split()
    assert configuration == ["lab", "test"]
    # Exit 1 means packages are missing here, which is allowed; 2 is a file bindep cannot parse.
    listed = subprocess.run(
        [str(BIN / "bindep"), "-f", str(REPO / "bindep.txt"), "-b", "lab", "test"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert listed.returncode in (0, 1), listed.stdout + listed.stderr
