"""The macOS path end to end for a ring of four Mac Studios: the exact commands on every Mac.

Each Mac is built from the recorded M3 Ultra Mac Studio capture
(system_profiler_macstudio_m3ultra_peer_macbookpro_owc_drive.json and the Studio's
networksetup -listallhardwareports): its six buses keep their recorded structure; only the
domain UUIDs are made per Mac and per port, and the recorded peer-Mac entry is placed on the
two ring ports (Thunderbolt 1 and 2, en2 and en3 on that Studio) pointing at the neighbour's
port. No four-Mac ring capture exists publicly; this is the nearest real thing.
Run with -s to see the command lists.
"""

from __future__ import annotations

import copy
import json
import plistlib
import uuid
from pathlib import Path

from ansible_collections.meshkit.cluster.plugins.module_utils import macos

from meshkit.topology import Observation, build_plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "macos"
STUDIO = json.loads((FIXTURES / "system_profiler_macstudio_m3ultra_peer_macbookpro_owc_drive.json").read_text())
HARDWARE = (FIXTURES / "networksetup_listallhardwareports_macstudio_m3ultra_TRIMMED.txt").read_text()
SERVICES = (FIXTURES / "networksetup_listallnetworkservices_rmbp_2014.txt").read_text()
# The Studio's service order with no service on its Thunderbolt ports (hand-written in the
# format of tests/fixtures/macos/synthetic/networksetup_listnetworkserviceorder_*.txt).
ORDER = """An asterisk (*) denotes that a network service is disabled.
(1) Ethernet
(Hardware Port: Ethernet, Device: en0)

(*) Thunderbolt Bridge
(Hardware Port: Thunderbolt Bridge, Device: bridge0)
"""
MACS = ["mac1", "mac2", "mac3", "mac4"]
NS = uuid.UUID("6f1c4d52-8a8e-4b0e-9a53-2d1f0a7c3e11")


def port_uuid(mac: str, receptacle: str) -> str:
    return str(uuid.uuid5(NS, f"{mac}-{receptacle}")).upper()


def peer_entry() -> dict:
    for bus in STUDIO["SPThunderboltDataType"]:
        for item in bus.get("_items", []):
            if item.get("domain_uuid_key"):
                return item
    raise AssertionError("the recorded capture has a peer Mac")


def studio(index: int) -> dict:
    """Mac i: port 2 cabled to Mac i+1's port 1, port 1 to Mac i-1's port 2."""
    mac = MACS[index]
    links = {"1": (MACS[index - 1], "2"), "2": (MACS[(index + 1) % 4], "1")}
    data = copy.deepcopy(STUDIO)
    for bus in data["SPThunderboltDataType"]:
        tag = bus["receptacle_1_tag"]
        receptacle = tag["receptacle_id_key"]
        bus["domain_uuid_key"] = port_uuid(mac, receptacle)
        bus.pop("_items", None)
        if receptacle in links:
            other, other_port = links[receptacle]
            peer = copy.deepcopy(peer_entry())
            peer["_name"] = "Mac Studio"
            peer["domain_uuid_key"] = port_uuid(other, other_port)
            bus["_items"] = [peer]
            tag["current_speed_key"] = "80 Gb/s"
        else:
            tag["current_speed_key"] = "Up to 120 Gb/s"
    return data


def bridge_text() -> str:
    members = "".join(f"\tmember: en{n} flags=3<LEARNING,DISCOVER>\n" for n in range(2, 8))
    return f"bridge0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500\n{members}\tstatus: active\n"


def fake(index: int, calls: list[list[str]]):
    answers = {
        ("system_profiler", "SPThunderboltDataType", "-json"): json.dumps(studio(index)),
        ("networksetup", "-listallhardwareports"): HARDWARE,
        ("networksetup", "-listallnetworkservices"): SERVICES,
        ("networksetup", "-listnetworkserviceorder"): ORDER,
        ("ifconfig", "bridge0"): bridge_text(),
    }

    def run(argv: list[str]) -> tuple[int, str, str]:
        calls.append(argv)
        if tuple(argv) in answers:
            return 0, answers[tuple(argv)], ""
        if argv[:3] == ["route", "-n", "get"]:
            return 1, "", "route: writing to routing socket: not in table"
        raise AssertionError(f"unexpected command {argv}")

    return run


def studio_preferences(tmp_path: Path) -> str:
    """The saved Thunderbolt Bridge of a Studio: every Thunderbolt port (en2..en7) a member (hand-written in
    the layout of tests/fixtures/macos/synthetic/preferences_bridge0_en1_en6_en2.plist)."""
    path = tmp_path / "preferences.plist"
    members = [f"en{n}" for n in range(2, 8)]
    bridge = {"Interfaces": members, "SCNetworkInterfaceType": "Bridge", "UserDefinedName": "Thunderbolt Bridge"}
    path.write_bytes(plistlib.dumps({"VirtualNetworkInterfaces": {"Bridge": {"bridge0": bridge}}}))
    return str(path)


def converge_commands(preferences: str) -> tuple[dict, dict[str, list[list[str]]]]:
    observations = []
    for i, mac in enumerate(MACS):
        for port in macos.discover(fake(i, [])):
            observations.append(
                Observation(mac, port["port"], port["ident"], port["seen"], port["speed"], port["rdma"])
            )
    plan = build_plan(MACS, observations, backend="ring").as_dict()
    commands = {}
    for i, mac in enumerate(MACS):
        run = fake(i, [])
        state = macos.read_bridge_state(run, "bridge0", "Thunderbolt Bridge", preferences)
        bridge = macos.plan_bridge(state, "bridge0", "Thunderbolt Bridge", "en0")
        links = macos.plan_peer_links(run, plan["per_host"][mac], None, "en0")
        assert bridge["refused"] is None and links["refused"] is None
        commands[mac] = bridge["commands"] + links["commands"]
    return plan, commands


HARDWARE_PORT = {"en2": "Thunderbolt 1", "en3": "Thunderbolt 2"}  # the Studio's networksetup capture


def peer_cmds(port: str, address: str, peer: str) -> list[list[str]]:
    service = f"meshkit {port}"
    return [
        ["networksetup", "-createnetworkservice", service, HARDWARE_PORT[port]],
        ["networksetup", "-setmanual", service, address, "255.255.255.252", ""],
        ["route", "-n", "add", "-host", peer, "-interface", port],
    ]


BRIDGE = [["ifconfig", "bridge0", "deletem", f"en{n}"] for n in range(2, 8)] + [
    ["networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off"],
    [
        "/usr/libexec/PlistBuddy",
        "-c",
        "Delete :VirtualNetworkInterfaces:Bridge:bridge0:Interfaces",
        "-c",
        "Add :VirtualNetworkInterfaces:Bridge:bridge0:Interfaces array",
        "/Library/Preferences/SystemConfiguration/preferences.plist",
    ],
]


def test_four_mac_ring_plan(tmp_path):
    plan, _ = converge_commands(studio_preferences(tmp_path))
    assert plan["ring"] == MACS
    assert plan["backend"] == "ring"
    assert [sorted((e["host"], e["port"]) for e in c["ends"]) for c in plan["cables"]] == [
        [("mac1", "en2"), ("mac4", "en3")],
        [("mac1", "en3"), ("mac2", "en2")],
        [("mac2", "en3"), ("mac3", "en2")],
        [("mac3", "en3"), ("mac4", "en2")],
    ]
    assert {e["speed"] for c in plan["cables"] for e in c["ends"]} == {"80 Gb/s"}
    assert {e["rdma"] for c in plan["cables"] for e in c["ends"] if e["host"] == "mac1"} == {"rdma_en2", "rdma_en3"}


def test_four_mac_ring_exact_commands_per_mac(tmp_path):
    _, commands = converge_commands(studio_preferences(tmp_path))
    for mac, cmds in commands.items():
        print(f"\n{mac}:")
        for c in cmds:
            print("  " + " ".join(f'"{a}"' if " " in a else a for a in c))
    assert commands["mac1"] == BRIDGE + peer_cmds("en2", "198.18.128.1", "198.18.128.2") + peer_cmds(
        "en3", "198.18.128.5", "198.18.128.6"
    )
    assert commands["mac2"] == BRIDGE + peer_cmds("en2", "198.18.128.6", "198.18.128.5") + peer_cmds(
        "en3", "198.18.128.9", "198.18.128.10"
    )
    assert commands["mac3"] == BRIDGE + peer_cmds("en2", "198.18.128.10", "198.18.128.9") + peer_cmds(
        "en3", "198.18.128.13", "198.18.128.14"
    )
    assert commands["mac4"] == BRIDGE + peer_cmds("en2", "198.18.128.14", "198.18.128.13") + peer_cmds(
        "en3", "198.18.128.2", "198.18.128.1"
    )
