# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the local lab is asked to be: validated input and the plan derived from it.

Plain Python (no AnsibleModule), so the unit tests import it directly. The
module ``meshkit.cluster.lab`` validates its input here before it touches
anything, then builds exactly the plan this file computes.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from cerberus import Validator

SHAPES = ("mesh", "ring", "line")
MIN_HOSTS = 2
MAX_HOSTS = 64
DEFAULT_SIZE = 4
# Linux interface names have 15 characters; the longest the lab makes in the
# machine's own namespace is "<name>-mgmt" and "<name>-m<index>".
NAME_PATTERN = r"^[a-z][a-z0-9]{0,9}$"
RATE_PATTERN = r"^[0-9]+(\.[0-9]+)?([kmgt]?bit|[kmgt]?bps)$"
HOST_PORT_PREFIX = "tb"
HOST_MGMT_PORT = "mgmt0"
HOST_BRIDGE = "bridge0"
ACCESS = ("root", "sudo")
NETWORK_DAEMONS = ("none", "networkd")
# lab_access=sudo: the hosts' login user (passwordless sudo; root cannot log in over SSH).
LAB_USER = "meshadmin"
# lab_names: host names are <host>.<lab>.meshkit.test (.test is reserved: RFC 2606, RFC 6761).
NAME_SUFFIX = "meshkit.test"
# lab_head: one more host, with no cables and outside the inventory's cluster group, standing in for
# a cluster's head (login, Slurm controller) node. Its name is also its inventory group's.
HEAD_NAME = "head"


class LabSpecError(ValueError):
    """Raised with every problem found in the lab's input, one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid lab input:\n  - " + "\n  - ".join(problems))


def _int_or_none(value: Any) -> Any:
    # Extra vars given as -e key=value arrive as strings; booleans are not sizes.
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise TypeError("not an integer")
    return int(value)


def _str_or_none(value: Any) -> Any:
    if value is None or value == "":
        return None
    return str(value)


def _bool(value: Any) -> Any:
    # -e lab_names=true arrives as a string.
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1", "false", "no", "off", "0", ""):
        return value.strip().lower() in ("true", "yes", "on", "1")
    return value


def _cable_end(value: Any) -> Any:
    if isinstance(value, bool):
        raise TypeError("not an integer")
    return int(value)


SCHEMA: dict[str, dict[str, Any]] = {
    "lab_name": {"type": "string", "required": True, "regex": NAME_PATTERN},
    "lab_state": {"type": "string", "required": True, "allowed": ["present", "absent"]},
    "lab_size": {
        "type": "integer",
        "nullable": True,
        "coerce": _int_or_none,
        "min": MIN_HOSTS,
        "max": MAX_HOSTS,
    },
    "lab_shape": {"type": "string", "required": True, "allowed": list(SHAPES)},
    "lab_cables": {
        "type": "list",
        "nullable": True,
        "schema": {
            "type": "list",
            "minlength": 2,
            "maxlength": 2,
            "schema": {"type": "integer", "coerce": _cable_end, "min": 1},
        },
    },
    "lab_link_rate": {
        "type": "string",
        "nullable": True,
        "coerce": _str_or_none,
        "regex": RATE_PATTERN,
    },
    "lab_mgmt_subnet": {"type": "string", "required": True, "check_with": "ipv4_network"},
    "lab_access": {"type": "string", "default": "root", "allowed": list(ACCESS)},
    "lab_names": {"type": "boolean", "default": False, "coerce": _bool},
    "lab_head": {"type": "boolean", "default": False, "coerce": _bool},
    "lab_network_daemon": {"type": "string", "default": "none", "allowed": list(NETWORK_DAEMONS)},
}

HINTS = {
    "lab_name": "use 1-10 characters: a lowercase letter, then lowercase letters or digits",
    "lab_state": "use present or absent",
    "lab_size": f"use a number of hosts from {MIN_HOSTS} to {MAX_HOSTS}",
    "lab_shape": "use one of " + ", ".join(SHAPES) + ", or give lab_cables",
    "lab_cables": "give a list of [host, host] pairs with host numbers from 1",
    "lab_link_rate": "use a tc rate such as 2gbit or 500mbit",
    "lab_mgmt_subnet": "use an IPv4 network such as 198.18.0.0/24",
    "lab_access": "use root (the inventory logs in as root) or sudo (as " + LAB_USER + ", with become)",
    "lab_names": "use true (hosts reached by name) or false (by address)",
    "lab_head": f"use true (one more host, {HEAD_NAME}, with no cables, outside the cluster group) or false",
    "lab_network_daemon": "use none (the lab configures the network) or networkd (each host's systemd-networkd)",
}


class _LabValidator(Validator):
    def _check_with_ipv4_network(self, field: str, value: Any) -> None:
        try:
            ipaddress.IPv4Network(value, strict=True)
        except ValueError as exc:
            self._error(field, f"not an IPv4 network ({exc})")


def _flatten(errors: Any, path: str) -> list[tuple[str, str]]:
    """Cerberus nests errors as dicts and lists; give (path, message) pairs."""
    out: list[tuple[str, str]] = []
    if isinstance(errors, dict):
        for key, sub in errors.items():
            sub_path = f"{path}[{key}]" if isinstance(key, int) else key
            out.extend(_flatten(sub, sub_path))
    elif isinstance(errors, list):
        for item in errors:
            out.extend(_flatten(item, path))
    else:
        out.append((path, str(errors)))
    return out


def _value_at(document: dict[str, Any], path: str) -> Any:
    field, _, rest = path.partition("[")
    value: Any = document.get(field)
    for part in rest.replace("]", "").split("[") if rest else []:
        try:
            value = value[int(part)]
        except (IndexError, KeyError, TypeError, ValueError):
            return None
    return value


@dataclass(frozen=True)
class CableEnd:
    host: str
    port: str


@dataclass(frozen=True)
class Cable:
    index: int
    a: CableEnd
    b: CableEnd


@dataclass(frozen=True)
class Host:
    index: int
    name: str
    netns: str
    mgmt_ip: str
    mgmt_root_port: str
    ports: tuple[str, ...]
    fqdn: str = ""
    # The head node (lab_head): no ports, no cables, not in the inventory's cluster group.
    head: bool = False


@dataclass(frozen=True)
class LabPlan:
    name: str
    size: int
    shape: str
    link_rate: str | None
    mgmt_subnet: str
    controller_ip: str
    mgmt_bridge: str
    hosts: tuple[Host, ...]
    cables: tuple[Cable, ...]
    access: str = "root"
    names: bool = False
    network_daemon: str = "none"

    @property
    def domain(self) -> str:
        return f"{self.name}.{NAME_SUFFIX}"

    @property
    def login_user(self) -> str:
        return LAB_USER if self.access == "sudo" else "root"

    @property
    def nodes(self) -> tuple[Host, ...]:
        """The cabled hosts node1..nodeN (the inventory's cluster group): every host but the head."""
        return tuple(h for h in self.hosts if not h.head)

    @property
    def head(self) -> Host | None:
        """The head node, when the lab has one (lab_head)."""
        return next((h for h in self.hosts if h.head), None)

    def ssh_name(self, host: Host) -> str:
        """What the inventory's ansible_host (and ssh_config's HostName) says for a host."""
        return host.fqdn if self.names else host.mgmt_ip

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain data: what the state file records and the module returns. A lab
        without a head gives exactly what it gave before lab_head existed (keys about the head
        appear only with one), so the record of a lab built earlier still matches its plan."""
        data: dict[str, Any] = {
            "name": self.name,
            "size": self.size,
            "shape": self.shape,
            "link_rate": self.link_rate,
            "mgmt_subnet": self.mgmt_subnet,
            "controller_ip": self.controller_ip,
            "mgmt_bridge": self.mgmt_bridge,
            "access": self.access,
            "login_user": self.login_user,
            "names": self.names,
            "domain": self.domain,
            "network_daemon": self.network_daemon,
            "hosts": [
                {
                    "index": h.index,
                    "name": h.name,
                    "netns": h.netns,
                    "mgmt_ip": h.mgmt_ip,
                    "mgmt_root_port": h.mgmt_root_port,
                    "ports": list(h.ports),
                    "fqdn": h.fqdn,
                    "ssh_name": self.ssh_name(h),
                    **({"head": True} if h.head else {}),
                }
                for h in self.hosts
            ],
            "cables": [
                {
                    "index": c.index,
                    "ends": [
                        {"host": c.a.host, "port": c.a.port},
                        {"host": c.b.host, "port": c.b.port},
                    ],
                }
                for c in self.cables
            ],
        }
        head = self.head
        if head is not None:
            data["head"] = head.name
        return data


def shape_pairs(shape: str, size: int) -> list[tuple[int, int]]:
    """Host pairs (1-based) cabled by a named shape, in a fixed order."""
    if shape == "mesh":
        return [(i, j) for i in range(1, size + 1) for j in range(i + 1, size + 1)]
    if shape == "line":
        return [(i, i + 1) for i in range(1, size)]
    if shape == "ring":
        pairs = [(i, i + 1) for i in range(1, size)]
        # Two hosts in a "ring" share one cable, not a doubled one: ask for
        # parallel cables explicitly with lab_cables.
        if size > 2:
            pairs.append((size, 1))
        return pairs
    raise ValueError(f"unknown shape {shape!r}")


def validate(params: dict[str, Any]) -> dict[str, Any]:
    """Check the lab's input; return it normalised or raise LabSpecError listing every problem."""
    validator = _LabValidator(SCHEMA, allow_unknown=False)
    if not validator.validate(params):
        problems = []
        for path, message in _flatten(validator.errors, ""):
            field = path.split("[", 1)[0]
            value = _value_at(params, path)
            problems.append(f"{path} = {value!r}: {message}; {HINTS.get(field, '')}".rstrip("; "))
        raise LabSpecError(problems)
    doc = dict(validator.document)

    problems = []
    cables = doc.get("lab_cables") or []
    size = doc.get("lab_size")
    if size is None:
        size = max((max(pair) for pair in cables), default=DEFAULT_SIZE) if cables else DEFAULT_SIZE
        size = max(size, MIN_HOSTS)
    for i, (a, b) in enumerate(cables):
        for end in (a, b):
            if end > size:
                problems.append(
                    f"lab_cables[{i}] = [{a}, {b}]: host {end} does not exist "
                    f"(the lab has hosts 1..{size}); raise lab_size or fix the cable"
                )
        if a == b:
            problems.append(
                f"lab_cables[{i}] = [{a}, {b}]: a cable from host {a} to itself; a cable joins two different hosts"
            )
    if size > MAX_HOSTS:
        problems.append(f"lab_cables names host {size}: the lab has at most {MAX_HOSTS} hosts")

    subnet = ipaddress.IPv4Network(doc["lab_mgmt_subnet"])
    usable = subnet.num_addresses - 2 if subnet.prefixlen < 31 else 0
    head = bool(doc.get("lab_head"))
    needed = size + 1 + (1 if head else 0)
    if usable < needed:
        who = f"{size} hosts, the head node and the controller" if head else f"{size} hosts and the controller"
        problems.append(
            f"lab_mgmt_subnet = {doc['lab_mgmt_subnet']!r}: holds {usable} host addresses, but "
            f"{who} need {needed}; use a larger network such as a /24"
        )
    if problems:
        raise LabSpecError(problems)
    doc["lab_size"] = size
    doc["lab_cables"] = [list(pair) for pair in cables]
    return doc


def plan(doc: dict[str, Any]) -> LabPlan:
    """The lab a validated input describes: hosts, their ports and every cable."""
    name = doc["lab_name"]
    size = doc["lab_size"]
    shape = "cables" if doc["lab_cables"] else doc["lab_shape"]
    pairs = [tuple(p) for p in doc["lab_cables"]] or shape_pairs(shape, size)
    subnet = ipaddress.IPv4Network(doc["lab_mgmt_subnet"])
    first = subnet.network_address + 1

    host_names = {i: f"node{i}" for i in range(1, size + 1)}
    next_port = dict.fromkeys(host_names, 0)
    ports: dict[int, list[str]] = {i: [] for i in host_names}
    cables = []
    for index, (a, b) in enumerate(pairs):
        ends = []
        for h in (a, b):
            port = f"{HOST_PORT_PREFIX}{next_port[h]}"
            next_port[h] += 1
            ports[h].append(port)
            ends.append(CableEnd(host_names[h], port))
        cables.append(Cable(index=index, a=ends[0], b=ends[1]))

    hosts = tuple(
        Host(
            index=i,
            name=host_names[i],
            netns=f"{name}-node{i}",
            mgmt_ip=str(first + i),
            mgmt_root_port=f"{name}-m{i}",
            ports=tuple(ports[i]),
            fqdn=f"{host_names[i]}.{name}.{NAME_SUFFIX}",
        )
        for i in sorted(host_names)
    )
    if doc.get("lab_head"):
        # One more host after nodeN: the next management address, no ports, no cables.
        i = size + 1
        hosts += (
            Host(
                index=i,
                name=HEAD_NAME,
                netns=f"{name}-{HEAD_NAME}",
                mgmt_ip=str(first + i),
                mgmt_root_port=f"{name}-m{i}",
                ports=(),
                fqdn=f"{HEAD_NAME}.{name}.{NAME_SUFFIX}",
                head=True,
            ),
        )
    return LabPlan(
        name=name,
        size=size,
        shape=shape,
        link_rate=doc.get("lab_link_rate"),
        mgmt_subnet=str(subnet),
        controller_ip=str(first),
        mgmt_bridge=f"{name}-mgmt",
        hosts=hosts,
        cables=tuple(cables),
        access=doc.get("lab_access", "root"),
        names=bool(doc.get("lab_names", False)),
        network_daemon=doc.get("lab_network_daemon", "none"),
    )


def plan_from_dict(data: dict[str, Any]) -> LabPlan:
    """The LabPlan a record holds (the inverse of LabPlan.as_dict)."""
    hosts = tuple(
        Host(
            index=h["index"],
            name=h["name"],
            netns=h["netns"],
            mgmt_ip=h["mgmt_ip"],
            mgmt_root_port=h["mgmt_root_port"],
            ports=tuple(h["ports"]),
            fqdn=h.get("fqdn", ""),
            head=bool(h.get("head", False)),
        )
        for h in data["hosts"]
    )
    cables = tuple(
        Cable(
            index=c["index"],
            a=CableEnd(c["ends"][0]["host"], c["ends"][0]["port"]),
            b=CableEnd(c["ends"][1]["host"], c["ends"][1]["port"]),
        )
        for c in data["cables"]
    )
    return LabPlan(
        name=data["name"],
        size=data["size"],
        shape=data["shape"],
        link_rate=data["link_rate"],
        mgmt_subnet=data["mgmt_subnet"],
        controller_ip=data["controller_ip"],
        mgmt_bridge=data["mgmt_bridge"],
        hosts=hosts,
        cables=cables,
        access=data.get("access", "root"),
        names=bool(data.get("names", False)),
        network_daemon=data.get("network_daemon", "none"),
    )


def cable_name(cable: Cable) -> str:
    """``node4:tb1-node5:tb0``: a cable by its two ends, in the plan's order."""
    return f"{cable.a.host}:{cable.a.port}-{cable.b.host}:{cable.b.port}"


def cable_key(cable: Cable) -> frozenset[CableEnd]:
    """What a cable is: its two ends (host and port). The same ends in either order, or under another
    index, are the same cable; one end elsewhere is another cable."""
    return frozenset((cable.a, cable.b))


# What must be equal for a running lab to be changed in place (its hosts and cables alone differ):
# anything else is in every host or in the machine's own network, and the lab is built again.
IN_PLACE_KEYS = (
    "name",
    "mgmt_subnet",
    "controller_ip",
    "mgmt_bridge",
    "link_rate",
    "access",
    "names",
    "network_daemon",
)
# What a host is, apart from its ports: a host in both plans must agree on all of it.
HOST_KEYS = ("index", "netns", "mgmt_ip", "mgmt_root_port", "fqdn", "head")


@dataclass(frozen=True)
class PlanDiff:
    """From one plan (the lab as recorded) to another (as asked): hosts and cables to add and remove.

    ``moved`` pairs a removed cable with an added one that shares one of its ends (the same port now
    cabled to another port or host). ``blockers`` says what else differs: when it is not empty the lab
    cannot be changed in place and is built again."""

    hosts_added: tuple[str, ...]
    hosts_removed: tuple[str, ...]
    cables_added: tuple[Cable, ...]
    cables_removed: tuple[Cable, ...]
    cables_kept: tuple[Cable, ...]
    moved: tuple[tuple[str, str], ...]
    blockers: tuple[str, ...]

    @property
    def in_place(self) -> bool:
        return not self.blockers

    @property
    def hosts_or_cables(self) -> bool:
        return bool(self.hosts_added or self.hosts_removed or self.cables_added or self.cables_removed)

    def summary(self) -> str:
        """One line naming every host and cable that comes and goes (``added node5; cables added
        node4:tb1-node5:tb0, node5:tb1-node1:tb1; removed node4:tb1-node1:tb1``)."""
        parts = []
        if self.hosts_added:
            parts.append("added " + ", ".join(self.hosts_added))
        if self.hosts_removed:
            parts.append("removed " + ", ".join(self.hosts_removed))
        if self.cables_added:
            parts.append("cables added " + ", ".join(cable_name(c) for c in self.cables_added))
        if self.cables_removed:
            word = "removed" if self.cables_added else "cables removed"
            parts.append(word + " " + ", ".join(cable_name(c) for c in self.cables_removed))
        if self.moved:
            parts.append("moved " + ", ".join(f"{old} -> {new}" for old, new in self.moved))
        return "; ".join(parts) or "no host or cable changes"

    def as_dict(self) -> dict[str, Any]:
        return {
            "hosts_added": list(self.hosts_added),
            "hosts_removed": list(self.hosts_removed),
            "cables_added": [cable_name(c) for c in self.cables_added],
            "cables_removed": [cable_name(c) for c in self.cables_removed],
            "cables_moved": [list(pair) for pair in self.moved],
            "cables_kept": len(self.cables_kept),
            "summary": self.summary(),
        }


def plan_diff(before: LabPlan, after: LabPlan) -> PlanDiff:
    """What changes from ``before`` to ``after``, host by host (by name) and cable by cable (by its
    two ends, see cable_key)."""
    blockers = []
    old, new = before.as_dict(), after.as_dict()
    for key in IN_PLACE_KEYS:
        if old.get(key) != new.get(key):
            blockers.append(f"{key} {old.get(key)} -> {new.get(key)}")
    if old.get("head") != new.get("head"):
        blockers.append("head node " + ("added" if new.get("head") else "removed"))
    old_hosts = {h["name"]: h for h in old["hosts"]}
    new_hosts = {h["name"]: h for h in new["hosts"]}
    for name in old_hosts.keys() & new_hosts.keys():
        for key in HOST_KEYS:
            was, now = old_hosts[name].get(key), new_hosts[name].get(key)
            if was != now:
                blockers.append(f"{name}: {key} {was} -> {now}")
    old_cables = {cable_key(c): c for c in before.cables}
    new_cables = {cable_key(c): c for c in after.cables}
    added = tuple(c for k, c in new_cables.items() if k not in old_cables)
    removed = tuple(c for k, c in old_cables.items() if k not in new_cables)
    # A move: a removed cable and an added one share an end, and neither shares one with any other
    # (a ring's closing cable replaced by two through a new host is a removal and two additions).
    touching = {(r, a) for r in removed for a in added if cable_key(r) & cable_key(a)}
    moved = tuple(
        (cable_name(r), cable_name(a))
        for r, a in sorted(touching, key=lambda pair: (pair[0].index, pair[1].index))
        if sum(1 for x, _ in touching if x == r) == 1 and sum(1 for _, y in touching if y == a) == 1
    )
    return PlanDiff(
        hosts_added=tuple(h.name for h in after.hosts if h.name not in old_hosts),
        hosts_removed=tuple(h.name for h in before.hosts if h.name not in new_hosts),
        cables_added=added,
        cables_removed=removed,
        cables_kept=tuple(c for k, c in new_cables.items() if k in old_cables),
        moved=moved,
        blockers=tuple(sorted(set(blockers), key=blockers.index)),
    )
