"""The CI workflow for macOS and Linux runners (.github/workflows/meshccl.yml) cannot run here:
these tests check what can be checked without a runner. It parses; it has the legs the issue asks
for; every shell step is valid bash; and everything it names exists in this checkout (paths, the
package's test extra, CMake options and targets, worker scenarios, pins shared with
requirements-dev.txt), so a rename here breaks this test instead of the first run on a Mac."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "meshccl.yml"


@pytest.fixture(scope="module")
def workflow() -> dict:
    data = yaml.safe_load(WORKFLOW.read_text())
    # YAML 1.1 (PyYAML) reads the key `on` as True.
    data["on"] = data.pop(True, data.get("on"))
    return data


def steps(workflow: dict) -> list[tuple[str, dict]]:
    return [(job, step) for job, spec in workflow["jobs"].items() for step in spec["steps"]]


def run_text(workflow: dict) -> str:
    return "\n".join(step.get("run", "") for _, step in steps(workflow))


def test_header_says_it_cannot_run_here():
    header = WORKFLOW.read_text().split("\nname:", 1)[0]
    assert "CANNOT RUN" in header and "scripts/meshccl-macos" in header


def test_legs_macos_arm64_and_x86_64_linux_and_stock_python39(workflow):
    main = workflow["jobs"]["build-and-test"]
    oses = [leg["os"] for leg in main["strategy"]["matrix"]["include"]]
    assert {"ubuntu-24.04", "macos-14", "macos-15-intel"} <= set(oses), oses
    assert main["runs-on"] == "${{ matrix.os }}"
    py39 = workflow["jobs"]["python39-macos"]
    assert py39["runs-on"].startswith("macos")
    assert "(3, 9)" in "\n".join(s.get("run", "") for s in py39["steps"])
    assert set(workflow["on"]) >= {"push", "pull_request"}


def test_every_leg_builds_runs_the_cpp_suite_and_the_python_jobs(workflow):
    text = run_text(workflow)
    assert "-DMESHCCL_BUILD_TESTS=ON" in text and "-DMESHCCL_WERROR=ON" in text
    assert "build/meshccl_tests" in text
    assert "pytest tests/meshccl" in text
    cmake = (REPO / "collective" / "CMakeLists.txt").read_text()
    for option in re.findall(r"-D(MESHCCL_\w+)=", text):
        assert re.search(rf"\b{option}\b", cmake), f"CMake option {option} is not in collective/CMakeLists.txt"
    assert re.search(r"add_executable\(meshccl_tests\b", cmake)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash checks the steps' syntax")
def test_every_shell_step_is_valid_bash(workflow, tmp_path):
    for job, step in steps(workflow):
        if "run" not in step:
            continue
        script = re.sub(r"\$\{\{[^}]*\}\}", "EXPR", step["run"])
        path = tmp_path / "step.sh"
        path.write_text(script)
        result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, f"{job} / {step.get('name')}: {result.stderr}"


def test_what_it_names_exists(workflow):
    text = run_text(workflow)
    paths = {p.rstrip(".") for p in re.findall(r"(?<![\w./-])((?:collective|tests|requirements)[\w./-]*)", text)}
    assert {"collective", "requirements.txt", "tests/meshccl", "tests/meshccl/worker.py"} <= paths, paths
    for path in paths:
        assert (REPO / path).exists(), f"the workflow names {path}, which is not in the checkout"
    pyproject = tomllib.loads((REPO / "collective" / "pyproject.toml").read_text())
    assert "test" in pyproject["project"]["optional-dependencies"], "collective/pyproject.toml has no [test] extra"
    worker = (REPO / "tests" / "meshccl" / "worker.py").read_text()
    loop = re.search(r"for scenario in ([\w ]+); do", text)
    assert loop, "the Python 3.9 job's scenarios"
    for scenario in loop.group(1).split():
        assert f'scenario == "{scenario}"' in worker, f"tests/meshccl/worker.py has no scenario {scenario}"
    for action in re.findall(r"uses: (\S+)", WORKFLOW.read_text()):
        assert re.fullmatch(r"actions/(checkout|setup-python)@v\d+", action), action


def test_pins_match_requirements_dev(workflow):
    dev = {}
    for line in (REPO / "requirements-dev.txt").read_text().splitlines():
        m = re.match(r"([A-Za-z0-9_.\[\]-]+)\s*([<>=!~].*)$", line.strip())
        if m:
            dev[m.group(1).lower()] = m.group(2).replace(" ", "")
    shared = [
        (n, s) for n, s in re.findall(r'"([A-Za-z0-9_-]+)([<>=!~][^"]*)"', run_text(workflow)) if n.lower() in dev
    ]
    assert shared, "the workflow pins nothing that requirements-dev.txt pins (hypothesis)"
    for name, spec in shared:
        assert spec == dev[name.lower()], f"{name}{spec} in the workflow, {dev[name.lower()]} in requirements-dev.txt"
