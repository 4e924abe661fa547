"""macOS parsers and planners (plugins/module_utils/macos.py) against recorded Mac output.

The recorded fixtures and their provenance are described in tests/fixtures/macos/SOURCES.md and
FORMAT.md. Outputs that were never recorded (ifconfig bridge0, -listnetworkserviceorder, -getinfo,
route -n get) come from tests/fixtures/macos/synthetic/, which are hand-written.
"""

from __future__ import annotations

import copy
import json
import plistlib
import re
from pathlib import Path

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import macos

from meshkit.topology import (
    Observation,
    build_plan,
    cables_from_observations,
)

from .test_macos_undo import UNDO_PLANNERS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "macos"
SYNTHETIC = FIXTURES / "synthetic"
PREFS = "preferences_bridge0_en1_en6_en2.plist"

# The real Mac-to-Mac cable recorded from both ends (omlx-plus): MacBook Pro M5 Max bus_0 <-> Mac Studio M3 Ultra bus_1.
MBP_UUID = "817DCFA4-B481-4100-80FC-91C7AA969F0B"
STUDIO_UUID = "28CA4C30-A263-4C55-B302-953416D0B209"
# The anonymized osaurus pair: local (TB5 dock) bus_1 <-> peer (TB3 dock) bus_1.
LOCAL_UUID = "00000004-0000-4000-8000-000000000004"
PEER_UUID = "00000003-0000-4000-8000-000000000003"


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def synthetic(name: str) -> str:
    return (SYNTHETIC / name).read_text()


def profiler(name: str) -> dict:
    return json.loads(text(name))


def hardware(name: str) -> dict[str, str]:
    return macos.parse_hardware_ports(text(name))


M5MAX_PORTS = "networksetup_listallhardwareports_macbookpro_m5max_anonymized.txt"
M3ULTRA_PORTS = "networksetup_listallhardwareports_macstudio_m3ultra_TRIMMED.txt"
M4MAX_PORTS = "networksetup_listallhardwareports_macbookpro_m4max_TRIMMED.txt"


def observations(host: str, ports: list[dict]) -> list[Observation]:
    """What meshkit/cabling_plan.py builds from one host's discover result."""
    return [Observation(host, p["port"], p["ident"], p["seen"], p["speed"], p["rdma"]) for p in ports]


def by_port(ports: list[dict]) -> dict[str, dict]:
    return {p["port"]: p for p in ports}


# ---- networksetup -listallhardwareports ---------------------------------------------------
@pytest.mark.parametrize(
    ("fixture", "thunderbolt", "others"),
    [
        (
            M5MAX_PORTS,
            {"Thunderbolt 1": "en1", "Thunderbolt 2": "en6", "Thunderbolt 3": "en2"},
            {"Thunderbolt Bridge": "bridge0", "Wi-Fi": "en0", "Ethernet Adapter (en3)": "en3"},
        ),
        (
            M3ULTRA_PORTS,
            {f"Thunderbolt {n}": f"en{n + 1}" for n in range(1, 7)},
            {"Ethernet": "en0", "Wi-Fi": "en1", "Ethernet Adapter (en13)": "en13"},
        ),
        (
            M4MAX_PORTS,
            {"Thunderbolt 1": "en1", "Thunderbolt 2": "en2", "Thunderbolt 3": "en3"},
            {"Wi-Fi": "en0", "USB 10/100/1G/2.5G LAN": "en7"},
        ),
        (
            "networksetup_listallhardwareports_macbook_2020_thunderbolt_bridge.txt",
            {"Thunderbolt 1": "en1", "Thunderbolt 2": "en2"},
            {"Thunderbolt Bridge": "bridge0", "iPhone USB": "en5", "Bluetooth PAN": "en3", "Wi-Fi": "en0"},
        ),
    ],
)
def test_parse_hardware_ports(fixture, thunderbolt, others):
    ports = macos.parse_hardware_ports(text(fixture))
    assert {k: v for k, v in ports.items() if k.startswith("Thunderbolt ") and k[-1].isdigit()} == thunderbolt
    for name, device in others.items():
        assert ports[name] == device
    # the VLAN trailer is not a port
    assert not any("VLAN" in k or "=" in k for k in ports)
    assert all(" " not in v and v for v in ports.values())


# ---- system_profiler SPThunderboltDataType -json ------------------------------------------
def test_m5max_end_of_the_real_cable():
    ports = by_port(
        macos.parse_thunderbolt(profiler("system_profiler_macbookpro_m5max_peer_macstudio.json"), hardware(M5MAX_PORTS))
    )
    assert list(ports) == ["en1", "en6", "en2"]  # receptacle order 1, 2, 3
    en1 = ports["en1"]
    assert en1["receptacle"] == "1"
    assert en1["ident"] == MBP_UUID
    assert en1["seen"] == [STUDIO_UUID]
    assert en1["speed"] == "80 Gb/s"
    assert en1["linked"] is True
    assert en1["generation"] == "tb5"
    assert en1["rdma"] == "rdma_en1"
    assert en1["devices"] == []  # the peer Mac is a peer, not a device
    for idle in ("en6", "en2"):
        assert ports[idle]["seen"] == []
        assert ports[idle]["linked"] is False
        assert ports[idle]["speed"] == "Up to 120 Gb/s"


def test_m3ultra_end_of_the_real_cable_and_the_owc_drive():
    ports = by_port(
        macos.parse_thunderbolt(
            profiler("system_profiler_macstudio_m3ultra_peer_macbookpro_owc_drive.json"), hardware(M3ULTRA_PORTS)
        )
    )
    assert list(ports) == ["en2", "en3", "en4", "en5", "en6", "en7"]
    assert ports["en3"]["ident"] == STUDIO_UUID
    assert ports["en3"]["seen"] == [MBP_UUID]
    # receptacle 4: an OWC Envoy Ultra TB5 drive, linked at 80 Gb/s but with no domain UUID: no peer
    owc = ports["en5"]
    assert owc["receptacle"] == "4"
    assert owc["linked"] is True
    assert owc["seen"] == []
    assert owc["devices"] == ["Envoy Ultra"]
    assert sum(1 for p in ports.values() if p["seen"]) == 1


def test_real_pair_gives_exactly_one_cable_between_the_right_ports():
    # The two profiler captures are the two ends of one cable. The networksetup captures come from
    # other Macs of the same models (see SOURCES.md); the Thunderbolt N -> enX maps are per model.
    mbp = macos.parse_thunderbolt(
        profiler("system_profiler_macbookpro_m5max_peer_macstudio.json"), hardware(M5MAX_PORTS)
    )
    studio = macos.parse_thunderbolt(
        profiler("system_profiler_macstudio_m3ultra_peer_macbookpro_owc_drive.json"), hardware(M3ULTRA_PORTS)
    )
    obs = observations("mbp", mbp) + observations("studio", studio)
    cables, asymmetric, unknown = cables_from_observations(obs)
    assert [str(c) for c in cables] == ["mbp:en1 <-> studio:en3"]
    assert asymmetric == []
    assert unknown == []

    plan = build_plan(["studio", "mbp"], obs, pool="198.18.128.0/17").as_dict()
    assert plan["per_host"]["mbp"][0]["port"] == "en1"
    assert plan["per_host"]["studio"][0]["port"] == "en3"
    assert plan["per_host"]["mbp"][0]["peer_address"] == plan["per_host"]["studio"][0]["address"]
    assert [e["speed"] for e in plan["cables"][0]["ends"]] == ["80 Gb/s", "80 Gb/s"]
    assert [e["rdma"] for e in plan["cables"][0]["ends"]] == ["rdma_en1", "rdma_en3"]


def test_real_pair_seen_from_one_side_only_is_asymmetric():
    mbp = macos.parse_thunderbolt(
        profiler("system_profiler_macbookpro_m5max_peer_macstudio.json"), hardware(M5MAX_PORTS)
    )
    studio = macos.parse_thunderbolt(
        profiler("system_profiler_macstudio_m3ultra_peer_macbookpro_owc_drive.json"), hardware(M3ULTRA_PORTS)
    )
    for p in studio:
        p["seen"] = []
    cables, asymmetric, _unknown = cables_from_observations(observations("mbp", mbp) + observations("studio", studio))
    assert cables == []
    assert asymmetric == [{"seen_by": "mbp:en1", "peer": "studio:en3", "reason": "studio:en3 did not see mbp:en1"}]


def test_anonymized_pair_with_docks_gives_one_cable_and_docks_are_devices():
    hw = hardware(M5MAX_PORTS)
    local = macos.parse_thunderbolt(profiler("system_profiler_macbookpro_m5max_peer_tb5dock_anonymized.json"), hw)
    peer = macos.parse_thunderbolt(profiler("system_profiler_macbookpro_m5max_peer_tb3dock_anonymized.json"), hw)
    local_ports, peer_ports = by_port(local), by_port(peer)

    assert local_ports["en6"]["ident"] == LOCAL_UUID
    assert local_ports["en6"]["seen"] == [PEER_UUID]
    assert peer_ports["en6"]["ident"] == PEER_UUID
    assert peer_ports["en6"]["seen"] == [LOCAL_UUID]

    # receptacle 3 (en2): Sabrent TB5 dock on one Mac, ACASIS TB3 dock on the other: no domain UUID, no peer
    assert local_ports["en2"]["devices"] == ["SB-XTM5"]
    assert local_ports["en2"]["seen"] == []
    assert local_ports["en2"]["generation"] == "tb5"
    assert peer_ports["en2"]["devices"] == ["TBU405Pro"]
    assert peer_ports["en2"]["seen"] == []
    assert peer_ports["en2"]["speed"] == "40 Gb/s"
    assert peer_ports["en2"]["generation"] == "tb4"

    cables, asymmetric, unknown = cables_from_observations(observations("local", local) + observations("peer", peer))
    assert [str(c) for c in cables] == ["local:en6 <-> peer:en6"]
    assert asymmetric == []
    assert unknown == []


def test_peer_nested_behind_a_dock_is_found():
    # No capture with domain UUIDs has a Mac behind a dock (the Knurlogic one is TRIMMED of its UUIDs),
    # so build one from real parts: the real ACASIS TB3 dock entry, with the real Mac Studio peer entry
    # moved into the dock's _items (as the Knurlogic capture shows a Mac two levels down).
    mbp = profiler("system_profiler_macbookpro_m5max_peer_macstudio.json")
    dock_bus = next(
        b
        for b in profiler("system_profiler_macbookpro_m5max_peer_tb3dock_anonymized.json")["SPThunderboltDataType"]
        if b["receptacle_1_tag"]["receptacle_id_key"] == "3"
    )
    dock = copy.deepcopy(dock_bus["_items"][0])
    assert "domain_uuid_key" not in dock
    bus0 = next(b for b in mbp["SPThunderboltDataType"] if b["_name"] == "thunderboltusb4_bus_0")
    studio_entry = bus0["_items"][0]
    assert studio_entry["domain_uuid_key"] == STUDIO_UUID
    dock["_items"] = [studio_entry]
    bus0["_items"] = [dock]

    en1 = by_port(macos.parse_thunderbolt(mbp, hardware(M5MAX_PORTS)))["en1"]
    assert en1["seen"] == [STUDIO_UUID]
    assert en1["devices"] == ["TBU405Pro"]


def test_mlx_style_first_item_only_would_miss_the_nested_peer_but_we_do_not():
    # Two levels down, behind two docks (the shape of the Knurlogic capture, with a UUID put back).
    data = profiler("system_profiler_macstudio_m3ultra_TRIMMED_peer_via_tb3_dock.json")
    bus = next(b for b in data["SPThunderboltDataType"] if b["receptacle_1_tag"]["receptacle_id_key"] == "3")
    nested_mac = bus["_items"][0]["_items"][0]
    assert nested_mac["device_name_key"] == "Mac16,5"
    nested_mac["domain_uuid_key"] = MBP_UUID
    ports = by_port(macos.parse_thunderbolt(data, hardware(M3ULTRA_PORTS)))
    assert ports["en4"]["seen"] == [MBP_UUID]
    assert ports["en4"]["devices"] == ["ThunderBay Flex 8"]


def test_trimmed_capture_without_uuids_parses_without_peers():
    ports = by_port(
        macos.parse_thunderbolt(
            profiler("system_profiler_macstudio_m3ultra_TRIMMED_peer_via_tb3_dock.json"), hardware(M3ULTRA_PORTS)
        )
    )
    assert list(ports) == ["en2", "en3", "en4", "en5", "en6", "en7"]
    assert all(p["ident"] == "" and p["seen"] == [] for p in ports.values())
    assert ports["en7"]["speed"] == "80 Gb/s" and ports["en7"]["generation"] == "tb5"
    assert ports["en4"]["speed"] == "40 Gb/s" and ports["en4"]["generation"] == "tb4"
    assert ports["en3"]["devices"] == ["Mercury Helios 3S"]
    # no identities at all: nothing can become a cable, and nothing crashes
    assert cables_from_observations(observations("studio", list(ports.values()))) == ([], [], [])


def test_m4max_trimmed_tb5_and_tb4_links():
    ports = by_port(
        macos.parse_thunderbolt(
            profiler("system_profiler_macbookpro_m4max_TRIMMED_tb5_and_tb4_links.json"), hardware(M4MAX_PORTS)
        )
    )
    assert list(ports) == ["en1", "en2", "en3"]
    assert (ports["en2"]["speed"], ports["en2"]["generation"], ports["en2"]["linked"]) == ("80 Gb/s", "tb5", True)
    assert (ports["en3"]["speed"], ports["en3"]["generation"], ports["en3"]["linked"]) == ("40 Gb/s", "tb4", True)
    assert ports["en1"]["linked"] is False


def test_bus_without_a_networksetup_port_has_no_device():
    data = profiler("system_profiler_macbookpro_m5max_peer_macstudio.json")
    ports = macos.parse_thunderbolt(data, {"Thunderbolt 1": "en1"})
    assert [p["port"] for p in ports] == ["en1", None, None]
    assert [p["rdma"] for p in ports] == ["rdma_en1", None, None]


@pytest.mark.parametrize(
    ("speed", "generation"),
    [
        ("80 Gb/s", "tb5"),
        ("40 Gb/s", "tb4"),
        ("Up to 120 Gb/s", "tb5"),
        ("Up to 40 Gb/s", "tb4"),
        ("Up to 80 Gb/s", "tb5"),
        ("20 Gb/s", "tb3-or-older"),
        ("10 Gb/s", "tb3-or-older"),
        ("", None),
        (None, None),
        ("unknown", None),
    ],
)
def test_thunderbolt_generation(speed, generation):
    assert macos.thunderbolt_generation(speed) == generation


def test_every_recorded_speed_has_a_generation():
    speeds = set()

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "current_speed_key":
                    speeds.add(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for path in FIXTURES.glob("system_profiler_*.json"):
        walk(json.loads(path.read_text()))
    assert speeds >= {"80 Gb/s", "40 Gb/s", "Up to 120 Gb/s", "Up to 40 Gb/s"}
    assert all(macos.thunderbolt_generation(s) in ("tb4", "tb5") for s in speeds)


# ---- discover() with a fake runner --------------------------------------------------------
def fake_run(answers: dict[tuple[str, ...], tuple[int, str, str]], calls: list[list[str]]):
    def run(argv):
        calls.append(list(argv))
        return answers[tuple(argv)]

    return run


def test_discover_runs_two_read_commands_and_drops_ports_without_a_device():
    calls: list[list[str]] = []
    run = fake_run(
        {
            tuple(macos.HARDWARE_PORTS): (0, text(M5MAX_PORTS), ""),
            tuple(macos.SYSTEM_PROFILER): (0, text("system_profiler_macbookpro_m5max_peer_macstudio.json"), ""),
        },
        calls,
    )
    ports = macos.discover(run)
    assert calls == [
        ["networksetup", "-listallhardwareports"],
        ["system_profiler", "SPThunderboltDataType", "-json"],
    ]
    assert [p["port"] for p in ports] == ["en1", "en6", "en2"]


def test_discover_failure_names_the_command():
    run = fake_run(
        {
            tuple(macos.HARDWARE_PORTS): (0, text(M5MAX_PORTS), ""),
            tuple(macos.SYSTEM_PROFILER): (1, "", "system_profiler: not permitted\n"),
        },
        [],
    )
    with pytest.raises(macos.MacError, match=r"system_profiler SPThunderboltDataType -json failed \(rc=1\)"):
        macos.discover(run)


# ---- route -n get, ifconfig, -getMTU (real captures) ----------------------------------------
@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        (
            "route_get_8.8.8.8_default_gateway_en0_macos26vm.txt",
            {"route to": "8.8.8.8", "destination": "default", "mask": "default", "gateway": "192.168.64.1"},
        ),
        ("route_get_default_en0_macos26vm.txt", {"route to": "default", "gateway": "192.168.64.1"}),
        ("route_get_192.168.64.1_onlink_gateway_en0_macos26vm.txt", {"destination": "192.168.64.1"}),
        (
            "route_get_192.168.64.3_own_address_en0_macos26vm.txt",
            {"destination": "192.168.64.3", "mask": "255.255.255.255"},
        ),
        (
            "route_get_203.0.113.1_net_via_gateway_ifscope_en0_macos26vm.txt",
            {"destination": "203.0.113.0", "mask": "255.255.255.0", "gateway": "192.168.64.1"},
        ),
    ],
)
def test_parse_route_get_real_captures_through_en0(fixture, expected):
    route = macos.parse_route_get(text(fixture))
    assert route["interface"] == "en0"
    assert route["flags"][0] == "UP"
    for key, value in expected.items():
        assert route[key] == value
    if "gateway" not in expected:
        assert "gateway" not in route  # on-link: no gateway line at all
        assert "GATEWAY" not in route["flags"]


@pytest.mark.parametrize(
    ("fixture", "interface", "destination"),
    [
        ("route_get_127.0.0.1_lo0_macos26vm.txt", "lo0", "127.0.0.1"),
        ("route_get_203.0.113.1_interface_route_utun3_macos26vm.txt", "utun3", "203.0.113.0"),
        ("route_get_198.51.100.129_interface_route_lo0_macos26vm.txt", "lo0", "198.51.100.128"),
    ],
)
def test_parse_route_get_interface_routes_have_no_gateway(fixture, interface, destination):
    route = macos.parse_route_get(text(fixture))
    assert (route["interface"], route["destination"]) == (interface, destination)
    assert "gateway" not in route and "GATEWAY" not in route["flags"]


def test_parse_route_get_keeps_colons_in_values_and_ignores_errors():
    ipv6 = "   route to: 2001:db8::1\ndestination: default\n    gateway: fe80::1%en0\n  interface: en0\n"
    assert macos.parse_route_get(ipv6)["gateway"] == "fe80::1%en0"  # hand-written: no real -inet6 capture
    assert macos.parse_route_get("route: writing to routing socket: not in table\n") == {}
    assert macos.parse_route_get("") == {}


@pytest.mark.parametrize(
    ("fixture", "members"),
    [
        ("ifconfig_intel_mbp_bridge0_4_tb_members_bridge100_inet.txt", ["en1", "en2", "en3", "en4"]),
        ("ifconfig_a_macbookpro16_apple_silicon_sonoma14.4_bridge0_3_tb_members.txt", ["en1", "en2", "en3"]),
    ],
)
def test_bridge0_members_from_real_ifconfig(fixture, members):
    whole = text(fixture)
    block = macos.ifconfig_block(whole, "bridge0")
    assert block.startswith("bridge0: flags=") and "status: inactive" in block
    assert "en0: flags" not in block and "bridge100" not in block
    assert macos.parse_bridge_members(block) == members


def test_bridge100_members_are_not_bridge0_members():
    whole = text("ifconfig_intel_mbp_bridge0_4_tb_members_bridge100_inet.txt")
    assert macos.parse_bridge_members(macos.ifconfig_block(whole, "bridge100")) == ["en10"]
    assert macos.ifconfig_block(whole, "bridge1") == ""


def test_read_bridge_state_reads_only_the_bridge_block_of_a_longer_answer():
    whole = text("ifconfig_intel_mbp_bridge0_4_tb_members_bridge100_inet.txt")
    run = fake_run(
        {
            ("ifconfig", "bridge0"): (0, whole, ""),
            tuple(macos.ALL_SERVICES): (0, text("networksetup_listallnetworkservices_rmbp_2014.txt"), ""),
        },
        [],
    )
    state = macos.read_bridge_state(run, "bridge0", "Thunderbolt Bridge", str(SYNTHETIC / PREFS))
    assert state["members"] == ["en1", "en2", "en3", "en4"]  # not bridge100's en10


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ("Active MTU: 1500 (Current Setting: 1500)\n", (1500, 1500)),
        ("Active MTU: 9000 (Current Setting: 1500)\n", (9000, 1500)),
        ("Active MTU: 1500\n", (1500, None)),
        ("** Error: The parameters were not valid.\n", (None, None)),
    ],
)
def test_parse_getmtu(out, expected):
    assert macos.parse_getmtu(out) == expected
    assert macos.parse_getmtu(synthetic("networksetup_getmtu_9000.txt")) == (9000, 9000)


# ---- services, bridge ---------------------------------------------------------------------
def test_parse_services_real_output_all_enabled():
    services = macos.parse_services(text("networksetup_listallnetworkservices_rmbp_2014.txt"))
    assert services == {
        "Thunderbolt Ethernet": True,
        "Wi-Fi": True,
        "Thunderbolt Bridge": True,
        "VPN (PPTP)": True,
        "Witopia KC IPsec": True,
        "Bluetooth DUN": True,
        "Bluetooth PAN": True,
    }
    assert not any(name.startswith("An asterisk") for name in services)


def test_parse_services_star_prefix_is_disabled():
    real = text("networksetup_listallnetworkservices_rmbp_2014.txt")
    edited = real.replace("\nThunderbolt Bridge\n", "\n*Thunderbolt Bridge\n")
    assert edited != real
    services = macos.parse_services(edited)
    assert services["Thunderbolt Bridge"] is False
    assert services["Wi-Fi"] is True
    assert macos.parse_services(synthetic("networksetup_listallnetworkservices_bridge_disabled.txt")) == {
        "Ethernet Adapter (en3)": True,
        "Thunderbolt Bridge": False,
        "Wi-Fi": True,
    }


def test_parse_service_order():
    assert macos.parse_service_order(synthetic("networksetup_listnetworkserviceorder_port_services.txt")) == {
        "en3": "Ethernet Adapter (en3)",
        "en0": "Wi-Fi",
        "bridge0": "Thunderbolt Bridge",
        "en1": "meshkit en1",
        "en6": "Thunderbolt 2",
    }


def test_parse_service_order_full_knows_ports_and_disabled_services():
    order = macos.parse_service_order_full(synthetic("networksetup_listnetworkserviceorder_port_services.txt"))
    assert order["en1"] == {"service": "meshkit en1", "port": "Thunderbolt 1", "enabled": True}
    assert order["en6"] == {"service": "Thunderbolt 2", "port": "Thunderbolt 2", "enabled": True}
    assert order["bridge0"] == {"service": "Thunderbolt Bridge", "port": "Thunderbolt Bridge", "enabled": False}
    assert order["en3"]["port"] == "Ethernet Adapter (en3)"  # a port name with a parenthesis


def test_parse_bridge_members():
    assert macos.parse_bridge_members(synthetic("ifconfig_bridge0_members_en1_en6_en2.txt")) == ["en1", "en6", "en2"]
    assert macos.parse_bridge_members(synthetic("ifconfig_bridge0_no_members.txt")) == []


def test_read_bridge_state(tmp_path):
    calls: list[list[str]] = []
    run = fake_run(
        {
            ("ifconfig", "bridge0"): (0, synthetic("ifconfig_bridge0_members_en1_en6_en2.txt"), ""),
            tuple(macos.ALL_SERVICES): (0, text("networksetup_listallnetworkservices_rmbp_2014.txt"), ""),
        },
        calls,
    )
    state = macos.read_bridge_state(run, "bridge0", "Thunderbolt Bridge", str(SYNTHETIC / PREFS))
    assert state == {
        "exists": True,
        "members": ["en1", "en6", "en2"],
        "service_enabled": True,
        "saved_members": ["en1", "en6", "en2"],
    }
    assert calls == [["ifconfig", "bridge0"], ["networksetup", "-listallnetworkservices"]]
    # unreadable preferences: the saved list is unknown (None), not empty
    state = macos.read_bridge_state(run, "bridge0", "Thunderbolt Bridge", str(tmp_path / "missing.plist"))
    assert state["saved_members"] is None


def test_read_bridge_state_without_a_bridge():
    run = fake_run(
        {
            ("ifconfig", "bridge0"): (1, "", "ifconfig: interface bridge0 does not exist\n"),
            tuple(macos.ALL_SERVICES): (0, synthetic("networksetup_listallnetworkservices_bridge_disabled.txt"), ""),
        },
        [],
    )
    state = macos.read_bridge_state(run, "bridge0", "Thunderbolt Bridge", str(SYNTHETIC / PREFS))
    assert state == {"exists": False, "members": [], "service_enabled": False, "saved_members": ["en1", "en6", "en2"]}


def test_saved_bridge_members_from_the_preferences(tmp_path):
    prefs = macos.read_preferences(str(SYNTHETIC / PREFS))
    assert macos.saved_bridge(prefs, "bridge0") == ["en1", "en6", "en2"]
    assert macos.saved_bridge(prefs, "bridge1") == []  # not defined: nothing to take out
    assert macos.saved_bridge({}, "bridge0") == []  # exo deletes the whole definition
    assert macos.saved_bridge(None, "bridge0") is None  # unreadable: unknown
    # the binary form macOS may write reads the same
    binary = tmp_path / "preferences.plist"
    binary.write_bytes(plistlib.dumps(prefs, fmt=plistlib.FMT_BINARY))
    assert macos.saved_bridge(macos.read_preferences(str(binary)), "bridge0") == ["en1", "en6", "en2"]
    garbage = tmp_path / "garbage.plist"
    garbage.write_text("not a plist")
    assert macos.read_preferences(str(garbage)) is None
    assert macos.read_preferences(str(tmp_path / "absent.plist")) is None


FRESH_BRIDGE = {"exists": True, "members": ["en1", "en6", "en2"], "service_enabled": True, "saved_members": None}
SAVED = ["en1", "en6", "en2"]
UNSAVE = [
    "/usr/libexec/PlistBuddy",
    "-c",
    "Delete :VirtualNetworkInterfaces:Bridge:bridge0:Interfaces",
    "-c",
    "Add :VirtualNetworkInterfaces:Bridge:bridge0:Interfaces array",
    "/Library/Preferences/SystemConfiguration/preferences.plist",
]


def test_plan_bridge_detaches_every_member_disables_the_service_and_empties_the_saved_list():
    plan = macos.plan_bridge({**FRESH_BRIDGE, "saved_members": SAVED}, "bridge0", "Thunderbolt Bridge", "en0")
    assert plan["refused"] is None
    assert plan["detach"] == ["en1", "en6", "en2"]
    assert plan["unsave"] == ["en1", "en6", "en2"]
    assert plan["commands"] == [
        ["ifconfig", "bridge0", "deletem", "en1"],
        ["ifconfig", "bridge0", "deletem", "en6"],
        ["ifconfig", "bridge0", "deletem", "en2"],
        ["networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off"],
        UNSAVE,
    ]
    assert plan["notes"] == []
    assert "saved member list" in plan["persistence"]


def test_plan_bridge_after_a_reboot_that_kept_the_saved_list_empties_only_the_list():
    # Members came back at boot because the list was saved (the service alone did not keep them out).
    state = {"exists": True, "members": ["en1", "en6", "en2"], "service_enabled": False, "saved_members": SAVED}
    plan = macos.plan_bridge(state, "bridge0", "Thunderbolt Bridge", "en0")
    assert plan["commands"][-1] == UNSAVE
    assert ["networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off"] not in plan["commands"]


def test_plan_bridge_second_run_plans_nothing():
    state = {"exists": True, "members": [], "service_enabled": False, "saved_members": []}
    plan = macos.plan_bridge(state, "bridge0", "Thunderbolt Bridge", "en0")
    assert plan["commands"] == [] and plan["notes"] == []


def test_plan_bridge_with_unreadable_preferences_writes_nothing_blind_and_says_so():
    state = {"exists": True, "members": [], "service_enabled": False, "saved_members": None}
    plan = macos.plan_bridge(state, "bridge0", "Thunderbolt Bridge", "en0")
    assert plan["commands"] == []
    assert "could not be read" in plan["notes"][0] and "next boot" in plan["notes"][0]


def test_plan_bridge_without_any_bridge_is_empty():
    state = {"exists": False, "members": [], "service_enabled": None, "saved_members": []}
    assert macos.plan_bridge(state, "bridge0", "Thunderbolt Bridge", "en0")["commands"] == []


@pytest.mark.parametrize("mgmt", ["en6", "bridge0"])
def test_plan_bridge_refuses_when_management_runs_over_it(mgmt):
    plan = macos.plan_bridge({**FRESH_BRIDGE, "saved_members": SAVED}, "bridge0", "Thunderbolt Bridge", mgmt)
    assert plan["commands"] == []
    assert plan["detach"] == []
    assert mgmt in plan["refused"]
    assert "Nothing was changed" in plan["refused"]


def test_plan_bridge_refuses_when_management_is_a_saved_member_only():
    # Not a member now (it has its own service), but saved as one: the next boot would bridge it.
    state = {"exists": True, "members": ["en1", "en2"], "service_enabled": False, "saved_members": SAVED}
    plan = macos.plan_bridge(state, "bridge0", "Thunderbolt Bridge", "en6")
    assert plan["commands"] == []
    assert "en6" in plan["refused"] and "next boot" in plan["refused"]


@pytest.mark.parametrize("mgmt", [None, ""])
def test_plan_bridge_fails_closed_without_a_management_interface(mgmt):
    plan = macos.plan_bridge({**FRESH_BRIDGE, "saved_members": SAVED}, "bridge0", "Thunderbolt Bridge", mgmt)
    assert plan["commands"] == []
    assert "meshkit_management_interface" in plan["refused"]


# ---- peer links ---------------------------------------------------------------------------
def test_parse_getinfo_and_netmask():
    info = macos.parse_getinfo(synthetic("networksetup_getinfo_manual_198.18.128.1.txt"))
    assert info["IP address"] == "198.18.128.1"
    assert info["Subnet mask"] == "255.255.255.252"
    assert macos.netmask(30) == "255.255.255.252"
    assert macos.netmask(24) == "255.255.255.0"


PORT_EN1 = {"port": "en1", "address": "198.18.128.1", "prefix": 30, "peer_address": "198.18.128.2"}
PORT_EN6 = {"port": "en6", "address": "198.18.128.5", "prefix": 30, "peer_address": "198.18.128.6"}
ORDER_NO_PORTS = synthetic("networksetup_listnetworkserviceorder_no_port_services.txt")
ORDER_PORTS = synthetic("networksetup_listnetworkserviceorder_port_services.txt")
MANUAL_EN1 = synthetic("networksetup_getinfo_manual_198.18.128.1.txt")


def answers(**extra: str) -> dict[tuple[str, ...], tuple[int, str, str]]:
    return {tuple(k.split("|")): (0, v, "") for k, v in extra.items()}


def test_plan_peer_links_fresh_ports_get_a_service_on_their_hardware_port():
    calls: list[list[str]] = []
    run = fake_run(
        answers(
            **{
                "networksetup|-listnetworkserviceorder": ORDER_NO_PORTS,
                "networksetup|-listallhardwareports": text(M5MAX_PORTS),
                "networksetup|-getMTU|en1": synthetic("networksetup_getmtu_1500.txt"),
                "networksetup|-getMTU|en6": synthetic("networksetup_getmtu_1500.txt"),
                "route|-n|get|198.18.128.2": synthetic("route_get_198.18.128.2_default_en0.txt"),
                "route|-n|get|198.18.128.6": synthetic("route_get_198.18.128.6_default_en0.txt"),
            }
        ),
        calls,
    )
    plan = macos.plan_peer_links(run, [PORT_EN1, PORT_EN6], 9000, "en0")
    assert plan["refused"] is None
    assert plan["commands"] == [
        ["networksetup", "-createnetworkservice", "meshkit en1", "Thunderbolt 1"],
        ["networksetup", "-setmanual", "meshkit en1", "198.18.128.1", "255.255.255.252", ""],
        ["networksetup", "-setMTU", "en1", "9000"],
        ["route", "-n", "add", "-host", "198.18.128.2", "-interface", "en1"],
        ["networksetup", "-createnetworkservice", "meshkit en6", "Thunderbolt 2"],
        ["networksetup", "-setmanual", "meshkit en6", "198.18.128.5", "255.255.255.252", ""],
        ["networksetup", "-setMTU", "en6", "9000"],
        ["route", "-n", "add", "-host", "198.18.128.6", "-interface", "en6"],
    ]
    # the hardware ports are read once, and only because a service had to be created
    assert calls.count(["networksetup", "-listallhardwareports"]) == 1
    # what does not persist is said, with what takes its place after a reboot
    assert plan["notes"] == [
        "en1: the host route to 198.18.128.2 is runtime only; after a reboot 198.18.128.2 is reached through "
        "198.18.128.0/30 on en1, which macOS installs from the saved address of 'meshkit en1'",
        "en6: the host route to 198.18.128.6 is runtime only; after a reboot 198.18.128.6 is reached through "
        "198.18.128.4/30 on en6, which macOS installs from the saved address of 'meshkit en6'",
    ]
    assert "runtime only" in plan["persistence"] and "saved" in plan["persistence"]


def test_plan_peer_links_after_a_reboot_plans_nothing():
    # After a reboot the service holds its saved manual address and macOS has installed the /30: the
    # route to the peer leaves through the port (no host route any more), the MTU is the saved one.
    run = fake_run(
        answers(
            **{
                "networksetup|-listnetworkserviceorder": ORDER_PORTS,
                "networksetup|-getinfo|meshkit en1": MANUAL_EN1,
                "networksetup|-getMTU|en1": synthetic("networksetup_getmtu_9000.txt"),
                "route|-n|get|198.18.128.2": synthetic("route_get_198.18.128.2_connected_en1.txt"),
            }
        ),
        [],
    )
    assert macos.plan_peer_links(run, [PORT_EN1], 9000, "en0") == {
        "commands": [],
        "notes": [],
        "persistence": macos.PEER_LINK_PERSISTENCE,
        "refused": None,
    }


def test_plan_peer_links_an_on_link_peer_needs_no_route():
    # Real capture: an on-link neighbour answers with its own cloned entry, interface and no gateway.
    port = {"port": "en0", "address": "192.168.64.3", "prefix": 24, "peer_address": "192.168.64.1"}
    run = fake_run(
        answers(
            **{
                "networksetup|-listnetworkserviceorder": ORDER_PORTS,
                "networksetup|-getinfo|Wi-Fi": "Manual Configuration\nIP address: 192.168.64.3\n"
                "Subnet mask: 255.255.255.0\nRouter: (null)\n",
                "route|-n|get|192.168.64.1": text("route_get_192.168.64.1_onlink_gateway_en0_macos26vm.txt"),
            }
        ),
        [],
    )
    assert macos.plan_peer_links(run, [port], None, "en1")["commands"] == []


def test_plan_peer_links_route_check_does_not_confuse_en1_with_en10():
    run = fake_run(
        answers(
            **{
                "networksetup|-listnetworkserviceorder": ORDER_PORTS,
                "networksetup|-getinfo|meshkit en1": MANUAL_EN1,
                "route|-n|get|198.18.128.2": synthetic("route_get_198.18.128.2_connected_en10.txt"),
            }
        ),
        [],
    )
    assert macos.plan_peer_links(run, [PORT_EN1], None, "en0")["commands"] == [
        ["route", "-n", "add", "-host", "198.18.128.2", "-interface", "en1"]
    ]


def test_plan_peer_links_a_stale_host_route_is_changed_not_added():
    stale = text("route_get_192.168.64.1_onlink_gateway_en0_macos26vm.txt").replace("192.168.64.1", "198.18.128.2")
    run = fake_run(
        answers(
            **{
                "networksetup|-listnetworkserviceorder": ORDER_PORTS,
                "networksetup|-getinfo|meshkit en1": MANUAL_EN1,
                "route|-n|get|198.18.128.2": stale,
            }
        ),
        [],
    )
    assert macos.plan_peer_links(run, [PORT_EN1], None, "en0")["commands"] == [
        ["route", "-n", "change", "-host", "198.18.128.2", "-interface", "en1"]
    ]


def test_plan_peer_links_enables_a_disabled_service_and_drops_a_router():
    order = ORDER_PORTS.replace("(3) meshkit en1", "(*) meshkit en1")
    routed = MANUAL_EN1.replace("Router: (null)", "Router: 198.18.128.2")
    run = fake_run(
        answers(
            **{
                "networksetup|-listnetworkserviceorder": order,
                "networksetup|-getinfo|meshkit en1": routed,
                "route|-n|get|198.18.128.2": synthetic("route_get_198.18.128.2_connected_en1.txt"),
            }
        ),
        [],
    )
    assert macos.plan_peer_links(run, [PORT_EN1], None, "en0")["commands"] == [
        ["networksetup", "-setnetworkserviceenabled", "meshkit en1", "on"],
        ["networksetup", "-setmanual", "meshkit en1", "198.18.128.1", "255.255.255.252", ""],
    ]


def test_plan_peer_links_switches_dhcp_to_manual_and_fixes_a_stale_saved_mtu():
    run = fake_run(
        answers(
            **{
                "networksetup|-listnetworkserviceorder": ORDER_PORTS,
                "networksetup|-getinfo|Thunderbolt 2": synthetic("networksetup_getinfo_dhcp_198.18.128.5.txt"),
                "networksetup|-getMTU|en6": "Active MTU: 9000 (Current Setting: 1500)\n",
                "route|-n|get|198.18.128.6": synthetic("route_get_198.18.128.2_connected_en1.txt")
                .replace("198.18.128.2", "198.18.128.6")
                .replace("198.18.128.0", "198.18.128.4")
                .replace("en1", "en6"),
            }
        ),
        [],
    )
    assert macos.plan_peer_links(run, [PORT_EN6], 9000, "en0")["commands"] == [
        ["networksetup", "-setmanual", "Thunderbolt 2", "198.18.128.5", "255.255.255.252", ""],
        ["networksetup", "-setMTU", "en6", "9000"],
    ]


def test_plan_peer_links_a_port_without_a_hardware_port_is_an_error():
    run = fake_run(
        answers(
            **{
                "networksetup|-listnetworkserviceorder": ORDER_NO_PORTS,
                "networksetup|-listallhardwareports": text(M5MAX_PORTS),
            }
        ),
        [],
    )
    with pytest.raises(macos.MacError, match="en9 is no hardware port"):
        macos.plan_peer_links(run, [{**PORT_EN1, "port": "en9"}], None, "en0")


def test_plan_peer_links_refusals_run_nothing():
    calls: list[list[str]] = []
    run = fake_run({}, calls)
    plan = macos.plan_peer_links(run, [PORT_EN1, PORT_EN6], 9000, "en6")
    assert plan["commands"] == [] and "en6" in plan["refused"]
    plan = macos.plan_peer_links(run, [PORT_EN1], 9000, None)
    assert plan["commands"] == [] and "meshkit_management_interface" in plan["refused"]
    assert calls == []


def test_plan_peer_links_service_order_failure_is_a_mac_error():
    run = fake_run({tuple(macos.SERVICE_ORDER): (4, "", "** Error: ...")}, [])
    with pytest.raises(macos.MacError, match="networksetup -listnetworkserviceorder failed"):
        macos.plan_peer_links(run, [PORT_EN1], None, "en0")


# ---- the management interface is never named by a planned command ----------------------------
CANDIDATE_MGMT = ["en0", "en1", "en2", "en3", "en6", "en10", "bridge0", "bridge100"]


def names(argv: list[str], iface: str) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(iface)}(?![\w.])", arg) for arg in argv)


def bridge_plans(mgmt: str):
    for members in (["en1", "en6", "en2"], ["en1", "en2"], []):
        for saved in (["en1", "en6", "en2"], [], None):
            for enabled in (True, False):
                state = {"exists": True, "members": members, "service_enabled": enabled, "saved_members": saved}
                yield state, macos.plan_bridge(state, "bridge0", "Thunderbolt Bridge", mgmt)


def peer_plans(mgmt: str):
    fixtures = {
        ("networksetup", "-listallhardwareports"): text(M5MAX_PORTS),
        ("networksetup", "-getinfo", "meshkit en1"): synthetic("networksetup_getinfo_manual_198.18.128.1.txt"),
        ("networksetup", "-getinfo", "Thunderbolt 2"): synthetic("networksetup_getinfo_dhcp_198.18.128.5.txt"),
    }
    for order in ("no_port_services", "port_services"):
        for route in ("default_en0", "connected_en10"):

            def run(argv: list[str], order=order, route=route) -> tuple[int, str, str]:
                if argv == macos.SERVICE_ORDER:
                    return 0, synthetic(f"networksetup_listnetworkserviceorder_{order}.txt"), ""
                if argv[:3] == ["route", "-n", "get"]:
                    return 0, synthetic(f"route_get_198.18.128.2_{route}.txt").replace("198.18.128.2", argv[3]), ""
                if argv[:2] == ["networksetup", "-getMTU"]:
                    return 0, synthetic("networksetup_getmtu_1500.txt"), ""
                return 0, fixtures[tuple(argv)], ""

            for ports in ([PORT_EN1, PORT_EN6], [PORT_EN1], [PORT_EN6]):
                yield ports, macos.plan_peer_links(run, ports, 9000, mgmt)


PLANNERS = {"plan_bridge": bridge_plans, "plan_peer_links": peer_plans}


def test_every_plan_function_is_checked_for_the_management_interface():
    assert {name for name in dir(macos) if name.startswith("plan_")} == set(PLANNERS) | set(UNDO_PLANNERS)


@pytest.mark.parametrize("planner", sorted(PLANNERS))
@pytest.mark.parametrize("mgmt", CANDIDATE_MGMT)
def test_no_planned_command_names_the_management_interface(planner, mgmt):
    planned = 0
    for _case, plan in PLANNERS[planner](mgmt):
        for argv in plan["commands"]:
            assert not names(argv, mgmt), (mgmt, argv)
        if plan["refused"]:
            assert plan["commands"] == []
        planned += len(plan["commands"])
    if mgmt in ("en0", "en3", "en10", "bridge100"):  # not a bridge member or cable port: work is planned
        assert planned > 0


def test_the_name_check_matches_whole_interface_names():
    assert names(["ifconfig", "bridge0", "deletem", "en1"], "en1")
    assert names(["networksetup", "-setmanual", "meshkit en1", "198.18.128.1"], "en1")
    assert not names(["route", "-n", "add", "-host", "198.18.128.2", "-interface", "en10"], "en1")
    assert not names(["networksetup", "-createnetworkservice", "meshkit en1", "Thunderbolt 1"], "en10")
