# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""macOS side of meshkit's network modules: parse what Macs print, plan what to run.

Parsers are tested against recorded outputs of real Macs (tests/fixtures/macos/).
Command runners take ``run(argv) -> (rc, out, err)`` as in linux_net.
"""

from __future__ import annotations

import ipaddress
import json
import plistlib
import re
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
        if line[:1] not in ("", " ", "\t"):
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
    rc, out, _err = run(["ifconfig", bridge])
    members = parse_bridge_members(ifconfig_block(out, bridge)) if rc == 0 else []
    services = parse_services(_out(run, ALL_SERVICES))
    return {
        "exists": rc == 0,
        "members": members,
        "service_enabled": services.get(service),
        "saved_members": saved_bridge(read_preferences(preferences), bridge),
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
