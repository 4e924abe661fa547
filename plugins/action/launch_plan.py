# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: plan a launch (ranks, environment per runtime, files, ports) on the controller.

Secrets: the job's environment may come from a variable (``env_var``, launch.yml's ``launch_env``)
read here from the task's variables, so its values are never among the task's arguments, which
callbacks may show or record (display_args_to_stdout, ARA). The job returned and written to
job.json holds every secret as <hidden> (launch_plan.build); check mode writes nothing."""

from __future__ import annotations

from ansible.plugins.action import ActionBase
from ansible_collections.meshkit.cluster.plugins.plugin_utils.controller import MeshkitImports

MESHKIT = MeshkitImports()
with MESHKIT:
    from meshkit.launch_plan import (
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
        MESHKIT.require("launch_plan")
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        result["changed"] = False
        try:
            given = dict(args.get("settings") or {})
            if args.get("env_var"):
                # The environment from a variable of the task (never a task argument): its secrets
                # reach no callback; the plan keeps them as <hidden>.
                found = task_vars.get(args["env_var"])
                found = self._templar.template(found) if found is not None else {}
                if not isinstance(found, dict):
                    raise LaunchError(
                        f"{args['env_var']} = a {type(found).__name__}: give a mapping of environment variable "
                        "names to values; nothing was started"
                    )
                given["env"] = {**dict(given.get("env") or {}), **found}
            settings = validate(given)
            if args.get("manifests") is not None:
                stale = stale_hosts(args["plan"], dict(args["manifests"]), args["state_dir"])
                if stale:
                    raise LaunchError("hostfiles are stale; nothing was started:\n  - " + "\n  - ".join(stale))
            inputs = {name: args.get(name) for name in INPUTS}
            data = make_job(args["plan"], settings, inputs, args.get("job_id"))
            if not self._play_context.check_mode:  # check mode writes nothing anywhere
                data = record_job(data, inputs.get("dest"))
        except LaunchError as exc:
            result["failed"] = True
            result["msg"] = str(exc)
            return result
        result["job"] = data
        # What `meshkit launch` keeps to plan its next jobs without Ansible (launch_fast).
        result["inputs"] = inputs
        result["msg"] = describe(data)
        return result
