# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""One launch, whichever door it comes in by: a job prepared from validated settings, started,
and its outcome worded.

`meshkit launch` (cli.py), `meshkit check` (check.py) and the launch action (launch.yml's last
task) are adapters over this module: they turn their input (flags; task arguments and variables)
into launch_settings' settings and the outcome into theirs (an exit status and lines; a task
result).

Preparing (`meshkit launch`, `meshkit check`): quick() plans the job from what the last full
launch on the inventory left and has every host check that it still holds (launch_fast); full()
runs launch.yml through ansible-runner up to the start, its launch action writing the checked job
and every host's connection (job.json), with what it planned from, for the next quick().

Starting (all three): start_of() settles how the job starts (scheduler, host timeout, timeout,
grace) from what was given, the job's own settings and the table's defaults; run() chooses the
scheduler, builds every host's share (launch_mpi.hosts_for: an agent per host, or one mpirun;
launch_slurm.hosts_for: one srun or sbatch), runs the Launcher and returns the Outcome, which says
itself as `meshkit launch` does (said(), exit_code()) and as the task does (task_result()).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from meshkit import job_leases, launch_fast, launch_mpi, launch_slurm
from meshkit.collection import collection_root, runner_env
from meshkit.launch_plan import HIDDEN, LaunchError, is_secret, preflight_problems, refusal, secret_values
from meshkit.launch_settings import HINTS, SETTING, SETTINGS, check, default
from meshkit.launcher import JobResult, Launcher, Terminal


class NotStarted(Exception):
    """The job cannot start as asked; nothing was started. ``str()`` says why as the launch task
    says it, ``cli`` as `meshkit launch` does."""

    def __init__(self, message: str, cli: str | None = None) -> None:
        super().__init__(message)
        self.cli = cli or message


class Refused(NotStarted):
    """A host's preflight failed: nothing was started."""

    def __init__(self, job_id: str, problems: list[str]) -> None:
        super().__init__(refusal(job_id, problems))
        self.problems = problems


# --- preparing: the remembered checks, else launch.yml ------------------------------------------


@dataclass
class Request:
    """A launch to prepare, as `meshkit launch` and `meshkit check` ask for one. ``settings``: the
    job's settings by launch_settings' names, ``env`` with its secrets' values (they stay in this
    process: Ansible and the plan get <hidden>)."""

    inventory: str
    settings: dict[str, Any]
    recheck: bool = False
    extra_vars: list[str] = field(default_factory=list)
    quiet: bool = False
    label: str = "meshkit launch"

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"{self.label}: {text}", file=sys.stderr, flush=True)

    def secrets(self) -> list[str]:
        marked = self.settings.get("secret_env") or []
        return [name for name in self.settings.get("env") or {} if is_secret(name, marked)]

    def extravars(self, job_file: Path) -> dict[str, Any]:
        """launch.yml's variables: every setting given (launch_<name>), secrets' values <hidden>
        (their names stay, so the plan lists them; launch() puts the values in when the ranks start)."""
        hidden = self.secrets()
        out: dict[str, Any] = {}
        for name, given in self.settings.items():
            if given is None or given == "":
                continue
            value = list(given) if isinstance(given, (list, tuple)) else given
            if name == "env":
                value = {k: (HIDDEN if k in hidden else v) for k, v in given.items()}
            out[SETTING[name].variable] = value
        out["launch_prepare_to"] = str(job_file)
        return out


def playbook(request: Request, job_file: Path, private: Path) -> tuple[int, list[str]]:
    """Run launch.yml up to the start: the plan, the checks, every host's connection."""
    import ansible_runner

    envvars = {**runner_env(), "ANSIBLE_NOCOLOR": "1"}
    failures: list[str] = []

    def on_event(event: dict) -> bool:
        name = event.get("event")
        data = event.get("event_data", {})
        if name == "playbook_on_task_start":
            request.say(str(data.get("task")))
        elif name in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors"):
            res = data.get("res", {})
            failures.append(f"{data.get('host')}: {res.get('msg') or res.get('stderr') or res}")
        return True

    cmdline = " ".join(f"-e {json.dumps(v) if not v.startswith('@') else v}" for v in request.extra_vars) or None
    # ansible-runner records the environment it runs Ansible with (<private>/artifacts/*/command):
    # a secret -x took from this environment (-x NAME) is not in it. Ansible has no use for it.
    with environment_without(request.secrets()):
        run = ansible_runner.run(
            private_data_dir=str(private),
            playbook="meshkit.cluster.launch",
            inventory=str(Path(request.inventory).resolve()),
            extravars=request.extravars(job_file),
            envvars=envvars,
            cmdline=cmdline,
            quiet=True,
            event_handler=on_event,
            project_dir=os.getcwd(),  # relative paths (artifacts, ansible.cfg) are the caller's
        )
    return run.rc, failures


@contextlib.contextmanager
def environment_without(names: list[str]) -> Iterator[None]:
    """This process's environment without ``names`` for the duration, then as it was."""
    kept = {name: os.environ.pop(name) for name in dict.fromkeys(names) if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(kept)


def cache_file(request: Request) -> tuple[Path, str]:
    """Where this inventory's remembered context is kept (~/.cache/meshkit/launch, or $MESHKIT_LAUNCH_CACHE),
    and the key it must match."""
    inventory = Path(request.inventory)
    runtime = request.settings.get("runtime") or default("runtime")
    cfg = runner_env().get("ANSIBLE_CONFIG")
    key = launch_fast.cache_key(inventory, runtime, collection_root(), Path(cfg) if cfg else None)
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    where = Path(os.environ.get("MESHKIT_LAUNCH_CACHE") or cache_home / "meshkit" / "launch")
    return launch_fast.cache_path(where, inventory, runtime), key


def quick(request: Request, problems: list[str] | None = None) -> dict | None:
    """The job planned from the remembered context and checked on every host; {} when the full
    launch must run instead; None when the job must not start (said why, and added to ``problems``)."""
    if request.recheck or request.extra_vars:
        return {}
    label = request.label
    try:
        path, key = cache_file(request)
        record = launch_fast.load(path, key)
        # Planned with every secret's value hidden (launch_plan.build).
        job, connections = launch_fast.prepare(record, dict(request.settings), on_event=request.say)
    except launch_fast.Stale as exc:
        print(f"{label}: {exc}; running every check (launch.yml)", file=sys.stderr, flush=True)
        return {}
    except launch_fast.Refused as exc:
        print(f"{label}: {exc}", file=sys.stderr)
        if problems is not None:
            problems.append(str(exc))
        return None
    except (KeyError, TypeError, ValueError, AttributeError, OSError) as exc:  # a record of another shape
        print(f"{label}: the remembered checks are unusable ({exc!r}); running every check (launch.yml)",
              file=sys.stderr)  # fmt: skip
        return {}
    return {"job": job, "connections": connections, "context": record["context"]}


def full(request: Request, problems: list[str] | None = None) -> dict | None:
    """launch.yml up to the start; what it planned from is remembered for the next launch. None when
    the job must not start (said why, and added to ``problems``)."""
    label = request.label
    try:
        path, key = cache_file(request)
    except (launch_fast.Stale, OSError):
        path = key = None  # a dynamic inventory, or files it cannot read: nothing to remember
    with tempfile.TemporaryDirectory(prefix="meshkit-launch-") as tmp:
        job_file = Path(tmp) / "job.json"
        (Path(tmp) / "runner").mkdir()
        rc, failures = playbook(request, job_file, Path(tmp) / "runner")
        if rc != 0 or not job_file.exists():
            print(f"{label}: the job was not started:", file=sys.stderr)
            for line in failures or [f"launch.yml exited with {rc}"]:
                print(f"  {line}", file=sys.stderr)
            if problems is not None:
                problems.extend(failures or [f"launch.yml exited with {rc}"])
            return None
        prepared = json.loads(job_file.read_text())
    if path is not None and prepared.get("context") and not request.extra_vars:
        try:
            launch_fast.save(path, key, prepared["context"], prepared["connections"])
        except OSError as exc:
            print(f"{label}: cannot remember the checks in {path} ({exc}); the next run checks all again",
                  file=sys.stderr)  # fmt: skip
    return prepared


# --- starting -----------------------------------------------------------------------------------


@dataclass
class Start:
    """How a prepared job starts (launch_settings' start settings, settled by start_of())."""

    log_dir: Path
    host_timeout: float
    timeout: float | None
    grace: float
    scheduler: str = "meshkit"
    submit_host: str | None = None
    partition: str | None = None
    batch: bool = False
    quiet: bool = False

    @property
    def slurm(self) -> bool:
        return self.scheduler == "slurm"

    def headline(self, job: Mapping[str, Any], hosts: int, broadcast: bool) -> str:
        """What `meshkit launch` says as the ranks start."""
        via = ""
        if self.slurm:
            submit = launch_slurm.submit_host_of(dict(job), self.submit_host)
            via = f" through Slurm ({'sbatch' if self.batch else 'srun'} on {submit})"
        return (
            f"job {job['job_id']}: {job['world_size']} ranks of {job['runtime']} on {hosts} hosts{via}"
            f"{'; stdin goes to every rank' if broadcast else ''}"
        )


def start_of(given: Mapping[str, Any], job: Mapping[str, Any], log_dir: Path) -> Start:
    """How the job starts: each start setting as ``given`` (None: not given), else the job's own
    (launch_plan's settings), else the table's default. NotStarted naming launch.yml's variable of
    a bad one."""
    host_timeout = given.get("host_timeout")
    if host_timeout is None:
        host_timeout = job.get("host_timeout")
    if host_timeout is None or host_timeout == "":
        host_timeout = default("host_timeout")
    checked, problems = check("host_timeout", host_timeout)
    if problems:
        raise NotStarted(
            f"{SETTING['host_timeout'].variable} = {host_timeout!r}: {HINTS['host_timeout']}; no rank of job "
            f"{job['job_id']} was started"
        )
    scheduler = given.get("scheduler") or default("scheduler")
    if scheduler not in SETTING["scheduler"].choices:
        choices = [f"{c} (the default)" if c == default("scheduler") else c for c in SETTING["scheduler"].choices]
        raise NotStarted(f"{SETTING['scheduler'].variable}={scheduler!r}: use {' or '.join(choices)}")
    slurm_only = [s.variable for s in SETTINGS if s.slurm and given.get(s.name)]
    if slurm_only and scheduler != "slurm":
        raise NotStarted(f"{', '.join(slurm_only)} need {SETTING['scheduler'].variable}: slurm")
    grace = given.get("grace")
    return Start(
        log_dir=Path(log_dir),
        host_timeout=float(checked),
        timeout=float(given.get("timeout") or job.get("timeout") or 0) or None,
        grace=float(grace if grace is not None else job.get("grace", default("grace"))),
        scheduler=scheduler,
        submit_host=given.get("submit_host"),
        partition=given.get("partition"),
        batch=bool(given.get("batch")),
        quiet=bool(given.get("quiet")),
    )


def secrets(job: Mapping[str, Any], given_env: Mapping[str, Any]) -> dict[str, str]:
    """The values of the job's secrets (a fresh job token, the user's from ``given_env``: the
    environment as given, launch_env or -x); NotStarted naming any without a value."""
    try:
        return secret_values(job, given_env)
    except LaunchError as exc:
        raise NotStarted(str(exc)) from None


@dataclass
class Outcome:
    """A job that ran: the launcher's result, worded for `meshkit launch` and for the task."""

    job: dict[str, Any]
    start: Start
    result: JobResult

    def explained(self) -> tuple[str, list[tuple[str, list[str]]]]:
        """Why it failed and, per rank to blame, (heading, last lines): the scheduler's words."""
        return (launch_slurm.explain if self.start.slurm else launch_mpi.explain)(self.job, self.result)

    def submitted(self) -> tuple[str | None, str] | None:
        """A --batch job Slurm queued: (its Slurm job id or None, what to say); else None."""
        if self.start.slurm and self.start.batch and self.result.ok:
            return launch_slurm.submitted(self.job, self.result)
        return None

    def said(self, label: str = "meshkit launch") -> list[tuple[bool, str]]:
        """`meshkit launch`'s lines after the run, (on stdout?, text): the table, then the batch
        job's id, or the first failed rank's last lines and the reason."""
        result = self.result
        out = [(False, f"  {line}") for line in result.table()]
        queued = self.submitted()
        if queued is not None:
            number, message = queued
            return [*out, (False, f"{label}: {message}"), *([(True, number)] if number is not None else [])]
        reason, failures = self.explained() if not result.ok else (result.reason, [])
        for heading, tail in failures[:1] if not result.reason.startswith("interrupted") else []:
            out.append((False, f"{label}: {heading}; last lines:"))
            out += [(False, f"    {line}") for line in tail or ["(no output)"]]
        return [*out, (False, f"{label}: {reason}; logs in {result.log_dir}")]

    def exit_code(self) -> int:
        """`meshkit launch`'s exit status: 0, the failed rank's exit code, 1 for a lost host (or a
        batch job without an id), 124 after the timeout, 130 after Ctrl-C."""
        result = self.result
        queued = self.submitted()
        if queued is not None:
            return 0 if queued[0] is not None else 1
        if result.ok:
            return 0
        if result.reason.startswith("interrupted"):
            return 130
        code = launch_slurm.exit_code(self.job, result) if self.start.slurm else None
        if code:
            return min(code, 255)
        failed = result.failed
        if failed and failed[0].code:
            return min(int(failed[0].code), 255)
        if any(r.state == "timeout" for r in result.ranks):
            return 124
        return 1

    def task_result(self) -> dict[str, Any]:
        """The launch task's result: the table, the log directory, and the message (failed: every
        failed rank with its last lines, whatever the ranks left behind)."""
        result, job_id, log_dir = self.result, self.job["job_id"], self.start.log_dir
        out: dict[str, Any] = {"table": result.table(), "log_dir": str(log_dir)}
        queued = self.submitted()
        if queued is not None:
            number, message = queued
            out |= {"summary": result.summary(), "msg": f"job {job_id}: {message}"}
            return out | ({"failed": True} if number is None else {"slurm_job_id": number})
        if result.ok:
            msg = f"job {job_id}: {result.reason} in {result.wall:.1f} s; logs in {log_dir}"
            return out | {"summary": result.summary(), "msg": msg}
        # Failed: the message says it all (the whole summary is in summary.json beside the logs).
        reason, failures = self.explained()
        lines = [f"job {job_id} failed: {reason}"]
        for heading, tail in failures:
            lines.append(f"{heading}; last lines:")
            lines += [f"    {line}" for line in tail] or ["    (no output)"]
        if result.leftovers:
            lines.append(f"killed what ranks left running: {result.leftovers}")
        lines.append(f"every rank was stopped; logs in {log_dir}")
        return out | {"failed": True, "msg": "\n".join(lines)}


def run(
    job: dict[str, Any],
    connections: dict[str, dict[str, Any]],
    values: Mapping[str, str],
    start: Start,
    write: Callable[[str, bool], None] | None = None,
    *,
    stdin: TextIO | None = None,
    partial_flush: float | None = None,
    on_line: Callable[[Any, str], None] | None = None,
    preflight: dict[str, dict[str, Any]] | None = None,
    purpose: str = "job",
) -> Outcome:
    """Start the prepared job and supervise it to its end. ``values``: secrets(). ``write(text,
    is_event)`` shows the output (a Terminal's writer, in its own thread); ``preflight``: every
    host's preflight spec, checked by its agent before anything starts (Refused, recorded for `meshkit
    watch`). While the job runs it holds its hosts (job_leases: a scheduled check skips them; ``purpose`` "check"
    for meshkit check's own). NotStarted when
    the scheduler cannot run the job."""
    try:
        if start.slurm:
            hosts = launch_slurm.hosts_for(
                job,
                connections,
                values,
                submit_host=start.submit_host,
                host_timeout=start.host_timeout,
                partition=start.partition,
                batch=start.batch,
            )
        else:
            hosts = launch_mpi.hosts_for(job, connections, values, start.log_dir, start.host_timeout)
    except (launch_mpi.MpiError, launch_slurm.SlurmError) as exc:
        raise NotStarted(
            f"{exc}; no rank of job {job['job_id']} was started", cli=f"{exc}; the job was not started"
        ) from None
    terminal = Terminal(write, lines=not start.quiet, log=str(start.log_dir / "output.log")) if write else None
    try:
        launcher = Launcher(
            hosts,
            job["job_id"],
            start.log_dir,
            timeout=start.timeout,
            grace=start.grace,
            stdin=stdin,
            on_line=on_line,
            partial_flush=partial_flush,
            host_timeout=start.host_timeout,
            lines=launch_slurm.Lines(job) if start.slurm else launch_mpi.Lines(job),
            terminal=terminal,
        )
        if preflight is not None:
            try:
                problems = preflight_problems(launcher.preflight(preflight))
            except BaseException:
                launcher.close()
                raise
            if problems:
                launcher.close()
                job_leases.record_refusal(job, connections, problems)
                raise Refused(job["job_id"], problems)
        with job_leases.held(job, connections, purpose) as lease:
            result = launcher.run()
            lease["outcome"], lease["reason"] = ("ok" if result.ok else "failed"), result.reason
    finally:
        if terminal is not None:
            terminal.close()  # what the terminal has not taken yet (this may wait for a paused pager)
    return Outcome(job, start, result)
