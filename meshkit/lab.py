# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""meshkit.cluster.lab's work: build, keep, change, reboot or remove the local emulated cluster
(lab_spec.py checks and plans it, lab_netns.py makes it).

Run by the action plugin of the same name in ansible-playbook's own Python (no Python of its own
for the task): ``sys.executable`` runs every host's holder (lab_init.py). Option names in error
messages are the role's ``lab_*`` variables; plugins/modules/lab.py documents the options and the
result.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from meshkit.lab_netns import Lab, LabError
from meshkit.lab_spec import LabSpecError, plan, validate

ARGUMENT_SPEC: dict[str, Any] = {
    "name": {"type": "str", "default": "lab"},
    "state": {"type": "str", "default": "present", "choices": ["present", "absent"]},
    "size": {"type": "raw"},
    "shape": {"type": "str", "default": "mesh"},
    "cables": {"type": "raw"},
    "link_rate": {"type": "raw"},
    "mgmt_subnet": {"type": "str", "default": "198.18.0.0/24"},
    "dir": {"type": "path", "required": True},
    "init_script": {"type": "path", "required": True},
    "ssh_timeout": {"type": "int", "default": 120},
    "settle_timeout": {"type": "int", "default": 60},
    "access": {"type": "str", "default": "root", "choices": ["root", "sudo"]},
    "names": {"type": "bool", "default": False},
    "head": {"type": "bool", "default": False},
    "network_daemon": {"type": "str", "default": "none", "choices": ["none", "networkd"]},
    "reboot": {"type": "list", "elements": "str", "default": []},
    "factory_network": {"type": "list", "elements": "str", "default": []},
    "replace": {"type": "list", "elements": "str", "default": []},
    "hosts_file": {"type": "path", "default": "/etc/hosts"},
    "shared_paths": {"type": "list", "elements": "path", "default": []},
}


class Failed(Exception):
    """The task fails with this result (``msg`` and what else it says)."""

    def __init__(self, msg: str, **result: Any):
        super().__init__(msg)
        self.result = {"failed": True, "msg": msg, **result}


def summary(plan_dict: dict) -> str:
    head = next((h for h in plan_dict["hosts"] if h.get("head")), None)
    lines = [
        f"lab {plan_dict['name']}: {plan_dict['size']} hosts"
        + (f" and a head node ({head['name']}, {head['mgmt_ip']}, no cables)" if head else "")
        + f", {plan_dict['shape']}, "
        f"{len(plan_dict['cables'])} cables, link rate {plan_dict['link_rate'] or 'unlimited'}, "
        f"management {plan_dict['mgmt_subnet']}"
    ]
    for c in plan_dict["cables"]:
        a, b = c["ends"]
        lines.append(f"  cable {c['index']}: {a['host']}:{a['port']} <-> {b['host']}:{b['port']}")
    return "\n".join(lines) + "\n"


def run_task(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    """The task's result: ``lab``, ``removed``, ``reasons``, ``elapsed`` (and ``diff``, ``settled_in``,
    ``reshaped``, ``rebooted``, ``factory_network``); the lab made, changed, rebooted or removed unless
    ``check_mode``."""
    try:
        return _run_task(params, check_mode)
    except Failed as exc:
        return exc.result


def _run_task(p: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    try:
        doc = validate(
            {
                "lab_name": p["name"],
                "lab_state": p["state"],
                "lab_size": p["size"],
                "lab_shape": p["shape"],
                "lab_cables": p["cables"],
                "lab_link_rate": p["link_rate"],
                "lab_mgmt_subnet": p["mgmt_subnet"],
                "lab_access": p["access"],
                "lab_names": p["names"],
                "lab_head": p["head"],
                "lab_network_daemon": p["network_daemon"],
            }
        )
    except LabSpecError as exc:
        raise Failed(str(exc), problems=exc.problems) from None

    lab = Lab(
        plan(doc),
        p["dir"],
        p["init_script"],
        sys.executable,
        ssh_timeout=p["ssh_timeout"],
        settle_timeout=p["settle_timeout"],
        hosts_file=p["hosts_file"],
    )
    result: dict = {"changed": False, "removed": [], "reasons": [], "elapsed": 0.0}
    start = time.monotonic()
    try:
        if p["state"] == "absent":
            if lab.exists():
                result["changed"] = True
                result["reasons"] = ["state=absent"]
                result["diff"] = {"before": summary(lab.plan.as_dict()), "after": ""}
                if not check_mode:
                    result["removed"] = lab.teardown(keep_files=False)
            result["lab"] = lab.plan.as_dict()
        else:
            missing = lab.missing_tools()
            if missing:
                raise Failed("this machine cannot run the lab: " + "; ".join(missing), missing=missing)
            conflicts = lab.route_conflicts()
            if conflicts:
                raise Failed(
                    f"lab_mgmt_subnet = {doc['lab_mgmt_subnet']!r} overlaps routes this machine "
                    f"already has: {'; '.join(conflicts)}. Pick another subnet (-e lab_mgmt_subnet=...) "
                    "so lab traffic can never leave the machine.",
                    conflicts=conflicts,
                )
            # Only hosts and cables differ from the running lab: change just those, in place.
            in_place = lab.in_place_changes()
            reasons = [] if in_place else lab.problems()
            reboot = [name for name in p["reboot"] if name]
            factory = [name for name in p["factory_network"] if name]
            replace = [name for name in p["replace"] if name]
            for option, names in (("lab_reboot", reboot), ("lab_factory_network", factory), ("lab_replace", replace)):
                if names and (reasons or in_place):
                    why = reasons or (
                        [f"its hosts and cables would change: {in_place[1].summary()}"] if in_place else []
                    )
                    raise Failed(
                        f"{option}: lab {doc['lab_name']} is not up as asked ({'; '.join(why)}); "
                        f"run playbooks/lab.yml without {option} first",
                        reasons=why,
                    )
            if in_place:
                before_plan, change = in_place
                result["changed"] = True
                result["reshaped"] = change.as_dict()
                result["diff"] = {
                    "before_header": f"lab {doc['lab_name']} as built",
                    "after_header": f"lab {doc['lab_name']} changed in place: {change.summary()}",
                    "before": summary(before_plan.as_dict()),
                    "after": summary(lab.plan.as_dict()),
                }
                if not check_mode:
                    result["removed"] = lab.reshape(before_plan, change)
            elif reasons:
                result["changed"] = True
                result["reasons"] = reasons
                before = lab.recorded()
                result["diff"] = {
                    "before": summary(before["plan"]) if before else "",
                    "after": summary(lab.plan.as_dict()),
                }
                if not check_mode:
                    if lab.exists():
                        result["removed"] = lab.teardown(keep_files=True)
                    try:
                        lab.build()
                        lab.check_shared_paths(p["shared_paths"])
                    except LabError:
                        lab.teardown(keep_files=True)  # leave nothing half-built behind
                        raise
            elif lab.plan.names and lab.names_problem():
                # Built as asked, but this machine's hosts file lost the lab's names.
                result["changed"] = True
                result["reasons"] = [str(lab.names_problem())]
                if not check_mode:
                    lab.write_names_block()
            if not replace and not reasons and lab.untrusted():
                # Replaced hosts' new keys (the lab made them): known_hosts takes them now.
                result["changed"] = True
                result["trusted"] = [line.split()[0] for line in lab.untrusted()]
                if not check_mode:
                    result["trusted"] = lab.trust_replaced()
            if replace:
                result["changed"] = True
                if not check_mode:
                    result["replaced"] = lab.replace(replace)
            if factory:
                fixed = lab.factory_network(factory, check_mode)
                result["factory_network"] = fixed
                result["changed"] = result["changed"] or any(fixed.values())
            if reboot:
                result["changed"] = True
                if not check_mode:
                    result["rebooted"] = lab.reboot(reboot)
            if not check_mode:
                # Built now or earlier: return only once every host is settled.
                result["settled_in"] = lab.settle()
            result["lab"] = lab.report()
    except LabError as exc:
        raise Failed(str(exc), **result) from None
    result["elapsed"] = round(time.monotonic() - start, 2)
    return result
