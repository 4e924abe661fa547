# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""meshkit.cluster.cabling_plan's work: the one topology model of the cluster from every host's
discovery, sealed and recorded in plan.json.

Run by the action plugin of the same name in ansible-playbook's own Python (no Python of its own
for the task); plugins/modules/cabling_plan.py documents the options and the result.

plan.json also keeps the cables the last recabling removed (``removed``: descriptive, outside the
fingerprint) until the cabling changes again, so the picture still shows them on the next run,
which then has nothing to change.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ansible.module_utils.basic import missing_required_lib
from ansible.module_utils.parsing.convert_bool import boolean

from meshkit.plan_contract import seal
from meshkit.topology import (
    HAS_NETWORKX,
    NETWORKX_IMPORT_ERROR,
    Observation,
    TopologyError,
    build_plan,
    cabling_changes,
    why_removed,
)

ARGUMENT_SPEC: dict[str, Any] = {
    "discovery": {"type": "dict", "required": True},
    "pool": {"type": "str", "required": True},
    "backend": {"type": "str", "default": "", "choices": ["", "ring", "jaccl", "jaccl-ring"]},
    "rdma": {"type": "raw", "default": False},
    "save": {"type": "bool", "default": True},
    "record": {"type": "path", "required": True},
}


def read_record(path: str) -> dict[str, Any] | None:
    """The last recorded plan, or None (none yet, or unreadable: then planned afresh)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def removed_record(previous: dict[str, Any] | None, changes: dict[str, list[str]]) -> list[str]:
    """The cables the last recabling removed: this run's when the cabling changed since the record,
    else the record's own (kept until the cabling changes again)."""
    if changes["added"] or changes["removed"] or not previous:
        return list(changes["removed"])
    kept = previous.get("removed")
    return [c for c in kept if isinstance(c, str)] if isinstance(kept, list) else []


def run_task(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    """The task's result: ``plan``, ``changes``, ``unprobed``, ``changed`` (and ``diff``); plan.json
    written when it changed, unless ``check_mode``."""
    if not HAS_NETWORKX:
        return {"failed": True, "msg": missing_required_lib("networkx"), "exception": NETWORKX_IMPORT_ERROR}
    p = params
    observations = []
    unprobed = []
    for host, ports in p["discovery"].items():
        for port in ports or []:
            if port.get("in_bridge"):
                unprobed.append(f"{host}:{port['port']} (in {port['in_bridge']})")
            observations.append(
                Observation(
                    host,
                    port["port"],
                    port.get("ident") or "",
                    list(port.get("seen") or []),
                    port.get("speed"),
                    port.get("rdma"),
                )
            )
    previous = read_record(p["record"])
    try:  # as AnsibleModule.boolean: None stays None, a word that is no boolean fails saying so
        rdma = p["rdma"] if isinstance(p["rdma"], dict) or p["rdma"] is None else boolean(p["rdma"])
    except TypeError as exc:
        return {"failed": True, "msg": str(exc)}
    try:
        # With ports still in a bridge (check mode on a fresh cluster) the cabling is not
        # known yet: plan what can be seen and do not judge the backend on it.
        backend = "" if unprobed else p["backend"]
        plan = build_plan(list(p["discovery"]), observations, p["pool"], backend, rdma, previous)
    except TopologyError as exc:
        return {"failed": True, "msg": str(exc), "unprobed": unprobed}
    changes = cabling_changes(previous, plan)
    model = plan.as_dict()
    removed = removed_record(previous, changes)
    if removed:
        model["removed"] = removed
    data = seal(model, p["discovery"])
    changes["why_removed"] = why_removed(changes["removed"], p["discovery"])
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    old_text = json.dumps(previous, indent=2, sort_keys=True) + "\n" if previous else ""
    changed = text != old_text and not unprobed and p["save"]
    result: dict[str, Any] = {"changed": changed, "plan": data, "changes": changes, "unprobed": unprobed}
    if changed:
        result["diff"] = {"before": old_text, "after": text, "before_header": p["record"], "after_header": p["record"]}
        if not check_mode:
            os.makedirs(os.path.dirname(p["record"]) or ".", exist_ok=True)
            tmp = p["record"] + ".tmp"
            with open(tmp, "w") as handle:
                handle.write(text)
            os.replace(tmp, p["record"])
    return result
