"""Undo on macOS (plugins/module_utils/macos.py: read_undo_record, meshkit_present, plan_links_undo,
plan_bridge_undo) against recorded outputs of real Macs.

The tests drive a small model of one Mac (``Mac`` below). Its read-only commands answer with recorded
outputs where they exist (tests/fixtures/macos/, see SOURCES.md): the real `ifconfig -a` and
`networksetup -listallhardwareports` of a 16" MacBook Pro (Sonoma 14.4; bridge0 holds en1, en2, en3) and
the real `netstat -rn -f inet` of a macOS 26 VM. What no Mac was recorded printing (-listnetworkserviceorder,
-getinfo, -getMTU, a routing table holding meshkit's host routes, the preferences file) is rendered in
the formats of the hand-written fixtures in tests/fixtures/macos/synthetic/, and the renders are compared
with the snapshots kept in tests/fixtures/macos/synthetic/undo/ (SOURCES.md, "Undo"). Its mutating
commands change the model, so a test can run setup's own planners, then undo's, and compare what is
left with what the recorded Mac printed before.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import plistlib
import re
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import macos

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "macos"
SYNTHETIC = FIXTURES / "synthetic"
UNDO = SYNTHETIC / "undo"
SONOMA_IFCONFIG = (FIXTURES / "ifconfig_a_macbookpro16_apple_silicon_sonoma14.4_bridge0_3_tb_members.txt").read_text()
SONOMA_PORTS = (FIXTURES / "networksetup_listallhardwareports_macbookpro16_apple_silicon_sonoma14.4.txt").read_text()
M5MAX_PORTS = (FIXTURES / "networksetup_listallhardwareports_macbookpro_m5max_anonymized.txt").read_text()
NETSTAT = (FIXTURES / "netstat_rn_finet_macos26vm.txt").read_text()
BRIDGE = "bridge0"
SERVICE = "Thunderbolt Bridge"
POOL = "198.18.128.0/17"
KEY = ":VirtualNetworkInterfaces:Bridge:bridge0:Interfaces"
ORDER_HEADER = "An asterisk (*) denotes that a network service is disabled.\n"


def snapshot(name: str) -> str:
    return (UNDO / name).read_text()


# ---- a model of one Mac ---------------------------------------------------------------------------
class Mac:
    """One Mac's network state; ``run`` answers read-only commands from it and applies mutating ones.

    ``services`` are listed in service order: {name, port, device, enabled, configuration, ip, mask, router,
    client_id}; ``mtu`` {device: [active, saved]}; ``routes`` {peer: device} static host routes; the
    preferences file holds bridge0's saved member list."""

    def __init__(self, tmp_path: Path, hardware: str, bridge_block: str, members: list[str], services: list[dict]):
        self.hardware = hardware
        self.ports = macos.parse_hardware_ports(hardware)
        self.port_of = {dev: name for name, dev in self.ports.items()}
        self.macs = dict(re.findall(r"^Device: (\S+)\nEthernet Address: (\S+)", hardware, re.M))
        # bridge0's block as recorded, its member lines kept per member so a member put back reads as before
        self.bridge_lines = bridge_block.splitlines(keepends=True)
        self.member_lines: dict[str, str] = {}
        for i, line in enumerate(self.bridge_lines):
            found = re.match(r"^\tmember: (\S+)", line)
            if found:
                self.member_lines[found.group(1)] = line + self.bridge_lines[i + 1]
        self.bridge_exists = True
        self.bridge_up = "<UP," in self.bridge_lines[0]
        self.members = list(members)
        self.services = [dict(s) for s in services]
        self.mtu = {dev: [1500, 1500] for dev in self.ports.values()}
        self.routes: dict[str, str] = {}
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.prefs_path = tmp_path / "preferences.plist"
        prefs = plistlib.loads((SYNTHETIC / "preferences_bridge0_en1_en6_en2.plist").read_bytes())
        prefs["VirtualNetworkInterfaces"]["Bridge"]["bridge0"]["Interfaces"] = list(members)
        self.prefs_path.write_bytes(plistlib.dumps(prefs))
        self.calls: list[list[str]] = []
        self.mutations: list[list[str]] = []
        self.leases = 0

    # -- what the Mac prints --------------------------------------------------------------------
    def ifconfig_bridge(self) -> str:
        out = []
        for line in self.bridge_lines:
            if line.startswith("bridge0: flags="):
                flags = "8863<UP,BROADCAST,SMART,RUNNING," if self.bridge_up else "8822<BROADCAST,SMART,"
                out.append(f"bridge0: flags={flags}SIMPLEX,MULTICAST> mtu 1500\n")
            elif line.startswith("\tmember: ") or line.startswith("\t        ifmaxaddr"):
                continue
            else:
                out.append(line)
                if line.startswith("\t\tipfilter"):
                    out += [
                        self.member_lines.get(m, f"\tmember: {m} flags=3<LEARNING,DISCOVER>\n") for m in self.members
                    ]
        return "".join(out)

    def service(self, name: str) -> dict | None:
        return next((s for s in self.services if s["name"] == name), None)

    def service_order(self) -> str:
        out, number = [ORDER_HEADER], 0
        for s in self.services:
            number += s["enabled"]
            out.append(f"({number if s['enabled'] else '*'}) {s['name']}\n")
            out.append(f"(Hardware Port: {s['port']}, Device: {s['device']})\n\n")
        return "".join(out)

    def all_services(self) -> str:
        return ORDER_HEADER + "".join(f"{'' if s['enabled'] else '*'}{s['name']}\n" for s in self.services)

    def getinfo(self, name: str) -> tuple[int, str, str]:
        s = self.service(name)
        if s is None:
            return 4, f"** Error: The parameters were not valid.\n{name} is not a recognized network service.\n", ""
        lines = [s["configuration"]]
        lines += [f"IP address: {s['ip']}", f"Subnet mask: {s['mask']}", f"Router: {s['router'] or '(null)'}"]
        if s["configuration"] == "DHCP Configuration":
            lines.append(f"Client ID:{' ' + s['client_id'] if s['client_id'] else ''}")
        lines += ["IPv6: Automatic", "IPv6 IP address: none", "IPv6 Router: none"]
        lines.append(f"Ethernet Address: {self.macs.get(s['device'], 'N/A')}")
        return 0, "".join(f"{line}\n" for line in lines), ""

    def netstat(self) -> str:
        """The recorded table, with the entries macOS adds for each manual address on a port (its network
        and its own /32) and the static host routes, inserted before the multicast lines."""
        extra = []
        for s in self.services:
            cable_port = macos.THUNDERBOLT_PORT.match(s["port"])  # the rest of the table is the recorded one
            if cable_port and s["configuration"] == "Manual Configuration" and s["ip"] and s["enabled"]:
                net = ipaddress.IPv4Interface(f"{s['ip']}/{s['mask']}").network
                short = re.sub(r"\.0$", "", str(net.network_address))  # netstat leaves out a last .0
                extra.append((net.network_address, f"{short}/{net.prefixlen}", "UCS", s["device"], "!"))
                extra.append((ipaddress.IPv4Address(s["ip"]), f"{s['ip']}/32", "UCS", s["device"], "!"))
        extra += [(ipaddress.IPv4Address(peer), peer, "UHS", dev, "") for peer, dev in self.routes.items()]
        rows = [
            f"{dest:<19}link#{self.link(dev):<14}{flags}{dev:>{25 - len(flags)}}{expire:>7}\n"
            for _key, dest, flags, dev, expire in sorted(extra)
        ]
        lines = NETSTAT.splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if line.startswith("224."))
        return "".join(lines[:at] + rows + lines[at:])

    def link(self, dev: str) -> int:
        return 10 + list(self.ports.values()).index(dev)  # an interface index; no recording says which

    def route_get(self, peer: str) -> str:
        if peer in self.routes:
            dev = self.routes[peer]
            return f"   route to: {peer}\ndestination: {peer}\n  interface: {dev}\n      flags: <UP,HOST,DONE,STATIC>\n"
        for s in self.services:
            if s["configuration"] == "Manual Configuration" and s["ip"]:
                net = ipaddress.IPv4Interface(f"{s['ip']}/{s['mask']}").network
                if ipaddress.IPv4Address(peer) in net:
                    template = (SYNTHETIC / "route_get_198.18.128.2_connected_en1.txt").read_text()
                    return (
                        template.replace("198.18.128.2", peer)
                        .replace("198.18.128.0", str(net.network_address))
                        .replace("en1", s["device"])
                    )
        return (SYNTHETIC / "route_get_198.18.128.2_default_en0.txt").read_text().replace("198.18.128.2", peer)

    def saved(self) -> list[str] | None:
        return macos.saved_bridge(macos.read_preferences(str(self.prefs_path)), BRIDGE)

    # -- the runner -----------------------------------------------------------------------------
    def run(self, argv: list[str]) -> tuple[int, str, str]:
        self.calls.append(list(argv))
        a = list(argv)
        if a == ["ifconfig", BRIDGE]:
            return (
                (0, self.ifconfig_bridge(), "")
                if self.bridge_exists
                else (1, "", "ifconfig: interface bridge0 does not exist\n")
            )
        if a == macos.HARDWARE_PORTS:
            return 0, self.hardware, ""
        if a == macos.SERVICE_ORDER:
            return 0, self.service_order(), ""
        if a == macos.ALL_SERVICES:
            return 0, self.all_services(), ""
        if a[:2] == ["networksetup", "-getinfo"]:
            return self.getinfo(a[2])
        if a[:2] == ["networksetup", "-getMTU"]:
            active, saved = self.mtu[a[2]]
            return 0, f"Active MTU: {active} (Current Setting: {saved})\n", ""
        if a == ["netstat", "-rn", "-f", "inet"]:
            return 0, self.netstat(), ""
        if a[:3] == ["route", "-n", "get"]:
            return 0, self.route_get(a[3]), ""
        self.mutations.append(a)
        self.apply(a)
        return 0, "", ""

    def apply(self, a: list[str]) -> None:
        if a[0] == "ifconfig" and a[2] == "deletem":
            self.members.remove(a[3])
        elif a[0] == "ifconfig" and a[2] == "addm":
            assert a[3] not in self.members, a  # ifconfig fails on a member already there
            self.members.append(a[3])
        elif a[0] == "ifconfig" and a[2] in ("up", "down"):
            self.bridge_up = a[2] == "up"
        elif a[0] == "ifconfig" and a[2] == "create":
            self.bridge_exists = True
        elif a[:2] == ["networksetup", "-setnetworkserviceenabled"]:
            self.service(a[2])["enabled"] = a[3] == "on"
        elif a[:2] == ["networksetup", "-createnetworkservice"]:
            assert self.service(a[2]) is None, a
            blank = {"ip": None, "mask": None, "router": None, "client_id": None}
            self.services.append(
                {
                    "name": a[2],
                    "port": a[3],
                    "device": self.ports[a[3]],
                    "enabled": True,
                    "configuration": "DHCP Configuration",
                    **blank,
                }
            )
        elif a[:2] == ["networksetup", "-removenetworkservice"]:
            self.services.remove(self.service(a[2]))
        elif a[:2] == ["networksetup", "-setmanual"]:
            self.service(a[2]).update(configuration="Manual Configuration", ip=a[3], mask=a[4], router=a[5] or None)
        elif a[:2] == ["networksetup", "-setdhcp"]:
            s = self.service(a[2])
            # no DHCP server on a cable: macOS gives the port a self-assigned address, a new one each time
            self.leases += 1
            s.update(
                configuration="DHCP Configuration",
                ip=f"169.254.{self.link(s['device'])}.{self.leases}",
                mask="255.255.0.0",
                router=None,
                client_id=a[3] if len(a) > 3 else None,
            )
        elif a[:2] == ["networksetup", "-setMTU"]:
            self.mtu[a[2]] = [int(a[3]), int(a[3])]
        elif a[:2] == ["route", "-n"] and a[2] in ("add", "change") and a[3] == "-host":
            self.routes[a[4]] = a[6]
        elif a[:4] == ["route", "-n", "delete", "-host"]:
            del self.routes[a[4]]
        elif a[0] == macos.PLISTBUDDY:
            self.plistbuddy(a)
        else:
            raise AssertionError(f"the model does not know {a}")

    def plistbuddy(self, a: list[str]) -> None:
        assert a[-1] in (str(self.prefs_path), macos.PREFERENCES), a
        prefs = plistlib.loads(self.prefs_path.read_bytes())
        for verb, rest in (c.split(" ", 1) for c in a[2:-1:2]):
            path, _sep, kind_value = rest.partition(" ")
            *parents, last = path.strip(":").split(":")
            node: Any = prefs
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            if verb == "Delete":
                del node[last]
            elif kind_value == "array":
                node[last] = []
            else:
                kind, value = kind_value.split(" ", 1)
                assert kind == "string" and isinstance(node, list) and int(last) == len(node), a
                node.append(value)
        self.prefs_path.write_bytes(plistlib.dumps(prefs))

    def state(self) -> dict:
        """Everything undo puts back (a DHCP service's leased address is the server's, not meshkit's)."""
        services = [
            {**s, "ip": None, "mask": None} if s["configuration"] == "DHCP Configuration" else s for s in self.services
        ]
        return copy.deepcopy(
            {
                "bridge": [self.bridge_exists, self.bridge_up, self.members, self.saved()],
                "services": services,
                "mtu": self.mtu,
                "routes": self.routes,
            }
        )


def service(
    name: str,
    port: str,
    device: str,
    enabled: bool = True,
    configuration: str = "DHCP Configuration",
    ip: str | None = None,
    mask: str | None = None,
    router: str | None = None,
) -> dict:
    return {
        "name": name,
        "port": port,
        "device": device,
        "enabled": enabled,
        "configuration": configuration,
        "ip": ip,
        "mask": mask,
        "router": router,
        "client_id": None,
    }


SONOMA_SERVICES = [
    service(
        "Wi-Fi",
        "Wi-Fi",
        "en0",
        configuration="Manual Configuration",
        ip="192.168.2.46",
        mask="255.255.255.0",
        router="192.168.2.1",
    ),
    service(SERVICE, SERVICE, "bridge0"),
]


def sonoma(tmp_path: Path) -> Mac:
    """The recorded 16" MacBook Pro as it came: bridge0 holds en1, en2, en3, the bridge service is on."""
    return Mac(
        tmp_path, SONOMA_PORTS, macos.ifconfig_block(SONOMA_IFCONFIG, BRIDGE), ["en1", "en2", "en3"], SONOMA_SERVICES
    )


def cable(port: str, n: int) -> dict:
    base = ipaddress.IPv4Address("198.18.128.0") + 4 * n
    return {"port": port, "address": str(base + 1), "prefix": 30, "peer_address": str(base + 2)}


SONOMA_CABLES = [cable("en1", 0), cable("en2", 1), cable("en3", 2)]


def setup(mac: Mac, cables: list[dict], mtu: int | None = 9000, mgmt: str = "en0") -> None:
    """What setup.yml's bridge_detach and peer_link do on a Mac: setup's own planners, applied."""
    state = macos.read_bridge_state(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    bridge = macos.plan_bridge(state, BRIDGE, SERVICE, mgmt)
    links = macos.plan_peer_links(mac.run, cables, mtu, mgmt)
    assert bridge["refused"] is None and links["refused"] is None
    for argv in bridge["commands"] + links["commands"]:
        mac.run([str(mac.prefs_path) if a == macos.PREFERENCES else a for a in argv])


def undo(mac: Mac, record: dict | None, mgmt: str | None = "en0") -> tuple[dict, dict]:
    links = macos.plan_links_undo(mac.run, record, POOL, mgmt)
    for argv in links["commands"]:
        mac.run(argv)
    bridge = macos.plan_bridge_undo(mac.run, record, BRIDGE, SERVICE, mgmt, str(mac.prefs_path))
    for argv in bridge["commands"]:
        mac.run(argv)
    return links, bridge


# ---- netstat -rn -f inet ------------------------------------------------------------------------
def test_the_recorded_routing_tables_hold_no_static_host_route():
    # Real captures: 127.0.0.1 (UH, not static), ARP entries (UHLWIir: cloned), /32 entries (UCS: no H).
    assert macos.parse_netstat_host_routes(NETSTAT) == []
    for name in ("netstat_rn_finet_two_defaults_vpn_EXCERPT.txt", "netstat_rn_finet_wifi_EXCERPT.txt"):
        assert macos.parse_netstat_host_routes((FIXTURES.parent / "macos_routes" / name).read_text()) == []


def test_static_host_routes_are_read_and_the_connected_entries_are_not():
    table = snapshot("netstat_rn_finet_macos26vm_after_setup.txt")
    # the recorded table with meshkit's lines in it
    assert "".join(line for line in table.splitlines(keepends=True) if "198.18." not in line) == NETSTAT
    assert macos.parse_netstat_host_routes(table) == [
        {"destination": "198.18.128.2", "gateway": "link#14", "flags": "UHS", "interface": "en1"},
        {"destination": "198.18.128.6", "gateway": "link#15", "flags": "UHS", "interface": "en2"},
        {"destination": "198.18.128.10", "gateway": "link#16", "flags": "UHS", "interface": "en3"},
    ]
    # A cloned ARP entry for a peer is no route anyone added; the older layout (Refs, Use) reads the same.
    arp = "198.18.128.2       2:0:0:0:0:9        UHLWIi                en1   1180\n"
    older = (
        "Routing tables\n\nInternet:\nDestination        Gateway            Flags        Refs      Use   Netif Expire\n"
        "198.18.128.2       link#13            UHS             0        0     en1\n"
    )
    assert macos.parse_netstat_host_routes(NETSTAT + arp) == []
    assert macos.parse_netstat_host_routes(older) == [
        {"destination": "198.18.128.2", "gateway": "link#13", "flags": "UHS", "interface": "en1"}
    ]


# ---- the whole life: record, setup, undo, undo again -----------------------------------------------
FACTORY_RECORD = {
    "version": 1,
    "bridge": {
        "name": "bridge0",
        "service": "Thunderbolt Bridge",
        "exists": True,
        "up": True,
        "members": ["en1", "en2", "en3"],
        "service_enabled": True,
        "saved_members": ["en1", "en2", "en3"],
    },
    "ports": {
        dev: {"hardware_port": f"Thunderbolt {n}", "service": None, "mtu": {"active": 1500, "saved": 1500}}
        for n, dev in ((1, "en1"), (2, "en2"), (3, "en3"))
    },
    "meshkit_found": [],
}
LINKS_UNDO = [
    ["route", "-n", "delete", "-host", "198.18.128.2"],
    ["route", "-n", "delete", "-host", "198.18.128.6"],
    ["route", "-n", "delete", "-host", "198.18.128.10"],
    ["networksetup", "-setMTU", "en1", "1500"],
    ["networksetup", "-removenetworkservice", "meshkit en1"],
    ["networksetup", "-setMTU", "en2", "1500"],
    ["networksetup", "-removenetworkservice", "meshkit en2"],
    ["networksetup", "-setMTU", "en3", "1500"],
    ["networksetup", "-removenetworkservice", "meshkit en3"],
]


def bridge_undo(prefs: Path) -> list[list[str]]:
    return [
        ["ifconfig", "bridge0", "addm", "en1"],
        ["ifconfig", "bridge0", "addm", "en2"],
        ["ifconfig", "bridge0", "addm", "en3"],
        [
            "/usr/libexec/PlistBuddy",
            "-c",
            f"Delete {KEY}",
            "-c",
            f"Add {KEY} array",
            "-c",
            f"Add {KEY}:0 string en1",
            "-c",
            f"Add {KEY}:1 string en2",
            "-c",
            f"Add {KEY}:2 string en3",
            str(prefs),
        ],
        ["networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "on"],
    ]


def test_the_model_prints_what_the_recorded_mac_printed(tmp_path):
    mac = sonoma(tmp_path)
    assert mac.run(["ifconfig", BRIDGE])[1] == macos.ifconfig_block(SONOMA_IFCONFIG, BRIDGE)
    assert mac.run(macos.HARDWARE_PORTS)[1] == SONOMA_PORTS
    assert mac.run(["netstat", "-rn", "-f", "inet"])[1] == NETSTAT
    assert mac.run(macos.SERVICE_ORDER)[1] == snapshot("networksetup_listnetworkserviceorder_sonoma_factory.txt")
    assert mac.run(macos.ALL_SERVICES)[1] == snapshot("networksetup_listallnetworkservices_sonoma_factory.txt")
    assert mac.saved() == ["en1", "en2", "en3"]


def test_record_setup_undo_puts_the_factory_mac_back_and_a_second_undo_changes_nothing(tmp_path):
    mac = sonoma(tmp_path)
    factory = mac.state()
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    assert record == FACTORY_RECORD
    assert json.loads(json.dumps(record)) == record  # kept as JSON in the host's state directory
    assert mac.mutations == []
    assert macos.meshkit_present(mac.run, POOL) == []

    setup(mac, SONOMA_CABLES)
    # What setup left, in the formats the snapshots keep (so what undo reads is on file).
    assert mac.run(["ifconfig", BRIDGE])[1] == snapshot("ifconfig_bridge0_sonoma_after_setup.txt")
    assert mac.run(macos.SERVICE_ORDER)[1] == snapshot("networksetup_listnetworkserviceorder_sonoma_after_setup.txt")
    assert mac.run(macos.ALL_SERVICES)[1] == snapshot("networksetup_listallnetworkservices_sonoma_after_setup.txt")
    assert mac.run(["networksetup", "-getinfo", "meshkit en2"])[1] == snapshot("networksetup_getinfo_meshkit_en2.txt")
    assert mac.run(["netstat", "-rn", "-f", "inet"])[1] == snapshot("netstat_rn_finet_macos26vm_after_setup.txt")
    assert mac.saved() == []
    assert macos.meshkit_present(mac.run, POOL) == [
        "network service 'meshkit en1' (en1)",
        "network service 'meshkit en2' (en2)",
        "network service 'meshkit en3' (en3)",
        "198.18.128.1 (inside 198.18.128.0/17) on network service 'meshkit en1' (en1)",
        "198.18.128.5 (inside 198.18.128.0/17) on network service 'meshkit en2' (en2)",
        "198.18.128.9 (inside 198.18.128.0/17) on network service 'meshkit en3' (en3)",
        "host route to 198.18.128.2 out of en1",
        "host route to 198.18.128.6 out of en2",
        "host route to 198.18.128.10 out of en3",
    ]
    # A record taken now would show meshkit's services, so undo would not trust it.
    assert macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))["meshkit_found"] == [
        "meshkit en1",
        "meshkit en2",
        "meshkit en3",
    ]

    mac.mutations.clear()
    links, bridge = undo(mac, record)
    assert links == {"commands": LINKS_UNDO, "notes": [], "refused": None}
    assert bridge == {"commands": bridge_undo(mac.prefs_path), "notes": [], "refused": None}
    assert mac.mutations == LINKS_UNDO + bridge_undo(mac.prefs_path)

    # The Mac prints what it printed before setup: the ports are back in bridge0, as recorded.
    assert mac.state() == factory
    assert mac.run(["ifconfig", BRIDGE])[1] == macos.ifconfig_block(SONOMA_IFCONFIG, BRIDGE)
    assert mac.run(["netstat", "-rn", "-f", "inet"])[1] == NETSTAT
    assert mac.run(macos.SERVICE_ORDER)[1] == snapshot("networksetup_listnetworkserviceorder_sonoma_factory.txt")
    assert macos.meshkit_present(mac.run, POOL) == []
    assert macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path)) == FACTORY_RECORD

    # A second undo changes nothing, with the record or without it.
    mac.mutations.clear()
    for again in (record, None):
        links = macos.plan_links_undo(mac.run, again, POOL, "en0")
        assert links["commands"] == [] and links["refused"] is None
    assert macos.plan_bridge_undo(mac.run, record, BRIDGE, SERVICE, "en0", str(mac.prefs_path)) == {
        "commands": [],
        "notes": [],
        "refused": None,
    }
    assert mac.mutations == []


def test_an_undo_cut_short_is_finished_by_the_next_one(tmp_path):
    mac = sonoma(tmp_path)
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    setup(mac, SONOMA_CABLES)
    for argv in macos.plan_links_undo(mac.run, record, POOL, "en0")["commands"][:5]:  # lost after meshkit en1
        mac.run(argv)
    mac.mutations.clear()
    links, bridge = undo(mac, record)
    assert links["commands"] == LINKS_UNDO[5:]
    assert bridge["commands"] == bridge_undo(mac.prefs_path)
    assert macos.meshkit_present(mac.run, POOL) == []


# ---- a service that was there before: given back its configuration, state and MTU --------------------
def m5max(tmp_path: Path, thunderbolt2: dict) -> Mac:
    """The recorded M5 Max port map (Thunderbolt 1/2/3 -> en1/en6/en2) with a user's own service on
    Thunderbolt 2 (en6), which claims the port, so bridge0 holds en1 and en2 (its block is the synthetic one)."""
    services = [
        service("Ethernet Adapter (en3)", "Ethernet Adapter (en3)", "en3"),
        service("Wi-Fi", "Wi-Fi", "en0"),
        service(SERVICE, SERVICE, "bridge0"),
        thunderbolt2,
    ]
    block = (SYNTHETIC / "ifconfig_bridge0_members_en1_en6_en2.txt").read_text()
    return Mac(tmp_path, M5MAX_PORTS, block, ["en1", "en2"], services)


def test_a_dhcp_service_that_was_off_gets_dhcp_its_mtu_and_off_back(tmp_path):
    mac = m5max(tmp_path, service("Thunderbolt 2", "Thunderbolt 2", "en6", enabled=False))
    mac.run(["networksetup", "-setdhcp", "Thunderbolt 2"])  # leased the self-assigned address
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    assert record["ports"]["en6"] == {
        "hardware_port": "Thunderbolt 2",
        "service": {
            "name": "Thunderbolt 2",
            "enabled": False,
            "configuration": "DHCP Configuration",
            "ip": "169.254.14.1",
            "mask": "255.255.0.0",
            "router": None,
            "client_id": None,
        },
        "mtu": {"active": 1500, "saved": 1500},
    }
    assert list(record["ports"]) == ["en1", "en6", "en2"]  # Thunderbolt 1, 2, 3
    factory = mac.state()
    setup(mac, [cable("en1", 0), cable("en6", 1)])
    assert mac.service("Thunderbolt 2")["configuration"] == "Manual Configuration"  # setup used the user's service
    mac.mutations.clear()
    links, bridge = undo(mac, record)
    assert links["commands"] == [
        ["route", "-n", "delete", "-host", "198.18.128.2"],
        ["route", "-n", "delete", "-host", "198.18.128.6"],
        ["networksetup", "-setMTU", "en1", "1500"],
        ["networksetup", "-removenetworkservice", "meshkit en1"],
        ["networksetup", "-setMTU", "en6", "1500"],
        ["networksetup", "-setdhcp", "Thunderbolt 2"],
        ["networksetup", "-setnetworkserviceenabled", "Thunderbolt 2", "off"],
    ]
    assert bridge["commands"][:2] == [["ifconfig", "bridge0", "addm", "en1"], ["ifconfig", "bridge0", "addm", "en2"]]
    assert mac.state() == factory
    assert macos.plan_links_undo(mac.run, record, POOL, "en0")["commands"] == []


def test_a_manual_service_gets_its_address_and_router_back(tmp_path):
    mine = service(
        "Thunderbolt 2",
        "Thunderbolt 2",
        "en6",
        configuration="Manual Configuration",
        ip="10.9.0.1",
        mask="255.255.255.0",
        router="10.9.0.254",
    )
    mac = m5max(tmp_path, mine)
    mac.mtu["en6"] = [4000, 4000]
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    factory = mac.state()
    setup(mac, [cable("en6", 1)])
    links, _bridge = undo(mac, record)
    assert links["commands"] == [
        ["route", "-n", "delete", "-host", "198.18.128.6"],
        ["networksetup", "-setMTU", "en6", "4000"],
        ["networksetup", "-setmanual", "Thunderbolt 2", "10.9.0.1", "255.255.255.0", "10.9.0.254"],
    ]
    assert mac.state() == factory
    # setup without an MTU of its own leaves the MTU alone, and so does undo
    mac = m5max(tmp_path, dict(mine))
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    setup(mac, [cable("en6", 1)], mtu=None)
    assert not any(argv[1] == "-setMTU" for argv in macos.plan_links_undo(mac.run, record, POOL, "en0")["commands"])


# ---- without a record ---------------------------------------------------------------------------------
def test_without_a_record_only_meshkits_own_configuration_goes(tmp_path):
    mac = m5max(tmp_path, service("Thunderbolt 2", "Thunderbolt 2", "en6"))
    setup(mac, [cable("en1", 0), cable("en6", 1)])
    links = macos.plan_links_undo(mac.run, None, POOL, "en0")
    assert links["refused"] is None
    assert links["commands"] == [
        ["route", "-n", "delete", "-host", "198.18.128.2"],
        ["route", "-n", "delete", "-host", "198.18.128.6"],
        ["networksetup", "-removenetworkservice", "meshkit en1"],
    ]
    assert links["notes"] == [
        "en1: its MTU (9000 now) was not set back: no record says what it was before setup",
        "en6: the network service 'Thunderbolt 2' keeps 198.18.128.5 (inside 198.18.128.0/17): it was there "
        "before setup and no record says how it was configured, so it was not restored; set it in System "
        "Settings > Network, or undo with the record setup.yml took",
    ]
    for argv in links["commands"]:
        mac.run(argv)
    # what is left is the user's service, which meshkit_present still reports
    assert macos.meshkit_present(mac.run, POOL) == [
        "198.18.128.5 (inside 198.18.128.0/17) on network service 'Thunderbolt 2' (en6)"
    ]
    assert macos.plan_links_undo(mac.run, None, POOL, "en0")["commands"] == []


def test_a_meshkit_service_whose_port_is_gone_is_removed_too(tmp_path):
    mac = sonoma(tmp_path)
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    setup(mac, SONOMA_CABLES[:1])
    mac.services.append(service("meshkit en9", "Thunderbolt 4", ""))  # a port since unplugged: no device
    assert "(Hardware Port: Thunderbolt 4, Device: )" in mac.run(macos.SERVICE_ORDER)[1]
    assert "network service 'meshkit en9' (no port)" in macos.meshkit_present(mac.run, POOL)
    links, _bridge = undo(mac, record)
    assert links["commands"] == [
        ["route", "-n", "delete", "-host", "198.18.128.2"],
        ["networksetup", "-setMTU", "en1", "1500"],
        ["networksetup", "-removenetworkservice", "meshkit en1"],
        ["networksetup", "-removenetworkservice", "meshkit en9"],
    ]
    assert macos.meshkit_present(mac.run, POOL) == []


def test_without_a_record_the_bridge_is_not_guessed(tmp_path):
    mac = sonoma(tmp_path)
    setup(mac, SONOMA_CABLES)
    mac.mutations.clear()
    plan = macos.plan_bridge_undo(mac.run, None, BRIDGE, SERVICE, "en0", str(mac.prefs_path))
    assert plan["commands"] == []
    assert plan["refused"].startswith("no record of what bridge0 held before setup; nothing restored.")
    assert "holds every Thunderbolt port (en1, en2, en3)" in plan["refused"]
    assert "ifconfig bridge0 addm" in plan["refused"] and "Nothing was changed" in plan["refused"]
    assert mac.mutations == []


def test_a_record_taken_after_meshkit_configured_the_host_counts_as_none(tmp_path):
    mac = sonoma(tmp_path)
    setup(mac, SONOMA_CABLES)
    late = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    links = macos.plan_links_undo(mac.run, late, POOL, "en0")
    assert links["commands"] == macos.plan_links_undo(mac.run, None, POOL, "en0")["commands"]
    assert "taken after meshkit had configured this host" in links["notes"][0]
    bridge = macos.plan_bridge_undo(mac.run, late, BRIDGE, SERVICE, "en0", str(mac.prefs_path))
    assert bridge["commands"] == [] and bridge["refused"].startswith("no record of what bridge0 held")


@pytest.mark.parametrize(
    ("record", "field"),
    [("not a record", "no mapping"), ({"bridge": {}, "ports": {}}, "'meshkit_found'"), ({"ports": {}}, "'bridge'")],
)
def test_a_malformed_record_is_an_error_naming_the_field(tmp_path, record, field):
    mac = sonoma(tmp_path)
    with pytest.raises(macos.MacError, match=field):
        macos.plan_links_undo(mac.run, record, POOL, "en0")
    with pytest.raises(macos.MacError, match=field):
        macos.plan_bridge_undo(mac.run, record, BRIDGE, SERVICE, "en0", str(mac.prefs_path))


def test_a_bad_pool_is_an_error_naming_it(tmp_path):
    mac = sonoma(tmp_path)
    with pytest.raises(macos.MacError, match=re.escape("pool: '198.18.128.0/33'")):
        macos.plan_links_undo(mac.run, None, "198.18.128.0/33", "en0")
    with pytest.raises(macos.MacError, match="pool: 'x'"):
        macos.meshkit_present(mac.run, "x")


# ---- the bridge: exactly the recorded members, up, saved list, service ------------------------------------
def test_a_bridge_left_down_is_brought_up_and_a_missing_member_list_key_is_added(tmp_path):
    mac = sonoma(tmp_path)
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    setup(mac, SONOMA_CABLES)
    mac.run(["ifconfig", BRIDGE, "down"])
    prefs = plistlib.loads(mac.prefs_path.read_bytes())
    del prefs["VirtualNetworkInterfaces"]["Bridge"]["bridge0"]["Interfaces"]
    mac.prefs_path.write_bytes(plistlib.dumps(prefs))
    plan = macos.plan_bridge_undo(mac.run, record, BRIDGE, SERVICE, "en0", str(mac.prefs_path))
    assert plan["commands"][3] == ["ifconfig", "bridge0", "up"]
    assert plan["commands"][4][:5] == [macos.PLISTBUDDY, "-c", f"Add {KEY} array", "-c", f"Add {KEY}:0 string en1"]


def test_a_bridge_definition_removed_by_something_else_is_not_rebuilt(tmp_path):
    mac = sonoma(tmp_path)
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    setup(mac, SONOMA_CABLES)
    prefs = plistlib.loads(mac.prefs_path.read_bytes())
    del prefs["VirtualNetworkInterfaces"]["Bridge"]["bridge0"]  # as exo's daemon does
    mac.prefs_path.write_bytes(plistlib.dumps(prefs))
    plan = macos.plan_bridge_undo(mac.run, record, BRIDGE, SERVICE, "en0", str(mac.prefs_path))
    assert not any(argv[0] == macos.PLISTBUDDY for argv in plan["commands"])
    assert "definition is gone" in plan["notes"][0] and "en1, en2, en3" in plan["notes"][0]


def test_members_the_record_does_not_name_are_left_in_and_named(tmp_path):
    mac = sonoma(tmp_path)
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    record["bridge"]["members"] = ["en1", "en3"]
    mac.run(["ifconfig", BRIDGE, "deletem", "en3"])
    plan = macos.plan_bridge_undo(mac.run, record, BRIDGE, SERVICE, "en0", str(mac.prefs_path))
    assert plan["commands"] == [["ifconfig", "bridge0", "addm", "en3"]]
    assert plan["notes"] == ["bridge0 also holds en2, which it did not before setup; left in"]


def test_unreadable_preferences_are_not_written_blind(tmp_path):
    mac = sonoma(tmp_path)
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(tmp_path / "absent.plist"))
    assert record["bridge"]["saved_members"] is None
    setup(mac, SONOMA_CABLES)
    plan = macos.plan_bridge_undo(mac.run, record, BRIDGE, SERVICE, "en0", str(mac.prefs_path))
    assert not any(argv[0] == macos.PLISTBUDDY for argv in plan["commands"])
    assert "could not be read when the record was taken" in plan["notes"][0]
    plan = macos.plan_bridge_undo(mac.run, FACTORY_RECORD, BRIDGE, SERVICE, "en0", str(tmp_path / "absent.plist"))
    assert not any(argv[0] == macos.PLISTBUDDY for argv in plan["commands"])
    assert "cannot be read now" in plan["notes"][0]


# ---- the management interface ------------------------------------------------------------------------
@pytest.mark.parametrize("mgmt", [None, ""])
def test_undo_fails_closed_without_a_management_interface(tmp_path, mgmt):
    mac = sonoma(tmp_path)
    setup(mac, SONOMA_CABLES)
    mac.calls.clear()
    links = macos.plan_links_undo(mac.run, FACTORY_RECORD, POOL, mgmt)
    bridge = macos.plan_bridge_undo(mac.run, FACTORY_RECORD, BRIDGE, SERVICE, mgmt, str(mac.prefs_path))
    for plan in (links, bridge):
        assert plan["commands"] == [] and "meshkit_management_interface" in plan["refused"]
    assert mac.calls == []  # nothing read, nothing run


@pytest.mark.parametrize("mgmt", ["en1", "en2", "en3", "bridge0"])
def test_the_bridge_is_not_put_back_over_the_management_interface(tmp_path, mgmt):
    mac = sonoma(tmp_path)
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    setup(mac, SONOMA_CABLES)
    plan = macos.plan_bridge_undo(mac.run, record, BRIDGE, SERVICE, mgmt, str(mac.prefs_path))
    assert plan["commands"] == []
    assert f"the management interface {mgmt} is bridge0 or one of its members" in plan["refused"]
    assert "Nothing was changed" in plan["refused"]


def test_a_link_undo_that_would_touch_the_management_interface_is_refused(tmp_path):
    mac = sonoma(tmp_path)
    record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
    setup(mac, SONOMA_CABLES)
    plan = macos.plan_links_undo(mac.run, record, POOL, "en2")
    assert plan["commands"] == []
    assert plan["refused"].startswith("undoing the cable configuration would run `route -n delete -host 198.18.128.6`")
    assert "management interface en2" in plan["refused"] and "Nothing was changed" in plan["refused"]
    # its service, when that is all there is left on it
    mac.run(["route", "-n", "delete", "-host", "198.18.128.6"])
    mac.run(["networksetup", "-setMTU", "en2", "1500"])
    plan = macos.plan_links_undo(mac.run, record, POOL, "en2")
    assert "`networksetup -removenetworkservice meshkit en2`" in plan["refused"]


CANDIDATE_MGMT = ["en0", "en1", "en2", "en3", "en6", "en10", "bridge0", "bridge100"]


def names(argv: list[str], iface: str) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(iface)}(?![\w.])", arg) for arg in argv)


# Undo's planners, each as the sweep below calls it. tests/unit/test_macos.py's check that every plan_*
# function is swept for the management interface can count these as covered.
UNDO_PLANNERS = {
    "plan_links_undo": lambda mac, record, mgmt: macos.plan_links_undo(mac.run, record, POOL, mgmt),
    "plan_bridge_undo": lambda mac, record, mgmt: macos.plan_bridge_undo(
        mac.run, record, BRIDGE, SERVICE, mgmt, str(mac.prefs_path)
    ),
}


def test_every_undo_planner_is_swept():
    assert {name for name in dir(macos) if name.startswith("plan_") and name.endswith("_undo")} == set(UNDO_PLANNERS)


@pytest.mark.parametrize("planner", sorted(UNDO_PLANNERS))
@pytest.mark.parametrize("mgmt", CANDIDATE_MGMT)
def test_no_undo_command_names_the_management_interface(tmp_path, planner, mgmt):
    planned = 0
    for n, (world, cables) in enumerate(
        [("sonoma", SONOMA_CABLES), ("sonoma", SONOMA_CABLES[:1]), ("m5max", [cable("en1", 0), cable("en6", 1)])]
    ):
        mac = (
            sonoma(tmp_path / str(n))
            if world == "sonoma"
            else m5max(tmp_path / str(n), service("Thunderbolt 2", "Thunderbolt 2", "en6"))
        )
        record = macos.read_undo_record(mac.run, BRIDGE, SERVICE, str(mac.prefs_path))
        setup(mac, cables, mgmt="en0")
        for kept in (record, None):
            plan = UNDO_PLANNERS[planner](mac, kept, mgmt)
            for argv in plan["commands"]:
                assert not names(argv, mgmt), (mgmt, argv)
            if plan["refused"]:
                assert plan["commands"] == []
            planned += len(plan["commands"])
    if mgmt in ("en0", "en10", "bridge100"):  # neither a cable port nor the bridge: undo has work to do
        assert planned > 0


# ---- through the modules: setup keeps the record, undo reads it ---------------------------------
def test_the_modules_record_the_mac_then_undo_puts_it_back_and_a_second_undo_changes_nothing(tmp_path, monkeypatch):
    """bridge_detach and peer_link as setup.yml runs them (state_dir given: the record is kept before the first
    change), then with state absent as teardown.yml runs them, on the model Mac: the record written is the
    factory record, undo puts the factory Mac back, removes the record, and a second undo changes nothing."""
    import platform

    from ansible.module_utils import basic
    from ansible.module_utils.testing import patch_module_args
    from ansible_collections.meshkit.cluster.plugins.modules import bridge_detach, peer_link

    from .module_harness import Exit, patch_exits

    mac = sonoma(tmp_path)
    factory = mac.state()
    state_dir = tmp_path / "meshkit"
    monkeypatch.setattr(macos, "PREFERENCES", str(mac.prefs_path))
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.delenv("SSH_CONNECTION", raising=False)
    patch_exits(monkeypatch)

    def run_command(_self, argv, **_kw):
        if list(argv) == ["ifconfig"]:  # the management check reads every interface
            return 0, SONOMA_IFCONFIG, ""
        return mac.run(list(argv))

    monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)

    def module(which, args, check=False):
        with patch_module_args({**args, "_ansible_check_mode": check}), pytest.raises(Exit) as info:
            which.main()
        return info.value.args[0]

    common = {"management_interface": "en0", "state_dir": str(state_dir)}
    module(bridge_detach, common)
    record = json.loads((state_dir / "record.json").read_text())
    assert {k: record[k] for k in FACTORY_RECORD if k != "version"} == {
        k: v for k, v in FACTORY_RECORD.items() if k != "version"
    }
    assert record["platform"] == "Darwin" and record["management_interface"] == "en0"
    module(peer_link, {**common, "ports": SONOMA_CABLES, "pool": POOL, "mtu": 9000})
    assert json.loads((state_dir / "record.json").read_text()) == record  # the first record is kept
    assert mac.state() != factory

    undo_args = {**common, "state": "absent", "pool": POOL}
    mac.mutations.clear()
    shown = module(peer_link, undo_args, check=True)
    assert shown["changed"] and shown["commands"] == LINKS_UNDO and mac.mutations == []  # --check: shown, not run
    links = module(peer_link, undo_args)
    assert links["commands"] == LINKS_UNDO and mac.mutations == LINKS_UNDO
    bridge = module(bridge_detach, undo_args)
    assert bridge["commands"] == bridge_undo(mac.prefs_path)
    assert bridge["removed"] == [str(state_dir / "record.json"), str(state_dir)]
    assert mac.state() == factory and not state_dir.exists()

    mac.mutations.clear()
    assert module(peer_link, undo_args)["changed"] is False
    assert module(bridge_detach, undo_args)["changed"] is False
    assert mac.mutations == []
