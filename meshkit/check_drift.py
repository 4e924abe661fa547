# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Configuration drift for `meshkit check`: what every host reports now (the launch agent's
host_facts(), asked over the launch connection) against the plan setup.yml left.

drift(plan, facts) -> items {"flag", "where", "cable", "detail"}:

- ``mtu-mismatch``: the two ends of a cable have different MTUs (where: the cable).
- ``port-down``: a planned port is gone or has no link.
- ``address-missing``: a planned port lacks its planned address.
- ``address-unplanned``: an IPv4 address on a planned port other than its planned one.
- ``route-unplanned``: an IPv4 route leaving through a planned port other than its planned
  network and the planned host route to the peer (a stray address's own network is left to
  ``address-unplanned``).
- ``route-wrong-port``: the route to the peer's cable address leaves through another port.
- ``port-unplanned``: a candidate peer port up with carrier that the plan does not have.
- ``rdma-drift``: an RDMA port torch.env's ``NCCL_IB_HCA`` names is not ACTIVE (or gone), the RoCE v2
  IPv4-mapped GID is no longer at ``NCCL_IB_GID_INDEX``, or torch.env disables RDMA that is ACTIVE now.

Per-port items carry the cable of that port (``cable``: the plan's cable key ``"A:pa <-> B:pb"``),
so the report shows them on that cable; ``where`` is ``host:port`` for them, the display name
``"A:pa ↔ B:pb"`` for a cable's MTU, ``host`` for RDMA drift of a device on no planned port.

A host without port facts (macOS, whose host_facts() stops before the ports, or a host that did not
answer) gets no item: what is not known is not reported; the launch preflight speaks for those.
"""

from __future__ import annotations

import contextlib
import ipaddress
from typing import Any

RUNBOOK = "docs/runbooks/check.md"
FLAGS = (
    "mtu-mismatch",
    "port-down",
    "address-missing",
    "address-unplanned",
    "route-unplanned",
    "route-wrong-port",
    "port-unplanned",
    "rdma-drift",
)


def cable_key(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The plan's / meshccl hostfile's name of the cable between ends ``a`` and ``b``."""
    return f"{a['host']}:{a['port']} <-> {b['host']}:{b['port']}"


def display(key: str) -> str:
    return key.replace(" <-> ", " \u2194 ")


def _item(flag: str, where: str, cable: str | None, detail: str) -> dict[str, Any]:
    return {"flag": flag, "where": where, "cable": cable, "detail": detail}


def _facts_of(answer: Any) -> dict[str, Any]:
    """A host's facts: the facts dict itself, or an agent answer {"preflight", "facts"}."""
    if not isinstance(answer, dict):
        return {}
    if "facts" in answer and "platform" not in answer:
        return answer.get("facts") or {}
    return answer


def _ports(facts: dict[str, Any]) -> dict[str, Any] | None:
    ports = facts.get("ports")
    return ports if isinstance(ports, dict) else None


def drift(plan: dict[str, Any], facts: dict[str, Any]) -> list[dict[str, Any]]:
    """Every drift item of the cluster, cables' MTUs first, then host by host in plan order."""
    hosts = {host: _facts_of(answer) for host, answer in facts.items()}
    keys: dict[tuple[str, str], str] = {}
    items: list[dict[str, Any]] = []
    for cable in plan.get("cables") or []:
        a, b = cable["ends"]
        key = cable_key(a, b)
        keys[(a["host"], a["port"])] = keys[(b["host"], b["port"])] = key
        pa = (_ports(hosts.get(a["host"]) or {}) or {}).get(a["port"]) or {}
        pb = (_ports(hosts.get(b["host"]) or {}) or {}).get(b["port"]) or {}
        ma, mb = pa.get("mtu"), pb.get("mtu")
        if isinstance(ma, int) and isinstance(mb, int) and ma != mb:
            items.append(
                _item(
                    "mtu-mismatch",
                    display(key),
                    key,
                    f"{a['host']}:{a['port']} mtu {ma}, {b['host']}:{b['port']} mtu {mb}: frames over "
                    f"{min(ma, mb)} bytes are dropped; set one MTU at both ends (meshkit_mtu) and run setup.yml",
                )
            )
    per_host = plan.get("per_host") or {}
    order = list(plan.get("hosts") or []) + [h for h in per_host if h not in (plan.get("hosts") or [])]
    for host in order:
        host_facts = hosts.get(host) or {}
        ports = _ports(host_facts)
        if ports is None:
            continue  # no port facts (macOS, or no answer): nothing known, nothing said
        planned_ports = {}
        for link in per_host.get(host) or []:
            key = keys.get((host, link["port"]))
            planned_ports[link["port"]] = key
            info = ports.get(link["port"])
            if isinstance(info, dict):
                items += _port_items(host, link, info, key)
        for port in host_facts.get("unplanned") or []:
            items.append(
                _item(
                    "port-unplanned",
                    f"{host}:{port}",
                    None,
                    f"{host}:{port} is up with carrier but the plan has no cable on it (a new or moved cable?): "
                    f"run setup.yml to plan it, or unplug it / `ip link set {port} down`",
                )
            )
        rdma = host_facts.get("rdma")
        if isinstance(rdma, dict):
            items += _rdma_items(host, rdma, planned_ports)
    return items


def _port_items(host: str, link: dict[str, Any], info: dict[str, Any], key: str | None) -> list[dict[str, Any]]:
    port = link["port"]
    where = f"{host}:{port}"
    peer = f"{link['peer_host']}:{link['peer_port']}"
    if not info.get("exists", True):
        return [
            _item(
                "port-down",
                where,
                key,
                f"{where} does not exist on {host} (adapter removed or renamed; cable to {peer}): "
                "check `ip link`, then run setup.yml",
            )
        ]
    out = []
    up = bool(info.get("up"))
    if not up:
        out.append(
            _item(
                "port-down",
                where,
                key,
                f"{where} has no link (down, or no carrier from {peer}): reseat or replace the cable, "
                f"`ip link set {port} up` at both ends",
            )
        )
    planned = f"{link['address']}/{link['prefix']}"
    addresses = [a for a in info.get("addresses") or [] if isinstance(a, str)]
    route = info.get("route")
    has_planned = planned in addresses
    if not has_planned:
        have = ", ".join(addresses) or "no IPv4 address"
        then = ""
        if up and route != port:
            goes = f"leaves through {route}" if route else "is gone"
            then = f"; the route to {link['peer_address']} ({peer}) {goes} meanwhile"
        out.append(
            _item(
                "address-missing",
                where,
                key,
                f"{where} lacks its planned address {planned} (has {have}){then}: run setup.yml (peer_network)",
            )
        )
    stray_networks = set()
    for address in addresses:
        if address == planned:
            continue
        with contextlib.suppress(ValueError):
            stray_networks.add(str(ipaddress.ip_interface(address).network))
        out.append(
            _item(
                "address-unplanned",
                where,
                key,
                f"{where} has {address} besides its planned {planned}: remove it "
                f"(`ip addr del {address} dev {port}`) or move it to another interface",
            )
        )
    for dst in info.get("routes") or []:
        if dst in stray_networks:
            continue  # the kernel's route of a stray address: address-unplanned says it
        out.append(
            _item(
                "route-unplanned",
                where,
                key,
                f"{where} carries a route to {dst} that the plan does not have (traffic for it goes to {peer}): "
                f"remove it (`ip route del {dst} dev {port}`) and whatever re-adds it",
            )
        )
    if up and has_planned and route != port:
        via = f"leaves through {route}" if route else "does not exist"
        out.append(
            _item(
                "route-wrong-port",
                where,
                key,
                f"the route from {host} to {link['peer_address']} ({peer}) {via}, not {port}: "
                f"`ip route get {link['peer_address']}` shows the route that wins; remove it, run setup.yml",
            )
        )
    return out


def _hca(value: str) -> tuple[str, list[tuple[str, int | None]]]:
    """NCCL_IB_HCA -> (mode, [(device, port or None)]); mode "exact" (``=``), "exclude" (``^``) or
    "prefix" (a bare list: every device whose name starts with an entry)."""
    mode = "prefix"
    if value.startswith("^"):
        mode, value = "exclude", value[1:]
    if value.startswith("="):
        mode, value = ("exclude" if mode == "exclude" else "exact"), value[1:]
    entries: list[tuple[str, int | None]] = []
    for part in value.split(","):
        name, _sep, number = part.strip().partition(":")
        if name:
            entries.append((name, int(number) if number.strip().isdigit() else None))
    return mode, entries


def _rdma_items(host: str, rdma: dict[str, Any], planned_ports: dict[str, str | None]) -> list[dict[str, Any]]:
    env = rdma.get("env")
    if not isinstance(env, dict) or not env:
        return []  # no torch.env (or no NCCL_IB_* in it): nothing written to compare with
    sysfs = [p for p in rdma.get("ports") or [] if isinstance(p, dict)]
    root = rdma.get("sysfs_root") or "/sys"
    out: list[dict[str, Any]] = []

    def where_of(p: dict[str, Any]) -> tuple[str, str | None]:
        netdev = p.get("netdev")
        if netdev in planned_ports:
            return f"{host}:{netdev}", planned_ports[netdev]
        return host, None

    def name_of(p: dict[str, Any]) -> str:
        on = f" ({p['netdev']})" if p.get("netdev") else ""
        return f"{host}: {p['device']} port {p['port']}{on}"

    def known_down(p: dict[str, Any]) -> bool:
        return p.get("state") not in ("ACTIVE", "UNKNOWN", None)  # UNKNOWN: unreadable, not DOWN

    active = [p for p in sysfs if p.get("state") == "ACTIVE"]
    named = active
    hca = env.get("NCCL_IB_HCA")
    if hca:
        mode, entries = _hca(hca)
        if mode == "exclude":
            named = [p for p in active if not any(_matches(p, e, exact=True) for e in entries)]
        else:
            named = []
            for entry in entries:
                found = [p for p in sysfs if _matches(p, entry, exact=mode == "exact")]
                label = entry[0] + (f":{entry[1]}" if entry[1] is not None else "")
                if not found:
                    out.append(
                        _item(
                            "rdma-drift",
                            host,
                            None,
                            f"{host}: torch.env's NCCL_IB_HCA={hca} names {label}, which {root}/class/infiniband "
                            "does not have: the adapter is gone or renamed; run setup.yml to rewrite the hostfiles",
                        )
                    )
                    continue
                down = [p for p in found if known_down(p)]
                if mode == "prefix" and len(down) < len(found):
                    down = []  # a hand-written prefix also matches ports not meant; one ACTIVE is enough
                for p in down:
                    where, key = where_of(p)
                    out.append(
                        _item(
                            "rdma-drift",
                            where,
                            key,
                            f"{name_of(p)} is {p.get('state')}, but torch.env's NCCL_IB_HCA={hca} lists it: "
                            "check its link (`ibstat`, `rdma link`), then run setup.yml",
                        )
                    )
                named += [p for p in found if p.get("state") == "ACTIVE" and p not in named]
    index = env.get("NCCL_IB_GID_INDEX")
    if index is not None and str(index).strip().isdigit():
        want = int(str(index).strip())
        for p in named:
            if str(p.get("link_layer") or "").lower() != "ethernet":
                continue  # InfiniBand needs no IPv4 GID
            where, key = where_of(p)
            if p.get("gid_index") is None:
                out.append(
                    _item(
                        "rdma-drift",
                        where,
                        key,
                        f"{name_of(p)} has no RoCE v2 IPv4-mapped GID now, torch.env says NCCL_IB_GID_INDEX={want}: "
                        f"its interface lost its IPv4 address; run setup.yml",
                    )
                )
            elif p["gid_index"] != want:
                out.append(
                    _item(
                        "rdma-drift",
                        where,
                        key,
                        f"{name_of(p)}: its RoCE v2 IPv4-mapped GID (::ffff:{p.get('gid_ipv4')}) is at index "
                        f"{p['gid_index']}, torch.env says NCCL_IB_GID_INDEX={want}: "
                        "run setup.yml to rewrite torch.env",
                    )
                )
    if str(env.get("NCCL_IB_DISABLE", "")).strip() == "1" and active:
        names = ", ".join(f"{p['device']}:{p['port']}" for p in active)
        out.append(
            _item(
                "rdma-drift",
                host,
                None,
                f"{host}: torch.env disables RDMA (NCCL_IB_DISABLE=1) but {names} ACTIVE now: run setup.yml to use it",
            )
        )
    return out


def _matches(p: dict[str, Any], entry: tuple[str, int | None], exact: bool) -> bool:
    name, number = entry
    device = str(p.get("device") or "")
    same = device == name if exact else device.startswith(name)
    return same and (number is None or p.get("port") == number)
