# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which interface carries the management connection, from facts that do not depend on the
login environment; and whether the cable address pool collides with anything a host has.

meshkit never reconfigures the interface the controller reaches a host through. Before the first
change on a host that interface must be known, or nothing changes (fail closed). The answer comes
from what the host itself says, each piece recorded as a ``Finding``:

- the inventory's ``meshkit_management_interface``, which wins (it must exist on the host);
- ``ansible_host`` resolved on the host itself (``getaddrinfo``), then the interface holding one of
  the addresses it resolves to; loopback answers (Debian maps a host's own name to 127.0.1.1) tell
  nothing;
- the controller's address as the host sees it (the controller's source address toward the host,
  sent by the ``meshkit.cluster.management`` action), then the interface of the host's route back
  to it: ``ip route get`` on Linux, ``route -n get`` on macOS;
- sshd's ``SSH_CONNECTION``, when the login environment still has it (it does not under ``become``:
  sudo's ``env_reset`` drops it), for both of the above.

With no override, every answer found must name the same interface; none at all, or two that
disagree, is a refusal naming the host, what was tried and the variable to set.

Plain Python: commands through ``run(argv) -> (rc, out, err)``, name resolution through
``resolve(name) -> [(address, scope interface or None)]``, so unit tests drive both.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import re
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ansible_collections.meshkit.cluster.plugins.module_utils import macos
from ansible_collections.meshkit.cluster.plugins.module_utils.defaults import DEFAULT_POOL
from ansible_collections.meshkit.cluster.plugins.module_utils.port_rules import matches, protected

if TYPE_CHECKING:  # annotations only: modules run on the hosts' Pythons (3.8 and later)
    from collections.abc import Callable, Iterable
    from typing import Optional

    Run = Callable[[list[str]], tuple[int, str, str]]
    # Optional: ansible-test's pylint (set for Python 3.8) rejects "str | None" in an alias, even here.
    Resolve = Callable[[str], list[tuple[str, Optional[str]]]]  # noqa: UP045

VARIABLE = "meshkit_management_interface"


class ManagementError(RuntimeError):
    """The management interface cannot be established, or the address pool is unsafe."""


@dataclass
class Finding:
    """One attempt at naming the management interface: what was asked and what it gave."""

    source: str  # what was tried, in words: "ansible_host 'studio1.local' resolved on the host"
    detail: str  # what came of it: "198.18.0.2 on eth0", "127.0.1.1 only (loopback): tells nothing"
    interface: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "detail": self.detail, "interface": self.interface}


@dataclass
class HostNet:
    """What one host has: interfaces with their addresses, and its IPv4 routes."""

    addresses: dict[str, list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]] = field(default_factory=dict)
    # (destination network, interface, text for messages)
    routes: list[tuple[ipaddress.IPv4Network, str, str]] = field(default_factory=list)
    bridge_members: dict[str, list[str]] = field(default_factory=dict)  # master -> its ports (bonds too)
    links: list[dict[str, Any]] = field(default_factory=list)  # Linux: ``ip -j addr show`` as it came

    def holders(self, address: str) -> list[str]:
        ip = ipaddress.ip_address(_split_scope(address)[0])
        return sorted(name for name, addrs in self.addresses.items() if any(a.ip == ip for a in addrs))

    def interface_of(self, address: str) -> str | None:
        """The interface holding ``address``, when exactly one does."""
        holders = self.holders(address)
        return holders[0] if len(holders) == 1 else None


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _split_scope(address: str) -> tuple[str, str | None]:
    base, _sep, scope = address.partition("%")
    return base, scope or None


def system_resolve(name: str) -> list[tuple[str, str | None]]:
    """Addresses ``name`` resolves to on this host, with the interface of a scoped IPv6 one."""
    out: list[tuple[str, str | None]] = []
    for family, _type, _proto, _canon, sockaddr in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP):
        address, scope = sockaddr[0], None
        if family == socket.AF_INET6 and len(sockaddr) >= 4 and sockaddr[3]:
            try:
                scope = socket.if_indextoname(sockaddr[3])
            except OSError:
                scope = None
        address = _split_scope(address)[0]
        if (address, scope) not in out:
            out.append((address, scope))
    return out


def ssh_connection(environ: dict[str, str] | None = None) -> tuple[str | None, str | None]:
    """(controller address, this host's address) of the SSH session, when the environment has it."""
    parts = (environ if environ is not None else os.environ).get("SSH_CONNECTION", "").split()
    if len(parts) != 4:
        return None, None
    return _split_scope(parts[0])[0], _split_scope(parts[2])[0]


# ---- what a Linux host has ---------------------------------------------------------------------
def _json(run: Run, argv: list[str]) -> Any:
    rc, out, err = run(argv)
    if rc != 0:
        raise ManagementError(f"{' '.join(argv)} failed (rc={rc}): {err.strip()}")
    return json.loads(out) if out.strip() else []


def linux_hostnet(run: Run) -> HostNet:
    net = HostNet()
    net.links = _json(run, ["ip", "-j", "addr", "show"])
    for link in net.links:
        addrs = net.addresses.setdefault(link["ifname"], [])
        for a in link.get("addr_info", []):
            try:
                addrs.append(ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}"))
            except (KeyError, ValueError):
                continue
        if link.get("master"):
            net.bridge_members.setdefault(link["master"], []).append(link["ifname"])
    for r in _json(run, ["ip", "-j", "-4", "route", "show", "table", "all"]):
        dst = r.get("dst", "")
        if dst in ("", "default") or r.get("type") in ("broadcast", "multicast"):
            continue
        try:
            network = ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False)
        except ValueError:
            continue
        table = f" table {r['table']}" if r.get("table") not in (None, "main") else ""
        kind = f"{r['type']} " if r.get("type") not in (None, "unicast") else ""
        net.routes.append((network, r.get("dev", ""), f"{kind}{dst} dev {r.get('dev', '?')}{table}"))
    return net


def linux_route_interface(run: Run, address: str) -> tuple[str | None, str]:
    """The interface of this host's route to ``address`` (None for one of its own addresses)."""
    rc, out, err = run(["ip", "-j", "route", "get", address])
    if rc != 0:
        return None, f"no route ({err.strip() or f'rc={rc}'})"
    routes = json.loads(out) if out.strip() else []
    if not routes:
        return None, "no route"
    route = routes[0]
    dev = route.get("dev")
    if route.get("type") == "local" or dev == "lo":
        return None, "it is this host's own address: tells nothing"
    via = f" via {route['gateway']}" if route.get("gateway") else ""
    return dev, f"leaves through {dev}{via}"


# ---- what a Mac has ----------------------------------------------------------------------------
def parse_ifconfig(text: str) -> HostNet:
    """``ifconfig`` (macOS) -> addresses per interface and bridge members."""
    net = HostNet()
    name = None
    for line in text.splitlines():
        head = re.match(r"^([A-Za-z0-9.]+): flags=", line)
        if head:
            name = head.group(1)
            net.addresses.setdefault(name, [])
            continue
        if name is None:
            continue
        inet = re.match(r"^\s+inet (\d+\.\d+\.\d+\.\d+)(?: --> \S+)? netmask (0x[0-9a-fA-F]+)", line)
        if inet:
            prefix = bin(int(inet.group(2), 16)).count("1")
            net.addresses[name].append(ipaddress.IPv4Interface(f"{inet.group(1)}/{prefix}"))
            continue
        inet6 = re.match(r"^\s+inet6 ([0-9a-fA-F:]+)(?:%\S+)? prefixlen (\d+)", line)
        if inet6:
            net.addresses[name].append(ipaddress.IPv6Interface(f"{inet6.group(1)}/{inet6.group(2)}"))
            continue
        member = re.match(r"^\s+member: (\S+)", line)
        if member:
            net.bridge_members.setdefault(name, []).append(member.group(1))
    return net


def _bsd_network(dest: str, flags: str) -> ipaddress.IPv4Network | None:
    """A destination of BSD ``netstat -rn`` as a network: ``192.168.0`` is /24, ``169.254`` /16,
    ``127`` /8 (the octets given), ``10/16`` and ``224.0.0/4`` carry their prefix, a host entry (H)
    is /32."""
    if dest == "default":
        return None
    base, _sep, prefix = dest.partition("/")
    octets = base.split(".")
    if not all(o.isdigit() for o in octets) or len(octets) > 4:
        return None  # a name (netstat without -n) or a link-layer entry
    address = ".".join(octets + ["0"] * (4 - len(octets)))
    if prefix:
        bits = int(prefix)
    elif "H" in flags or len(octets) == 4:
        bits = 32
    else:
        bits = 8 * len(octets)
    try:
        return ipaddress.IPv4Network(f"{address}/{bits}", strict=False)
    except ValueError:
        return None


def parse_netstat_routes(text: str) -> list[tuple[ipaddress.IPv4Network, str, str]]:
    """The Internet (IPv4) part of ``netstat -rn -f inet`` (macOS) -> (network, interface, line)."""
    routes = []
    section = None
    netif_col = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith(":") and not line.startswith(" "):
            section = line[:-1]
            continue
        if section != "Internet" or not line.strip():
            continue
        cols = line.split()
        if cols[0] == "Destination":
            netif_col = cols.index("Netif")
            continue
        if netif_col is None or len(cols) <= netif_col:
            continue
        # Newer macOS prints no Refs and Use columns; the header says where Netif is.
        network = _bsd_network(cols[0], cols[2])
        if network is not None:
            routes.append((network, cols[netif_col], " ".join(cols[: netif_col + 1])))
    return routes


def darwin_hostnet(run: Run) -> HostNet:
    rc, out, err = run(["ifconfig"])
    if rc != 0:
        raise ManagementError(f"ifconfig failed (rc={rc}): {err.strip()}")
    net = parse_ifconfig(out)
    rc, out, err = run(["netstat", "-rn", "-f", "inet"])
    if rc != 0:
        raise ManagementError(f"netstat -rn -f inet failed (rc={rc}): {err.strip()}")
    net.routes = parse_netstat_routes(out)
    return net


def darwin_route_interface(run: Run, address: str) -> tuple[str | None, str]:
    family = ["-inet6"] if ipaddress.ip_address(address).version == 6 else []
    rc, out, err = run(["route", "-n", "get", *family, address])
    match = re.search(r"^\s*interface:\s*(\S+)", out, re.M) if rc == 0 else None
    if not match:
        return None, f"no route ({(err or out).strip() or f'rc={rc}'})"
    dev = match.group(1)
    if dev.startswith("lo"):
        return None, "it is this host's own address: tells nothing"
    gateway = re.search(r"^\s*gateway:\s*(\S+)", out, re.M)
    return dev, f"leaves through {dev}" + (f" via {gateway.group(1)}" if gateway else "")


# ---- the decision ------------------------------------------------------------------------------
def _locate(net: HostNet, address: str, scope: str | None) -> tuple[str | None, str]:
    """The one interface of this host holding ``address`` (a resolver's scope picks among several)."""
    holders = net.holders(address)
    if scope and scope in holders:
        return scope, f"{address} on {scope}"
    if len(holders) == 1:
        return holders[0], f"{address} on {holders[0]}"
    if not holders:
        return None, f"{address}, which no interface of this host holds"
    return None, f"{address}, held by {', '.join(holders)}: tells nothing"


def _link_local(address: str) -> bool:
    return ipaddress.ip_address(address).is_link_local


def _name_findings(source: str, target: str, net: HostNet, resolve: Resolve, peer_ports: list[str]) -> list[Finding]:
    base, _zone = _split_scope(target)
    try:
        ipaddress.ip_address(base)
    except ValueError:
        try:
            resolved = resolve(target)
        except (OSError, UnicodeError) as exc:
            return [Finding(source, f"does not resolve here ({exc})")]
    else:
        # A literal address: its zone, if any, names the controller's interface, not this host's.
        resolved = [(base, None)]
    if not resolved:
        return [Finding(source, "resolves to nothing")]
    usable = [(a, s) for a, s in resolved if not _is_loopback(a)]
    if not usable:
        shown = ", ".join(a for a, _scope in resolved)
        return [Finding(source, f"{shown} only (loopback: this host maps the name to itself): tells nothing")]
    answers: list[tuple[str, str | None, str]] = []
    for address, scope in usable:
        iface, detail = _locate(net, address, scope)
        if iface and peer_ports and matches(iface, peer_ports):
            # mDNS answers a Mac's name with every address it has, the cable addresses too.
            iface, detail = None, f"{address} on the peer port {iface} (a cable address): tells nothing"
        answers.append((address, iface, detail))
    # A name that answers on several interfaces says which one only through its routable answers
    # (link-local ones, as mDNS adds, are on every interface); if those still disagree, it tells nothing.
    routable = {i for a, i, _d in answers if i and not _link_local(a)}
    chosen = routable or {i for _a, i, _d in answers if i}
    out = []
    for _address, iface, detail in answers:
        if iface and len(chosen) == 1 and iface in chosen:
            out.append(Finding(source, detail, iface))
        elif iface and len(chosen) > 1:
            out.append(
                Finding(
                    source,
                    f"{detail}, but the name also answers on {', '.join(sorted(chosen - {iface}))}: tells nothing",
                )
            )
        elif iface:
            out.append(
                Finding(
                    source, f"{detail} (link-local; the name's routable answers say {', '.join(chosen)}): tells nothing"
                )
            )
        else:
            out.append(Finding(source, detail))
    return out


def findings(
    target: str | None,
    controllers: Iterable[str],
    net: HostNet,
    route_interface: Callable[[str], tuple[str | None, str]],
    resolve: Resolve,
    environ: dict[str, str] | None = None,
    peer_ports: list[str] | None = None,
) -> list[Finding]:
    """Every answer the host gives: ``target`` (ansible_host) resolved here, the route back to each
    controller address, and SSH_CONNECTION's two addresses when present. ``peer_ports`` (patterns or
    names): an answer on a peer port is a cable address and tells nothing about management."""
    out: list[Finding] = []
    if target:
        out += _name_findings(f"ansible_host {target!r} resolved on the host", target, net, resolve, peer_ports or [])
    ssh_controller, ssh_local = ssh_connection(environ)
    seen: set[str] = set()
    for given in [*controllers, *([ssh_controller] if ssh_controller else [])]:
        address = _split_scope(given)[0]
        if address in seen:
            continue
        seen.add(address)
        label = "SSH_CONNECTION's client" if address == ssh_controller else "the controller"
        if ipaddress.ip_address(address).version == 6 and _link_local(address):
            # Without its zone a link-local route lookup answers with whichever interface comes first.
            out.append(Finding(f"route to {label} {address}", "link-local, no zone on this host: tells nothing"))
            continue
        iface, detail = route_interface(address)
        out.append(Finding(f"route to {label} {address}", detail, iface))
    if ssh_local:
        iface, detail = _locate(net, ssh_local, None)
        out.append(Finding("SSH_CONNECTION's server address", detail, iface))
    return out


def decide(host: str, override: str | None, found: list[Finding], net: HostNet) -> str:
    """The management interface, or ManagementError saying what was tried and what to set."""
    tried = "; ".join(f"{f.source}: {f.detail}" for f in found) or "nothing to go on"
    if override:
        if override not in net.addresses:
            have = ", ".join(sorted(net.addresses)) or "none"
            raise ManagementError(
                f"{host}: {VARIABLE} = {override!r}, but this host has no such interface (it has: {have}). "
                f"Fix {VARIABLE} for this host; nothing was changed on any host"
            )
        return override
    named = sorted({f.interface for f in found if f.interface})
    if not named:
        raise ManagementError(
            f"{host}: cannot tell which interface carries the management connection, so meshkit changes "
            f"nothing on any host. Tried: {tried}. Set {VARIABLE} for this host in the inventory "
            "(the interface its ansible_host address is on)"
        )
    if len(named) > 1:
        raise ManagementError(
            f"{host}: the management connection looks like it runs over more than one interface "
            f"({', '.join(named)}), so meshkit changes nothing on any host. Tried: {tried}. Set {VARIABLE} "
            "for this host in the inventory to the one SSH arrives on"
        )
    return named[0]


def pool_conflicts(
    pool: str,
    net: HostNet,
    peer_ports: list[str],
    mgmt: str | None,
    others: dict[str, Iterable[str]] | None = None,
) -> list[str]:
    """What on this host overlaps the cable address pool: addresses and routes on any interface that
    is not a peer port (peer ports carry meshkit's own pool addresses and /32 routes; the management
    interface never counts as one), default routes excepted; and any of ``others`` ({what: addresses},
    e.g. the controller's address and ansible_host) inside the pool."""
    network = ipaddress.IPv4Network(pool)
    conflicts: list[str] = []

    def ours(iface: str) -> bool:
        return iface != mgmt and bool(peer_ports) and matches(iface, peer_ports)

    for iface, addrs in sorted(net.addresses.items()):
        if ours(iface):
            continue
        for a in addrs:
            if a.version == 4 and a.network.overlaps(network):
                conflicts.append(f"address {a} on {iface}")
    for dst, iface, text in net.routes:
        if ours(iface) or dst.prefixlen <= 1:
            continue  # a default route, or one half of a VPN's split default (0/1 and 128.0/1)
        if dst.overlaps(network):
            conflicts.append(f"route {text}")
    for what, addresses in (others or {}).items():
        for address in addresses:
            try:
                ip = ipaddress.ip_address(_split_scope(address)[0])
            except ValueError:
                continue
            if ip.version == 4 and ip in network:
                conflicts.append(f"{what} {ip}")
    return sorted(set(conflicts))


def refuse_pool(host: str, pool: str, conflicts: list[str]) -> str:
    return (
        f"{host}: the cable address pool meshkit_address_pool = {pool!r} overlaps what this host already has: "
        f"{'; '.join(conflicts)}. A cable's /32 route could shadow it (and cut the management connection). "
        f"Pick a pool that overlaps no address or route on any host (the default {DEFAULT_POOL} is reserved "
        "for benchmarking networks); nothing was changed on any host"
    )


def establish(params: dict, run, system: str, resolve: Resolve, environ: dict | None = None) -> dict:
    """Module management's work, without AnsibleModule: {"interface", "findings", "failed"?, "msg"?}."""
    host = params.get("host") or params.get("address") or "this host"
    if system == "Darwin":
        net = darwin_hostnet(run)
        route = functools.partial(darwin_route_interface, run)
        rc, out, _err = run(list(macos.HARDWARE_PORTS))
        hardware = macos.parse_hardware_ports(out) if rc == 0 else {}
        peers = [dev for name, dev in hardware.items() if name.startswith("Thunderbolt ") and name[-1:].isdigit()]
    else:
        net = linux_hostnet(run)
        route = functools.partial(linux_route_interface, run)
        peers = list(params.get("peer_ports") or [])
    found = findings(
        params.get("address"), params.get("controller_addresses") or [], net, route, resolve, environ, peers
    )
    result: dict = {"findings": [f.as_dict() for f in found], "interface": None}
    try:
        mgmt = decide(host, params.get("interface"), found, net)
    except ManagementError as exc:
        return {**result, "failed": True, "msg": str(exc)}
    result["interface"] = mgmt
    bridge = params.get("bridge")
    # What the management interface rests on (a VLAN's lower device, a bond's ports) counts as it.
    rests_on = protected(net.links, mgmt) if net.links else {mgmt}
    inside = sorted(n for n in rests_on if n == bridge or n in net.bridge_members.get(bridge or "", []))
    if bridge and inside:
        what = (
            f"{bridge} itself"
            if mgmt == bridge
            else f"{mgmt}, a member of {bridge}"
            if inside == [mgmt]
            else f"{mgmt}, which rests on {', '.join(i for i in inside if i != mgmt)} ({bridge} or a member)"
        )
        return {
            **result,
            "failed": True,
            "msg": f"{host}: the management connection runs over {what}; taking {bridge} apart would cut the "
            "connection this play runs over. Move management off the bridge first (docs/runbooks/"
            "thunderbolt-bridge.md); nothing was changed on any host",
        }
    if params.get("pool"):
        ssh_client = ssh_connection(environ)[0]
        addresses = {
            "the controller's address": params.get("controller_addresses") or [],
            "SSH_CONNECTION's client": [ssh_client] if ssh_client else [],
        }
        if params.get("address"):
            with contextlib.suppress(OSError, UnicodeError):
                # Answers on peer ports are cable addresses meshkit itself gave (mDNS names them too).
                addresses["ansible_host"] = [
                    a
                    for a, _scope in resolve(params["address"])
                    if not any(matches(h, peers) for h in net.holders(a)) or not peers
                ]
        conflicts = pool_conflicts(params["pool"], net, peers, mgmt, addresses)
        if conflicts:
            return {**result, "failed": True, "msg": refuse_pool(host, params["pool"], conflicts)}
    return result
