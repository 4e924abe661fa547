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
