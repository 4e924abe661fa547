# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Linux side of meshkit's network modules: read links and addresses, plan ip commands.

Plain Python. Every function that runs a command takes ``run(argv) -> (rc, out, err)``
(``AnsibleModule.run_command`` in modules, a fake in unit tests), so the command
lists are testable without a host.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from typing import TYPE_CHECKING, Any

# Which interfaces may be cables, and which never are (the management interface and what it rests
# on): port_rules, the one definition discovery, the launch agent and `meshkit check` share.
from ansible_collections.meshkit.cluster.plugins.module_utils.port_rules import matches, protected

if TYPE_CHECKING:  # annotations only: modules run on the hosts' Pythons (3.8 and later)
    from collections.abc import Callable

    Run = Callable[[list[str]], tuple[int, str, str]]


class NetError(RuntimeError):
    pass


def checked(run: Run, argv: list[str], error: type[Exception] = NetError) -> str:
    """A read-only command's output; ``error`` naming the command when it fails."""
    rc, out, err = run(argv)
    if rc != 0:
        raise error(f"{' '.join(argv)} failed (rc={rc}): {err.strip()}")
    return out


def _json(run: Run, argv: list[str]) -> Any:
    out = checked(run, argv)
    return json.loads(out) if out.strip() else []


def links(run: Run) -> list[dict[str, Any]]:
    return _json(run, ["ip", "-j", "-d", "link", "show"])


def addresses(run: Run) -> list[dict[str, Any]]:
    return _json(run, ["ip", "-j", "addr", "show"])


def routes_by_device(run: Run) -> dict[str, list[dict[str, Any]]]:
    """IPv4 routes of the main table, grouped by device."""
    routes: dict[str, list[dict[str, Any]]] = {}
    for r in _json(run, ["ip", "-j", "-4", "route", "show", "table", "main"]):
        routes.setdefault(r.get("dev", ""), []).append(r)
    return routes


def neighbours(run: Run) -> list[dict[str, Any]]:
    return _json(run, ["ip", "-j", "-6", "neigh", "show"])


def refuse_if_management(mgmt: str | None, bridge: str, by_name: dict[str, dict[str, Any]]) -> str | None:
    """Why the bridge must not be touched, or None. Fails closed: an unknown management interface
    is a refusal, never a licence."""
    if not mgmt:
        return (
            f"the management interface is not known, so taking {bridge} apart could cut the connection this "
            "play runs over; set meshkit_management_interface for this host. Nothing was changed"
        )
    if mgmt == bridge:
        return f"the management connection runs over {bridge} itself ({mgmt}); refusing to change {bridge}"
    rests_on = sorted(
        n
        for n in protected(list(by_name.values()), mgmt)
        if n != mgmt and (n == bridge or by_name[n].get("master") == bridge)
    )
    if rests_on:
        return (
            f"the management interface {mgmt} rests on {', '.join(rests_on)}, which is {bridge} or one of its "
            f"members; taking {bridge} apart would cut the connection this play runs over. Nothing was changed"
        )
    if by_name.get(mgmt, {}).get("master") == bridge:
        return (
            f"the management interface {mgmt} is a member of {bridge}; taking the bridge apart would cut "
            f"the connection this play runs over. Move management off {bridge} first (see "
            "docs/runbooks/thunderbolt-bridge.md); nothing was changed"
        )
    return None


def plan_bridge(all_links: list[dict[str, Any]], bridge: str, patterns: list[str], mgmt: str | None) -> dict[str, Any]:
    """Commands that take the peer ports out of the bridge and bring the bridge down."""
    by_name = {link["ifname"]: link for link in all_links}
    result: dict[str, Any] = {"commands": [], "members": [], "detach": [], "kept": [], "refused": None}
    if bridge not in by_name:
        return result
    members = sorted(name for name, link in by_name.items() if link.get("master") == bridge)
    result["members"] = members
    refusal = refuse_if_management(mgmt, bridge, by_name)
    if refusal:
        result["refused"] = refusal
        return result
    detach = [m for m in members if not patterns or matches(m, patterns)]
    result["detach"] = detach
    result["kept"] = [m for m in members if m not in detach]
    result["commands"] = [["ip", "link", "set", "dev", m, "nomaster"] for m in detach]
    if not result["kept"] and "UP" in by_name[bridge].get("flags", []):
        result["commands"].append(["ip", "link", "set", "dev", bridge, "down"])
    return result


def plan_peer_links(
    all_links: list[dict[str, Any]],
    addrs: list[dict[str, Any]],
    ports: list[dict[str, Any]],
    pool: str,
    patterns: list[str],
    mtu: int | None,
    mgmt: str | None,
    routes: dict[str, list[dict[str, Any]]],
) -> tuple[list[list[str]], list[str]]:
    """Commands that give every planned port its address, host route and MTU, and clear
    pool addresses from peer ports that no longer have a cable. Returns (commands, notes)."""
    pool_net = ipaddress.IPv4Network(pool)
    by_name = {link["ifname"]: link for link in all_links}
    addr_of = {a["ifname"]: a.get("addr_info", []) for a in addrs}
    commands: list[list[str]] = []
    notes: list[str] = []
    planned = {p["port"] for p in ports}
    for p in ports:
        port = p["port"]
        if port == mgmt:
            raise NetError(f"the plan puts a cable address on the management interface {port}; refusing")
        link = by_name.get(port)
        if link is None:
            raise NetError(f"port {port} of the plan does not exist on this host; run discovery again")
        if link.get("master"):
            raise NetError(f"port {port} is still enslaved to {link['master']}; run the discovery role first")
        if mtu and link.get("mtu") != mtu:
            commands.append(["ip", "link", "set", "dev", port, "mtu", str(mtu)])
        if "UP" not in link.get("flags", []):
            commands.append(["ip", "link", "set", "dev", port, "up"])
        want = f"{p['address']}/{p['prefix']}"
        have = [f"{a['local']}/{a['prefixlen']}" for a in addr_of.get(port, []) if a.get("family") == "inet"]
        for h in have:
            if h != want and ipaddress.IPv4Address(h.split("/")[0]) in pool_net:
                commands.append(["ip", "addr", "del", h, "dev", port])
        if want not in have:
            commands.append(["ip", "addr", "add", want, "dev", port])
        peer = f"{p['peer_address']}/32"
        current = routes.get(port, [])
        if not any(r.get("dst") in (p["peer_address"], peer) for r in current):
            commands.append(["ip", "route", "replace", peer, "dev", port, "src", p["address"]])
    for link in all_links:
        name = link["ifname"]
        if name in planned or name == mgmt or not matches(name, patterns):
            continue
        for a in addr_of.get(name, []):
            if a.get("family") == "inet" and ipaddress.IPv4Address(a["local"]) in pool_net:
                commands.append(["ip", "addr", "del", f"{a['local']}/{a['prefixlen']}", "dev", name])
                notes.append(f"{name}: removed {a['local']}/{a['prefixlen']} (no cable planned on this port)")
    return commands, notes


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def thunderbolt_peer(sys_root: str, port: str) -> dict[str, Any] | None:
    """What sysfs says about the Thunderbolt host at the other end of a thunderbolt-net port.

    The netdev's parent is the peer's network service device (``<domain>-<route>.<n>``),
    whose parent is the peer (XDomain) device and whose grandparent is this host's router
    (``<domain>-0``). None when the port is not thunderbolt-net (veth, Ethernet).
    """
    service = os.path.realpath(os.path.join(sys_root, "class", "net", port, "device"))
    peer = os.path.dirname(service)
    router = os.path.dirname(peer)
    if not re.fullmatch(r"[0-9]+-[0-9a-f]+\.[0-9]+", os.path.basename(service)):
        return None
    speed, lanes = _read(os.path.join(peer, "rx_speed")), _read(os.path.join(peer, "rx_lanes"))
    total = None
    match = re.match(r"([0-9.]+)\s*Gb/s", speed or "")
    if match and lanes and lanes.isdigit():
        total = f"{float(match.group(1)) * int(lanes):g} Gb/s"
    return {
        "service": os.path.basename(service),
        "peer_device": os.path.basename(peer),
        "peer_uuid": _read(os.path.join(peer, "unique_id")),
        "peer_name": _read(os.path.join(peer, "device_name")),
        "peer_vendor": _read(os.path.join(peer, "vendor_name")),
        "local_uuid": _read(os.path.join(router, "unique_id")),
        "lane_speed": speed,
        "lanes": int(lanes) if lanes and lanes.isdigit() else None,
        "speed": total,
    }
