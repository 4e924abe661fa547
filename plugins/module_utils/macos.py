# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""macOS side of meshkit's network modules: parse what Macs print, plan what to run.

Parsers are tested against recorded outputs of real Macs (tests/fixtures/macos/).
Command runners take ``run(argv) -> (rc, out, err)`` as in linux_net.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils.linux_net import Run, checked

SYSTEM_PROFILER = ["system_profiler", "SPThunderboltDataType", "-json"]
HARDWARE_PORTS = ["networksetup", "-listallhardwareports"]
SERVICE_ORDER = ["networksetup", "-listnetworkserviceorder"]
ALL_SERVICES = ["networksetup", "-listallnetworkservices"]
SERVICE_PREFIX = "meshkit"


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


# ---- bridge -----------------------------------------------------------------
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


def parse_service_order(text: str) -> dict[str, str]:
    """`networksetup -listnetworkserviceorder` → {device: service}."""
    out = {}
    service = None
    for line in text.splitlines():
        head = re.match(r"^\((\d+|\*)\)\s+(.*)$", line.strip())
        if head:
            service = head.group(2).strip()
            continue
        dev = re.search(r"Device:\s*([^)\s]+)\)", line)
        if dev and service:
            out[dev.group(1)] = service
            service = None
    return out


def read_bridge_state(run: Run, bridge: str, service: str) -> dict[str, Any]:
    rc, out, _err = run(["ifconfig", bridge])
    members = parse_bridge_members(out) if rc == 0 else []
    services = parse_services(_out(run, ALL_SERVICES))
    return {"exists": rc == 0, "members": members, "service_enabled": services.get(service)}


def management_interface(run: Run, candidates: list[str]) -> str | None:
    for address in candidates:
        try:
            ipaddress.ip_address(address)
        except ValueError:
            continue
        rc, out, _err = run(["route", "-n", "get", address])
        match = re.search(r"interface:\s*(\S+)", out) if rc == 0 else None
        # The route to the controller leaves through the interface we are reached on; the
        # host's own address routes through lo0, which tells nothing.
        if match and match.group(1) != "lo0":
            return match.group(1)
    return None


def plan_bridge(state: dict[str, Any], bridge: str, service: str, mgmt: str | None) -> dict[str, Any]:
    """Commands that empty the bridge and disable its service. Fails closed: with no management
    interface known, nothing is planned and the result says why."""
    result: dict[str, Any] = {"commands": [], "members": state["members"], "detach": [], "kept": [], "refused": None}
    if not mgmt:
        result["refused"] = (
            f"the management interface is not known, so taking {bridge} apart could cut the connection this "
            "play runs over; set meshkit_management_interface for this host. Nothing was changed"
        )
        return result
    if mgmt == bridge or mgmt in state["members"]:
        result["refused"] = (
            f"the management connection runs over {mgmt}, which is {bridge} or one of its members; "
            f"taking {bridge} apart would cut it. Nothing was changed"
        )
        return result
    result["detach"] = list(state["members"])
    result["commands"] = [["ifconfig", bridge, "deletem", m] for m in state["members"]]
    if state.get("service_enabled"):
        result["commands"].append(["networksetup", "-setnetworkserviceenabled", service, "off"])
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


def plan_peer_links(run: Run, ports: list[dict[str, Any]], mtu: int | None) -> list[list[str]]:
    """Commands giving each planned port a network service with a manual address, MTU and host route."""
    commands: list[list[str]] = []
    by_device = parse_service_order(_out(run, SERVICE_ORDER))
    for p in ports:
        dev = p["port"]
        service = by_device.get(dev)
        if service is None:
            service = f"{SERVICE_PREFIX} {dev}"
            commands.append(["networksetup", "-createnetworkservice", service, dev])
            info: dict[str, str] = {}
        else:
            info = parse_getinfo(_out(run, ["networksetup", "-getinfo", service]))
        mask = netmask(p["prefix"])
        if not (
            info.get("IP address") == p["address"]
            and info.get("Subnet mask") == mask
            and info.get("Configuration") == "Manual Configuration"
        ):
            commands.append(["networksetup", "-setmanual", service, p["address"], mask])
        if mtu:
            rc, out, _err = run(["networksetup", "-getMTU", dev])
            current = re.search(r"Active MTU:\s*([0-9]+)", out) if rc == 0 else None
            if not current or int(current.group(1)) != mtu:
                commands.append(["networksetup", "-setMTU", dev, str(mtu)])
        rc, out, _err = run(["route", "-n", "get", p["peer_address"]])
        if rc != 0 or not re.search(rf"interface:\s*{re.escape(dev)}\b", out):
            # A stale host route to the peer (another port) is changed, not added twice.
            host_route = rc == 0 and re.search(rf"destination:\s*{re.escape(p['peer_address'])}\s*$", out, re.M)
            verb = "change" if host_route else "add"
            commands.append(["route", "-n", verb, "-host", p["peer_address"], "-interface", dev])
    return commands
