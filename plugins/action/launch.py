# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: start a planned job on every host, supervise it, fail fast, collect the logs.

The job (launch_plan's) holds its secrets as <hidden>; their values are read here from the task's
variables (``env_var``: launch.yml's ``launch_env``), never from the task's arguments, and go with a
fresh job token to the ranks only (launcher.host_jobs): no result, log or summary has them."""

from __future__ import annotations

import json
from pathlib import Path

from ansible import constants
from ansible.plugins.action import ActionBase
from ansible.plugins.loader import connection_loader
from ansible.utils.display import Display
from ansible_collections.meshkit.cluster.plugins.plugin_utils.controller import MeshkitImports

# The controller package (pip install meshkit); the collection's hosts never need it.
MESHKIT = MeshkitImports()
with MESHKIT:
    from meshkit import launch_service
    from meshkit.launch_connection import ConnectionError_, connection_for
    from meshkit.launch_fast import context_of, preflight_everywhere, preflight_specs
    from meshkit.launch_plan import preflight_problems, refusal
    from meshkit.launch_settings import SETTING, START

display = Display()

# Ansible's ssh connection options the launcher's own ssh command line takes over.
SSH_OPTIONS = (
    "host",
    "port",
    "remote_user",
    "private_key_file",
    "ssh_args",
    "ssh_common_args",
    "ssh_extra_args",
    "host_key_checking",
    "control_path_dir",
)


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def _start_given(self, args: dict, job: dict, task_vars: dict) -> dict:
        """The task's start options (launch_settings' start settings); the host timeout, given
        neither here nor in the job (launch_plan's settings), from launch.yml's launch_host_timeout."""
        given = {name: args.get(name) for name, setting in SETTING.items() if START in setting.where}
        variable = SETTING["host_timeout"].variable
        if given["host_timeout"] is None and job.get("host_timeout") is None and task_vars.get(variable) is not None:
            given["host_timeout"] = self._templar.template(task_vars[variable])
        return given

    def _given_env(self, args: dict, task_vars: dict) -> dict:
        """The job's environment as the user gave it (the values of its secrets are wanted): the
        variable ``env_var`` names, templated here, so no value is ever a task argument."""
        name = args.get("env_var")
        if not name or task_vars.get(name) is None:
            return {}
        found = self._templar.template(task_vars[name])
        return dict(found) if isinstance(found, dict) else {}

    def _ssh_options(self, hv) -> dict:
        """A host's ssh connection options as Ansible itself resolves them for the ssh plugin:
        ansible.cfg, ANSIBLE_* environment variables, then the host's variables."""
        plugin = connection_loader.get("ansible.builtin.ssh", self._play_context)
        variables = {}
        for name in constants.config.get_plugin_vars("connection", "ssh"):
            if name in hv:
                variables[name] = self._templar.template(hv[name])
        plugin.set_options(var_options=variables)
        return {name: plugin.get_option(name) for name in SSH_OPTIONS}

    def _become(self, hv) -> dict | None:
        """Become as this task would for the host (play, ansible.cfg, -b, the host's ansible_become*)."""
        pc = self._play_context
        on = self._templar.template(hv["ansible_become"]) if "ansible_become" in hv else pc.become
        if not on or str(on).lower() in ("false", "no", "0"):
            return None
        method = self._templar.template(hv.get("ansible_become_method") or pc.become_method or "sudo")
        user = self._templar.template(hv.get("ansible_become_user") or pc.become_user or "root")
        return {"method": str(method).rsplit(".", 1)[-1], "user": user}

    def _launch_connection(self, host: str, hv) -> dict:
        kind = self._templar.template(hv.get("ansible_connection") or "ssh")
        ssh = self._ssh_options(hv) if kind in ("ssh", "ansible.builtin.ssh", "smart", "ansible.legacy.ssh") else None
        return connection_for(host, hv, self._templar, ssh=ssh, become=self._become(hv))

    @staticmethod
    def _refused(result: dict, job: dict, problems: list[str]) -> dict:
        result["failed"] = True
        result["changed"] = False
        result["msg"] = refusal(job["job_id"], problems)
        return result

    def run(self, tmp=None, task_vars=None):
        MESHKIT.require("launch")
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = self._task.args
        job = args["job"]
        result["changed"] = True
        check_hosts = bool(args.get("check_hosts"))
        if self._play_context.check_mode and not check_hosts:
            result["changed"] = False
            result["msg"] = f"check mode: job {job['job_id']} would start {job['world_size']} ranks"
            return result
        preflight = dict(args.get("preflight") or {})
        if preflight and (problems := preflight_problems(preflight)):
            return self._refused(result, job, problems)
        try:
            connections = {
                host: self._launch_connection(host, task_vars["hostvars"][host])
                for host in dict.fromkeys(r["host"] for r in job["ranks"])
            }
        except ConnectionError_ as exc:
            result["failed"] = True
            result["changed"] = False
            result["msg"] = str(exc)
            return result
        cables = dict(args.get("cables") or {})
        slurm = (args.get("scheduler") or SETTING["scheduler"].default) == "slurm"
        # launch.yml's preflight, on every host at once over the connection its ranks then use. Where
        # an agent per host starts the ranks it is that agent's first answer, on the job's own
        # connection (below); else (check mode, `meshkit launch`, Slurm, MPI) a round trip of its own.
        folded = check_hosts and not (self._play_context.check_mode or args.get("prepare_to") or slurm)
        folded = folded and job["runtime"] != "mpi"
        if check_hosts and not folded:
            problems = preflight_problems(preflight_everywhere(job, connections, cables))
            if problems:
                return self._refused(result, job, problems)
        if self._play_context.check_mode:
            result["changed"] = False
            result["msg"] = f"check mode: job {job['job_id']} would start {job['world_size']} ranks"
            return result
        if args.get("prepare_to"):
            # `meshkit launch`: everything is checked; the CLI starts the ranks itself, with stdin.
            path = Path(args["prepare_to"])
            path.parent.mkdir(parents=True, exist_ok=True)
            prepared = {"job": job, "connections": connections}
            if args.get("context"):
                prepared["context"] = context_of(dict(args["context"]))
            path.write_text(json.dumps(prepared, indent=1) + "\n")
            path.chmod(0o600)
            result["changed"] = False
            result["msg"] = f"job {job['job_id']} prepared in {path}"
            return result
        log_dir = Path(args.get("log_dir") or job.get("log_dir") or f"artifacts/launch/{job['job_id']}")

        def write(text: str, event: bool) -> None:
            # In the terminal's own thread: Ansible's display (a worker's queue to the main process,
            # which writes to the terminal) may block there, never in the launcher's loop.
            if event:
                display.display(f"meshkit launch: {text}", color="bright blue")
            else:
                display.display(text)

        try:
            start = launch_service.start_of(self._start_given(args, job, task_vars), job, log_dir)
            values = launch_service.secrets(job, self._given_env(args, task_vars))
            outcome = launch_service.run(
                job, connections, values, start, write, preflight=preflight_specs(job, cables) if folded else None
            )
        except launch_service.Refused as exc:
            return self._refused(result, job, exc.problems)
        except launch_service.NotStarted as exc:
            result["failed"] = True
            result["changed"] = False
            result["msg"] = str(exc)
            return result
        result.update(outcome.task_result())
        return result
