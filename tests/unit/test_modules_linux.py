"""bridge_detach and peer_link as Ansible modules on the Linux path, on recorded `ip -j` outputs
of a lab host (tests/fixtures/linux/), with persistence through systemd-networkd and
NetworkManager: the exact commands and files, and nothing mutated in check mode."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import pytest
from ansible.module_utils import basic
from ansible.module_utils.testing import patch_module_args
from ansible_collections.meshkit.cluster.plugins.modules import bridge_detach, peer_link

from .module_harness import Exit, Fail, patch_exits

LINUX = Path(__file__).resolve().parents[1] / "fixtures" / "linux"
MGMT = "198.20.0.2"  # node1's management address on mgmt0 in the recording
PORT = {
    "port": "tb0",
    "address": "198.18.128.1",
    "prefix": 30,
    "network": "198.18.128.0/30",
    "peer_host": "node2",
    "peer_port": "tb0",
    "peer_address": "198.18.128.2",
}
POOL = "198.18.128.0/17"


def recorded(state: str) -> dict[tuple[str, ...], tuple[int, str, str]]:
    read = lambda name: (0, (LINUX / f"lab_node1_{state}_ip_{name}.json").read_text(), "")  # noqa: E731
    return {
        ("ip", "-j", "-d", "link", "show"): read("link"),
        ("ip", "-j", "addr", "show"): read("addr"),
        ("ip", "-j", "-4", "route", "show", "table", "main"): read("route"),
        ("ip", "-j", "-4", "route", "show", "table", "all"): read("route_all"),
    }


NETWORKD = {("systemctl", "is-active", "systemd-networkd"): (0, "active\n", "")}
RUNTIME = {("systemctl", "is-active", "systemd-networkd"): (3, "inactive\n", "")}


@pytest.fixture
def linux(monkeypatch):
    monkeypatch.delenv("SSH_CONNECTION", raising=False)
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    patch_exits(monkeypatch)
    have = {"systemctl", "networkctl"}
    monkeypatch.setattr(
        basic.AnsibleModule, "get_bin_path", lambda _m, name, *a, **k: f"/usr/bin/{name}" if name in have else None
    )

    def run(module, args: dict[str, Any], answers, *, check_mode=False, expect=Exit):
        calls: list[list[str]] = []

        def run_command(_self, argv, **_kw):
            calls.append(list(argv))
            if tuple(argv) in answers:
                return answers[tuple(argv)]
            if argv[:2] == ["ip", "-j"] or argv[0] == "systemctl":
                raise AssertionError(f"unanswered read {argv}")
            return 0, "", ""

        monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
        with patch_module_args({**args, "_ansible_check_mode": check_mode}), pytest.raises(expect) as info:
            module.main()
        mutating = [c for c in calls if c[:2] != ["ip", "-j"] and c[0] != "systemctl"]
        return info.value.args[0], mutating

    return run


def test_bridge_detach_with_networkd(linux, tmp_path):
    args = {"management_address": MGMT, "peer_ports": ["tb*"], "networkd_dir": str(tmp_path)}
    result, mutating = linux(bridge_detach, args, {**recorded("fresh"), **NETWORKD})
    assert result["management_interface"] == "mgmt0"
    assert result["members"] == ["tb0"]
    assert mutating == [
        ["ip", "link", "set", "dev", "tb0", "nomaster"],
        ["ip", "link", "set", "dev", "bridge0", "down"],
        ["networkctl", "reload"],
    ]
    assert result["files"] == [str(tmp_path / "00-meshkit-bridge0.network"), str(tmp_path / "00-meshkit-tb0.network")]
    assert "Name=tb0" in (tmp_path / "00-meshkit-tb0.network").read_text()
    # The emptied bridge stays down at boot too (a factory file would bring it back up).
    assert "ActivationPolicy=down" in (tmp_path / "00-meshkit-bridge0.network").read_text()
    assert result["persistence"].startswith("systemd-networkd")


def test_bridge_detach_check_mode_touches_nothing(linux, tmp_path):
    args = {"management_address": MGMT, "peer_ports": ["tb*"], "networkd_dir": str(tmp_path)}
    result, mutating = linux(bridge_detach, args, {**recorded("fresh"), **NETWORKD}, check_mode=True)
    assert result["changed"] is True
    assert mutating == []
    assert list(tmp_path.iterdir()) == []
    assert "bridge0 members: tb0" in result["diff"]["before"]


def test_bridge_detach_runtime_only_where_no_manager_runs(linux):
    result, mutating = linux(bridge_detach, {"management_address": MGMT}, {**recorded("fresh"), **RUNTIME})
    assert mutating == [
        ["ip", "link", "set", "dev", "tb0", "nomaster"],
        ["ip", "link", "set", "dev", "bridge0", "down"],
    ]
    assert "runtime only" in result["persistence"]


def test_bridge_detach_converged_is_unchanged(linux, tmp_path):
    args = {"management_address": MGMT, "peer_ports": ["tb*"], "networkd_dir": str(tmp_path)}
    linux(bridge_detach, args, {**recorded("converged"), **NETWORKD})
    result, mutating = linux(bridge_detach, args, {**recorded("converged"), **NETWORKD})
    assert result["changed"] is False
    assert mutating == []


def test_bridge_detach_refuses_management_on_the_bridge(linux):
    result, mutating = linux(
        bridge_detach, {"management_interface": "bridge0"}, {**recorded("fresh"), **RUNTIME}, expect=Fail
    )
    assert "runs over bridge0 itself" in result["msg"]
    assert mutating == []


def test_peer_link_applies_address_route_and_networkd_dropin(linux, tmp_path):
    args = {"ports": [PORT], "pool": POOL, "peer_ports": ["tb*"], "management_address": MGMT,
            "networkd_dir": str(tmp_path)}  # fmt: skip
    fresh_but_detached = {**recorded("converged"), **NETWORKD}
    addr = recorded("fresh")[("ip", "-j", "addr", "show")]
    route = recorded("fresh")[("ip", "-j", "-4", "route", "show", "table", "main")]
    fresh_but_detached[("ip", "-j", "addr", "show")] = addr
    fresh_but_detached[("ip", "-j", "-4", "route", "show", "table", "main")] = route
    _result, mutating = linux(peer_link, args, fresh_but_detached)
    assert mutating == [
        ["ip", "addr", "add", "198.18.128.1/30", "dev", "tb0"],
        ["ip", "route", "replace", "198.18.128.2/32", "dev", "tb0", "src", "198.18.128.1"],
        ["networkctl", "reload"],
    ]
    dropin = tmp_path / "00-meshkit-tb0.network.d" / "50-address.conf"
    assert "Address=198.18.128.1/30" in dropin.read_text()
    # Converged: nothing to do, and the drop-in is already right.
    again, mutating = linux(peer_link, args, {**recorded("converged"), **NETWORKD})
    assert again["changed"] is False and mutating == []


def test_peer_link_refuses_a_port_still_in_the_bridge(linux):
    result, mutating = linux(
        peer_link, {"ports": [PORT], "pool": POOL, "management_address": MGMT}, {**recorded("fresh"), **RUNTIME},
        expect=Fail,
    )  # fmt: skip
    assert "tb0 is still enslaved to bridge0" in result["msg"]
    assert mutating == []
