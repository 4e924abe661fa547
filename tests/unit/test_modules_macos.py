"""bridge_detach, discover and peer_link run as Ansible modules on the macOS path.

platform.system() answers "Darwin"; AnsibleModule.run_command is a fake that answers read-only
commands from fixtures (tests/fixtures/macos/, tests/fixtures/macos/synthetic/), answers mutating
commands with rc 0, and records every argv, so each test can assert the exact command list.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import pytest
from ansible.module_utils import basic
from ansible.module_utils.testing import patch_module_args
from ansible_collections.meshkit.cluster.plugins.modules import bridge_detach, discover, peer_link

from .module_harness import Exit as ExitJson
from .module_harness import Fail as FailJson
from .module_harness import patch_exits

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "macos"
SYNTHETIC = FIXTURES / "synthetic"

MGMT = "192.168.1.20"  # reached over en0 (synthetic route_get_192.168.1.20_en0.txt)
MGMT_ON_EN1 = "169.254.10.20"  # reached over en1, a Thunderbolt port (route_get_169.254.10.20_en1.txt)
POOL = "198.18.128.0/17"
PEER_UUID = "00000003-0000-4000-8000-000000000003"


def real(name: str) -> tuple[int, str, str]:
    return 0, (FIXTURES / name).read_text(), ""


def synthetic(name: str) -> tuple[int, str, str]:
    return 0, (SYNTHETIC / name).read_text(), ""


READ_ONLY_NETWORKSETUP = (
    "-listallhardwareports",
    "-listallnetworkservices",
    "-listnetworkserviceorder",
    "-getinfo",
    "-getMTU",
)


def read_only(argv: list[str]) -> bool:
    if argv[0] == "ifconfig":
        return len(argv) == 2
    if argv[0] == "networksetup":
        return argv[1] in READ_ONLY_NETWORKSETUP
    if argv[0] == "route":
        return argv[1:3] == ["-n", "get"]
    return argv[0] == "system_profiler"


ROUTES = {
    ("route", "-n", "get", MGMT): synthetic("route_get_192.168.1.20_en0.txt"),
    ("route", "-n", "get", MGMT_ON_EN1): synthetic("route_get_169.254.10.20_en1.txt"),
}


class FakeMac:
    def __init__(self, answers: dict[tuple[str, ...], tuple[int, str, str]]):
        self.answers = {**ROUTES, **answers}
        self.calls: list[list[str]] = []

    def run_command(self, _module, args, **kwargs):
        assert isinstance(args, list), args
        assert kwargs.get("environ_update") == {"LC_ALL": "C", "LANG": "C"}
        self.calls.append(list(args))
        if tuple(args) in self.answers:
            return self.answers[tuple(args)]
        if read_only(args):
            raise AssertionError(f"no fixture answers the read-only command {args}")
        return 0, "", ""

    @property
    def mutating(self) -> list[list[str]]:
        return [c for c in self.calls if not read_only(c)]

    @property
    def reads(self) -> list[list[str]]:
        return [c for c in self.calls if read_only(c)]


@pytest.fixture
def mac(monkeypatch):
    monkeypatch.delenv("SSH_CONNECTION", raising=False)
    monkeypatch.setattr(platform, "system", lambda: "Darwin")

    patch_exits(monkeypatch)

    def run(module, args: dict[str, Any], answers, *, check_mode=False, expect=ExitJson) -> tuple[dict, FakeMac]:
        fake = FakeMac(answers)

        def run_command(module_self, args, **kwargs):  # a plain function, so AnsibleModule binds it
            return fake.run_command(module_self, args, **kwargs)

        monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
        with patch_module_args({**args, "_ansible_check_mode": check_mode}), pytest.raises(expect) as info:
            module.main()
        return info.value.args[0], fake

    return run


# ---- bridge_detach ----------------------------------------------------------------------------
BRIDGE_WITH_MEMBERS = {
    ("ifconfig", "bridge0"): synthetic("ifconfig_bridge0_members_en1_en6_en2.txt"),
    ("networksetup", "-listallnetworkservices"): real("networksetup_listallnetworkservices_rmbp_2014.txt"),
}
BRIDGE_READS = [
    ["ifconfig", "bridge0"],
    ["networksetup", "-listallnetworkservices"],
    ["route", "-n", "get", MGMT],
]
BRIDGE_COMMANDS = [
    ["ifconfig", "bridge0", "deletem", "en1"],
    ["ifconfig", "bridge0", "deletem", "en6"],
    ["ifconfig", "bridge0", "deletem", "en2"],
    ["networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off"],
]


def test_bridge_detach_removes_members_and_disables_the_service(mac):
    result, fake = mac(bridge_detach, {"management_address": MGMT}, BRIDGE_WITH_MEMBERS)
    assert fake.calls == BRIDGE_READS + BRIDGE_COMMANDS
    assert result["changed"] is True
    assert result["commands"] == BRIDGE_COMMANDS
    assert result["members"] == ["en1", "en6", "en2"]
    assert result["detached"] == ["en1", "en6", "en2"]
    assert result["management_interface"] == "en0"
    assert "stays disabled across reboots" in result["persistence"]
    assert result["diff"] == {
        "before": "bridge0 members: en1, en6, en2\n",
        "after": "bridge0 members: (none); bridge0 disabled\n",
    }


def test_bridge_detach_check_mode_runs_no_mutating_command(mac):
    result, fake = mac(bridge_detach, {"management_address": MGMT}, BRIDGE_WITH_MEMBERS, check_mode=True)
    assert fake.mutating == []
    assert fake.calls == BRIDGE_READS
    assert result["changed"] is True
    assert result["commands"] == BRIDGE_COMMANDS


def test_bridge_detach_management_interface_from_the_route_to_the_controller(mac, monkeypatch):
    # SSH_CONNECTION = "controller port this-host port": macOS looks up the route to the
    # controller (the host's own address would route through lo0).
    monkeypatch.setenv("SSH_CONNECTION", f"192.168.1.5 50022 {MGMT} 22")
    answers = {
        **BRIDGE_WITH_MEMBERS,
        ("route", "-n", "get", "192.168.1.5"): synthetic("route_get_192.168.1.20_en0.txt"),
    }
    result, fake = mac(bridge_detach, {}, answers, check_mode=True)
    routes = [c for c in fake.calls if c[:3] == ["route", "-n", "get"]]
    assert routes[0] == ["route", "-n", "get", "192.168.1.5"]
    assert result["management_interface"] == "en0"


def test_bridge_detach_refuses_when_management_is_a_bridge_member(mac):
    result, fake = mac(bridge_detach, {"management_address": MGMT_ON_EN1}, BRIDGE_WITH_MEMBERS, expect=FailJson)
    assert fake.mutating == []
    assert fake.calls == [
        ["ifconfig", "bridge0"],
        ["networksetup", "-listallnetworkservices"],
        ["route", "-n", "get", MGMT_ON_EN1],
    ]
    assert "en1" in result["msg"]
    assert "Nothing was changed" in result["msg"]
    assert result["changed"] is False
    assert result["management_interface"] == "en1"
    assert result["commands"] == []


def test_bridge_detach_refuses_when_management_is_the_bridge(mac):
    result, fake = mac(bridge_detach, {"management_interface": "bridge0"}, BRIDGE_WITH_MEMBERS, expect=FailJson)
    assert fake.mutating == []
    assert fake.calls == [
        ["ifconfig", "bridge0"],
        ["networksetup", "-listallnetworkservices"],
    ]  # override: no route lookup
    assert "bridge0" in result["msg"]


def test_bridge_detach_converged_changes_nothing(mac):
    answers = {
        ("ifconfig", "bridge0"): synthetic("ifconfig_bridge0_no_members.txt"),
        ("networksetup", "-listallnetworkservices"): synthetic(
            "networksetup_listallnetworkservices_bridge_disabled.txt"
        ),
    }
    result, fake = mac(bridge_detach, {"management_address": MGMT}, answers)
    assert fake.calls == BRIDGE_READS
    assert result["changed"] is False
    assert result["commands"] == []
    assert "diff" not in result


def test_bridge_detach_failing_command_stops_and_is_named(mac):
    answers = {
        **BRIDGE_WITH_MEMBERS,
        ("ifconfig", "bridge0", "deletem", "en6"): (1, "", "ifconfig: SIOCDELM: Operation not permitted\n"),
    }
    result, fake = mac(bridge_detach, {"management_address": MGMT}, answers, expect=FailJson)
    assert fake.mutating == BRIDGE_COMMANDS[:2]  # nothing after the failure runs
    assert result["msg"] == "ifconfig bridge0 deletem en6 failed (rc=1): ifconfig: SIOCDELM: Operation not permitted"


# ---- discover ---------------------------------------------------------------------------------
DISCOVER_ANSWERS = {
    ("networksetup", "-listallhardwareports"): real(
        "networksetup_listallhardwareports_macbookpro_m5max_anonymized.txt"
    ),
    ("system_profiler", "SPThunderboltDataType", "-json"): real(
        "system_profiler_macbookpro_m5max_peer_tb5dock_anonymized.json"
    ),
}
DISCOVER_READS = [
    ["networksetup", "-listallhardwareports"],
    ["system_profiler", "SPThunderboltDataType", "-json"],
]


@pytest.mark.parametrize("check_mode", [False, True])
def test_discover_reports_every_thunderbolt_port(mac, check_mode):
    result, fake = mac(discover, {"management_address": MGMT}, DISCOVER_ANSWERS, check_mode=check_mode)
    assert fake.calls == [*DISCOVER_READS, ["route", "-n", "get", MGMT]]
    assert result["changed"] is False
    assert result["platform"] == "Darwin"
    assert result["management_interface"] == "en0"
    ports = {p["port"]: p for p in result["ports"]}
    assert [p["port"] for p in result["ports"]] == ["en1", "en6", "en2"]
    assert ports["en6"]["seen"] == [PEER_UUID]
    assert ports["en6"]["speed"] == "80 Gb/s"
    assert ports["en6"]["generation"] == "tb5"
    assert ports["en2"]["seen"] == []
    assert ports["en2"]["devices"] == ["SB-XTM5"]
    assert ports["en1"]["linked"] is False
    json.dumps(result)  # what Ansible sends back must be JSON


def test_discover_leaves_out_the_management_port(mac):
    result, fake = mac(discover, {"management_interface": "en6"}, DISCOVER_ANSWERS)
    assert fake.calls == DISCOVER_READS
    assert [p["port"] for p in result["ports"]] == ["en1", "en2"]
    assert result["management_interface"] == "en6"


def test_discover_failure_fails_the_module(mac):
    answers = {**DISCOVER_ANSWERS, ("system_profiler", "SPThunderboltDataType", "-json"): (1, "", "boom\n")}
    result, fake = mac(discover, {"management_address": MGMT}, answers, expect=FailJson)
    assert result["msg"] == "system_profiler SPThunderboltDataType -json failed (rc=1): boom"
    assert fake.mutating == []


# ---- peer_link --------------------------------------------------------------------------------
EN1 = {"port": "en1", "address": "198.18.128.1", "prefix": 30, "peer_address": "198.18.128.2", "peer_host": "mac2"}
EN6 = {"port": "en6", "address": "198.18.128.5", "prefix": 30, "peer_address": "198.18.128.6", "peer_host": "mac3"}

FRESH_ANSWERS = {
    ("networksetup", "-listnetworkserviceorder"): synthetic(
        "networksetup_listnetworkserviceorder_no_port_services.txt"
    ),
    ("networksetup", "-getMTU", "en1"): synthetic("networksetup_getmtu_1500.txt"),
    ("networksetup", "-getMTU", "en6"): synthetic("networksetup_getmtu_1500.txt"),
    ("route", "-n", "get", "198.18.128.2"): synthetic("route_get_198.18.128.2_default_en0.txt"),
    ("route", "-n", "get", "198.18.128.6"): synthetic("route_get_198.18.128.6_default_en0.txt"),
}
FRESH_READS = [
    ["route", "-n", "get", MGMT],
    ["networksetup", "-listnetworkserviceorder"],
    ["networksetup", "-getMTU", "en1"],
    ["route", "-n", "get", "198.18.128.2"],
    ["networksetup", "-getMTU", "en6"],
    ["route", "-n", "get", "198.18.128.6"],
]
FRESH_COMMANDS = [
    ["networksetup", "-createnetworkservice", "meshkit en1", "en1"],
    ["networksetup", "-setmanual", "meshkit en1", "198.18.128.1", "255.255.255.252"],
    ["networksetup", "-setMTU", "en1", "9000"],
    ["route", "-n", "add", "-host", "198.18.128.2", "-interface", "en1"],
    ["networksetup", "-createnetworkservice", "meshkit en6", "en6"],
    ["networksetup", "-setmanual", "meshkit en6", "198.18.128.5", "255.255.255.252"],
    ["networksetup", "-setMTU", "en6", "9000"],
    ["route", "-n", "add", "-host", "198.18.128.6", "-interface", "en6"],
]
PEER_ARGS = {"ports": [EN1, EN6], "pool": POOL, "mtu": 9000, "management_address": MGMT}


def test_peer_link_fresh_ports_get_a_service_address_mtu_and_route(mac):
    result, fake = mac(peer_link, PEER_ARGS, FRESH_ANSWERS)
    assert fake.calls == FRESH_READS + FRESH_COMMANDS
    assert result["changed"] is True
    assert result["commands"] == FRESH_COMMANDS
    assert result["notes"] == []
    assert result["diff"]["after"].splitlines()[0] == "networksetup -createnetworkservice meshkit en1 en1"


def test_peer_link_check_mode_runs_no_mutating_command(mac):
    result, fake = mac(peer_link, PEER_ARGS, FRESH_ANSWERS, check_mode=True)
    assert fake.mutating == []
    assert fake.calls == FRESH_READS
    assert result["changed"] is True
    assert result["commands"] == FRESH_COMMANDS


def test_peer_link_existing_services_are_reused_and_only_the_differences_run(mac):
    answers = {
        ("networksetup", "-listnetworkserviceorder"): synthetic(
            "networksetup_listnetworkserviceorder_port_services.txt"
        ),
        # en1's service already has the planned address; en6's has another one
        ("networksetup", "-getinfo", "meshkit en1"): synthetic("networksetup_getinfo_manual_198.18.128.1.txt"),
        ("networksetup", "-getinfo", "Thunderbolt 2"): synthetic("networksetup_getinfo_manual_198.18.128.1.txt"),
        ("route", "-n", "get", "198.18.128.2"): synthetic("route_get_198.18.128.2_connected_en1.txt"),
        ("route", "-n", "get", "198.18.128.6"): synthetic("route_get_198.18.128.6_default_en0.txt"),
    }
    result, fake = mac(peer_link, {"ports": [EN1, EN6], "pool": POOL, "management_address": MGMT}, answers)
    assert fake.calls == [
        ["route", "-n", "get", MGMT],
        ["networksetup", "-listnetworkserviceorder"],
        ["networksetup", "-getinfo", "meshkit en1"],
        ["route", "-n", "get", "198.18.128.2"],
        ["networksetup", "-getinfo", "Thunderbolt 2"],
        ["route", "-n", "get", "198.18.128.6"],
        ["networksetup", "-setmanual", "Thunderbolt 2", "198.18.128.5", "255.255.255.252"],
        ["route", "-n", "add", "-host", "198.18.128.6", "-interface", "en6"],
    ]
    assert result["changed"] is True


def test_peer_link_converged_changes_nothing(mac):
    answers = {
        ("networksetup", "-listnetworkserviceorder"): synthetic(
            "networksetup_listnetworkserviceorder_port_services.txt"
        ),
        ("networksetup", "-getinfo", "meshkit en1"): synthetic("networksetup_getinfo_manual_198.18.128.1.txt"),
        ("networksetup", "-getMTU", "en1"): synthetic("networksetup_getmtu_9000.txt"),
        ("route", "-n", "get", "198.18.128.2"): synthetic("route_get_198.18.128.2_connected_en1.txt"),
    }
    result, fake = mac(peer_link, {"ports": [EN1], "pool": POOL, "mtu": 9000, "management_interface": "en0"}, answers)
    assert fake.mutating == []
    assert result == {
        "changed": False,
        "commands": [],
        "notes": [],
        "persistence": "network services set with networksetup persist across reboots",
        "files": [],
    }


def test_peer_link_switches_a_dhcp_service_to_manual(mac):
    answers = {
        ("networksetup", "-listnetworkserviceorder"): synthetic(
            "networksetup_listnetworkserviceorder_port_services.txt"
        ),
        ("networksetup", "-getinfo", "Thunderbolt 2"): synthetic("networksetup_getinfo_dhcp_198.18.128.5.txt"),
        ("route", "-n", "get", "198.18.128.6"): synthetic("route_get_198.18.128.6_default_en0.txt"),
    }
    result, _fake = mac(peer_link, {"ports": [EN6], "pool": POOL, "management_interface": "en0"}, answers)
    assert ["networksetup", "-setmanual", "Thunderbolt 2", "198.18.128.5", "255.255.255.252"] in result["commands"]


def test_peer_link_refuses_the_management_interface(mac):
    result, fake = mac(peer_link, {**PEER_ARGS, "management_address": MGMT_ON_EN1}, FRESH_ANSWERS, expect=FailJson)
    assert result["msg"] == "the plan puts a cable address on the management interface en1; refusing"
    assert fake.calls == [["route", "-n", "get", MGMT_ON_EN1]]
    assert fake.mutating == []


def test_peer_link_failing_command_stops_and_is_named(mac):
    answers = {
        **FRESH_ANSWERS,
        ("networksetup", "-createnetworkservice", "meshkit en1", "en1"): (
            4,
            "",
            "** Error: The parameters were not valid.\n",
        ),
    }
    result, fake = mac(peer_link, PEER_ARGS, answers, expect=FailJson)
    assert fake.mutating == [["networksetup", "-createnetworkservice", "meshkit en1", "en1"]]
    assert result["msg"] == (
        "networksetup -createnetworkservice meshkit en1 en1 failed (rc=4): ** Error: The parameters were not valid."
    )
    assert result["done"] == [{"cmd": ["networksetup", "-createnetworkservice", "meshkit en1", "en1"], "rc": 4}]
