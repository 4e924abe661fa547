"""The launch agent's check of its host (plugins/module_utils/agent_preflight.py) on this machine: the
program, its interpreter and script or module resolved to real paths, the working directory, further
commands, the planned ports; check_host() as the agent answers a preflight or a check. (Over a real
connection: test_launch_fast.py, test_launcher.py; the cable checks' macOS cases: test_macos_facts.py.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils.agent_preflight import check_host

Preflight = Callable[..., dict[str, Any]]


@pytest.fixture
def preflight() -> Preflight:
    """The preflight as the agent runs it for launch.yml: check_host() with no cables and no facts."""

    def run(**args: Any) -> dict[str, Any]:
        out = check_host({"preflight": args, "facts": False})
        assert set(out) == {"t", "preflight"} and out["t"] == "checked", out
        return out["preflight"]

    return run


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    path = tmp_path / "bin"
    path.mkdir()
    return path


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


PYTHON_DIR = os.path.dirname(sys.executable)
PYTHON3 = "python3" if shutil.which("python3", path=PYTHON_DIR) else os.path.basename(sys.executable)


def test_preflight_missing_program(preflight: Preflight, bin_dir: Path) -> None:
    out = preflight(argv=["no-such-program-xyz", "--flag"], path=str(bin_dir))
    assert out["program"] is None and out["interpreter"] is None and out["script"] is None
    assert out["problems"] == [f"program no-such-program-xyz not found on PATH ({bin_dir}), or not executable"]
    out = preflight(argv=[str(bin_dir / "absent")])
    assert out["problems"] == [f"program {bin_dir / 'absent'} not found, or not executable"]


def test_preflight_not_executable_is_not_found(preflight: Preflight, bin_dir: Path) -> None:
    (bin_dir / "tool").write_text("#!/bin/sh\n")
    out = preflight(argv=["tool"], path=str(bin_dir))
    assert out["program"] is None
    assert out["problems"] and "not found" in out["problems"][0]


def test_preflight_program_on_path_resolves_to_its_real_path(
    preflight: Preflight, tmp_path: Path, bin_dir: Path
) -> None:
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    real = executable(real_dir / "tool.sh", "#!/bin/sh\necho hi\n")
    (bin_dir / "tool").symlink_to(real)
    out = preflight(argv=["tool", "arg"], path=f"{tmp_path / 'empty'}:{bin_dir}")
    assert out["problems"] == []
    assert out["program"] == str(real.resolve())
    assert out["interpreter"] == os.path.realpath("/bin/sh")
    assert out["script"] is None


def test_preflight_relative_program_is_found_from_cwd(preflight: Preflight, tmp_path: Path) -> None:
    real = executable(tmp_path / "run.sh", "#!/bin/sh\n")
    out = preflight(argv=["./run.sh"], cwd=str(tmp_path), path="/nonexistent")
    assert out["problems"] == []
    assert out["program"] == str(real.resolve())


def test_preflight_env_shebang_is_resolved_on_path(preflight: Preflight, bin_dir: Path) -> None:
    executable(bin_dir / "myinterp", "#!/bin/sh\n")
    script = executable(bin_dir / "job", "#!/usr/bin/env myinterp -x\n")
    out = preflight(argv=["job"], path=str(bin_dir))
    assert out["problems"] == []
    assert out["program"] == str(script.resolve())
    assert out["interpreter"] == str((bin_dir / "myinterp").resolve())


def test_preflight_script_whose_interpreter_is_missing(preflight: Preflight, bin_dir: Path) -> None:
    script = executable(bin_dir / "job", "#!/nonexistent/interp -u\nprint(1)\n")
    out = preflight(argv=["job"], path=str(bin_dir))
    assert out["program"] == str(script.resolve())
    assert out["interpreter"] is None
    assert out["problems"] == [f"{script.resolve()}: its interpreter /nonexistent/interp (#! line) is missing"]
    env_script = executable(bin_dir / "job2", "#!/usr/bin/env no-such-interp-xyz\n")
    out = preflight(argv=["job2"], path=str(bin_dir))
    assert out["problems"] == [f"{env_script.resolve()}: its interpreter no-such-interp-xyz (#! line) is missing"]


def test_preflight_python_with_a_missing_script(preflight: Preflight, tmp_path: Path) -> None:
    out = preflight(argv=[PYTHON3, "missing.py"], path=PYTHON_DIR, cwd=str(tmp_path))
    python = os.path.realpath(os.path.join(PYTHON_DIR, PYTHON3))
    assert out["program"] == python
    assert out["interpreter"] == python
    assert out["script"] is None
    assert out["problems"] == [f"script missing.py not found (run by {python})"]


def test_preflight_python_with_a_script_resolves_it(preflight: Preflight, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "link.py").symlink_to(tmp_path / "train.py")
    out = preflight(argv=[PYTHON3, "-u", "ignored"], path=PYTHON_DIR, cwd=str(tmp_path))
    assert out["problems"] == [] and out["script"] is None  # options first: nothing to check
    out = preflight(argv=[PYTHON3, "link.py", "--epochs", "1"], path=PYTHON_DIR, cwd=str(tmp_path))
    assert out["problems"] == []
    assert out["script"] == str((tmp_path / "train.py").resolve())


def test_preflight_python_module_resolves_to_its_file(preflight: Preflight) -> None:
    out = preflight(argv=[PYTHON3, "-m", "json", "--help"], path=PYTHON_DIR)
    assert out["problems"] == []
    assert out["script"] == os.path.realpath(json.__file__)
    assert out["interpreter"] == out["program"] == os.path.realpath(os.path.join(PYTHON_DIR, PYTHON3))


def test_preflight_python_module_of_a_virtual_environment(preflight: Preflight) -> None:
    """``python3 -m MOD`` where python3 is a virtual environment's (a link to the system's Python,
    as meshccl's on every host): the module is looked up as the ranks will run it, in the
    environment, not by the system Python the link resolves to (which lacks the package)."""
    venv_bin = Path(sys.prefix) / "bin"
    assert sys.prefix != sys.base_prefix and (venv_bin / "python3").is_symlink()
    out = preflight(argv=["python3", "-m", "meshccl.linkcheck"], path_prepend=[str(venv_bin)], path="/usr/bin:/bin")
    assert out["problems"] == [], out
    assert out["script"] is not None and out["script"].endswith("meshccl/linkcheck.py"), out
    assert out["program"] == os.path.realpath(venv_bin / "python3")


def test_preflight_python_module_that_cannot_be_imported(preflight: Preflight) -> None:
    out = preflight(argv=[PYTHON3, "-m", "no_such_mod_xyz"], path=PYTHON_DIR)
    assert out["script"] is None
    assert out["problems"] == [f"{out['program']} cannot import module no_such_mod_xyz (python -m)"]


def test_preflight_missing_cwd(preflight: Preflight, tmp_path: Path) -> None:
    out = preflight(argv=["sh"], cwd=str(tmp_path / "gone"))
    assert out["problems"] == [f"working directory {tmp_path / 'gone'} does not exist"]


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_preflight_port_in_use(preflight: Preflight, listening: int) -> None:
    out = preflight(argv=["sh"], ports=[["127.0.0.1", listening, "meshccl rank 0"]])
    assert len(out["problems"]) == 1
    problem = out["problems"][0]
    assert problem.startswith(f"port {listening} on 127.0.0.1 is in use")
    assert problem.endswith(" (planned for meshccl rank 0)")


def test_preflight_address_not_on_this_host(preflight: Preflight) -> None:
    out = preflight(argv=["sh"], ports=[["192.0.2.1", free_port(), "MLX ring rank 0"]])
    assert out["problems"] == [
        "address 192.0.2.1 is not on this host (run setup.yml: the cabling or addresses changed)"
        " (planned for MLX ring rank 0)"
    ]


def test_preflight_free_port_is_no_problem(preflight: Preflight) -> None:
    port = free_port()
    out = preflight(argv=["sh"], ports=[["127.0.0.1", port, "torch"], ["0.0.0.0", port], ["127.0.0.1", str(port)]])
    assert out["problems"] == []
    assert out["program"] == os.path.realpath(shutil.which("sh"))


# ---- check_host: the preflight, the cables, the facts, as the agent answers ---------------------------


def test_check_host_adds_the_cable_checks_to_the_preflight_and_reads_facts_unless_told_not_to(
    tmp_path: Path,
) -> None:
    """With cables, the cable checks run as the agent runs them (cable_checks(): the collection's macos,
    this host's sysfs, the ranks' Python); their fields join the preflight's and their problems follow its
    own. Facts are read unless ``facts`` is false."""
    cables = [
        {"port": "lo", "address": "127.0.0.1", "prefix": 8, "peer_address": "127.0.0.1", "peer_host": "b"},
        {"port": "lo", "address": "127.0.0.1", "prefix": 8, "peer_address": "127.0.0.2", "peer_host": "c"},
    ]
    argv = [sys.executable, "-c", "pass"]
    spec = {"preflight": {"argv": argv, "cwd": str(tmp_path / "gone")}, "cables": cables, "facts": False}
    out = check_host(spec)
    assert set(out) == {"t", "preflight"}
    found = out["preflight"]
    assert found["problems"] == [f"working directory {tmp_path / 'gone'} does not exist"]
    assert found["interpreter"] == found["probed_with"] == os.path.realpath(sys.executable)
    assert [(p["peer_host"], p["kind"]) for p in found["peers"]] == [("b", "reachable"), ("c", "reachable")]
    assert found["bridged"] == {} and "via" in found["context"]
    facts = check_host({"preflight": {"argv": argv}, "state_dir": str(tmp_path), "links": []})["facts"]
    assert facts["platform"] == sys.platform and facts["fingerprint"] is None and facts["torch_env"] is None
