"""bridge_detach, discover and peer_link run as Ansible modules on the macOS path.

platform.system() answers "Darwin"; AnsibleModule.run_command is a fake that answers read-only
commands from fixtures (tests/fixtures/macos/, tests/fixtures/macos/synthetic/), answers mutating
commands with rc 0, and records every argv, so each test can assert the exact command list.
"""

from __future__ import annotations

import json
import platform
import plistlib
from pathlib import Path
from typing import Any

import pytest
from ansible.module_utils import basic
from ansible.module_utils.testing import patch_module_args
from ansible_collections.meshkit.cluster.plugins.module_utils import macos
from ansible_collections.meshkit.cluster.plugins.modules import bridge_detach, discover, peer_link

from .module_harness import Exit as ExitJson
from .module_harness import Fail as FailJson
from .module_harness import patch_exits

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "macos"
SYNTHETIC = FIXTURES / "synthetic"

# The Mac these tests run against: the real `ifconfig -a` and `networksetup -listallhardwareports` of one
# 16" MacBook Pro (Apple silicon, macOS 14.4): Wi-Fi en0 holds 192.168.2.46/24, Thunderbolt 1/2/3 are
# en1/en2/en3, all three members of bridge0. `netstat -rn -f inet` is a real capture of another Mac (a
# macOS 26 VM); only the management-interface check reads it.
IFCONFIG = (FIXTURES / "ifconfig_a_macbookpro16_apple_silicon_sonoma14.4_bridge0_3_tb_members.txt").read_text()
HARDWARE = (FIXTURES / "networksetup_listallhardwareports_macbookpro16_apple_silicon_sonoma14.4.txt").read_text()
MGMT = "192.168.2.46"  # en0's address in IFCONFIG
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
        return len(argv) <= 2
    if argv[0] == "networksetup":
        return argv[1] in READ_ONLY_NETWORKSETUP
    if argv[0] == "route":
        return argv[1:3] == ["-n", "get"]
    return argv[0] in ("system_profiler", "netstat")


HOST = {
    ("ifconfig",): (0, IFCONFIG, ""),
    ("netstat", "-rn", "-f", "inet"): real("netstat_rn_finet_macos26vm.txt"),
}
HOST_READS = [["ifconfig"], ["netstat", "-rn", "-f", "inet"]]


class FakeMac:
    def __init__(self, answers: dict[tuple[str, ...], tuple[int, str, str]]):
        self.answers = {**HOST, **answers}
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
def prefs(monkeypatch, tmp_path) -> Path:
    """The Mac's saved bridge0 (every Thunderbolt port a member), where the module reads it."""
    synthetic_prefs = plistlib.loads((SYNTHETIC / "preferences_bridge0_en1_en6_en2.plist").read_bytes())
    synthetic_prefs["VirtualNetworkInterfaces"]["Bridge"]["bridge0"]["Interfaces"] = ["en1", "en2", "en3"]
    path = tmp_path / "preferences.plist"
    path.write_bytes(plistlib.dumps(synthetic_prefs))
    monkeypatch.setattr(macos, "PREFERENCES", str(path))
    return path


@pytest.fixture
def mac(monkeypatch, prefs):
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
    ("ifconfig", "bridge0"): (0, macos.ifconfig_block(IFCONFIG, "bridge0"), ""),
    ("networksetup", "-listallnetworkservices"): real("networksetup_listallnetworkservices_rmbp_2014.txt"),
}
BRIDGE_READS = [["ifconfig", "bridge0"], ["networksetup", "-listallnetworkservices"], *HOST_READS]
UNSAVE = [
    "/usr/libexec/PlistBuddy",
    "-c",
    "Delete :VirtualNetworkInterfaces:Bridge:bridge0:Interfaces",
    "-c",
    "Add :VirtualNetworkInterfaces:Bridge:bridge0:Interfaces array",
]
BRIDGE_COMMANDS = [
    ["ifconfig", "bridge0", "deletem", "en1"],
    ["ifconfig", "bridge0", "deletem", "en2"],
    ["ifconfig", "bridge0", "deletem", "en3"],
    ["networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off"],
]


def test_bridge_detach_removes_members_now_and_at_boot_and_disables_the_service(mac, prefs):
    result, fake = mac(bridge_detach, {"management_address": MGMT}, BRIDGE_WITH_MEMBERS)
    assert fake.calls == BRIDGE_READS + BRIDGE_COMMANDS + [[*UNSAVE, str(prefs)]]
    assert result["changed"] is True
    assert result["commands"] == [*BRIDGE_COMMANDS, [*UNSAVE, str(prefs)]]
    assert result["members"] == ["en1", "en2", "en3"]
    assert result["detached"] == ["en1", "en2", "en3"]
    assert result["management_interface"] == "en0"
    assert "saved member list" in result["persistence"] and "disabled" in result["persistence"]
    assert result["notes"] == []
    assert result["diff"] == {
        "before": "bridge0 members: en1, en2, en3\n",
        "after": "bridge0 members: (none); bridge0 disabled\n",
    }


def test_bridge_detach_check_mode_runs_no_mutating_command(mac, prefs):
    result, fake = mac(bridge_detach, {"management_address": MGMT}, BRIDGE_WITH_MEMBERS, check_mode=True)
    assert fake.mutating == []
    assert fake.calls == BRIDGE_READS
    assert result["changed"] is True
    assert result["commands"][-1] == [*UNSAVE, str(prefs)]
    assert plistlib.loads(prefs.read_bytes())["VirtualNetworkInterfaces"]["Bridge"]["bridge0"]["Interfaces"] == [
        "en1",
        "en2",
        "en3",
    ]


def test_bridge_detach_refuses_when_management_is_a_bridge_member(mac):
    result, fake = mac(bridge_detach, {"management_interface": "en1"}, BRIDGE_WITH_MEMBERS, expect=FailJson)
    assert fake.mutating == []
    assert fake.calls == BRIDGE_READS
    assert "en1" in result["msg"]
    assert "Nothing was changed" in result["msg"]
    assert result["changed"] is False
    assert result["management_interface"] == "en1"
    assert result["commands"] == []


def test_bridge_detach_refuses_when_management_is_the_bridge(mac):
    result, fake = mac(bridge_detach, {"management_interface": "bridge0"}, BRIDGE_WITH_MEMBERS, expect=FailJson)
    assert fake.mutating == []
    assert "bridge0" in result["msg"]


def test_bridge_detach_after_a_reboot_changes_nothing(mac, prefs):
    # What a reboot after the first run leaves: a bridge without members, the service disabled, the saved
    # member list empty.
    saved = plistlib.loads(prefs.read_bytes())
    saved["VirtualNetworkInterfaces"]["Bridge"]["bridge0"]["Interfaces"] = []
    prefs.write_bytes(plistlib.dumps(saved))
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


def test_bridge_detach_says_when_the_saved_list_cannot_be_read(mac, monkeypatch, tmp_path):
    monkeypatch.setattr(macos, "PREFERENCES", str(tmp_path / "absent.plist"))
    result, fake = mac(bridge_detach, {"management_address": MGMT}, BRIDGE_WITH_MEMBERS)
    assert fake.mutating == BRIDGE_COMMANDS  # the runtime part and the service, nothing written blind
    assert "could not be read" in result["notes"][0]


def test_bridge_detach_failing_command_stops_and_is_named(mac):
    answers = {
        **BRIDGE_WITH_MEMBERS,
        ("ifconfig", "bridge0", "deletem", "en2"): (1, "", "ifconfig: SIOCDELM: Operation not permitted\n"),
    }
    result, fake = mac(bridge_detach, {"management_address": MGMT}, answers, expect=FailJson)
    assert fake.mutating == BRIDGE_COMMANDS[:2]  # nothing after the failure runs
    assert result["msg"] == "ifconfig bridge0 deletem en2 failed (rc=1): ifconfig: SIOCDELM: Operation not permitted"


# ---- discover ---------------------------------------------------------------------------------

PATTERNS = ["thunderbolt*"]  # what the playbooks pass when meshkit_peer_ports is empty (macOS finds its own ports)
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
    result, fake = mac(
        discover, {"management_address": MGMT, "peer_ports": PATTERNS}, DISCOVER_ANSWERS, check_mode=check_mode
    )
    assert fake.calls == [*DISCOVER_READS, *HOST_READS]
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
    result, fake = mac(discover, {"management_interface": "en2", "peer_ports": PATTERNS}, DISCOVER_ANSWERS)
    assert fake.calls == [*DISCOVER_READS, *HOST_READS]
    assert [p["port"] for p in result["ports"]] == ["en1", "en6"]
    assert result["management_interface"] == "en2"


def test_discover_failure_fails_the_module(mac):
    answers = {**DISCOVER_ANSWERS, ("system_profiler", "SPThunderboltDataType", "-json"): (1, "", "boom\n")}
    result, fake = mac(discover, {"management_address": MGMT, "peer_ports": PATTERNS}, answers, expect=FailJson)
    assert result["msg"] == "system_profiler SPThunderboltDataType -json failed (rc=1): boom"
    assert fake.mutating == []


# ---- peer_link --------------------------------------------------------------------------------
EN1 = {"port": "en1", "address": "198.18.128.1", "prefix": 30, "peer_address": "198.18.128.2", "peer_host": "mac2"}
EN2 = {"port": "en2", "address": "198.18.128.5", "prefix": 30, "peer_address": "198.18.128.6", "peer_host": "mac3"}

FRESH_ANSWERS = {
    ("networksetup", "-listnetworkserviceorder"): synthetic(
        "networksetup_listnetworkserviceorder_no_port_services.txt"
    ),
    ("networksetup", "-listallhardwareports"): (0, HARDWARE, ""),
    ("networksetup", "-getMTU", "en1"): synthetic("networksetup_getmtu_1500.txt"),
    ("networksetup", "-getMTU", "en2"): synthetic("networksetup_getmtu_1500.txt"),
    ("route", "-n", "get", "198.18.128.2"): synthetic("route_get_198.18.128.2_default_en0.txt"),
    ("route", "-n", "get", "198.18.128.6"): synthetic("route_get_198.18.128.6_default_en0.txt"),
}
FRESH_READS = [
    *HOST_READS,
    ["networksetup", "-listnetworkserviceorder"],
    ["networksetup", "-listallhardwareports"],
    ["networksetup", "-getMTU", "en1"],
    ["route", "-n", "get", "198.18.128.2"],
    ["networksetup", "-getMTU", "en2"],
    ["route", "-n", "get", "198.18.128.6"],
]
FRESH_COMMANDS = [
    ["networksetup", "-createnetworkservice", "meshkit en1", "Thunderbolt 1"],
    ["networksetup", "-setmanual", "meshkit en1", "198.18.128.1", "255.255.255.252", ""],
    ["networksetup", "-setMTU", "en1", "9000"],
    ["route", "-n", "add", "-host", "198.18.128.2", "-interface", "en1"],
    ["networksetup", "-createnetworkservice", "meshkit en2", "Thunderbolt 2"],
    ["networksetup", "-setmanual", "meshkit en2", "198.18.128.5", "255.255.255.252", ""],
    ["networksetup", "-setMTU", "en2", "9000"],
    ["route", "-n", "add", "-host", "198.18.128.6", "-interface", "en2"],
]
PEER_ARGS = {"ports": [EN1, EN2], "pool": POOL, "mtu": 9000, "management_address": MGMT}


def test_peer_link_fresh_ports_get_a_service_address_mtu_and_route(mac):
    result, fake = mac(peer_link, PEER_ARGS, FRESH_ANSWERS)
    assert fake.calls == FRESH_READS + FRESH_COMMANDS
    assert result["changed"] is True
    assert result["commands"] == FRESH_COMMANDS
    # the host routes do not survive a reboot, and the result says what replaces them
    assert [n.split(":")[0] for n in result["notes"]] == ["en1", "en2"]
    assert all("runtime only" in n and "after a reboot" in n for n in result["notes"])
    assert result["persistence"] == macos.PEER_LINK_PERSISTENCE
    assert result["diff"]["after"].splitlines()[0] == "networksetup -createnetworkservice meshkit en1 Thunderbolt 1"


def test_peer_link_check_mode_runs_no_mutating_command(mac):
    result, fake = mac(peer_link, PEER_ARGS, FRESH_ANSWERS, check_mode=True)
    assert fake.mutating == []
    assert fake.calls == FRESH_READS
    assert result["changed"] is True
    assert result["commands"] == FRESH_COMMANDS


def test_peer_link_after_a_reboot_changes_nothing(mac):
    # The saved service brings the address back and macOS installs the /30, so the peer leaves
    # through en1 without the (runtime) host route; the saved MTU is active.
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
        "persistence": macos.PEER_LINK_PERSISTENCE,
        "files": [],
        "record": None,
    }


def test_peer_link_refuses_the_management_interface(mac):
    result, fake = mac(peer_link, {**PEER_ARGS, "management_interface": "en1"}, FRESH_ANSWERS, expect=FailJson)
    assert result["msg"] == "the plan puts a cable address on the management interface en1; refusing"
    assert fake.calls == HOST_READS
    assert fake.mutating == []


def test_peer_link_failing_command_stops_and_is_named(mac):
    create = ("networksetup", "-createnetworkservice", "meshkit en1", "Thunderbolt 1")
    answers = {**FRESH_ANSWERS, create: (4, "", "** Error: The parameters were not valid.\n")}
    result, fake = mac(peer_link, PEER_ARGS, answers, expect=FailJson)
    assert fake.mutating == [list(create)]
    assert result["msg"] == (
        "networksetup -createnetworkservice meshkit en1 Thunderbolt 1 failed (rc=4): "
        "** Error: The parameters were not valid."
    )
    assert result["done"] == [{"cmd": list(create), "rc": 4}]


def test_peer_link_a_route_that_fails_with_exit_0_is_a_failure(mac):
    # route(8) exits 0 when the routing socket refuses; only stderr says so (recorded on macOS 26).
    add = ("route", "-n", "add", "-host", "198.18.128.2", "-interface", "en1")
    refused = (
        0,
        real("route_add_net_exists_stdout_macos26vm.txt")[1],
        "route: writing to routing socket: File exists\n",
    )
    result, fake = mac(peer_link, PEER_ARGS, {**FRESH_ANSWERS, add: refused}, expect=FailJson)
    assert fake.mutating[-1] == list(add)  # nothing after it ran
    assert result["msg"] == (
        "route -n add -host 198.18.128.2 -interface en1 failed (rc=1): route: writing to routing socket: File exists"
    )
