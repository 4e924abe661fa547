"""launch_facts, launch.yml's one call per host before the plan: the management interface, the cabling
and the hostfiles, on recorded `ip -j` outputs of a lab host; a management refusal fails the call
naming its step, with the management module's own message, before discovery runs."""

from __future__ import annotations

import json
from pathlib import Path

from ansible_collections.meshkit.cluster.plugins.modules import launch_facts

from .module_harness import Fail
from .test_modules_linux import MGMT, linux, recorded  # noqa: F401  (linux: the fixture)


def test_management_discovery_and_hostfiles_in_one_call(linux, tmp_path: Path) -> None:  # noqa: F811
    (tmp_path / "manifest.json").write_text(json.dumps({"fingerprint": "sha256:x"}))
    args = {
        "management": {"host": "node1", "address": MGMT, "interface": "mgmt0"},
        "discover": {"peer_ports": ["no-such-port*"]},
        "hostfiles": str(tmp_path),
    }
    answers = {**recorded("converged"), ("ip", "-j", "-6", "neigh", "show"): (0, "[]", "")}
    out, mutating = linux(launch_facts, args, answers, check_mode=True)
    assert mutating == []
    assert out["changed"] is False
    assert out["management"]["interface"] == "mgmt0" and out["management"]["platform"] == "Linux"
    assert out["discovery"] == {"changed": False, "ports": [], "platform": "Linux", "management_interface": "mgmt0"}
    # torch.env is missing: read as empty, as launch.yml's slurp with a default gave it.
    assert out["hostfiles"] == {"manifest.json": json.dumps({"fingerprint": "sha256:x"}), "torch.env": ""}


def test_a_management_refusal_names_its_step_and_discovers_nothing(linux, tmp_path: Path) -> None:  # noqa: F811
    args = {
        "management": {"host": "node1", "address": MGMT, "interface": "eth9"},
        "discover": {"peer_ports": ["tb*"]},
        "hostfiles": str(tmp_path),
    }
    out, _mutating = linux(launch_facts, args, recorded("converged"), expect=Fail)
    assert out["step"] == "management"
    assert "meshkit_management_interface = 'eth9', but this host has no such interface" in out["msg"], out
    assert "discovery" not in out and "hostfiles" not in out
