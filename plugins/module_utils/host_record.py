# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a host had before meshkit's first change, kept in its state directory (``record.json``),
and what undo does with it.

setup.yml's first changing step on a host (the discovery role's bridge step, or peer_network's
when the bridge is left alone) reads the peer ports as they are and writes the record before it
changes anything; later runs keep the first record. Undo (each role's ``state: absent``) restores
exactly what the record says and removes what meshkit made, then the record itself.

A record is trusted only when it was taken before meshkit configured the host: one taken while
meshkit's own configuration was already there (a cluster set up by an older meshkit) lists it
under ``meshkit_found`` and counts as no record: undo then refuses to guess what was there
before, says what it would remove, and removes meshkit's own configuration only when told to.

Plain Python: commands go through ``run(argv) -> (rc, out, err)``, so the plans are testable
without a host (tests/unit/test_host_record.py).
"""

from __future__ import annotations

import ipaddress
import json
import os
import time
from typing import TYPE_CHECKING, Any

from ansible_collections.meshkit.cluster.plugins.module_utils import linux_persist
from ansible_collections.meshkit.cluster.plugins.module_utils.port_rules import candidate_ports, protected

if TYPE_CHECKING:  # annotations only: modules run on the hosts' Pythons (3.8 and later)
    from collections.abc import Callable

    Run = Callable[[list[str]], tuple[int, str, str]]

NAME = "record.json"
VERSION = 1
RUNBOOK = "docs/runbooks/undo.md"


class RecordError(RuntimeError):
    """The record cannot be read or trusted; the message says what to do."""


def path(state_dir: str) -> str:
    return os.path.join(state_dir, NAME)


def load(state_dir: str) -> dict[str, Any] | None:
    """The host's record, or None when it has none. RecordError when it cannot be read."""
    try:
        with open(path(state_dir)) as handle:
            record = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RecordError(
            f"{path(state_dir)} cannot be read ({exc}); it says what this host had before setup.yml. "
            f"Restore it from a backup, or undo meshkit's own configuration only (see {RUNBOOK})"
        ) from exc
    if not isinstance(record, dict) or record.get("version") != VERSION:
        raise RecordError(f"{path(state_dir)} is not a meshkit record of version {VERSION}; see {RUNBOOK}")
    return record


def trusted(record: dict[str, Any] | None) -> bool:
    """A record undo may restore from: taken before any of meshkit's configuration was on the host."""
    return bool(record) and not record.get("meshkit_found")


def ensure(module: Any, state_dir: str, take: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Keep the first record: when the host has none, take one now (before the caller changes anything)
    and write it (not in check mode). Returns {"changed", "path", "record"}."""
    where = path(state_dir)
    if os.path.exists(where):
        return {"changed": False, "path": where, "record": None}
    record = {
        "version": VERSION,
        "taken": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "state_dir_existed": os.path.isdir(state_dir),
        **take(),
    }
    if not module.check_mode:
        os.makedirs(state_dir, mode=0o755, exist_ok=True)
        tmp = where + ".tmp"
        with open(tmp, "w") as handle:
            json.dump(record, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, where)
    return {"changed": True, "path": where, "record": record}


def leftovers(state_dir: str, record: dict[str, Any] | None) -> list[str]:
    """What undo removes last: the record, and the state directory when setup.yml made it and nothing else
    is left in it (never a mount point)."""
    where = path(state_dir)
    gone = [where] if os.path.exists(where) else []
    made = record is not None and record.get("state_dir_existed") is False
    empty = made and os.path.isdir(state_dir) and not os.path.ismount(state_dir)
    if empty and not [n for n in os.listdir(state_dir) if os.path.join(state_dir, n) not in gone]:
        gone.append(state_dir)
    return gone


def remove(paths: list[str]) -> None:
    for p in paths:
        if os.path.isdir(p):
            os.rmdir(p)
        elif os.path.exists(p):
            os.remove(p)


# ---- Linux ---------------------------------------------------------------------------------------


def _link_local(addrs: list[dict[str, Any]]) -> list[str]:
    return sorted(a["local"] for a in addrs if a.get("family") == "inet6" and a.get("scope") == "link")


def linux_take(
    all_links: list[dict[str, Any]],
    addrs: list[dict[str, Any]],
    patterns: list[str],
    mgmt: str | None,
    bridge: str | None,
    manager: str | None,
    found: list[str],
    nm_autoconnect: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The Linux record: every peer port (matching ``patterns``, or a member of ``bridge``; never the
    management interface or what it rests on) with its bridge, MTU, up/down, IPv6 address generation and
    link-local addresses; every bridge one of them is in (or ``bridge``) with up/down; the network
    manager that persists the configuration; bridge-slave profiles' autoconnect (NetworkManager)."""
    by_name = {link["ifname"]: link for link in all_links}
    addr_of = {a["ifname"]: a.get("addr_info", []) for a in addrs}
    keep_off = protected(all_links, mgmt) | {"lo"}
    names = {link["ifname"] for link in candidate_ports(all_links, patterns, mgmt)}
    names |= {n for n, link in by_name.items() if bridge and link.get("master") == bridge and n not in keep_off}
    ports = {}
    for name in sorted(names):
        link = by_name[name]
        ports[name] = {
            "master": link.get("master"),
            "mtu": link.get("mtu"),
            "up": "UP" in link.get("flags", []),
            "addrgenmode": link.get("inet6_addr_gen_mode"),
            "link_local": _link_local(addr_of.get(name, [])),
        }
    bridges = {}
    for name in sorted({p["master"] for p in ports.values() if p["master"]} | ({bridge} if bridge else set())):
        link = by_name.get(name)
        bridges[name] = {"exists": link is not None, "up": bool(link) and "UP" in link.get("flags", [])}
    return {
        "platform": "Linux",
        "management_interface": mgmt,
        "meshkit_found": found,
        "ports": ports,
        "bridges": bridges,
        "persistence": manager,
        "nm_autoconnect": nm_autoconnect or {},
    }


def networkd_own_files(directory: str) -> list[str]:
    """meshkit's files in the networkd directory: 00-meshkit-*.network and the drop-ins in 00-meshkit-*.network.d/."""
    out = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not name.startswith(linux_persist.PREFIX):
            continue
        full = os.path.join(directory, name)
        if name.endswith(".network") and os.path.isfile(full):
            out.append(full)
        elif name.endswith(".network.d") and os.path.isdir(full):
            out += [os.path.join(full, n) for n in sorted(os.listdir(full))]
    return out


def pool_addresses(
    all_links: list[dict[str, Any]], addrs: list[dict[str, Any]], pool: str | None, mgmt: str | None
) -> dict[str, list[str]]:
    """Per interface (never the management interface or what it rests on), its IPv4 addresses inside the pool."""
    if not pool:
        return {}
    net = ipaddress.IPv4Network(pool)
    keep_off = protected(all_links, mgmt) | {"lo"}
    out: dict[str, list[str]] = {}
    for a in addrs:
        if a["ifname"] in keep_off:
            continue
        for i in a.get("addr_info", []):
            if i.get("family") == "inet" and ipaddress.IPv4Address(i["local"]) in net:
                out.setdefault(a["ifname"], []).append(f"{i['local']}/{i['prefixlen']}")
    return out


def plan_links_undo(
    all_links: list[dict[str, Any]],
    addrs: list[dict[str, Any]],
    routes: dict[str, list[dict[str, Any]]],
    record: dict[str, Any] | None,
    pool: str,
    mgmt: str | None,
) -> dict[str, Any]:
    """Commands that take the cables' addresses and host routes off the peer ports and give each
    port back the MTU and up/down state the record holds (the record: None or untrusted - addresses
    and routes only: they are meshkit's own, from its pool). Never the management interface or what it
    rests on. Returns {"commands", "notes", "refused"}."""
    result: dict[str, Any] = {"commands": [], "notes": [], "refused": None}
    if not mgmt:
        result["refused"] = (
            "the management interface is not known, so removing the cables' addresses could cut the "
            "connection this play runs over; set meshkit_management_interface for this host. Nothing was changed"
        )
        return result
    net = ipaddress.IPv4Network(pool)
    by_name = {link["ifname"]: link for link in all_links}
    keep_off = protected(all_links, mgmt) | {"lo"}
    commands: list[list[str]] = result["commands"]
    owned = pool_addresses(all_links, addrs, pool, mgmt)
    for name in sorted(owned):
        for r in routes.get(name, []):
            dst = r.get("dst", "")
            host = dst.split("/")[0]
            try:
                inside = ipaddress.IPv4Address(host) in net and (dst == host or dst.endswith("/32"))
            except ValueError:
                continue
            if inside and r.get("protocol") != "kernel":
                commands.append(["ip", "route", "del", f"{host}/32", "dev", name])
        commands += [["ip", "addr", "del", a, "dev", name] for a in owned[name]]
    ports = (record or {}).get("ports", {}) if trusted(record) else {}
    for name, was in sorted(ports.items()):
        link = by_name.get(name)
        if link is None or name in keep_off:
            if link is None:
                result["notes"].append(f"{name}: in the record, not on this host now; nothing to restore")
            continue
        if was.get("mtu") and link.get("mtu") != was["mtu"]:
            commands.append(["ip", "link", "set", "dev", name, "mtu", str(was["mtu"])])
        if was.get("up") is False and "UP" in link.get("flags", []):
            commands.append(["ip", "link", "set", "dev", name, "down"])
    return result


def plan_bridge_undo(
    all_links: list[dict[str, Any]],
    addrs: list[dict[str, Any]],
    record: dict[str, Any],
    mgmt: str | None,
) -> dict[str, Any]:
    """Commands that put every recorded port back into the bridge it was in, with the IPv6 address
    generation and link-local addresses it had, and bring each bridge up or down as it was.
    Returns {"commands", "notes", "refused"}."""
    result: dict[str, Any] = {"commands": [], "notes": [], "refused": None}
    by_name = {link["ifname"]: link for link in all_links}
    addr_of = {a["ifname"]: a.get("addr_info", []) for a in addrs}
    if not mgmt:
        result["refused"] = (
            "the management interface is not known, so putting ports back into a bridge could cut the "
            "connection this play runs over; set meshkit_management_interface for this host. Nothing was changed"
        )
        return result
    keep_off = protected(all_links, mgmt)
    ports = record.get("ports", {})
    bridges = record.get("bridges", {})
    for name in sorted(ports):
        if name in keep_off or ports[name].get("master") in keep_off:
            result["refused"] = (
                f"the record puts {name} into {ports[name].get('master')}, and the management interface {mgmt} "
                f"rests on it: restoring it could cut the connection this play runs over. Nothing was changed"
            )
            return result
    missing = sorted(b for b, was in bridges.items() if was.get("exists") and b not in by_name)
    if missing:
        result["refused"] = (
            f"{', '.join(missing)} existed before setup.yml and does not now (meshkit never deletes a bridge): "
            f"create it as the host's own network configuration does (a reboot may), then run undo again. "
            "Nothing was changed"
        )
        return result
    commands: list[list[str]] = result["commands"]
    later: list[list[str]] = []
    for name, was in sorted(ports.items()):
        link = by_name.get(name)
        if link is None:
            result["notes"].append(f"{name}: in the record, not on this host now; nothing to restore")
            continue
        if was.get("addrgenmode") and link.get("inet6_addr_gen_mode") not in (None, was["addrgenmode"]):
            commands.append(["ip", "link", "set", "dev", name, "addrgenmode", was["addrgenmode"]])
        extra = sorted(set(_link_local(addr_of.get(name, []))) - set(was.get("link_local", [])))
        if extra and not was.get("link_local"):
            commands.append(["ip", "-6", "addr", "flush", "dev", name, "scope", "link"])
        else:
            commands += [["ip", "-6", "addr", "del", f"{a}/64", "dev", name] for a in extra]
        if link.get("master") != was.get("master"):
            if was.get("master"):
                commands.append(["ip", "link", "set", "dev", name, "master", was["master"]])
            else:
                commands.append(["ip", "link", "set", "dev", name, "nomaster"])
        if was.get("up") and "UP" not in link.get("flags", []):
            later.append(["ip", "link", "set", "dev", name, "up"])
    for name, was in sorted(bridges.items()):
        link = by_name.get(name)
        if link is None:
            continue
        up = "UP" in link.get("flags", [])
        if was.get("up") and not up:
            later.append(["ip", "link", "set", "dev", name, "up"])
        elif was.get("up") is False and up:
            later.append(["ip", "link", "set", "dev", name, "down"])
    commands += later
    return result


def linux_own_configuration(directory: str, nm_profiles: list[str]) -> list[str]:
    """meshkit's persistent configuration on a Linux host: its networkd files, its NetworkManager profiles."""
    return networkd_own_files(directory) + [f"NetworkManager profile {n}" for n in nm_profiles]


def nm_own_profiles(run: Run) -> list[str]:
    return sorted(n for n in linux_persist.nm_profiles(run) if n.startswith("meshkit-"))


def nm_bridge_autoconnect(run: Run, bridge: str, ports: list[str]) -> dict[str, str]:
    """The autoconnect setting of every NetworkManager profile that makes one of ``ports`` a member of ``bridge``."""
    out = {}
    for name in sorted(linux_persist.nm_profiles(run)):
        s = linux_persist.nm_settings(
            run, name, ["connection.master", "connection.interface-name", "connection.autoconnect"]
        )
        if s.get("connection.master") == bridge and s.get("connection.interface-name") in ports:
            out[name] = s.get("connection.autoconnect", "")
    return out


def nm_undo_commands(run: Run, record: dict[str, Any] | None) -> list[list[str]]:
    """NetworkManager: meshkit's profiles deleted; the bridge-slave profiles get their autoconnect back, and
    those that connected on their own before are brought up again."""
    commands = [["nmcli", "connection", "delete", name] for name in nm_own_profiles(run)]
    for name, value in sorted(((record or {}).get("nm_autoconnect") or {}).items()):
        now = linux_persist.nm_settings(run, name, ["connection.autoconnect"]).get("connection.autoconnect")
        if now is not None and now != value:
            commands.append(["nmcli", "connection", "modify", name, "connection.autoconnect", value])
            if value == "yes":
                commands.append(["nmcli", "connection", "up", name])
    return commands
