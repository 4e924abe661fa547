# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""macOS side of meshkit's network modules: parse what Macs print, plan what to run.

Parsers are tested against recorded outputs of real Macs (tests/fixtures/macos/).
Command runners take ``run(argv) -> (rc, out, err)`` as in linux_net.
"""

from __future__ import annotations

import ipaddress
import json
import os
import plistlib
import re
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from ansible_collections.meshkit.cluster.plugins.module_utils.linux_net import checked

if TYPE_CHECKING:
    from ansible_collections.meshkit.cluster.plugins.module_utils.linux_net import Run

SYSTEM_PROFILER = ["system_profiler", "SPThunderboltDataType", "-json"]
HARDWARE_PORTS = ["networksetup", "-listallhardwareports"]
SERVICE_ORDER = ["networksetup", "-listnetworkserviceorder"]
ALL_SERVICES = ["networksetup", "-listallnetworkservices"]
SERVICE_PREFIX = "meshkit"
# Where macOS keeps its saved network configuration, bridge0's member list included
# (VirtualNetworkInterfaces -> Bridge -> bridge0 -> Interfaces; global, not per location).
PREFERENCES = "/Library/Preferences/SystemConfiguration/preferences.plist"
PLISTBUDDY = "/usr/libexec/PlistBuddy"


class MacError(RuntimeError):
    pass


def _out(run: Run, argv: list[str]) -> str:
    return checked(run, argv, MacError)


def parse_hardware_ports(text: str) -> dict[str, str]:
    """`networksetup -listallhardwareports` → {"Thunderbolt 1": "en1", ...}."""
    ports: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if line.startswith("Hardware Port:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and name:
            ports[name] = line.split(":", 1)[1].strip()
            name = None
    return ports


def _peer_uuids(items: list[dict[str, Any]]) -> list[str]:
    """Domain UUIDs of Macs anywhere below a port: directly cabled or behind hubs and docks."""
    found = []
    for item in items or []:
        if item.get("domain_uuid_key"):
            found.append(item["domain_uuid_key"])
        found.extend(_peer_uuids(item.get("_items", [])))
    return found


def parse_thunderbolt(data: dict[str, Any], hardware_ports: dict[str, str]) -> list[dict[str, Any]]:
    """`system_profiler SPThunderboltDataType -json` → one entry per port.

    A port's identity is its bus's domain UUID; a peer Mac shows up in the port's
    ``_items`` (possibly nested behind a hub) carrying the *remote* port's UUID.
    Displays and docks carry no domain UUID and are listed as devices only.
    """
    ports = []
    for bus in data.get("SPThunderboltDataType", []):
        tag = bus.get("receptacle_1_tag") or {}
        number = tag.get("receptacle_id_key")
        speed = tag.get("current_speed_key")
        device = hardware_ports.get(f"Thunderbolt {number}") if number else None
        peers = _peer_uuids(bus.get("_items", []))
        ports.append(
            {
                "port": device,
                "receptacle": number,
                "ident": bus.get("domain_uuid_key", ""),
                "seen": peers,
                "speed": speed,
                "linked": bool(speed) and not str(speed).startswith("Up to"),
                "generation": thunderbolt_generation(speed),
                "rdma": f"rdma_{device}" if device else None,
                "devices": [i.get("_name") for i in bus.get("_items", []) if not i.get("domain_uuid_key")],
            }
        )
    return sorted(ports, key=lambda p: int(p["receptacle"] or 0))


def thunderbolt_generation(speed: str | None) -> str | None:
    """TB5 links run at 80 Gb/s (120 boost); TB4/TB3 at 40 Gb/s."""
    match = re.search(r"([0-9]+)\s*Gb/s", speed or "")
    if not match:
        return None
    gbps = int(match.group(1))
    return "tb5" if gbps >= 80 else "tb4" if gbps >= 40 else "tb3-or-older"


def discover(run: Run) -> list[dict[str, Any]]:
    hardware = parse_hardware_ports(_out(run, HARDWARE_PORTS))
    data = json.loads(_out(run, SYSTEM_PROFILER))
    return [p for p in parse_thunderbolt(data, hardware) if p["port"]]


# ---- reading what macOS prints -------------------------------------------------
def parse_route_get(text: str) -> dict[str, Any]:
    """`route -n get [-inet6] ADDRESS` -> {"route to", "destination", "mask", "gateway", "interface",
    "flags": [...]}; keys that are absent (an on-link route has no gateway) are absent. Values may hold
    colons (IPv6), so only the first ": " splits."""
    fields: dict[str, Any] = {}
    for line in text.splitlines():
        match = re.match(r"^\s*(route to|destination|mask|gateway|interface|if address|flags):\s?(.*)$", line)
        if not match:
            continue  # the metrics header and values, error messages
        key, value = match.group(1), match.group(2).strip()
        if key == "flags":
            fields["flags"] = [f for f in value.strip("<>").split(",") if f]
        else:
            fields[key] = value
    return fields


def parse_getmtu(text: str) -> tuple[int | None, int | None]:
    """`networksetup -getMTU DEVICE` ("Active MTU: 1500 (Current Setting: 1500)") -> (active, saved)."""
    active = re.search(r"Active MTU:\s*([0-9]+)", text)
    saved = re.search(r"Current Setting:\s*([0-9]+)", text)
    return (int(active.group(1)) if active else None, int(saved.group(1)) if saved else None)


def read_preferences(path: str | None = None) -> dict[str, Any] | None:
    """macOS's saved network configuration (a plist, XML or binary), or None when it cannot be read."""
    try:
        with open(path or PREFERENCES, "rb") as handle:
            data = plistlib.load(handle)
    except (OSError, plistlib.InvalidFileException, ValueError):
        return None
    return data if isinstance(data, dict) else None


def saved_bridge(preferences: dict[str, Any] | None, bridge: str) -> list[str] | None:
    """The member list macOS builds ``bridge`` from at boot; [] when the bridge is not defined, None when
    the preferences could not be read."""
    if preferences is None:
        return None
    definition = (preferences.get("VirtualNetworkInterfaces") or {}).get("Bridge", {}).get(bridge)
    if not isinstance(definition, dict):
        return []
    return [str(m) for m in definition.get("Interfaces") or []]


# ---- bridge -----------------------------------------------------------------
def ifconfig_block(text: str, iface: str) -> str:
    """One interface's lines out of `ifconfig` / `ifconfig -a` (a block starts at column 0 with "NAME: ")."""
    block: list[str] = []
    inside = False
    for line in text.splitlines(keepends=True):
        if line[:1] not in ("", " ", "\t") and not line.startswith("..."):  # "...": a published copy's elision
            inside = line.startswith(f"{iface}: ")
        if inside:
            block.append(line)
    return "".join(block)


def parse_bridge_members(ifconfig: str) -> list[str]:
    return re.findall(r"^\s*member:\s*(\S+)", ifconfig, re.M)


def parse_services(text: str) -> dict[str, bool]:
    """`networksetup -listallnetworkservices` → {service: enabled}; disabled ones start with '*'."""
    services = {}
    for raw in text.splitlines()[1:]:  # the first line is an explanation
        line = raw.rstrip()
        if not line:
            continue
        services[line.lstrip("*").strip()] = not line.startswith("*")
    return services


def parse_service_order_full(text: str) -> dict[str, dict[str, Any]]:
    """`networksetup -listnetworkserviceorder` → {device: {"service", "port", "enabled"}}: "(N) NAME" or
    "(*) NAME" (disabled), then "(Hardware Port: PORT, Device: DEV)"."""
    out: dict[str, dict[str, Any]] = {}
    head = None
    for line in text.splitlines():
        first = re.match(r"^\((\d+|\*)\)\s+(.*)$", line.strip())
        if first:
            head = (first.group(2).strip(), first.group(1) != "*")
            continue
        port = re.search(r"Hardware Port:\s*(.*?),\s*Device:\s*([^)\s]*)\)", line)
        if port and head:
            if port.group(2):
                out[port.group(2)] = {"service": head[0], "port": port.group(1), "enabled": head[1]}
            head = None
    return out


def parse_service_order(text: str) -> dict[str, str]:
    """`networksetup -listnetworkserviceorder` → {device: service}."""
    return {dev: entry["service"] for dev, entry in parse_service_order_full(text).items()}


def read_bridge_state(run: Run, bridge: str, service: str, preferences: str | None = None) -> dict[str, Any]:
    """bridge0 now (`ifconfig`), its service (enabled or not), and the member list macOS saved for it."""
    state = _bridge_now(run, bridge, service, read_preferences(preferences))
    return {key: state[key] for key in ("exists", "members", "service_enabled", "saved_members")}


def _bridge_now(run: Run, bridge: str, service: str, preferences: dict[str, Any] | None) -> dict[str, Any]:
    """read_bridge_state's answer plus ``up`` (the UP flag of ``bridge``), which undo puts back too."""
    rc, out, _err = run(["ifconfig", bridge])
    block = ifconfig_block(out, bridge) if rc == 0 else ""
    flags = re.search(r"flags=[0-9a-f]+<([^>]*)>", block)
    services = parse_services(_out(run, ALL_SERVICES))
    return {
        "exists": rc == 0,
        "up": "UP" in (flags.group(1).split(",") if flags else []),
        "members": parse_bridge_members(block),
        "service_enabled": services.get(service),
        "saved_members": saved_bridge(preferences, bridge),
    }


def _unknown_management(what: str) -> str:
    return (
        f"the management interface is not known, so {what} could cut the connection this play runs over; "
        "set meshkit_management_interface for this host. Nothing was changed"
    )


def bridge_persistence(bridge: str, service: str) -> str:
    return (
        f"{bridge}'s members leave it now (ifconfig deletem, runtime) and its saved member list in {PREFERENCES} "
        f"(VirtualNetworkInterfaces > Bridge > {bridge} > Interfaces), so macOS does not put them back at boot; "
        f"the '{service}' service is disabled, which is saved"
    )


def plan_bridge(state: dict[str, Any], bridge: str, service: str, mgmt: str | None) -> dict[str, Any]:
    """Commands that empty the bridge now and at every boot, and disable its service.

    macOS builds the bridge at boot from the member list saved in its network preferences; a disabled
    "Thunderbolt Bridge" service alone does not change that list (exo and others delete or edit it for
    that reason), so the list is emptied too, with PlistBuddy (networksetup has no bridge commands).
    Fails closed: with no management interface known, or the management interface being the bridge or
    one of its members (now or at the next boot), nothing is planned and ``refused`` says why."""
    saved = state.get("saved_members")
    result: dict[str, Any] = {
        "commands": [],
        "members": state["members"],
        "detach": [],
        "kept": [],
        "saved_members": saved,
        "unsave": [],
        "refused": None,
        "notes": [],
        "persistence": bridge_persistence(bridge, service),
    }
    if not mgmt:
        result["refused"] = _unknown_management(f"taking {bridge} apart")
        return result
    if mgmt == bridge or mgmt in state["members"]:
        result["refused"] = (
            f"the management connection runs over {mgmt}, which is {bridge} or one of its members; "
            f"taking {bridge} apart would cut it. Nothing was changed"
        )
        return result
    if saved and mgmt in saved:
        result["refused"] = (
            f"the management interface {mgmt} is saved as a member of {bridge} in {PREFERENCES}: at the next boot "
            f"macOS would put it into {bridge} and cut the management connection. Give {mgmt} its own network "
            f"service (or take it out of the Thunderbolt Bridge in System Settings) first. Nothing was changed"
        )
        return result
    result["detach"] = list(state["members"])
    result["commands"] = [["ifconfig", bridge, "deletem", m] for m in state["members"]]
    if state.get("service_enabled"):
        result["commands"].append(["networksetup", "-setnetworkserviceenabled", service, "off"])
    if saved:
        # After the networksetup change, so no networksetup run of this play holds the list from before.
        result["unsave"] = list(saved)
        key = f":VirtualNetworkInterfaces:Bridge:{bridge}:Interfaces"
        result["commands"].append([PLISTBUDDY, "-c", f"Delete {key}", "-c", f"Add {key} array", PREFERENCES])
    elif saved is None:
        result["notes"].append(
            f"{PREFERENCES} could not be read, so {bridge}'s saved member list was not checked: macOS may put "
            f"the Thunderbolt ports back into {bridge} at the next boot; run setup.yml again after a reboot"
        )
    return result


# ---- peer links -------------------------------------------------------------
def parse_getinfo(text: str) -> dict[str, str]:
    """`networksetup -getinfo SERVICE` → fields; the mode line ("Manual Configuration",
    "DHCP Configuration", ...) has no colon and is kept under "Configuration"."""
    info = {}
    for line in text.splitlines():
        if line.strip().endswith("Configuration") and ":" not in line:
            info["Configuration"] = line.strip()
        elif ":" in line:
            key, value = line.split(":", 1)
            info[key.strip()] = value.strip()
    return info


def netmask(prefix: int) -> str:
    return str(ipaddress.IPv4Network(f"0.0.0.0/{prefix}").netmask)


def _is_ipv4(value: str | None) -> bool:
    try:
        ipaddress.IPv4Address(value or "")
    except ValueError:
        return False
    return True


PEER_LINK_PERSISTENCE = (
    "addresses: one network service per port with a manual address and no router (networksetup -setmanual), "
    "saved in the network preferences; MTU: networksetup -setMTU, saved with the port's service; "
    "host route to the peer: runtime only (route add): after a reboot the peer is reached through the port's "
    "/30, which macOS installs from the saved address"
)


def plan_peer_links(run: Run, ports: list[dict[str, Any]], mtu: int | None, mgmt: str | None) -> dict[str, Any]:
    """Each planned port gets a network service with a manual address and no router, the MTU, and a host route.

    Returns {"commands", "notes", "persistence", "refused"}. What persists: the service and its address
    (macOS installs the port's /30 from it at boot, so the peer is reachable after a reboot) and the MTU.
    The /32 host route is runtime only, and ``notes`` says so whenever one is added: the saved form would be
    the service's AdditionalRoutes, and configd installs an entry without a gateway as a route out of the
    service's port, but `networksetup -setadditionalroutes` takes "dest mask gateway" triplets and no
    documented or recorded use writes an entry without one, so meshkit does not guess. Fails closed on an
    unknown management interface and refuses a plan that puts an address on it."""
    result: dict[str, Any] = {"commands": [], "notes": [], "persistence": PEER_LINK_PERSISTENCE, "refused": None}
    if not mgmt:
        result["refused"] = _unknown_management("addressing the cable ports")
        return result
    if any(p["port"] == mgmt for p in ports):
        result["refused"] = f"the plan puts a cable address on the management interface {mgmt}; refusing"
        return result
    commands: list[list[str]] = result["commands"]
    order = parse_service_order_full(_out(run, SERVICE_ORDER))
    hardware: dict[str, str] | None = None
    for p in ports:
        dev = p["port"]
        entry = order.get(dev)
        if entry is None:
            if hardware is None:
                hardware = {d: name for name, d in parse_hardware_ports(_out(run, HARDWARE_PORTS)).items()}
            if dev not in hardware:
                raise MacError(f"{dev} is no hardware port of this Mac (networksetup -listallhardwareports)")
            service = f"{SERVICE_PREFIX} {dev}"
            commands.append(["networksetup", "-createnetworkservice", service, hardware[dev]])
            info: dict[str, str] = {}
        else:
            service = entry["service"]
            if not entry["enabled"]:
                commands.append(["networksetup", "-setnetworkserviceenabled", service, "on"])
            info = parse_getinfo(_out(run, ["networksetup", "-getinfo", service]))
        mask = netmask(p["prefix"])
        if not (
            info.get("IP address") == p["address"]
            and info.get("Subnet mask") == mask
            and info.get("Configuration") == "Manual Configuration"
            and not _is_ipv4(info.get("Router"))
        ):
            # The empty router keeps the service from ever carrying a default route.
            commands.append(["networksetup", "-setmanual", service, p["address"], mask, ""])
        if mtu:
            rc, out, _err = run(["networksetup", "-getMTU", dev])
            active, saved = parse_getmtu(out) if rc == 0 else (None, None)
            if active != mtu or saved not in (None, mtu):
                commands.append(["networksetup", "-setMTU", dev, str(mtu)])
        peer = p["peer_address"]
        rc, out, _err = run(["route", "-n", "get", peer])
        route = parse_route_get(out) if rc == 0 else {}
        if route.get("interface") != dev:
            # A stale host route to the peer (another port) is changed, not added twice: `route add`
            # over an existing entry fails with "File exists" and still exits 0.
            verb = "change" if route.get("destination") == peer else "add"
            commands.append(["route", "-n", verb, "-host", peer, "-interface", dev])
            subnet = ipaddress.IPv4Interface(f"{p['address']}/{p['prefix']}").network
            if ipaddress.IPv4Address(peer) in subnet:
                result["notes"].append(
                    f"{dev}: the host route to {peer} is runtime only; after a reboot {peer} is reached through "
                    f"{subnet} on {dev}, which macOS installs from the saved address of '{service}'"
                )
            else:
                result["notes"].append(
                    f"{dev}: the host route to {peer} is runtime only and {peer} is outside {subnet}: "
                    "after a reboot nothing routes it out of this port; run setup.yml again after a reboot"
                )
    return result


# ---- undo: what a Mac held before setup, and how to put it back ------------------------------------
# setup.yml records read_undo_record() before its first change; undo plans from that record and from what
# the Mac holds now, so a second undo finds nothing to do. The record is plain JSON (it is kept in the
# host's meshkit state directory).
UNDO_RECORD_VERSION = 1
THUNDERBOLT_PORT = re.compile(r"^Thunderbolt \d+$")
# networksetup -getinfo's mode line -> the networksetup option that sets it again.
CONFIGURATIONS = {
    "DHCP Configuration": "-setdhcp",
    "Manual Configuration": "-setmanual",
    "BOOTP Configuration": "-setbootp",
}


def _ours(service: str) -> bool:
    """A network service meshkit created (plan_peer_links names them "meshkit enX")."""
    return service.startswith(f"{SERVICE_PREFIX} ")


def _value(text: str | None) -> str | None:
    """A -getinfo value, with what networksetup prints for "nothing" ("(null)", "none", empty) as None."""
    value = (text or "").strip()
    return None if value in ("", "(null)", "none") else value


def service_config(info: dict[str, str]) -> dict[str, Any]:
    """The IPv4 part of `networksetup -getinfo SERVICE` (parse_getinfo) that undo can set back."""
    return {
        "configuration": info.get("Configuration"),
        "ip": _value(info.get("IP address")),
        "mask": _value(info.get("Subnet mask")),
        "router": _value(info.get("Router")),
        "client_id": _value(info.get("Client ID")),
    }


def _read_mtu(run: Run, device: str) -> dict[str, int | None]:
    rc, out, _err = run(["networksetup", "-getMTU", device])
    active, saved = parse_getmtu(out) if rc == 0 else (None, None)
    return {"active": active, "saved": saved}


def _pool(pool: str) -> ipaddress.IPv4Network:
    try:
        return ipaddress.IPv4Network(pool)
    except (ValueError, TypeError) as exc:
        raise MacError(f"pool: {pool!r} is no IPv4 network ({exc})") from None


def parse_netstat_host_routes(text: str) -> list[dict[str, Any]]:
    """Static IPv4 host routes in `netstat -rn -f inet`: [{"destination", "gateway", "flags", "interface"}].

    A route added with `route add -host` carries the H (host) and S (static) flags. Entries the kernel
    clones by itself (W: ARP entries, flags like UHLWIi) and the /32 entries macOS installs for a port's
    own address (UCS, no H) are not routes anyone added, so they are left out. Newer macOS prints no Refs
    and Use columns: the header says where Netif is."""
    routes: list[dict[str, Any]] = []
    section = None
    netif = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith(":") and not line.startswith(" "):
            section = line[:-1]
            continue
        cols = line.split()
        if section != "Internet" or not cols:
            continue
        if cols[0] == "Destination":
            netif = cols.index("Netif") if "Netif" in cols else None
            continue
        if netif is None or len(cols) <= netif:
            continue
        flags = cols[2]
        destination = cols[0][: -len("/32")] if cols[0].endswith("/32") else cols[0]
        if "H" not in flags or "S" not in flags or "W" in flags or not _is_ipv4(destination):
            continue
        routes.append({"destination": destination, "gateway": cols[1], "flags": flags, "interface": cols[netif]})
    return routes


def pool_host_routes(run: Run, pool: ipaddress.IPv4Network) -> list[dict[str, Any]]:
    """The static host routes to addresses inside the peer pool (meshkit's `route add -host PEER`)."""
    routes = parse_netstat_host_routes(_out(run, ["netstat", "-rn", "-f", "inet"]))
    return [r for r in routes if ipaddress.IPv4Address(r["destination"]) in pool]


def read_undo_record(run: Run, bridge: str, service: str, preferences: str | None = None) -> dict[str, Any]:
    """What this Mac holds before setup changes anything, as JSON for the host's state directory.

    ``bridge``: read_bridge_state's answer plus ``up``. ``ports``: every "Thunderbolt N" hardware port and
    every member of the bridge (setup only ever touches those), each with its hardware port name, its
    network service if it has one (name, enabled, -getinfo's configuration, ip, mask, router, client_id)
    and its MTU (-getMTU: active and saved). ``meshkit_found``: services meshkit names "meshkit ..."
    already there: a record taken after meshkit configured the host cannot say what was there before, so
    undo treats such a record as missing. Reads only."""
    bridge_state = _bridge_now(run, bridge, service, read_preferences(preferences))
    hardware = parse_hardware_ports(_out(run, HARDWARE_PORTS))
    port_names = {dev: name for name, dev in hardware.items()}
    devices = [dev for name, dev in hardware.items() if THUNDERBOLT_PORT.match(name)]
    devices += [m for m in bridge_state["members"] if m not in devices]
    order = parse_service_order_full(_out(run, SERVICE_ORDER))
    ports: dict[str, Any] = {}
    for dev in devices:
        entry = order.get(dev)
        recorded = None
        if entry:
            info = parse_getinfo(_out(run, ["networksetup", "-getinfo", entry["service"]]))
            recorded = {"name": entry["service"], "enabled": entry["enabled"], **service_config(info)}
        ports[dev] = {"hardware_port": port_names.get(dev), "service": recorded, "mtu": _read_mtu(run, dev)}
    services = parse_services(_out(run, ALL_SERVICES))
    return {
        "version": UNDO_RECORD_VERSION,
        "bridge": {"name": bridge, "service": service, **bridge_state},
        "ports": ports,
        "meshkit_found": [name for name in services if _ours(name)],
    }


def _usable_record(record: dict[str, Any] | None, notes: list[str]) -> dict[str, Any] | None:
    """The record, or None when there is none or it was taken after meshkit had already configured the host.
    A record of the wrong shape is an error naming the field."""
    if record is None:
        return None
    if not isinstance(record, dict):
        raise MacError(f"the undo record is no mapping: {type(record).__name__}")
    for key, kind in (("bridge", dict), ("ports", dict), ("meshkit_found", list)):
        if not isinstance(record.get(key), kind):
            raise MacError(f"the undo record's '{key}' is missing or no {kind.__name__}")
    if record["meshkit_found"]:
        notes.append(
            f"the undo record was taken after meshkit had configured this host (it found "
            f"{', '.join(repr(s) for s in record['meshkit_found'])}), so it cannot say what was there before: "
            "treated as missing"
        )
        return None
    return record


def _same_config(recorded: dict[str, Any], now: dict[str, Any]) -> bool:
    if recorded.get("configuration") != now.get("configuration"):
        return False
    if recorded.get("configuration") == "DHCP Configuration":
        return recorded.get("client_id") == now.get("client_id")  # the leased address is the server's
    if recorded.get("configuration") == "BOOTP Configuration":
        return True
    return all(recorded.get(k) == now.get(k) for k in ("ip", "mask", "router"))


def _config_command(name: str, recorded: dict[str, Any]) -> list[str] | None:
    """The networksetup command that gives service ``name`` its recorded IPv4 configuration, or None."""
    option = CONFIGURATIONS.get(recorded.get("configuration") or "")
    if option == "-setdhcp":
        return ["networksetup", option, name, *([recorded["client_id"]] if recorded.get("client_id") else [])]
    if option == "-setbootp":
        return ["networksetup", option, name]
    if option == "-setmanual" and recorded.get("ip") and recorded.get("mask"):
        # An empty router keeps a service that had none from ever carrying a default route (as setup does).
        return ["networksetup", option, name, recorded["ip"], recorded["mask"], recorded.get("router") or ""]
    return None


class _LinksNow:
    """What the Mac holds now, read once per plan: services (order and enabled), -getinfo and -getMTU on demand."""

    def __init__(self, run: Run):
        self.run = run
        self.order = parse_service_order_full(_out(run, SERVICE_ORDER))
        self.services = parse_services(_out(run, ALL_SERVICES))
        self.device_of = {entry["service"]: dev for dev, entry in self.order.items()}
        self._info: dict[str, dict[str, Any]] = {}
        self._mtu: dict[str, dict[str, int | None]] = {}

    def info(self, service: str) -> dict[str, Any]:
        if service not in self._info:
            self._info[service] = service_config(parse_getinfo(_out(self.run, ["networksetup", "-getinfo", service])))
        return self._info[service]

    def mtu(self, device: str) -> dict[str, int | None]:
        if device not in self._mtu:
            self._mtu[device] = _read_mtu(self.run, device)
        return self._mtu[device]

    def ours(self) -> list[str]:
        return [name for name in self.services if _ours(name)]

    def pool_addresses(self, pool: ipaddress.IPv4Network) -> list[tuple[str, str, str]]:
        """(service, device, address) for every address inside ``pool`` on a service meshkit could have set:
        its own services and those on Thunderbolt ports (the only ports setup addresses on a Mac)."""
        found = []
        for dev, entry in self.order.items():
            if not (_ours(entry["service"]) or THUNDERBOLT_PORT.match(entry["port"])):
                continue
            address = self.info(entry["service"]).get("ip")
            if _is_ipv4(address) and ipaddress.IPv4Address(address) in pool:
                found.append((entry["service"], dev, str(address)))
        return found


def meshkit_present(run: Run, pool: str) -> list[str]:
    """meshkit's configuration on this Mac now, one line each: its "meshkit enX" services, addresses inside
    the peer ``pool`` on services (its own or a Thunderbolt port's), static host routes into the pool.
    Empty when nothing of meshkit's is left. Reads only."""
    net = _pool(pool)
    now = _LinksNow(run)
    found = [f"network service '{name}' ({now.device_of.get(name) or 'no port'})" for name in now.ours()]
    found += [
        f"{address} (inside {net}) on network service '{svc}' ({dev})" for svc, dev, address in now.pool_addresses(net)
    ]
    found += [f"host route to {r['destination']} out of {r['interface']}" for r in pool_host_routes(run, net)]
    return found


def plan_links_undo(run: Run, record: dict[str, Any] | None, pool: str, mgmt: str | None) -> dict[str, Any]:
    """Commands that take back what plan_peer_links did, planned from what the Mac holds now.

    Returns {"commands", "notes", "refused"}. In order: the static host routes into ``pool`` are deleted
    (`route -n delete -host PEER`; runtime only, as setup added them); then per port, its MTU goes back to
    the recorded one (before its service goes: `networksetup -setMTU` acts through the port's service),
    the services meshkit created ("meshkit enX") are removed, and services that were there before get their
    recorded IPv4 configuration and enabled state back. With ``record`` None (or one taken after meshkit had
    configured the host) only meshkit's own services and host routes go; services that were there before
    are left as they are and ``notes`` names the ones still holding a pool address. Nothing already as
    recorded is planned, so a second undo plans nothing. Fails closed on an unknown management interface
    and refuses a plan with any command on it (its port, its service, or a route out of it)."""
    result: dict[str, Any] = {"commands": [], "notes": [], "refused": None}
    if not mgmt:
        result["refused"] = _unknown_management("undoing the cable ports' configuration")
        return result
    net = _pool(pool)
    notes: list[str] = result["notes"]
    record = _usable_record(record, notes)
    now = _LinksNow(run)
    planned: list[tuple[str | None, list[str]]] = []  # (the device a command acts on, argv)
    for route in pool_host_routes(run, net):
        planned.append((route["interface"], ["route", "-n", "delete", "-host", route["destination"]]))
    recorded_ports: dict[str, Any] = record["ports"] if record else {}
    devices = list(recorded_ports) + [
        d for d in (now.device_of.get(s) for s in now.ours()) if d and d not in recorded_ports
    ]
    for dev in devices:
        entry = now.order.get(dev)
        recorded = recorded_ports.get(dev)
        ours = entry is not None and _ours(entry["service"])
        if recorded:
            mtu = recorded.get("mtu") or {}
            target = mtu.get("saved") or mtu.get("active")
            current = now.mtu(dev) if target else {}
            if target and current["active"] is None:
                notes.append(
                    f"{dev}: its MTU could not be read (networksetup -getMTU), so it was not set back to {target}"
                )
            elif target and (current["active"] != target or current["saved"] not in (None, target)):
                planned.append((dev, ["networksetup", "-setMTU", dev, str(target)]))
        elif ours:
            notes.append(
                f"{dev}: its MTU ({now.mtu(dev)['active']} now) was not set back: no record says what it was before "
                "setup"
            )
        if ours:
            planned.append((dev, ["networksetup", "-removenetworkservice", entry["service"]]))
        recorded_service = (recorded or {}).get("service")
        if recorded_service and not _ours(recorded_service["name"]):
            name = recorded_service["name"]
            if name not in now.services:
                notes.append(f"{dev}: the network service '{name}' it had before setup is gone; not recreated")
                continue
            if now.device_of.get(name) != dev:
                notes.append(f"{dev}: the network service '{name}' is no longer on {dev}; left as it is")
                continue
            if not _same_config(recorded_service, now.info(name)):
                command = _config_command(name, recorded_service)
                if command:
                    planned.append((dev, command))
                else:
                    notes.append(
                        f"{dev}: '{name}' had '{recorded_service.get('configuration')}' before setup, which meshkit "
                        "cannot set back with networksetup; set it in System Settings > Network"
                    )
            if recorded_service.get("enabled") is not None and now.services[name] != recorded_service["enabled"]:
                state = "on" if recorded_service["enabled"] else "off"
                planned.append((dev, ["networksetup", "-setnetworkserviceenabled", name, state]))
    for name in now.ours():
        if name not in now.device_of:  # its port is gone: nothing to set back, the service still goes
            planned.append((None, ["networksetup", "-removenetworkservice", name]))
    if record is None:
        for svc, dev, address in now.pool_addresses(net):
            if not _ours(svc):
                notes.append(
                    f"{dev}: the network service '{svc}' keeps {address} (inside {net}): it was there before "
                    "setup and no record says how it was configured, so it was not restored; set it in System "
                    "Settings > Network, or undo with the record setup.yml took"
                )
    for dev, argv in planned:
        if dev == mgmt or (now.order.get(mgmt) or {}).get("service") in argv[2:3]:
            result["refused"] = (
                f"undoing the cable configuration would run `{' '.join(argv)}`, which acts on the management "
                f"interface {mgmt}; the management connection runs over it. Put {mgmt}'s configuration back by "
                "hand, or run undo over another interface. Nothing was changed"
            )
            return result
    result["commands"] = [argv for _dev, argv in planned]
    return result


def _bridge_definition(preferences: dict[str, Any] | None, bridge: str) -> dict[str, Any] | None:
    definition = ((preferences or {}).get("VirtualNetworkInterfaces") or {}).get("Bridge", {}).get(bridge)
    return definition if isinstance(definition, dict) else None


def plan_bridge_undo(
    run: Run,
    record: dict[str, Any] | None,
    bridge: str,
    service: str,
    mgmt: str | None,
    preferences: str | None = None,
) -> dict[str, Any]:
    """Commands that put ``bridge`` back as the record found it: the recorded members, up if it was, its
    saved member list and its service.

    Returns {"commands", "notes", "refused"}. In order: `ifconfig BRIDGE create` if it is gone,
    `ifconfig BRIDGE addm PORT` for each recorded member missing now (recorded order), `ifconfig BRIDGE up`
    if it was up, the saved member list in the network preferences rewritten with PlistBuddy (the list
    macOS builds the bridge from at boot; networksetup has no bridge commands), then the service enabled
    again. The ports go back and the list is written before the service is enabled, so when networksetup
    commits the preferences they already name the members the bridge holds. Run it after plan_links_undo:
    a port with its own network service is claimed by it. Members the record does not name are left in and
    named in ``notes``. Refuses without a record (it does not guess what the bridge held) and whenever the
    management interface is the bridge or one of its members, recorded or now; fails closed on an unknown
    one. Nothing already as recorded is planned, so a second undo plans nothing."""
    result: dict[str, Any] = {"commands": [], "notes": [], "refused": None}
    if not mgmt:
        result["refused"] = _unknown_management(f"putting ports back into {bridge}")
        return result
    record = _usable_record(record, result["notes"])
    if record is None:
        hardware = parse_hardware_ports(_out(run, HARDWARE_PORTS))
        ports = [dev for name, dev in hardware.items() if THUNDERBOLT_PORT.match(name) and dev != mgmt]
        result["refused"] = (
            f"no record of what {bridge} held before setup; nothing restored. With the record setup.yml takes before "
            f"its first change, undo puts the recorded members back into {bridge} (ifconfig {bridge} addm), restores "
            f"its saved member list in {preferences or PREFERENCES} and enables the '{service}' service again. As "
            f"macOS ships it, {bridge} holds every Thunderbolt port ({', '.join(ports) or 'none found'}) and the "
            f"service is enabled: System Settings > Network > {service} puts that back by hand. Nothing was changed"
        )
        return result
    recorded = record["bridge"]
    if recorded.get("name", bridge) != bridge:
        raise MacError(f"the undo record's 'bridge' is {recorded.get('name')}, not {bridge}")
    prefs = read_preferences(preferences)
    now = _bridge_now(run, bridge, service, prefs)
    members = list(recorded.get("members") or [])
    saved = recorded.get("saved_members")
    involved = {bridge, *members, *(saved or []), *now["members"], *(now["saved_members"] or [])}
    if mgmt in involved:
        result["refused"] = (
            f"the management interface {mgmt} is {bridge} or one of its members (recorded before setup, now, or in "
            f"its saved member list): putting {bridge} back would carry the management connection over the "
            f"bridge or cut it. Restore {bridge} by hand from a console. Nothing was changed"
        )
        return result
    commands: list[list[str]] = result["commands"]
    notes: list[str] = result["notes"]
    if recorded.get("exists") and not now["exists"]:
        commands.append(["ifconfig", bridge, "create"])
    commands += [["ifconfig", bridge, "addm", m] for m in members if m not in now["members"]]
    extra = [m for m in now["members"] if m not in members]
    if extra:
        notes.append(f"{bridge} also holds {', '.join(extra)}, which it did not before setup; left in")
    if recorded.get("exists") and recorded.get("up") and not (now["exists"] and now["up"]):
        commands.append(["ifconfig", bridge, "up"])
    if saved is None:
        notes.append(f"{bridge}'s saved member list could not be read when the record was taken; it was not restored")
    elif now["saved_members"] is None:
        notes.append(
            f"{preferences or PREFERENCES} cannot be read now, so {bridge}'s saved member list was not restored"
        )
    elif now["saved_members"] != saved:
        definition = _bridge_definition(prefs, bridge)
        if definition is None:
            notes.append(
                f"{bridge}'s definition is gone from {preferences or PREFERENCES} (setup only empties its member "
                f"list), so its saved members ({', '.join(saved)}) were not written back: recreate the bridge in "
                "System Settings > Network"
            )
        else:
            key = f":VirtualNetworkInterfaces:Bridge:{bridge}:Interfaces"
            argv = [PLISTBUDDY]
            if "Interfaces" in definition:
                argv += ["-c", f"Delete {key}"]
            argv += ["-c", f"Add {key} array"]
            for index, member in enumerate(saved):
                argv += ["-c", f"Add {key}:{index} string {member}"]
            commands.append([*argv, preferences or PREFERENCES])
    if recorded.get("service_enabled") and now["service_enabled"] is False:
        commands.append(["networksetup", "-setnetworkserviceenabled", service, "on"])
    elif recorded.get("service_enabled") and now["service_enabled"] is None:
        notes.append(f"the '{service}' service it had before setup is gone; not recreated")
    elif recorded.get("service_enabled") is False and now["service_enabled"]:
        notes.append(f"the '{service}' service was disabled before setup and is enabled now; left as it is")
    return result


# ---- what users trip on: read by the RDMA check (rdma_facts) and the launch preflight ----------
# Sources of every claim below: tests/fixtures/macos/SOURCES.md ("Facts users trip on").
RUNBOOK_BRIDGE = "docs/runbooks/thunderbolt-bridge.md"
RUNBOOK_LNP = "docs/runbooks/local-network-privacy.md"


def thunderbolt_links(data: dict[str, Any], hardware_ports: dict[str, str]) -> dict[str, dict[str, Any]]:
    """`system_profiler SPThunderboltDataType -json` → {netdev: link} for every port with a network device.

    A link: ``name`` ("Thunderbolt N"), ``receptacle``, ``speed`` as shown, ``linked`` (a negotiated speed:
    "80 Gb/s"; an idle port shows its capability, "Up to 120 Gb/s"), ``generation`` of the negotiated
    speed (tb5 / tb4 / tb3-or-older; None on an idle port), ``port_generation`` of an idle port's capability,
    and ``far_end``: what the port is cabled to, as system_profiler names it (a Mac with its model, a dock)."""
    links: dict[str, dict[str, Any]] = {}
    for bus in data.get("SPThunderboltDataType", []):
        tag = bus.get("receptacle_1_tag") or {}
        number = tag.get("receptacle_id_key")
        device = hardware_ports.get(f"Thunderbolt {number}") if number else None
        if not device:
            continue
        speed = tag.get("current_speed_key")
        linked = bool(speed) and not str(speed).startswith("Up to")
        items = bus.get("_items") or []
        far = items[0] if items else {}
        far_end = far.get("_name")
        vendor = far.get("vendor_name_key")
        if far_end and vendor and vendor != "Apple Inc." and not far_end.startswith(vendor):
            far_end = f"{vendor} {far_end}"
        model = far.get("device_name_key") or ""
        if far_end and "," in model:  # a Mac's model identifier ("Mac15,14")
            far_end = f"{far_end} ({model})"
        links[device] = {
            "port": device,
            "name": f"Thunderbolt {number}",
            "receptacle": number,
            "speed": speed,
            "linked": linked,
            "generation": thunderbolt_generation(speed) if linked else None,
            "port_generation": None if linked else thunderbolt_generation(speed),
            "far_end": far_end,
        }
    return links


def read_thunderbolt_links(run: Run) -> dict[str, dict[str, Any]]:
    """The links of this Mac's Thunderbolt ports now (MacError when a command fails)."""
    hardware = parse_hardware_ports(_out(run, HARDWARE_PORTS))
    return thunderbolt_links(json.loads(_out(run, SYSTEM_PROFILER)), hardware)


def parse_ifconfig_bridges(text: str) -> dict[str, dict[str, Any]]:
    """`ifconfig` / `ifconfig -a` / `ifconfig bridge0` → {bridge: {"members", "up", "active", "inet"}} for
    every interface block that is a bridge (has a "Configuration:" section or "member:" lines)."""
    bridges: dict[str, dict[str, Any]] = {}
    for name in re.findall(r"^([A-Za-z0-9]+): flags=", text, re.M):
        block = ifconfig_block(text, name)
        members = parse_bridge_members(block)
        if not members and not re.search(r"^\s+Configuration:", block, re.M):
            continue
        flags = re.search(r"flags=[0-9a-f]+<([^>]*)>", block)
        status = re.search(r"^\s*status:\s*(\S+)", block, re.M)
        bridges[name] = {
            "members": members,
            "up": "UP" in (flags.group(1).split(",") if flags else []),
            "active": status.group(1) == "active" if status else None,
            "inet": re.findall(r"^\s*inet\s+([0-9.]+)", block, re.M),
        }
    return bridges


def linux_bridges(sysfs_root: str = "/sys") -> dict[str, dict[str, Any]]:
    """Linux: {bridge: {"members", "up"}} from <sysfs_root>/class/net/<port>/master (the lab's hosts
    enslave their cable ports to a bridge0 as macOS does)."""
    base = os.path.join(sysfs_root, "class", "net")
    bridges: dict[str, dict[str, Any]] = {}
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return bridges
    for name in names:
        if os.path.isdir(os.path.join(base, name, "bridge")):
            bridges.setdefault(name, {"members": [], "up": None, "active": None, "inet": []})
        master = os.path.join(base, name, "master")
        if os.path.islink(master):
            bridge = os.path.basename(os.readlink(master))
            if os.path.isdir(os.path.join(base, bridge, "bridge")):
                bridges.setdefault(bridge, {"members": [], "up": None, "active": None, "inet": []})
                bridges[bridge]["members"].append(name)
    return bridges


def bridged_ports(bridges: dict[str, dict[str, Any]], ports: list[str]) -> dict[str, str]:
    """{port: bridge} for each of ``ports`` that is a member of a bridge."""
    return {m: b for b, info in bridges.items() for m in info["members"] if m in ports}


def bridge_problem(port: str, bridge: str, address: str | None = None, system: str = "Darwin") -> str:
    """Why a cable port inside a bridge stops a launch, naming the port and the way out."""
    where = f" its cable address {address} is not used," if address else ""
    mac = (
        "the Thunderbolt Bridge is active again: JACCL fails with "
        "'[jaccl] Changing queue pair to RTR failed with errno 22', and three or more Macs cabled in a loop "
        "make a broadcast storm"
        if system == "Darwin"
        else "traffic for the cable goes through the bridge"
    )
    return (
        f"{port} is a member of {bridge}:{where} {mac}. Run setup.yml again (its discovery step takes "
        f"the ports out of {bridge} and keeps them out); see {RUNBOOK_BRIDGE}"
    )


# -- Local Network Privacy: a probe from the ranks' own interpreter, and what its answer means --------
# The probe runs as `<interpreter> -c PROBE_SOURCE '<targets as JSON>'`, under the same process (and so
# the same "responsible" app for macOS's Local Network Privacy) the ranks will have. Python 3.6+.
PROBE_SOURCE = r"""
import errno, json, os, socket, sys, time


def probe(targets):
    results = []
    for t in targets:
        family = socket.AF_INET6 if ":" in t["address"] else socket.AF_INET
        r = {"address": t["address"], "port": t["port"]}
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(t.get("timeout", 2.0))
        start = time.time()
        try:
            s.connect((t["address"], t["port"]))
            r["result"] = "connected"
        except socket.timeout:
            r["result"] = "timeout"
        except OSError as e:
            r.update(result="error", errno=e.errno, name=errno.errorcode.get(e.errno), strerror=e.strerror)
        finally:
            r["elapsed"] = round(time.time() - start, 3)
            s.close()
        u = socket.socket(family, socket.SOCK_DGRAM)
        try:
            u.sendto(b"", (t["address"], 9))
            r["udp"] = "sent"
        except OSError as e:
            r["udp"] = errno.errorcode.get(e.errno, str(e.errno))
        finally:
            u.close()
        results.append(r)
    return {"results": results, "euid": os.geteuid(), "executable": sys.executable, "platform": sys.platform}


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
"""


def probe_peers(targets: list[dict[str, Any]], interpreter: str | None) -> dict[str, Any]:
    """Connect to every target ({"address", "port", "timeout"}) from ``interpreter`` (a Python), or from
    this Python when there is none or it cannot run the probe; {"results", "euid", "executable",
    "platform", "probed_with", "note"}."""
    note = None
    if interpreter and PYTHON_NAME.match(os.path.basename(interpreter)):
        limit = sum(2 * float(t.get("timeout", 2.0)) for t in targets) + 15
        found = None
        try:
            done = subprocess.run(
                [interpreter, "-c", PROBE_SOURCE, json.dumps(targets)],
                capture_output=True,
                text=True,
                timeout=limit,
                check=False,
            )
            if done.returncode == 0 and done.stdout.strip():
                found = json.loads(done.stdout.strip().splitlines()[-1])
        except (OSError, ValueError, subprocess.TimeoutExpired):
            found = None
        if isinstance(found, dict):
            return {**found, "probed_with": interpreter, "note": None}
        note = f"the probe could not run under {interpreter}; it ran under {sys.executable} instead"
    elif interpreter:
        note = f"the ranks' interpreter {interpreter} is no Python; the probe ran under {sys.executable}"
    space: dict[str, Any] = {"__name__": "meshkit_probe"}
    exec(compile(PROBE_SOURCE, "meshkit_probe", "exec"), space)
    return {**space["probe"](targets), "probed_with": sys.executable, "note": note}


PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
# errno names by number where the probe's own name is missing (numbers differ between the systems).
ERRNO_NAMES = {
    "Darwin": {51: "ENETUNREACH", 60: "ETIMEDOUT", 61: "ECONNREFUSED", 64: "EHOSTDOWN", 65: "EHOSTUNREACH"},
    "Linux": {101: "ENETUNREACH", 110: "ETIMEDOUT", 111: "ECONNREFUSED", 112: "EHOSTDOWN", 113: "EHOSTUNREACH"},
}
# Bundles a command-line runtime lives in (Homebrew's and python.org's Python): not the app that started it.
RUNTIME_BUNDLES = {"Python.app"}
MULTIPLEXERS = {"tmux": "tmux", "screen": "screen", "zellij": "zellij", "byobu": "byobu"}


def parse_ps(text: str) -> dict[int, tuple[int, str]]:
    """`ps -A -o pid=,ppid=,comm=` → {pid: (ppid, command)}."""
    table: dict[int, tuple[int, str]] = {}
    for line in text.splitlines():
        fields = line.split(None, 2)
        if len(fields) == 3 and fields[0].isdigit() and fields[1].isdigit():
            table[int(fields[0])] = (int(fields[1]), fields[2].strip())
    return table


def ancestry(table: dict[int, tuple[int, str]], pid: int) -> list[str]:
    """The commands from ``pid``'s parent up to (not including) PID 1."""
    out: list[str] = []
    seen = {pid}
    current = table.get(pid, (0, ""))[0]
    while current > 1 and current not in seen and current in table:
        seen.add(current)
        parent, command = table[current]
        out.append(command)
        current = parent
    return out


def launch_context(env: dict[str, str], parents: list[str]) -> dict[str, Any]:
    """Where the ranks would be started from, for Local Network Privacy: inside a terminal multiplexer, from
    an app's terminal, over SSH, or from Terminal. ``parents`` are the ancestors' commands (nearest first)."""
    names = [os.path.basename(c.split()[0]) if c else "" for c in parents]
    multiplexer = next((MULTIPLEXERS[n] for n in names if n in MULTIPLEXERS), None)
    if not multiplexer:
        multiplexer = "tmux" if env.get("TMUX") else "screen" if env.get("STY") else None
    bundles = [c.split(".app/")[0].rsplit("/", 1)[-1] + ".app" for c in parents if ".app/" in c]
    app = next((b for b in bundles if b not in RUNTIME_BUNDLES), None)
    terminal = env.get("TERM_PROGRAM")
    ssh = bool(env.get("SSH_CONNECTION")) or any(n in ("sshd", "sshd-session") for n in names)
    if multiplexer:
        via = f"inside {multiplexer}"
    elif app and app != "Terminal.app":
        via = f"from {app}"
    elif terminal and terminal != "Apple_Terminal":
        via = f"from {terminal}'s terminal"
    elif ssh:
        via = "over SSH"
    else:
        via = "from Terminal" if terminal == "Apple_Terminal" or app == "Terminal.app" else "from an unknown parent"
    return {"multiplexer": multiplexer, "app": app, "term_program": terminal, "ssh": ssh, "via": via}


def on_link(link: dict[str, Any], route: dict[str, Any] | None) -> bool:
    """Is the link's peer on a directly connected network: inside the cable's subnet, and (when a route was
    read) the route leaves through the cable's port without a gateway?"""
    try:
        net = ipaddress.ip_interface(f"{link['address']}/{link.get('prefix', 30)}").network
        inside = ipaddress.ip_address(link["peer_address"]) in net
    except (KeyError, ValueError):
        inside = False
    if not route:
        return inside
    gateway = route.get("gateway")
    direct = not gateway or gateway == link.get("peer_address") or gateway.startswith("link#")
    return inside and direct and route.get("interface") in (None, link.get("port"))


def classify_probe(
    result: dict[str, Any],
    link: dict[str, Any],
    system: str,
    route: dict[str, Any] | None = None,
    euid: int | None = None,
    interpreter: str | None = None,
    host: str | None = None,
    context: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What one probe's answer means: {"kind", "problem", "note"}.

    Kinds: ``reachable`` (connected, or refused: the peer answered), ``local_network_privacy`` (macOS, not
    root, EHOSTUNREACH to a peer on a directly connected network: the OS refused before any packet left),
    ``wrong_route`` (the route to the peer leaves through another interface), ``unreachable``
    (EHOSTUNREACH/EHOSTDOWN/ENETUNREACH otherwise), ``no_answer`` (timeout: a firewall, a dead cable, or the
    peer is down; only a note), ``error`` (anything else)."""
    peer = link.get("peer_address")
    port = link.get("port")
    peer_name = f"{link['peer_host']} at {peer}" if link.get("peer_host") else str(peer)
    here = f"{host}: " if host else ""
    what = f"{interpreter or 'this host'} could not reach {peer_name} (cable {port})"
    name = result.get("name") or ERRNO_NAMES.get(system, {}).get(result.get("errno") or -1)
    direct = on_link(link, route)
    out: dict[str, Any] = {"kind": "error", "problem": None, "note": None, "errno": name}
    if result.get("result") == "connected" or name == "ECONNREFUSED":
        out["kind"] = "reachable"
        return out
    if route and route.get("interface") and port and route["interface"] != port:
        out["kind"] = "wrong_route"
        out["problem"] = (
            f"{here}the route to {peer_name} leaves through {route['interface']}, not the cable port {port}: "
            "run setup.yml again (it puts back the cable's address and host route)"
        )
        return out
    if result.get("result") == "timeout":
        out["kind"] = "no_answer"
        hint = (
            " On macOS a process that lost its Terminal or SSH session (nohup, an orphan of launchd) can see this "
            f"from Local Network Privacy too: {RUNBOOK_LNP}"
            if system == "Darwin"
            else ""
        )
        out["note"] = (
            f"{here}{what}: no answer within {result.get('elapsed')} s (a firewall dropping port "
            f"{result.get('port')}, the peer down, or the cable).{hint}"
        )
        return out
    text = f"{name or 'error'} (errno {result.get('errno')}, '{result.get('strerror') or ''}')"
    if name == "EHOSTUNREACH" and system == "Darwin" and direct and euid != 0:
        ctx = context or {}
        app = ctx.get("app") or (ctx.get("term_program") if ctx.get("term_program") != "Apple_Terminal" else None)
        allow = f": {app}" if app and not ctx.get("multiplexer") else ""
        out["kind"] = "local_network_privacy"
        out["problem"] = (
            f"{here}{what}: connect() failed after {result.get('elapsed')} s with {text}, although {peer} is on "
            f"the cable's own network. This is macOS's Local Network Privacy refusing the program, not the "
            f"network (ping and ssh may still work); the ranks would be started {ctx.get('via') or 'as this was'}. "
            f"Fix: allow the app the launch runs from{allow} in System Settings > Privacy & Security > Local "
            f"Network and start the launch again (a tmux or screen server may not be listed there); or start it "
            f"from a plain ssh session or Apple's Terminal, not inside tmux/screen or another app's terminal; or "
            f"run it from a launchd daemon. See {RUNBOOK_LNP}"
        )
        return out
    if name in ("EHOSTUNREACH", "EHOSTDOWN", "ENETUNREACH", "EADDRNOTAVAIL"):
        out["kind"] = "unreachable"
        root = " (running as root rules out Local Network Privacy)" if system == "Darwin" and euid == 0 else ""
        out["problem"] = (
            f"{here}{what}: {text}. The peer does not answer on the cable (cable unplugged, the peer down, or its "
            f"address gone){root}: check the cable and run setup.yml again"
        )
        return out
    out["problem"] = f"{here}{what}: {text}"
    return out


def parse_ip_route_get(text: str) -> dict[str, Any]:
    """Linux `ip -j route get ADDRESS` → {"interface", "gateway"} (absent keys absent)."""
    try:
        entries = json.loads(text)
    except ValueError:
        return {}
    entry = entries[0] if isinstance(entries, list) and entries else {}
    out = {}
    if entry.get("dev"):
        out["interface"] = entry["dev"]
    if entry.get("gateway"):
        out["gateway"] = entry["gateway"]
    return out


def launch_checks(
    links: list[dict[str, Any]],
    run: Run,
    system: str,
    interpreter: str | None = None,
    probe_port: int = 22,
    probe_timeout: float = 2.0,
    sysfs_root: str = "/sys",
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The launch preflight's checks of this host's cables (``links``: the plan's per-host entries, each
    with port, address, prefix, peer_address, peer_host): no cable port inside a bridge, and every peer
    reachable from the ranks' interpreter, a refusal classified (Local Network Privacy on macOS).
    Returns {"problems", "notes", "peers", "bridged", "context", "probed_with"}; changes nothing. Messages
    do not name the host: the launch puts it in front of each."""
    problems: list[str] = []
    notes: list[str] = []
    ports = [str(link["port"]) for link in links if link.get("port")]
    if system == "Darwin":
        rc, out, err = run(["ifconfig", "-a"])
        bridges = parse_ifconfig_bridges(out) if rc == 0 else {}
        if rc != 0:
            notes.append(f"ifconfig -a failed (rc={rc}): {err.strip()}; bridge members not checked")
    else:
        bridges = linux_bridges(sysfs_root)
    bridged = bridged_ports(bridges, ports)
    for link in links:
        bridge = bridged.get(str(link.get("port")))
        if bridge:
            problems.append(bridge_problem(str(link["port"]), bridge, link.get("address"), system))
    rc, out, _err = run(["ps", "-A", "-o", "pid=,ppid=,comm="])
    parents = ancestry(parse_ps(out), os.getpid()) if rc == 0 else []
    context = launch_context(dict(os.environ if env is None else env), parents)
    targets = [
        {"address": str(link["peer_address"]), "port": int(probe_port), "timeout": float(probe_timeout)}
        for link in links
        if link.get("peer_address")
    ]
    peers: list[dict[str, Any]] = []
    probed_with = None
    if targets:
        probe = probe_peers(targets, interpreter)
        if probe.get("note"):
            notes.append(probe["note"])
        euid = probe.get("euid")
        probed_with = probe.get("probed_with")
        if system == "Darwin" and euid == 0:
            notes.append(
                f"the probe ran as root, which Local Network Privacy exempts: ranks started as another user "
                f"may still be refused ({RUNBOOK_LNP})"
            )
        answers = iter(probe.get("results") or [])
        for link in links:
            if not link.get("peer_address"):
                continue
            result = next(answers, {"result": "missing"})
            if system == "Darwin":
                rc, out, _err = run(["route", "-n", "get", str(link["peer_address"])])
                route = parse_route_get(out) if rc == 0 else None
            else:
                rc, out, _err = run(["ip", "-j", "route", "get", str(link["peer_address"])])
                route = parse_ip_route_get(out) if rc == 0 else None
            verdict = classify_probe(result, link, system, route, euid, probe.get("probed_with"), None, context)
            peers.append({**link, "probe": result, "route": route, **verdict})
            if verdict["problem"]:
                problems.append(verdict["problem"])
            if verdict["note"]:
                notes.append(verdict["note"])
    return {
        "problems": problems,
        "notes": notes,
        "peers": peers,
        "bridged": bridged,
        "context": context,
        "probed_with": probed_with,
    }
