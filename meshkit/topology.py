# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one topology model: cables from discovery, rings, mesh check, backend, addresses.

The controller's (meshkit.cluster.cabling_plan runs it in ansible-playbook's Python). Discovery
on every host reports, per candidate peer port, the port's own identity (a MAC on Linux, a
Thunderbolt domain UUID on macOS) and the identities it saw at the other end. Everything later
(addresses, hostfiles, pictures, launch environment) is derived from the ``Plan`` built here,
and nothing else re-derives topology.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils.defaults import DEFAULT_POOL
from ansible_collections.meshkit.cluster.plugins.module_utils.naming import natural_key


def _networkx() -> Any:
    import networkx

    return networkx


class _Networkx:
    """networkx, imported when the planner first uses it: what imports this file only for its
    names (the inventory check's BACKENDS) never plans, and networkx costs about 0.2 s to import."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_networkx(), name)


# networkx is a requirement of the meshkit package, where the plan is made (cabling_plan fails
# with missing_required_lib() without it); importing this file must not need it.
try:
    if importlib.util.find_spec("networkx") is None:
        _networkx()  # not there: the ImportError an import gives, for the message
except (ImportError, ValueError):
    nx = None
    HAS_NETWORKX = False
    NETWORKX_IMPORT_ERROR: str | None = traceback.format_exc()
else:
    nx = _Networkx()
    HAS_NETWORKX = True
    NETWORKX_IMPORT_ERROR = None

BACKENDS = ("", "ring", "jaccl", "jaccl-ring")
RDMA_BACKENDS = ("jaccl", "jaccl-ring")
RDMA_RUNBOOKS = "docs/runbooks/rdma-macos.md (macOS) or docs/runbooks/roce-nccl.md (Linux)"
# Above this many hosts the exhaustive search for a ring through every host
# gives up (a mesh never needs it; sparse real clusters are far smaller).
RING_SEARCH_BUDGET = 200_000


class TopologyError(ValueError):
    """The cabling cannot give what was asked (e.g. a ring backend on a line)."""


def end_key(end: PortEnd) -> tuple[Any, ...]:
    return (natural_key(end.host), natural_key(end.port))


@dataclass(frozen=True)
class PortEnd:
    host: str
    port: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Cable:
    a: PortEnd
    b: PortEnd

    @classmethod
    def between(cls, x: PortEnd, y: PortEnd) -> Cable:
        a, b = sorted((x, y), key=end_key)
        return cls(a, b)

    @property
    def hosts(self) -> tuple[str, str]:
        return (self.a.host, self.b.host)

    def __str__(self) -> str:
        return f"{self.a} <-> {self.b}"


@dataclass
class Observation:
    """What one host's discovery says about one of its ports."""

    host: str
    port: str
    ident: str
    seen: list[str] = field(default_factory=list)
    speed: str | None = None
    rdma: str | None = None


def cables_from_observations(obs: list[Observation]) -> tuple[list[Cable], list[dict[str, str]], list[dict[str, Any]]]:
    """Match every port's seen identities against all ports' own identities.

    Returns the cables (each port end in at most one cable), the asymmetric links
    (one end saw its peer, the other did not see it back) and the ports whose
    peers matched no port of the inventory.
    """
    by_ident: dict[str, Observation] = {}
    for o in obs:
        if o.ident:
            by_ident[o.ident.lower()] = o
    cables: set[Cable] = set()
    asymmetric = []
    unknown = []
    for o in obs:
        peers = [by_ident[s.lower()] for s in o.seen if s.lower() in by_ident and by_ident[s.lower()].host != o.host]
        strangers = [s for s in o.seen if s.lower() not in by_ident]
        if len(peers) > 1:
            # A cable has two ends: a port answering for several ports is on a shared
            # segment (a switch, or a hub with several Macs behind it), not a cable.
            unknown.append(
                {
                    "host": o.host,
                    "port": o.port,
                    "seen": sorted(str(PortEnd(p.host, p.port)) for p in peers),
                    "reason": "sees several ports: a shared segment, not a point-to-point cable",
                }
            )
            continue
        if strangers and not peers:
            unknown.append(
                {
                    "host": o.host,
                    "port": o.port,
                    "seen": sorted(strangers),
                    "reason": "its peer is not a port of any inventory host",
                }
            )
        for p in peers:
            mine = PortEnd(o.host, o.port)
            theirs = PortEnd(p.host, p.port)
            p_peers = {s.lower() for s in p.seen if s.lower() in by_ident and by_ident[s.lower()].host != p.host}
            if o.ident.lower() in p_peers and len(p_peers) == 1:
                cables.add(Cable.between(mine, theirs))
            elif o.ident.lower() not in p_peers:
                asymmetric.append({"seen_by": str(mine), "peer": str(theirs), "reason": f"{theirs} did not see {mine}"})
    asymmetric.sort(key=lambda a: (natural_key(a["seen_by"]), natural_key(a["peer"])))
    unknown.sort(key=lambda u: (natural_key(u["host"]), natural_key(u["port"])))
    return sorted(cables, key=lambda c: (end_key(c.a), end_key(c.b))), asymmetric, unknown


def _graph(hosts: list[str], cables: list[Cable]) -> nx.MultiGraph:
    g = nx.MultiGraph()
    g.add_nodes_from(hosts)
    for c in cables:
        g.add_edge(c.a.host, c.b.host, cable=c)
    return g


def longest_ring(hosts: list[str], cables: list[Cable]) -> list[str]:
    """Host order of the longest simple cycle, starting at the first host; [] if none.

    Two hosts joined by a cable form a ring of two: each rank's right and left neighbour is
    the other, and a cable carries both directions (as MLX's ring does on two Macs).
    """
    ordered = sorted(hosts, key=natural_key)
    cables = sorted(cables, key=lambda c: (end_key(c.a), end_key(c.b)))
    g = nx.Graph(_graph(ordered, cables))
    n = len(hosts)
    pair_count = Counter(frozenset(c.hosts) for c in cables)
    if n == 2 and g.has_edge(*ordered):
        return ordered
    if n >= 3 and all(g.has_edge(a, b) for i, a in enumerate(ordered) for b in ordered[i + 1 :]):
        return ordered  # a full mesh: any order is a ring, keep the natural one
    best: list[str] = []
    for steps, cycle in enumerate(nx.simple_cycles(g)):
        if len(cycle) > len(best) or (len(cycle) == len(best) and _canon(cycle) < _canon(best)):
            best = list(cycle)
            if len(best) == n:
                break
        if steps > RING_SEARCH_BUDGET:
            break
    if not best:
        doubled = sorted(
            (sorted(p, key=natural_key) for p, k in pair_count.items() if k >= 2), key=lambda p: natural_key(p[0])
        )
        return doubled[0] if doubled else []
    return _canon(best)


def _canon(cycle: list[str]) -> list[str]:
    """A cycle written from its smallest host, in the direction of the smaller neighbour."""
    if not cycle:
        return []
    i = min(range(len(cycle)), key=lambda k: natural_key(cycle[k]))
    rotated = cycle[i:] + cycle[:i]
    reverse = [rotated[0], *reversed(rotated[1:])]
    return min(rotated, reverse, key=lambda c: [natural_key(h) for h in c])


def ring_cables(ring: list[str], cables: list[Cable]) -> list[list[Cable]]:
    """Parallel rings along a host ring: ring k uses the k-th cable of every hop."""
    if len(ring) < 2:
        return []
    hops = [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
    if len(ring) == 2:
        hops = [hops[0]]
    per_hop = []
    for a, b in hops:
        between = [c for c in cables if set(c.hosts) == {a, b}]
        per_hop.append(between)
    if len(ring) == 2:
        return [[c] for c in per_hop[0]]  # each cable between two hosts is a ring of its own
    count = min(len(h) for h in per_hop)
    return [[h[k] for h in per_hop] for k in range(count)]


def missing_for_ring(hosts: list[str], cables: list[Cable]) -> list[tuple[str, str]]:
    """Host pairs whose cable would close a ring through every host (a short, concrete list)."""
    g = nx.Graph(_graph(hosts, cables))
    ordered = sorted(hosts, key=natural_key)
    # Follow the longest simple path we can find from each end host, then close it.
    best_path: list[str] = []
    for start in ordered:
        path = _longest_path_from(g, start)
        if len(path) > len(best_path):
            best_path = path
    rest = [h for h in ordered if h not in best_path]
    order = best_path + rest
    missing = []
    for i in range(len(order)):
        a, b = order[i], order[(i + 1) % len(order)]
        if not g.has_edge(a, b):
            missing.append(tuple(sorted((a, b), key=natural_key)))
    return missing  # type: ignore[return-value]


def _longest_path_from(g: nx.Graph, start: str, budget: int = 20_000) -> list[str]:
    best = [start]
    stack = [(start, [start])]
    steps = 0
    while stack and steps < budget:
        steps += 1
        node, path = stack.pop()
        if len(path) > len(best):
            best = path
        for nxt in sorted(g.neighbors(node), key=natural_key, reverse=True):
            if nxt not in path:
                stack.append((nxt, [*path, nxt]))
    return best


@dataclass
class Plan:
    hosts: list[str]
    cables: list[Cable]
    subnets: dict[Cable, ipaddress.IPv4Network]
    ring: list[str]
    rings: list[list[Cable]]
    mesh: bool
    missing_mesh: list[tuple[str, str]]
    backend: str
    backend_reason: str
    asymmetric: list[dict[str, str]]
    unknown: list[dict[str, Any]]
    speeds: dict[PortEnd, str | None]
    rdma_devices: dict[PortEnd, str | None]

    def address(self, end: PortEnd) -> str:
        for c, net in self.subnets.items():
            if end in (c.a, c.b):
                first, second = list(net.hosts())[:2]
                return str(first if end == c.a else second)
        raise KeyError(str(end))

    def host_ports(self, host: str) -> list[dict[str, Any]]:
        """Everything one host applies: per port its address, prefix and the peer's address."""
        out = []
        for c in self.cables:
            for mine, theirs in ((c.a, c.b), (c.b, c.a)):
                if mine.host == host:
                    net = self.subnets[c]
                    out.append(
                        {
                            "port": mine.port,
                            "address": self.address(mine),
                            "prefix": net.prefixlen,
                            "network": str(net),
                            "peer_host": theirs.host,
                            "peer_port": theirs.port,
                            "peer_address": self.address(theirs),
                        }
                    )
        return sorted(out, key=lambda p: natural_key(p["port"]))

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "hosts": self.hosts,
            "cables": [
                {
                    "ends": [
                        {
                            "host": end.host,
                            "port": end.port,
                            "address": self.address(end),
                            "speed": self.speeds.get(end),
                            "rdma": self.rdma_devices.get(end),
                        }
                        for end in (c.a, c.b)
                    ],
                    "network": str(self.subnets[c]),
                }
                for c in self.cables
            ],
            "ring": self.ring,
            "rings": [[str(c) for c in ring] for ring in self.rings],
            "mesh": self.mesh,
            "missing_mesh": [list(p) for p in self.missing_mesh],
            "backend": self.backend,
            "backend_reason": self.backend_reason,
            "asymmetric": self.asymmetric,
            "unknown_peers": self.unknown,
            "per_host": {h: self.host_ports(h) for h in self.hosts},
            "rdma_ports": {h: self.rdma_ports(h) for h in self.hosts},
        }

    def rdma_ports(self, host: str) -> list[str]:
        """This host's ports the chosen backend runs RDMA over (every cable for jaccl, the first
        ring's cables for jaccl-ring, none otherwise)."""
        if self.backend == "jaccl":
            used = self.cables
        elif self.backend == "jaccl-ring":
            used = self.rings[0] if self.rings else []
        else:
            used = []
        return sorted({e.port for c in used for e in (c.a, c.b) if e.host == host}, key=natural_key)


def allocate(
    cables: list[Cable], pool: str, previous: dict[str, str] | None = None, prefix: int = 30
) -> dict[Cable, ipaddress.IPv4Network]:
    """One /30 per cable from the pool: cables of the previous plan keep theirs, new ones take
    the lowest free subnets in cable order. Same input, same answer, whatever the host order."""
    net = ipaddress.IPv4Network(pool)
    previous = previous or {}
    taken: dict[Cable, ipaddress.IPv4Network] = {}
    used: set[ipaddress.IPv4Network] = set()
    for c in cables:
        old = previous.get(cable_id(c))
        if old:
            sub = ipaddress.IPv4Network(old)
            if sub.subnet_of(net) and sub.prefixlen == prefix and sub not in used:
                taken[c] = sub
                used.add(sub)
    free = (s for s in net.subnets(new_prefix=prefix) if s not in used)
    for c in cables:
        if c not in taken:
            try:
                taken[c] = next(free)
            except StopIteration:
                raise TopologyError(
                    f"address pool {pool} has no free /{prefix} left for {c}; "
                    "give meshkit_address_pool a larger network"
                ) from None
    return taken


def cable_id(c: Cable) -> str:
    return f"{c.a}={c.b}"


def choose_backend(
    requested: str,
    hosts: list[str],
    ring: list[str],
    mesh: bool,
    missing_mesh: list[tuple[str, str]],
    cables: list[Cable],
    rdma: bool | dict[str, list[str]],
) -> tuple[str, str]:
    """The backend to use and why; TopologyError naming what is missing when the request cannot hold.

    ``rdma`` is either a bool (every cable can carry RDMA, or none) or, from the RDMA facts, the
    cable ends that cannot, for the cables of the mesh (``"mesh"``) and of the ring (``"ring"``).
    """
    full_ring = len(ring) == len(hosts) and len(hosts) >= 2
    if isinstance(rdma, bool):
        rdma = {} if rdma else {"mesh": ["no RDMA facts"], "ring": ["no RDMA facts"]}
    rdma_mesh = not rdma.get("mesh")
    rdma_ring = not rdma.get("ring")

    def need_ring() -> None:
        if not full_ring:
            missing = list(dict.fromkeys(missing_for_ring(hosts, cables)))
            names = ", ".join(f"{a} <-> {b}" for a, b in missing)
            raise TopologyError(
                f"backend {requested} needs a ring through all {len(hosts)} hosts; missing cable(s): {names}"
            )

    def need_rdma(which: str) -> None:
        lacking = rdma.get(which)
        if lacking:
            shown = "; ".join(lacking[:8]) + (f"; and {len(lacking) - 8} more" if len(lacking) > 8 else "")
            raise TopologyError(
                f"backend {requested} needs RDMA on every cable it uses; no RDMA on: {shown}. "
                f"Fix: see {RDMA_RUNBOOKS}, or ask for backend ring"
            )

    if requested == "ring":
        need_ring()
        return "ring", f"ring through {len(ring)} hosts"
    if requested == "jaccl":
        if not mesh:
            names = ", ".join(f"{a} <-> {b}" for a, b in missing_mesh)
            raise TopologyError(f"backend jaccl needs a full mesh; missing cable(s): {names}")
        need_rdma("mesh")
        return "jaccl", "RDMA full mesh"
    if requested == "jaccl-ring":
        need_ring()
        need_rdma("ring")
        return "jaccl-ring", f"RDMA ring through {len(ring)} hosts"
    # Nothing asked: the best the cabling allows, never an error.
    if rdma_mesh and mesh:
        return "jaccl", "RDMA full mesh"
    if rdma_ring and full_ring:
        return "jaccl-ring", "RDMA ring"
    if full_ring:
        return "ring", f"ring through {len(ring)} hosts" + ("" if rdma_ring else " (no RDMA)")
    return "", "no ring through every host: addresses only"


def build_plan(
    hosts: list[str],
    observations: list[Observation],
    pool: str = DEFAULT_POOL,
    backend: str = "",
    rdma: bool | dict[str, dict[str, Any]] = False,
    previous: dict[str, Any] | None = None,
) -> Plan:
    """The plan. ``rdma`` is a bool, or per host the ``ports`` of its RDMA facts (rdma.host_facts):
    a cable end can carry RDMA when its port has a device whose port is ACTIVE (the IPv4 GID comes
    once the address is set, and is checked after)."""
    hosts = sorted(hosts, key=natural_key)
    cables, asymmetric, unknown = cables_from_observations(observations)
    pairs = {frozenset(c.hosts) for c in cables}
    missing_mesh = [(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1 :] if frozenset((a, b)) not in pairs]
    mesh = len(hosts) >= 2 and not missing_mesh
    ring = longest_ring(hosts, cables)
    rings = ring_cables(ring, cables) if ring else []
    rdma_devices = {PortEnd(o.host, o.port): o.rdma for o in observations}
    if isinstance(rdma, dict):
        lacking: dict[PortEnd, str] = {}
        for o in observations:
            end = PortEnd(o.host, o.port)
            facts = (rdma.get(o.host) or {}).get(o.port) or {}
            capable = bool(facts.get("device")) and facts.get("state") == "ACTIVE"
            rdma_devices[end] = facts.get("device") if capable else None
            if not capable:
                lacking[end] = facts.get("problem") or "no RDMA facts"

        def ends_lacking(cs: list[Cable]) -> list[str]:
            ends = sorted({e for c in cs for e in (c.a, c.b) if e in lacking or e not in rdma_devices}, key=end_key)
            return [f"{e} ({lacking.get(e, 'not discovered')})" for e in ends]

        rdma_need: bool | dict[str, list[str]] = {
            "mesh": ends_lacking(cables) if cables else ["no cables"],
            "ring": ends_lacking(rings[0]) if rings else ["no ring"],
        }
    else:
        rdma_need = rdma
    chosen, reason = choose_backend(backend, hosts, ring, mesh, missing_mesh, cables, rdma_need)
    prev_subnets = {}
    if previous:
        for c in previous.get("cables", []):
            a, b = c["ends"]
            prev_subnets[cable_id(Cable.between(PortEnd(a["host"], a["port"]), PortEnd(b["host"], b["port"])))] = c[
                "network"
            ]
    subnets = allocate(cables, pool, prev_subnets)
    speeds = {PortEnd(o.host, o.port): o.speed for o in observations}
    return Plan(
        hosts,
        cables,
        subnets,
        ring,
        rings,
        mesh,
        missing_mesh,
        chosen,
        reason,
        asymmetric,
        unknown,
        speeds,
        rdma_devices,
    )


def why_removed(removed: list[str], discovery: dict[str, list[dict[str, Any]]]) -> list[str]:
    """For each removed cable (as cabling_changes names it), what its two ends report now: down,
    in a bridge, no peer answering, or a peer other than the one it had. An operator needs to know
    which end to look at (a reseated cable, a port taken down, a peer that stopped answering)."""
    ports = {(host, p.get("port")): p for host, found in discovery.items() for p in found or []}
    names = {str(p.get("ident") or "").lower(): f"{host}:{port}" for (host, port), p in ports.items() if p.get("ident")}
    lines = []
    for cable in removed:
        ends = [end.strip() for end in cable.split("<->")]
        said = []
        for i, end in enumerate(ends):
            other = ends[-1 - i]
            host, _sep, port = end.partition(":")
            found = ports.get((host, port))
            if host not in discovery:
                said.append(f"{end}: its host was not discovered")
            elif found is None:
                said.append(f"{end}: no such port now")
            elif found.get("in_bridge"):
                said.append(f"{end}: in {found['in_bridge']}, not probed")
            elif not found.get("up"):
                said.append(f"{end}: down")
            elif found.get("probe_error"):
                said.append(f"{end}: could not be probed ({found['probe_error']})")
            elif not found.get("seen"):
                said.append(f"{end}: up, no peer answered")
            else:
                peers = sorted(names.get(str(s).lower(), str(s)) for s in found["seen"])
                if peers == [other]:
                    said.append(f"{end}: sees {other}")
                else:
                    said.append(f"{end}: sees {', '.join(peers)} instead of {other}")
        lines.append(f"{cable}: {'; '.join(said)}")
    return lines


def cable_names(plan_dict: dict[str, Any]) -> set[str]:
    """Every cable of a plan.json's content, named by its two ends ("node1:tb0 <-> node2:tb0")."""
    names = set()
    for c in plan_dict.get("cables", []):
        a, b = c["ends"]
        names.add(str(Cable.between(PortEnd(a["host"], a["port"]), PortEnd(b["host"], b["port"]))))
    return names


def cabling_changes(previous: dict[str, Any] | None, plan: Plan) -> dict[str, list[str]]:
    """Cables added and removed since the last recorded plan."""
    if not previous:
        return {"added": [], "removed": []}
    before = cable_names(previous)
    now = {str(c) for c in plan.cables}
    return {"added": sorted(now - before), "removed": sorted(before - now)}


def plan_changes(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two plan.json contents, for people: hosts and cables added and removed."""
    out = []
    hosts_before, hosts_now = set(previous.get("hosts", [])), set(current.get("hosts", []))
    cables_before, cables_now = cable_names(previous), cable_names(current)
    for what, names in (
        ("hosts added", hosts_now - hosts_before),
        ("hosts removed", hosts_before - hosts_now),
        ("cables added", cables_now - cables_before),
        ("cables removed", cables_before - cables_now),
    ):
        if names:
            out.append(f"{what} {', '.join(sorted(names))}")
    return out
