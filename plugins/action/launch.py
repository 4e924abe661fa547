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
from ansible.errors import AnsibleError
from ansible.plugins.action import ActionBase
from ansible.plugins.loader import connection_loader
from ansible.utils.display import Display

try:  # the controller package (pip install meshkit); the collection's hosts never need it
    from meshkit import launch_slurm
    from meshkit.launch_connection import (
        DEFAULT_HOST_TIMEOUT,
        ConnectionError_,
        connection_for,
    )
    from meshkit.launch_fast import context_of, preflight_everywhere, preflight_specs
    from meshkit.launch_mpi import Lines, MpiError, explain, hosts_for
    from meshkit.launch_plan import LaunchError, preflight_problems, secret_values
    from meshkit.launcher import Launcher, Terminal
except ImportError as exc:
    MESHKIT_IMPORT_ERROR: ImportError | None = exc
    DEFAULT_HOST_TIMEOUT = 20.0
else:
    MESHKIT_IMPORT_ERROR = None

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


def missing_controller_package() -> AnsibleError:
    return AnsibleError(
        "meshkit.cluster's launch runs on the controller with the meshkit Python package, which this "
        f"Python cannot import ({MESHKIT_IMPORT_ERROR}); install it where ansible-playbook runs: pip install meshkit"
    )


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def _host_timeout(self, args: dict, job: dict, task_vars: dict) -> float | str:
        """Seconds without a word from a host before it is lost: the task's ``host_timeout``, the
        job's (launch_plan's settings), else launch.yml's ``launch_host_timeout``, else the default.
        A string: what is wrong with the value given."""
        value = args.get("host_timeout")
        if value is None:
            value = job.get("host_timeout")
        if value is None and task_vars.get("launch_host_timeout") is not None:
            value = self._templar.template(task_vars["launch_host_timeout"])
        if value is None or value == "":
            return DEFAULT_HOST_TIMEOUT
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = 0.0
        if not 1 <= seconds <= 3600:
            return (
                f"launch_host_timeout = {value!r}: give the seconds without a word from a host before it counts as "
                f"lost (1-3600; default {DEFAULT_HOST_TIMEOUT:g}); no rank of job {job['job_id']} was started"
            )
        return seconds

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
        result["msg"] = f"preflight failed; no rank of job {job['job_id']} was started:\n  - " + "\n  - ".join(problems)
        return result

    def run(self, tmp=None, task_vars=None):
        if MESHKIT_IMPORT_ERROR is not None:
            raise missing_controller_package()
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
        slurm = (args.get("scheduler") or "meshkit") == "slurm"
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
        host_timeout = self._host_timeout(args, job, task_vars)
        if isinstance(host_timeout, str):
            result["failed"] = True
            result["changed"] = False
            result["msg"] = host_timeout
            return result
        try:
            values = secret_values(job, self._given_env(args, task_vars))
        except LaunchError as exc:
            result["failed"] = True
            result["changed"] = False
            result["msg"] = str(exc)
            return result
        log_dir = Path(args.get("log_dir") or job.get("log_dir") or f"artifacts/launch/{job['job_id']}")
        quiet = bool(args.get("quiet"))

        def write(text: str, event: bool) -> None:
            # In the terminal's own thread: Ansible's display (a worker's queue to the main process,
            # which writes to the terminal) may block there, never in the launcher's loop.
            if event:
                display.display(f"meshkit launch: {text}", color="bright blue")
            else:
                display.display(text)

        scheduler = args.get("scheduler") or "meshkit"
        if scheduler not in ("meshkit", "slurm"):
            result["failed"] = True
            result["changed"] = False
            result["msg"] = f"launch_scheduler={scheduler!r}: use meshkit (the default) or slurm"
            return result
        given = [name for name in ("submit_host", "partition", "batch") if args.get(name)]
        if given and not slurm:
            result["failed"] = True
            result["changed"] = False
            result["msg"] = f"{', '.join('launch_' + n for n in given)} need launch_scheduler: slurm"
            return result
        try:
            if slurm:
                hosts = launch_slurm.hosts_for(
                    job,
                    connections,
                    values,
                    submit_host=args.get("submit_host"),
                    host_timeout=host_timeout,
                    partition=args.get("partition"),
                    batch=bool(args.get("batch")),
                )
            else:
                hosts = hosts_for(job, connections, values, log_dir, host_timeout)
        except (MpiError, launch_slurm.SlurmError) as exc:
            result["failed"] = True
            result["changed"] = False
            result["msg"] = f"{exc}; no rank of job {job['job_id']} was started"
            return result
        terminal = Terminal(write, lines=not quiet, log=str(log_dir / "output.log"))
        launcher = Launcher(
            hosts,
            job["job_id"],
            log_dir,
            timeout=float(args.get("timeout") or job.get("timeout") or 0) or None,
            grace=float(args.get("grace") if args.get("grace") is not None else job.get("grace", 3.0)),
            host_timeout=host_timeout,
            lines=launch_slurm.Lines(job) if slurm else Lines(job),
            terminal=terminal,
        )
        try:
            if folded:
                try:
                    problems = preflight_problems(launcher.preflight(preflight_specs(job, cables)))
                except BaseException:
                    launcher.close()
                    raise
                if problems:
                    launcher.close()
                    return self._refused(result, job, problems)
            outcome = launcher.run()
        finally:
            terminal.close()
        result["table"] = outcome.table()
        result["log_dir"] = str(log_dir)
        if outcome.ok and slurm and args.get("batch"):
            number, message = launch_slurm.submitted(job, outcome)
            result["summary"] = outcome.summary()
            result["msg"] = f"job {job['job_id']}: {message}"
            if number is None:
                result["failed"] = True
            else:
                result["slurm_job_id"] = number
            return result
        if outcome.ok:
            result["summary"] = outcome.summary()
            result["msg"] = f"job {job['job_id']}: {outcome.reason} in {outcome.wall:.1f} s; logs in {log_dir}"
            return result
        # Failed: the message says it all (the whole summary is in summary.json beside the logs).
        result["failed"] = True
        reason, failures = (launch_slurm.explain if slurm else explain)(job, outcome)
        lines = [f"job {job['job_id']} failed: {reason}"]
        for heading, tail in failures:
            lines.append(f"{heading}; last lines:")
            lines += [f"    {line}" for line in tail] or ["    (no output)"]
        if outcome.leftovers:
            lines.append(f"killed what ranks left running: {outcome.leftovers}")
        lines.append(f"every rank was stopped; logs in {log_dir}")
        result["msg"] = "\n".join(lines)
        return result
