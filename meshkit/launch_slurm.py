# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Jobs through Slurm: one ``srun`` on a submit host (any host of the cluster: every one has
slurm.conf and the munge key), the ranks placed by Slurm in meshkit's ring order.

The job is planned and checked as for meshkit's own launcher (launch.yml, or the remembered plan
verified by every host); then, instead of one agent per host, one agent on the submit host runs

    srun --job-name meshkit-<job id> --nodes N --ntasks W --distribution=arbitrary
         --kill-on-bad-exit=1 --label --export=ALL [--chdir DIR] -- /bin/sh -c WRAP meshkit-rank PROGRAM...

with ``SLURM_HOSTFILE`` naming the ring's hosts, rank by rank, so Slurm's task r is meshkit's rank r
on the plan's host. srun starts every task with the submit host's environment plus what the plan
gives every rank (the job token among it, from the agent's environment, never a command line); the
wrapper (wrap()) sets what differs per rank from Slurm's own variables (MESHKIT_RANK = SLURM_PROCID,
...) and per host by SLURMD_NODENAME, and writes the job's files (meshccl.json, MLX's ring file)
into the host's job directory, which it first makes sure is the user's own and private.

A rank that exits non-zero makes Slurm kill the others (--kill-on-bad-exit); srun names it
("srun: error: node2: task 3: Exited with exit code 7") and the launch names it from there.
Stopping srun (Ctrl-C, --timeout, a lost submit host) ends the job step on every host; so does
``scancel``, which srun reports as a cancelled job.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshkit import launcher
from meshkit.launch_plan import HIDDEN, JOB_ID_ENV
from meshkit.launcher import HostJob, agent_argv, with_secrets

# The runtimes a Slurm job runs: every one meshkit's own launcher runs. MPI ranks are started by srun
# itself and find each other through Slurm's PMIx plugin (srun --mpi=pmix; Open MPI 4.1 as Debian 12
# packages it), no mpirun.
RUNTIMES = ("meshccl", "plain", "mpi", "torch", "mlx")
# Slurm's variables a task's own numbers are taken from.
PER_RANK = {"rank": "SLURM_PROCID", "local_rank": "SLURM_LOCALID"}
FILE_VAR = "MESHKIT_JOB_FILE_{}"
# Linux takes at most 128 KiB in one environment string (MAX_ARG_STRLEN): a job file above this
# cannot travel in srun's environment.
FILE_LIMIT = 120 * 1024
# The launch agent marks what it starts (MESHKIT_JOB_MARK) and sweeps what carries its mark when the
# job ends; Slurm's tasks are Slurm's to stop (a batch job outlives sbatch), so srun and sbatch are
# started without it.
UNMARKED = ["env", "-u", "MESHKIT_JOB_MARK"]
# Jobs that listen on the plan's fixed ports: two of them on one node would collide.
EXCLUSIVE = ("meshccl", "torch", "mlx")
# srun --label: "<task>: text", the task number zero-padded to the widest.
LABEL = re.compile(r"^\s*(\d+): ?(.*)$", re.S)
# srun's report of a task that failed: "srun: error: node2: task 3: Exited with exit code 7",
# "srun: error: node1: tasks 0-1: Killed".
TASK_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
EXITED = re.compile(r"Exited with exit code (\d+)")
CANCELLED = re.compile(r"\bCANCELLED\b")
# srun's words when the step was ended from outside (scancel), not by a task that failed.
ABORTED = "Job step aborted"
HOSTFILE_NAME = "slurm-hostfile"


class SlurmError(ValueError):
    """This job cannot run through Slurm (a runtime it does not run yet, an unknown submit host)."""


def slurm_hostfile(job: dict[str, Any]) -> str:
    """SLURM_HOSTFILE: one host per task, in rank order (Slurm's task r runs on line r's host)."""
    return "".join(f"{r['host']}\n" for r in sorted(job["ranks"], key=lambda r: r["rank"]))


def job_name(job: dict[str, Any]) -> str:
    return f"meshkit-{job['job_id']}"


def split_env(job: dict[str, Any]) -> tuple[dict[str, str], dict[str, str], dict[str, dict[str, str]]]:
    """The plan's per-rank environments as srun can give them: (the same for every task, in srun's
    own environment; per rank, the Slurm variable each is read from; per host, the values that host's
    tasks get). Under srun every task starts with one environment, so what differs must come from
    Slurm's variables (a rank's number, its number on its host) or from its host's name. A secret
    (shown <hidden> in the plan) is the same for every rank: it stays in the environment, never on
    the wrapper's command line."""
    ranks = sorted(job["ranks"], key=lambda r: r["rank"])
    names = sorted({name for r in ranks for name in r["env"]})
    common: dict[str, str] = {}
    per_rank: dict[str, str] = {}
    per_host: dict[str, dict[str, str]] = {r["host"]: {} for r in ranks}
    for name in names:
        values = [r["env"].get(name) for r in ranks]
        if any(v is None for v in values):
            missing = sorted({r["host"] for r, v in zip(ranks, values, strict=True) if v is None})
            raise SlurmError(f"{name} is set for some ranks only (not on {', '.join(missing)}): srun cannot give it")
        if len(set(values)) == 1:
            common[name] = str(values[0])
            continue
        if any(v == HIDDEN for v in values):
            raise SlurmError(f"{name} is a secret that differs between ranks: srun cannot give it without showing it")
        pairs = list(zip(ranks, values, strict=True))
        slurm = next((var for key, var in PER_RANK.items() if all(v == str(r.get(key)) for r, v in pairs)), None)
        if slurm:
            per_rank[name] = slurm
            continue
        by_host: dict[str, set[str]] = {}
        for r, v in zip(ranks, values, strict=True):
            by_host.setdefault(r["host"], set()).add(str(v))
        if any(len(found) > 1 for found in by_host.values()):
            raise SlurmError(
                f"{name} differs between ranks of one host, not as their rank numbers: srun cannot give it"
            )
        for host, found in by_host.items():
            per_host[host][name] = next(iter(found))
    for r in ranks:
        if r.get("path_prepend"):
            per_host[r["host"]]["PATH"] = ":".join(r["path_prepend"]) + ":$PATH"
    return common, per_rank, per_host


def job_files(job: dict[str, Any]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The job's files (meshccl.json, MLX's ring file), which meshkit's own agents write into each
    host's job directory: (variable -> content, in srun's environment; per host, file name ->
    variable). The task wrapper writes them there before the program starts."""
    contents: dict[str, str] = {}
    per_host: dict[str, dict[str, str]] = {}
    for host, files in sorted((job.get("files") or {}).items()):
        for name, text in sorted(files.items()):
            var = next((v for v, t in contents.items() if t == text), None)
            if var is None and len(text.encode()) > FILE_LIMIT:
                raise SlurmError(
                    f"the job's {name} is {len(text.encode()) // 1024} KiB: a file over {FILE_LIMIT // 1024} KiB "
                    "cannot travel in srun's environment (Linux's limit per variable); launch this job without "
                    "--scheduler slurm"
                )
            if var is None:
                var = FILE_VAR.format(len(contents))
                contents[var] = text
            per_host.setdefault(host, {})[name] = var
    return contents, per_host


def wrap(job: dict[str, Any]) -> str:
    """The shell line each task runs its program through: per rank the variables from Slurm's, per
    host its own values (the host's meshccl environment first on PATH among them) and its job
    files written into its job directory, then the program."""
    _common, per_rank, per_host = split_env(job)
    _contents, files = job_files(job)
    parts = [f'{name}="${var}"' for name, var in per_rank.items()]
    exported = set(per_rank)
    arms = []
    for host in dict.fromkeys(r["host"] for r in sorted(job["ranks"], key=lambda r: r["rank"])):
        sets = []
        for name, value in per_host.get(host, {}).items():
            exported.add(name)
            if name == "PATH":
                sets.append(f'PATH={shlex.quote(value.removesuffix(":$PATH"))}:"$PATH"')
            else:
                sets.append(f"{name}={shlex.quote(value)}")
        arms.append(f"{shlex.quote(host)}) {' '.join(sets)} ;;" if sets else f"{shlex.quote(host)}) ;;")
    parts.append(
        f'case "$SLURMD_NODENAME" in {" ".join(arms)} '
        '*) echo "meshkit: $SLURMD_NODENAME is not a host of this job" >&2; exit 97 ;; esac'
    )
    if exported:
        parts.append(f"export {' '.join(sorted(exported))}")
    if any(files.values()):
        d = shlex.quote(job["job_dir"])
        # The job directory must be this user's own and private, as meshkit's agent makes sure: its
        # parent is world-writable and the job's name is public (squeue), so another user could have
        # made it first, or a link.
        parts.append(f"umask 077; mkdir -m 0700 {d} 2>/dev/null")
        parts.append(
            f'if [ -L {d} ] || [ ! -d {d} ] || [ ! -O {d} ] || [ "$(stat -c %a {d})" != 700 ]; then '
            f'echo "meshkit: {job["job_dir"]} on $SLURMD_NODENAME is not a private directory of $(id -un)" >&2; '
            "exit 97; fi"
        )
        for host, named in files.items():
            writes = []
            for name, var in named.items():
                tmp = f'{d}/.{name}."$SLURM_PROCID"'
                writes.append(f'printf %s "${var}" > {tmp} && mv -f {tmp} {d}/{shlex.quote(name)}')
            parts.append(f'if [ "$SLURMD_NODENAME" = {shlex.quote(host)} ]; then {" && ".join(writes)} || exit 97; fi')
        parts.append(f"unset {' '.join(sorted({v for named in files.values() for v in named.values()}))}")
    return "; ".join([*parts, 'exec "$@"'])


def srun_argv(job: dict[str, Any], *, partition: str | None = None, srun: str = "srun") -> list[str]:
    first = min(job["ranks"], key=lambda r: r["rank"])
    hosts = list(dict.fromkeys(r["host"] for r in sorted(job["ranks"], key=lambda r: r["rank"])))
    argv = [
        *UNMARKED,
        srun,
        "--job-name", job_name(job),
        "--nodes", str(len(hosts)),
        "--ntasks", str(job["world_size"]),
        "--distribution=arbitrary",
        "--kill-on-bad-exit=1",
        "--label",
        "--export=ALL",
    ]  # fmt: skip
    if job["runtime"] == "mpi":
        argv.append("--mpi=pmix")
    if job["runtime"] in EXCLUSIVE:
        argv.append("--exclusive")
    argv += time_limit(job)
    if partition:
        argv += ["--partition", partition]
    if first.get("cwd"):
        argv += ["--chdir", first["cwd"]]
    return [*argv, "--", "/bin/sh", "-c", wrap(job), "meshkit-rank", *first["argv"]]


def time_limit(job: dict[str, Any]) -> list[str]:
    """--time from the job's timeout (-t): Slurm ends the job even when nothing of meshkit is left
    to (a batch job, a srun that was killed)."""
    seconds = float(job.get("timeout") or 0)
    if seconds <= 0:
        return []
    whole = int(seconds) + (seconds > int(seconds))
    return [f"--time={whole // 60}:{whole % 60:02d}"]


def batch_output(job: dict[str, Any]) -> str:
    """Where a batch job's output goes, on its batch host (rank 0's host): srun's labelled lines of
    every rank. %j is Slurm's job id."""
    return f"/tmp/{job_name(job)}-%j.out"


def sbatch_argv(job: dict[str, Any], *, partition: str | None = None, sbatch: str = "sbatch") -> list[str]:
    """sbatch of a script that runs the same srun inside the allocation. The allocation is asked in
    ring order (SLURM_HOSTFILE in sbatch's environment); the script writes the ring again on the
    batch host for its srun, which needs the file there."""
    hosts = [r["host"] for r in sorted(job["ranks"], key=lambda r: r["rank"])]
    script = "; ".join(
        [
            'SLURM_HOSTFILE="$(mktemp)"',
            "export SLURM_HOSTFILE",
            f"printf '%s\\n' {' '.join(shlex.quote(h) for h in hosts)} > \"$SLURM_HOSTFILE\"",
            f"{shlex.join(srun_argv(job))}",
            "status=$?",
            'rm -f "$SLURM_HOSTFILE"',
            'exit "$status"',
        ]
    )
    argv = [
        *UNMARKED,
        sbatch,
        "--parsable",
        "--job-name", job_name(job),
        "--nodes", str(len(dict.fromkeys(hosts))),
        "--ntasks", str(job["world_size"]),
        "--distribution=arbitrary",
        "--export=ALL",
        "--output", batch_output(job),
    ]  # fmt: skip
    if job["runtime"] in EXCLUSIVE:
        argv.append("--exclusive")
    argv += time_limit(job)
    if partition:
        argv += ["--partition", partition]
    return [*argv, "--wrap", script]


def batch_job_id(text: str) -> str | None:
    """The job id ``sbatch --parsable`` printed ("12" or "12;cluster")."""
    for line in text.splitlines():
        m = re.match(r"^\s*(\d+)(?:;\S+)?\s*$", line)
        if m:
            return m.group(1)
    return None


def host_job(
    job: dict[str, Any],
    connections: Mapping[str, dict[str, Any]],
    *,
    submit_host: str,
    secret_values: Mapping[str, str],
    host_timeout: float | None = None,
    partition: str | None = None,
    batch: bool = False,
) -> HostJob:
    """The job's one process, srun (or with ``batch`` sbatch, which returns once Slurm queued the
    job), run by an agent on ``submit_host`` (as rank -1)."""
    if job["runtime"] not in RUNTIMES:
        raise SlurmError(
            f"--scheduler slurm runs {', '.join(RUNTIMES)} jobs so far, not {job['runtime']}; "
            "launch it without --scheduler (meshkit's own launcher)"
        )
    if submit_host not in connections:
        raise SlurmError(f"submit host {submit_host!r} is not a host of this job ({', '.join(sorted(connections))})")
    conn = dict(connections[submit_host])
    if host_timeout is not None:
        conn["host_timeout"] = host_timeout
    common, _per_rank, _per_host = split_env(job)
    contents, _files = job_files(job)
    env = {
        JOB_ID_ENV: str(job["job_id"]),
        **common,
        **contents,
        **with_secrets(job, secret_values),
        "SLURM_HOSTFILE": f"{job['job_dir']}/{HOSTFILE_NAME}",
    }
    return HostJob(
        submit_host,
        agent_argv(conn, conn.get("python") or "python3"),
        job["job_dir"],
        [
            {
                "rank": -1,
                "argv": sbatch_argv(job, partition=partition) if batch else srun_argv(job, partition=partition),
                "env": env,
                "cwd": None,
                "driver": "sbatch" if batch else "srun",
            }
        ],
        {HOSTFILE_NAME: slurm_hostfile(job)},
    )


def submitted(job: dict[str, Any], outcome: Any) -> tuple[str | None, str]:
    """After a --batch launch: (the Slurm job id sbatch printed, or None; what to tell the user)."""
    said = "\n".join(outcome.ranks[0].tail) if outcome.ranks else ""
    number = batch_job_id(said)
    if number is None:
        return None, f"sbatch exited 0 but printed no Slurm job id: {said!r}"
    output = batch_output(job).replace("%j", number)
    return number, (
        f"submitted Slurm batch job {number} ({job_name(job)}): {job['world_size']} ranks in ring order; their "
        f"output (labelled by rank) goes to {submit_host_of(job)}:{output}. squeue -j {number} shows it, "
        f"scancel {number} stops it"
    )


def submit_host_of(job: dict[str, Any], given: str | None = None) -> str:
    """The host srun/sbatch runs on: the one given, else rank 0's."""
    return given or min(job["ranks"], key=lambda r: r["rank"])["host"]


def hosts_for(
    job: dict[str, Any],
    connections: Mapping[str, dict[str, Any]],
    secret_values: Mapping[str, str],
    *,
    submit_host: str | None = None,
    host_timeout: float | None = None,
    partition: str | None = None,
    batch: bool = False,
) -> list[HostJob]:
    """The Launcher's HostJobs of a job through Slurm (as launch_mpi.hosts_for for the others)."""
    return [
        host_job(
            job,
            connections,
            submit_host=submit_host_of(job, submit_host),
            secret_values=secret_values,
            host_timeout=host_timeout,
            partition=partition,
            batch=batch,
        )
    ]


class Lines(launcher.Lines):
    """srun's ``--label`` output taken apart per task (Slurm's task r is the plan's rank r); srun's
    own lines ("srun: ...") are shown as its own."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.hosts = {r["rank"]: r["host"] for r in job["ranks"]}

    def split(self, rank: Any, line: str) -> list[launcher.Shown]:
        if rank.rank >= 0:
            return [(rank.rank, rank.host, line)]
        m = LABEL.match(line)
        if m and int(m.group(1)) in self.hosts:
            r = int(m.group(1))
            return [(r, self.hosts[r], m.group(2))]
        return [(None, rank.host, line)]

    def __call__(self, rank: Any, line: str) -> list[str]:
        shown = self.split(rank, line)
        return [f"[{rank.driver}] {text}" if r is None else f"[{r}|{host}] {text}" for r, host, text in shown]


def own_lines(outcome: Any) -> str:
    """srun's own lines ("srun: ..."), in order: from srun.log in the job's log directory (every line
    it printed), else its last lines (which the ranks' labelled output may have pushed out)."""
    try:
        text = (Path(outcome.log_dir) / "srun.log").read_text(errors="replace")
    except (OSError, TypeError, AttributeError):
        failed = outcome.failed or outcome.ranks
        text = "\n".join(failed[0].tail) if failed else ""
    return "\n".join(line for line in text.splitlines() if not LABEL.match(line))


def first_failure(text: str) -> tuple[int, str, int | None, str] | None:
    """(task, host, exit code or None, srun's words) of the task srun reported first (a non-zero exit
    code, or a signal such as a segmentation fault), before Slurm stopped the rest: the tasks it
    killed because of it come after. None when srun reported no task, or when the step was aborted
    from outside (scancel, a node lost) before any task failed."""
    for line in text.splitlines():
        if ABORTED in line or CANCELLED.search(line) or "forcing job termination" in line:
            return None
        m = TASK_ERROR.search(line)
        if not m:
            continue
        host, tasks, what = m.group(1), m.group(2), m.group(3).strip()
        code = EXITED.search(what)
        if code and int(code.group(1)) == 0:
            continue
        return int(re.split(r"[,-]", tasks)[0]), host, int(code.group(1)) if code else None, what
    return None


def explain(job: dict[str, Any], outcome: Any) -> tuple[str, list[tuple[str, list[str]]]]:
    """Why a Slurm job failed and (heading, last lines) of the rank to blame: the first task srun
    reported failing (its exit code, or the signal it died of); else, when the step was aborted from
    outside (scancel, a node lost), the job; a timeout or an interrupt keeps its own reason."""
    failed = outcome.failed or [r for r in outcome.ranks if r.state == "timeout"]
    reason = outcome.reason
    if not failed:
        return reason, []
    driver = failed[0]
    last = (f"{driver.driver} on {driver.host}: {driver.state}, {driver.describe()}", list(driver.tail)[-10:])
    if driver.state == "timeout":
        return reason, [last]
    said = own_lines(outcome)
    found = first_failure(said)
    if found is not None:
        rank, host, code, what = found
        tail = (outcome.rank_output.get(rank) or (host, []))[1]
        if code is not None:
            reason = f"rank {rank} ({host}) exited with exit code {code} (reported by srun; Slurm stopped the others)"
            return reason, [(f"rank {rank} on {host}: failed, exit code {code}", list(tail)[-10:])]
        reason = f"rank {rank} ({host}): {what} (reported by srun; Slurm stopped the others)"
        return reason, [(f"rank {rank} on {host}: {what}", list(tail)[-10:])]
    if ABORTED in said or CANCELLED.search(said):
        reason = (
            f"the Slurm job step was cancelled from outside (scancel, or a node lost): "
            f"{driver.driver} {driver.describe()}"
        )
    return reason, [last]


def exit_code(job: dict[str, Any], outcome: Any) -> int | None:
    """The exit code of the rank to blame, when srun named one."""
    if not outcome.failed:
        return None
    found = first_failure(own_lines(outcome))
    return found[2] if found and found[2] else None
