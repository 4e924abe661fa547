# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: load setup.yml's plan.json and check the live cabling against it, here on the
controller (plugins/modules/plan_verify.py documents it).

plan.json is the controller's file and the comparison is the controller's (meshkit/plan_contract.py);
run as a module it cost a Python of its own (about 0.5 s a launch) for a few milliseconds of work
(issue 23)."""

from __future__ import annotations

import os

from ansible.plugins.action import ActionBase
from ansible_collections.meshkit.cluster.plugins.plugin_utils.controller import MeshkitImports

MESHKIT = MeshkitImports()
with MESHKIT:
    from meshkit.plan_contract import PlanError, live_differences, load


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        MESHKIT.require("plan_verify")
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = self._task.args
        result["changed"] = False
        record, discovery = args.get("record"), args.get("discovery")
        if not isinstance(record, str) or not record or not isinstance(discovery, dict):
            result["failed"] = True
            result["msg"] = "plan_verify needs record (the path of plan.json) and discovery (a mapping of hosts)"
            return result
        try:
            plan = load(os.path.expanduser(os.path.expandvars(record)))
        except PlanError as exc:
            result.update(failed=True, msg=str(exc), differences=[])
            return result
        differences = live_differences(plan, dict(discovery))
        if differences:
            result.update(
                failed=True,
                msg="the cabling differs from the plan setup.yml made; run setup.yml, then launch again:\n  - "
                + "\n  - ".join(differences),
                differences=differences,
            )
            return result
        result.update(plan=plan, differences=[])
        return result
