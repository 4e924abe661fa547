# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: plan a launch (ranks, environment per runtime, files, ports) on the controller."""

from __future__ import annotations

from ansible.plugins.action import ActionBase
from ansible_collections.meshkit.cluster.plugins.module_utils.launch_plan import (
    INPUTS,
    LaunchError,
    describe,
    make_job,
    record_job,
    stale_hosts,
    validate,
)


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        result["changed"] = False
        try:
            settings = validate(dict(args.get("settings") or {}))
            changes = args.get("changes") or {}
            if changes.get("added") or changes.get("removed"):
                raise LaunchError(
                    "the cabling changed since setup.yml planned it (added: "
                    f"{', '.join(changes.get('added') or []) or 'none'}; removed: "
                    f"{', '.join(changes.get('removed') or []) or 'none'}); run setup.yml, then launch again"
                    + "".join(f"\n  - {line}" for line in changes.get("why_removed") or [])
                )
            if args.get("manifests") is not None:
                stale = stale_hosts(args["plan"], dict(args["manifests"]), args["state_dir"])
                if stale:
                    raise LaunchError("hostfiles are stale; nothing was started:\n  - " + "\n  - ".join(stale))
            inputs = {name: args.get(name) for name in INPUTS}
            data = record_job(make_job(args["plan"], settings, inputs, args.get("job_id")), inputs.get("dest"))
        except LaunchError as exc:
            result["failed"] = True
            result["msg"] = str(exc)
            return result
        result["job"] = data
        # What `meshkit launch` keeps to plan its next jobs without Ansible (launch_fast).
        result["inputs"] = inputs
        result["msg"] = describe(data)
        return result
