"""macOS parsers and planners (plugins/module_utils/macos.py) against recorded Mac output.

The recorded fixtures and their provenance are described in tests/fixtures/macos/SOURCES.md and
FORMAT.md. Outputs that were never recorded (ifconfig bridge0, -listnetworkserviceorder, -getinfo,
route -n get) come from tests/fixtures/macos/synthetic/, which are hand-written.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import macos
from ansible_collections.meshkit.cluster.plugins.module_utils.topology import (
    Observation,
    build_plan,
    cables_from_observations,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "macos"
SYNTHETIC = FIXTURES / "synthetic"

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
    """What plugins/modules/cabling_plan.py builds from one host's discover result."""
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


def test_parse_bridge_members():
    assert macos.parse_bridge_members(synthetic("ifconfig_bridge0_members_en1_en6_en2.txt")) == ["en1", "en6", "en2"]
    assert macos.parse_bridge_members(synthetic("ifconfig_bridge0_no_members.txt")) == []


def test_read_bridge_state():
    calls: list[list[str]] = []
    run = fake_run(
        {
            ("ifconfig", "bridge0"): (0, synthetic("ifconfig_bridge0_members_en1_en6_en2.txt"), ""),
            tuple(macos.ALL_SERVICES): (0, text("networksetup_listallnetworkservices_rmbp_2014.txt"), ""),
        },
        calls,
    )
    state = macos.read_bridge_state(run, "bridge0", "Thunderbolt Bridge")
    assert state == {"exists": True, "members": ["en1", "en6", "en2"], "service_enabled": True}
    assert calls == [["ifconfig", "bridge0"], ["networksetup", "-listallnetworkservices"]]


def test_read_bridge_state_without_a_bridge():
    run = fake_run(
        {
            ("ifconfig", "bridge0"): (1, "", "ifconfig: interface bridge0 does not exist\n"),
            tuple(macos.ALL_SERVICES): (0, synthetic("networksetup_listallnetworkservices_bridge_disabled.txt"), ""),
        },
        [],
    )
    state = macos.read_bridge_state(run, "bridge0", "Thunderbolt Bridge")
    assert state == {"exists": False, "members": [], "service_enabled": False}


def test_plan_bridge_detaches_every_member_and_disables_the_service():
    state = {"exists": True, "members": ["en1", "en6", "en2"], "service_enabled": True}
    plan = macos.plan_bridge(state, "bridge0", "Thunderbolt Bridge", "en0")
    assert plan["refused"] is None
    assert plan["detach"] == ["en1", "en6", "en2"]
    assert plan["commands"] == [
        ["ifconfig", "bridge0", "deletem", "en1"],
        ["ifconfig", "bridge0", "deletem", "en6"],
        ["ifconfig", "bridge0", "deletem", "en2"],
        ["networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off"],
    ]


def test_plan_bridge_already_done_is_empty():
    state = {"exists": True, "members": [], "service_enabled": False}
    assert macos.plan_bridge(state, "bridge0", "Thunderbolt Bridge", "en0")["commands"] == []


@pytest.mark.parametrize("mgmt", ["en6", "bridge0"])
def test_plan_bridge_refuses_when_management_runs_over_it(mgmt):
    state = {"exists": True, "members": ["en1", "en6", "en2"], "service_enabled": True}
    plan = macos.plan_bridge(state, "bridge0", "Thunderbolt Bridge", mgmt)
    assert plan["commands"] == []
    assert plan["detach"] == []
    assert mgmt in plan["refused"]
    assert "Nothing was changed" in plan["refused"]


def test_management_interface_from_route_get():
    calls: list[list[str]] = []
    run = fake_run(
        {("route", "-n", "get", "192.168.1.20"): (0, synthetic("route_get_192.168.1.20_en0.txt"), "")}, calls
    )
    assert macos.management_interface(run, ["mac1.example", "192.168.1.20"]) == "en0"
    assert calls == [["route", "-n", "get", "192.168.1.20"]]  # a hostname is skipped, not looked up


def test_management_interface_unknown():
    run = fake_run(
        {("route", "-n", "get", "192.168.1.20"): (1, "", "route: writing to routing socket: not in table")}, []
    )
    assert macos.management_interface(run, ["192.168.1.20"]) is None
    assert macos.management_interface(run, []) is None


# ---- peer links ---------------------------------------------------------------------------
def test_parse_getinfo_and_netmask():
    info = macos.parse_getinfo(synthetic("networksetup_getinfo_manual_198.18.128.1.txt"))
    assert info["IP address"] == "198.18.128.1"
    assert info["Subnet mask"] == "255.255.255.252"
    assert macos.netmask(30) == "255.255.255.252"
    assert macos.netmask(24) == "255.255.255.0"


PORT_EN1 = {"port": "en1", "address": "198.18.128.1", "prefix": 30, "peer_address": "198.18.128.2"}


def test_plan_peer_links_route_check_does_not_confuse_en1_with_en10():
    run = fake_run(
        {
            tuple(macos.SERVICE_ORDER): (0, synthetic("networksetup_listnetworkserviceorder_port_services.txt"), ""),
            ("networksetup", "-getinfo", "meshkit en1"): (
                0,
                synthetic("networksetup_getinfo_manual_198.18.128.1.txt"),
                "",
            ),
            ("route", "-n", "get", "198.18.128.2"): (0, synthetic("route_get_198.18.128.2_connected_en10.txt"), ""),
        },
        [],
    )
    assert macos.plan_peer_links(run, [PORT_EN1], None) == [
        ["route", "-n", "add", "-host", "198.18.128.2", "-interface", "en1"]
    ]


def test_plan_peer_links_converged_is_empty():
    run = fake_run(
        {
            tuple(macos.SERVICE_ORDER): (0, synthetic("networksetup_listnetworkserviceorder_port_services.txt"), ""),
            ("networksetup", "-getinfo", "meshkit en1"): (
                0,
                synthetic("networksetup_getinfo_manual_198.18.128.1.txt"),
                "",
            ),
            ("networksetup", "-getMTU", "en1"): (0, synthetic("networksetup_getmtu_9000.txt"), ""),
            ("route", "-n", "get", "198.18.128.2"): (0, synthetic("route_get_198.18.128.2_connected_en1.txt"), ""),
        },
        [],
    )
    assert macos.plan_peer_links(run, [PORT_EN1], 9000) == []


def test_plan_peer_links_service_order_failure_is_a_mac_error():
    run = fake_run({tuple(macos.SERVICE_ORDER): (4, "", "** Error: ...")}, [])
    with pytest.raises(macos.MacError, match="networksetup -listnetworkserviceorder failed"):
        macos.plan_peer_links(run, [PORT_EN1], None)
