# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which network interfaces may be cables, and which never are: the rules, defined once.

Discovery (linux_net, host_steps), the management interface's checks (management) and the reading
of a host before a launch or a check (host_facts: the launch agent, the check_facts module) all judge
links by these, so `meshkit launch` and `meshkit check` see a cable exactly where discovery would.
Standard library only: the launch agent sends it to hosts that have no copy of the collection.
"""

from __future__ import annotations

import fnmatch
from typing import Any


def matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def protected(all_links: list[dict[str, Any]], mgmt: str | None) -> set[str]:
    """The management interface and every interface it depends on: the device a VLAN or macvlan
    rests on (``link``), recursively, and the ports of a bond or bridge it is (``master``). None of
    them is ever a peer port: a change to one cuts the management connection too."""
    if not mgmt:
        return set()
    lower = {link["ifname"]: link.get("link") for link in all_links}
    members: dict[str, list[str]] = {}
    for link in all_links:
        if link.get("master"):
            members.setdefault(link["master"], []).append(link["ifname"])
    out: set[str] = set()
    todo = [mgmt]
    while todo:
        name = todo.pop()
        if not name or name in out:
            continue
        out.add(name)
        if lower.get(name) in lower:  # a lower device in this namespace (a veth's peer elsewhere is not)
            todo.append(lower[name])
        todo.extend(members.get(name, []))
    return out


def has_carrier(link: dict[str, Any]) -> bool:
    """Up, and with carrier (a cable plugged in and its far end up)."""
    flags = link.get("flags") or []
    return "UP" in flags and "LOWER_UP" in flags


def candidate_ports(all_links: list[dict[str, Any]], patterns: list[str], mgmt: str | None) -> list[dict[str, Any]]:
    """Interfaces that may be peer ports: matching ``patterns``, never a bridge, ``lo``, the
    management interface or anything it depends on (see ``protected``)."""
    keep_off = protected(all_links, mgmt) | {"lo"}
    out = []
    for link in all_links:
        name = link["ifname"]
        kind = link.get("linkinfo", {}).get("info_kind")
        if name in keep_off or kind == "bridge" or not matches(name, patterns):
            continue
        out.append(link)
    return sorted(out, key=lambda link: link["ifname"])
