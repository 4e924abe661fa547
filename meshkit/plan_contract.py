# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""plan.json, the contract between setup and launch.

setup.yml plans the cabling once (``topology.build_plan``) and writes the plan here, sealed: a
format name, a version and a fingerprint over everything a hostfile or a launch depends on (hosts,
cables with their ends' addresses, identities and RDMA devices, rings, the backend, what each
host applies). launch.yml and ``meshkit launch`` load it, validate it, check the live cabling
against it and never plan again; hostfiles carry the same fingerprint, so a hostfile made from
another plan (another backend included) is refused by name.

The controller's: run in ansible-playbook's Python (meshkit.cluster.cabling_plan and plan_verify)
and by ``meshkit launch``. The fingerprint itself is the hostfiles' (module_utils/hostfiles.py),
since hosts compute it too.
"""

from __future__ import annotations

import json
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils.hostfiles import fingerprint

from meshkit.topology import BACKENDS  # "": addresses only

FORMAT = "meshkit-plan"
VERSION = 2


class PlanError(Exception):
    """plan.json cannot be used; the message says why and what to do."""


def seal(plan: dict[str, Any], discovery: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The plan as written to plan.json: each cable end's identity (MAC, Thunderbolt UUID) as
    discovery reported it, the format, the version and the fingerprint."""
    idents = {(h, p.get("port")): p.get("ident") or None for h, ports in discovery.items() for p in ports or []}
    out = json.loads(json.dumps(plan))  # a copy
    for cable in out.get("cables", []):
        for end in cable["ends"]:
            end["ident"] = idents.get((end["host"], end["port"])) or end.get("ident")
    out["format"] = FORMAT
    out["version"] = VERSION
    out["fingerprint"] = fingerprint(out)
    return out


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise PlanError(f"{where}: {what}")


def validate(plan: Any, source: str = "plan.json") -> dict[str, Any]:
    """The plan if it is one this meshkit can launch from; PlanError naming the field otherwise."""
    rerun = "run setup.yml to plan again"
    _need(isinstance(plan, dict), source, f"not a JSON object; {rerun}")
    _need(plan.get("format") == FORMAT, source, f"format {plan.get('format')!r} is not {FORMAT!r}; {rerun}")
    version = plan.get("version")
    if version != VERSION:
        older = isinstance(version, int) and version < VERSION
        raise PlanError(
            f"{source}: version {version!r} was written by "
            f"{'an older' if older else 'another'} meshkit (this one reads version {VERSION}); "
            + (rerun if older else "use that meshkit, or run setup.yml with this one")
        )
    hosts = plan.get("hosts")
    _need(
        isinstance(hosts, list) and hosts and all(isinstance(h, str) and h for h in hosts),
        f"{source}: hosts",
        "must be a non-empty list of host names",
    )
    _need(plan.get("backend") in BACKENDS, f"{source}: backend", f"{plan.get('backend')!r} is not one of {BACKENDS}")
    cables = plan.get("cables")
    _need(isinstance(cables, list), f"{source}: cables", "must be a list")
    for i, cable in enumerate(cables):
        ends = cable.get("ends") if isinstance(cable, dict) else None
        _need(isinstance(ends, list) and len(ends) == 2, f"{source}: cables[{i}].ends", "must be two ends")
        for j, end in enumerate(ends):
            ok = isinstance(end, dict) and all(
                isinstance(end.get(k), str) and end[k] for k in ("host", "port", "address")
            )
            _need(ok, f"{source}: cables[{i}].ends[{j}]", "needs host, port and address")
            _need(end["host"] in hosts, f"{source}: cables[{i}].ends[{j}].host", f"{end['host']!r} is not in hosts")
    for key, kind in (("ring", list), ("rings", list), ("per_host", dict), ("rdma_ports", dict)):
        _need(isinstance(plan.get(key), kind), f"{source}: {key}", f"must be a {kind.__name__}")
    _need(
        set(plan["per_host"]) == set(hosts),
        f"{source}: per_host",
        "must name exactly the plan's hosts",
    )
    found = fingerprint(plan)
    _need(
        plan.get("fingerprint") == found,
        f"{source}: fingerprint",
        f"is {plan.get('fingerprint')!r} but the contents give {found}: the file was edited by hand; {rerun}",
    )
    return plan


def load(path: str) -> dict[str, Any]:
    """plan.json read and validated."""
    try:
        with open(path) as handle:
            text = handle.read()
    except FileNotFoundError:
        raise PlanError(f"{path}: no plan; run setup.yml on this inventory first") from None
    except OSError as exc:
        raise PlanError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise PlanError(f"{path}: not JSON ({exc}); run setup.yml to plan again") from None
    return validate(data, path)


def _id(ident: Any) -> str:
    return str(ident or "").lower()


def live_differences(plan: dict[str, Any], discovery: dict[str, list[dict[str, Any]]]) -> list[str]:
    """How the cabling discovered now differs from the plan, one line per cable end: a port gone,
    in a bridge, down, a peer that no longer answers, another peer than planned, another identity
    (a replaced adapter or cable). Empty when every planned cable is as planned. Ports of the
    plan's hosts that see a planned host but belong to no planned cable are named too."""
    ports = {(h, p.get("port")): p for h, entries in discovery.items() for p in entries or []}
    by_ident = {_id(p.get("ident")): (h, port) for (h, port), p in ports.items() if p.get("ident")}
    planned: set[tuple[str, str]] = set()
    lines: list[str] = []
    for cable in plan.get("cables", []):
        a, b = cable["ends"]
        name = f"{a['host']}:{a['port']} <-> {b['host']}:{b['port']}"
        for mine, theirs in ((a, b), (b, a)):
            planned.add((mine["host"], mine["port"]))
            if mine["host"] not in discovery:
                continue  # a host this play does not reach is reported by Ansible itself
            live = ports.get((mine["host"], mine["port"]))
            end = f"{mine['host']}:{mine['port']}"
            if live is None:
                lines.append(f"{name}: {end} is gone (no such port now)")
            elif live.get("in_bridge"):
                lines.append(f"{name}: {end} is in {live['in_bridge']} again")
            elif live.get("probe_error"):
                lines.append(f"{name}: {end} could not be probed ({live['probe_error']})")
            elif not live.get("up", True):
                lines.append(f"{name}: {end} is down")
            elif mine.get("ident") and live.get("ident") and _id(live["ident"]) != _id(mine["ident"]):
                lines.append(f"{name}: {end} is now {live['ident']}, the plan has {mine['ident']} (replaced?)")
            elif theirs.get("ident") and _id(theirs["ident"]) not in {_id(s) for s in live.get("seen") or []}:
                seen = ["{}:{}".format(*by_ident[_id(s)]) if _id(s) in by_ident else s for s in live.get("seen") or []]
                peer = f"{theirs['host']}:{theirs['port']}"
                if peer not in seen:  # else the planned peer port answers with a new identity: its own line says so
                    lines.append(f"{name}: {end} sees {', '.join(seen) or 'no peer'} instead of {peer}")
    hosts = set(plan.get("hosts", []))
    for (host, port), live in sorted(ports.items()):
        if (host, port) in planned or host not in hosts:
            continue
        peers = [by_ident[_id(s)] for s in live.get("seen") or [] if by_ident.get(_id(s), ("",))[0] in hosts]
        for peer_host, peer_port in peers:
            lines.append(f"{host}:{port} <-> {peer_host}:{peer_port}: a cable the plan does not have")
    return lines
