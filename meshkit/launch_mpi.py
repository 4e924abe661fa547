# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""MPI jobs: one ``mpirun`` on the controller, reaching every host through the inventory's own
connection.

mpirun's remote shell agent (``plm_rsh_agent``) is launch_connection.py run as a program, with
the job's connections file, and tree spawning is off: only the controller starts the hosts'
daemons, over the same connections Ansible uses, so no host needs SSH to another (plain mpirun
does). meshkit supervises mpirun like any rank (timeout, Ctrl-C, stdin); mpirun stops every rank
when one fails, and meshkit names that rank from mpirun's report. ``--tag-output`` lines are
taken apart per MPI rank (Lines): shown as the rank's own (``[5|node3] ...``), kept in the
controller's ``<log dir>/rank-N.log`` with each rank's last lines for the summary and the failure
message. (mpirun's ``--output-filename`` is not used: each host's orted would write those files on
its own host, under the controller's path.) An error mpirun reports about itself and does not
recover from (a daemon that cannot start, a directory it cannot make) fails the job within
MPI_ERROR_GRACE seconds instead of leaving it to the timeout.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from meshkit import launch_connection, launcher
from meshkit.launch_plan import JOB_ID_ENV
from meshkit.launcher import HostJob, agent_argv, host_jobs, with_secrets

TAG = re.compile(r"^\[\d+,(\d+)\]<(?:stdout|stderr|stddiag)>:(.*)$", re.S)
ANY_TAG = re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr|stddiag)>:")
FIRST_FAILURE = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*\n\s*Exit code:\s*(-?\d+)")
# Set per rank by the plan; an MPI rank has OMPI_COMM_WORLD_RANK / _LOCAL_RANK from mpirun instead.
PER_RANK = ("MESHKIT_RANK", "MESHKIT_LOCAL_RANK", "MESHKIT_HOST")
# mpirun's own errors that it may not recover from (Open MPI 4.1 help texts and error logs): seen in
# its untagged output, they fail the job unless mpirun has exited within MPI_ERROR_GRACE seconds.
# (A mkdir that failed on a host's orted left mpirun hanging until the job's timeout.)
FATAL = (
    "A call to mkdir was unable to create",
    "ORTE was unable to reliably start",
    "An ORTE daemon has unexpectedly failed",
    "ORTE has lost communication with",
    "ORTE does not know how to route",
    "mpirun was unable to launch",
    "mpirun was unable to start",
    "mpirun was unable to find the specified executable",
    "It looks like orte_init failed",
)
# mpirun's words when a rank exited non-zero, before (and sometimes instead of) the report that names it.
UNNAMED = "1 process returned a non-zero exit code"
ERROR_LOG = re.compile(r"\b(?:ORTE|OPAL|OMPI|PRTE|PMIX)_ERROR_LOG\b|\bPMIX ERROR\b")
BANNER = re.compile(r"^-{20,}\s*$")
MPI_ERROR_GRACE = 5.0


class MpiError(ValueError):
    """The controller cannot run this MPI job (no mpirun, a path mpirun cannot take)."""


def hostfile(job: dict[str, Any]) -> str:
    """``host slots=N`` in ring order: ``-map-by slot`` then gives MPI rank r the plan's rank r."""
    slots: dict[str, int] = {}
    for r in sorted(job["ranks"], key=lambda r: r["rank"]):
        slots[r["host"]] = slots.get(r["host"], 0) + 1
    return "".join(f"{host} slots={n}\n" for host, n in slots.items())


def first_rank(job: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's spec: mpirun starts every rank with its program, working directory and the
    environment common to all."""
    return min(job["ranks"], key=lambda r: r["rank"])


def common_env(job: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in first_rank(job)["env"].items() if k not in PER_RANK}


def mpirun_argv(
    job: dict[str, Any],
    log_dir: Path,
    connections_file: Path,
    *,
    mpirun: str,
    as_root: bool,
    env_names: Iterable[str] | None = None,
) -> list[str]:
    """mpirun's command line. The ranks' environment goes by name only (``-x NAME``, every name of
    ``env_names``, else of common_env()): the values are in mpirun's own environment, so a secret
    (the job token) is on no command line that ps shows."""
    agent = [sys.executable, str(Path(launch_connection.__file__).resolve()), str(connections_file)]
    if any(" " in word for word in agent):
        # mpirun splits plm_rsh_agent at spaces.
        raise MpiError(f"mpirun cannot take a remote shell path with a space: {shlex.join(agent)}")
    first = first_rank(job)
    argv = [
        mpirun,
        "--hostfile", str(log_dir / "mpi-hostfile"),
        "-np", str(job["world_size"]),
        "-bind-to", "none",
        "-map-by", "slot",
        "--tag-output",
        "-mca", "plm_rsh_agent", " ".join(agent),
        "-mca", "plm_rsh_no_tree_spawn", "1",
    ]  # fmt: skip
    if as_root:
        argv.append("--allow-run-as-root")
    if first.get("cwd"):
        argv += ["--wdir", first["cwd"]]
    for name in dict.fromkeys(common_env(job) if env_names is None else env_names):
        argv += ["-x", name]
    return [*argv, "--", *first["argv"]]


def host_job(
    job: dict[str, Any],
    connections: dict[str, dict[str, Any]],
    log_dir: Path,
    host_timeout: float | None = None,
    *,
    secret_values: Mapping[str, str],
) -> HostJob:
    """The job's one process, mpirun, run by a local agent on the controller (as rank -1). Writes
    the MPI hostfile and the hosts' connections (mode 0600) into the log directory; with
    ``host_timeout``, each ssh connection to an orted gets keepalives within it. mpirun's
    environment is every rank's, the values of the job's secrets (``secret_values``: the job token
    and the user's) put in; mpirun passes each on to every MPI rank (-x NAME)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise MpiError(
            "runtime mpi: mpirun is not on the controller's PATH; install Open MPI (apt install openmpi-bin)"
        )
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "mpi-hostfile").write_text(hostfile(job))
    connections_file = log_dir / "connections.json"
    with open(os.open(connections_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
        if host_timeout is not None:
            connections = {host: dict(conn, host_timeout=host_timeout) for host, conn in connections.items()}
        handle.write(json.dumps(connections, indent=1) + "\n")
    env = {JOB_ID_ENV: str(job["job_id"]), **common_env(job), **with_secrets(job, secret_values)}
    argv = mpirun_argv(job, log_dir, connections_file, mpirun=mpirun, as_root=os.geteuid() == 0, env_names=env)
    return HostJob(
        "controller",
        agent_argv({"kind": "local"}, sys.executable),
        str(log_dir / "mpirun"),
        [{"rank": -1, "argv": argv, "env": env, "cwd": None}],
    )


def split_line(line: str) -> tuple[int, str] | None:
    """(MPI rank, text) of a ``--tag-output`` line, else None (mpirun's own). mpirun tags every
    write, not every line, so a line a rank wrote in pieces carries its tag again inside; those
    are taken out."""
    m = TAG.match(line)
    if not m:
        return None
    rank = m.group(1)
    return int(rank), re.sub(rf"\[\d+,{rank}\]<(?:stdout|stderr|stddiag)>:", "", m.group(2))


def first_failure(text: str) -> tuple[int, int] | None:
    """(rank, exit code) of the first rank mpirun saw fail, from its report."""
    m = FIRST_FAILURE.search(text)
    return (int(m.group(1)), int(m.group(2))) if m else None


# --- what the action and the CLI share ---------------------------------------------------------


def hosts_for(
    job: dict[str, Any],
    connections: dict[str, dict[str, Any]],
    secret_values: Mapping[str, str],
    log_dir: Path,
    host_timeout: float | None = None,
) -> list[HostJob]:
    """The job's HostJobs: one agent per host, or for MPI the one mpirun on the controller.
    ``secret_values``: launch_plan.secret_values() (the job token, the user's secrets)."""
    if job["runtime"] == "mpi":
        return [host_job(job, connections, log_dir, host_timeout, secret_values=secret_values)]
    return host_jobs(job, connections, secret_values, host_timeout)


class Lines(launcher.Lines):
    """mpirun's output taken apart per MPI rank. ``--tag-output`` tags every write of a rank, not
    every line, so writes of several ranks can share one line of mpirun's output (an unbuffered
    Python ``print`` writes its text and its newline apart). The pieces are put back together per
    rank: a piece that ends mpirun's line completes its rank's line, the others wait in that rank's
    buffer. Untagged text is mpirun's own; an error there that mpirun does not recover from (FATAL,
    ERROR_LOG) is reported by fault() once mpirun has not exited within MPI_ERROR_GRACE seconds."""

    def __init__(self, job: dict[str, Any], grace: float = MPI_ERROR_GRACE) -> None:
        self.hosts = {r["rank"]: r["host"] for r in job["ranks"]}
        self.partial: dict[int, str] = {}
        self.grace = grace
        self.banner: list[str] | None = None  # the lines of an Open MPI message box being read
        self.error: tuple[float, str] | None = None  # (when, what) of the first fatal error seen

    def split(self, rank: Any, line: str) -> list[launcher.Shown]:
        if rank.rank >= 0:
            return [(rank.rank, rank.host, line)]
        tags = list(ANY_TAG.finditer(line))
        out: list[launcher.Shown] = []
        if not tags or tags[0].start() > 0:
            own = line[: tags[0].start()] if tags else line
            self._mpirun_says(own)
            out.append((None, rank.host, own))
        for i, tag in enumerate(tags):
            r = int(tag.group(1))
            piece = line[tag.end() : tags[i + 1].start() if i + 1 < len(tags) else len(line)]
            if i + 1 < len(tags):
                self.partial[r] = self.partial.get(r, "") + piece
            else:
                out.append((r, self.hosts.get(r, "?"), self.partial.pop(r, "") + piece))
        return out

    def __call__(self, rank: Any, line: str) -> list[str]:
        """The lines as shown: ``[rank|host] text``, ``[mpirun] text``."""
        return [f"[mpirun] {text}" if r is None else f"[{r}|{host}] {text}" for r, host, text in self.split(rank, line)]

    def finish(self) -> list[launcher.Shown]:
        out = [(r, self.hosts.get(r, "?"), text) for r, text in sorted(self.partial.items())]
        self.partial.clear()
        return out

    def _mpirun_says(self, text: str) -> None:
        if self.error is not None:
            return
        if BANNER.match(text):
            if self.banner is None:
                self.banner = []
                return
            body, self.banner = self.banner, None
            if any(phrase in line for line in body for phrase in FATAL):
                self.error = (time.monotonic(), " ".join(" ".join(body).split())[:400])
            return
        if self.banner is not None:
            self.banner.append(text)
        elif ERROR_LOG.search(text) or any(phrase in text for phrase in FATAL):
            self.error = (time.monotonic(), " ".join(text.split())[:400])

    def fault(self, now: float) -> tuple[int, str] | None:
        if self.error is None or now - self.error[0] < self.grace:
            return None
        return -1, f"reported an error and did not exit within {self.grace:g} s: {self.error[1]}"


def explain(job: dict[str, Any], outcome: Any) -> tuple[str, list[tuple[str, list[str]]]]:
    """Why the job failed and, per failed rank, (heading, last lines). For MPI the rank mpirun
    reported first, with its own last lines, as taken from mpirun's tagged output."""
    failed = outcome.failed or [r for r in outcome.ranks if r.state == "timeout"]
    reason = outcome.reason
    if job["runtime"] == "mpi" and failed:
        mpirun = failed[0]
        said = "\n".join(mpirun.tail)
        found = first_failure(said)
        if found is not None:
            rank, code = found
            host = {r["rank"]: r["host"] for r in job["ranks"]}.get(rank, "?")
            reason = f"rank {rank} ({host}) exit code {code} (reported by mpirun, {mpirun.describe()})"
            tail = (outcome.rank_output.get(rank) or (host, []))[1]
            return reason, [(f"rank {rank} on {host}: failed, exit code {code}", list(tail)[-10:])]
        if UNNAMED in " ".join(said.split()):
            # About one failing job in ten, Open MPI 4.1 says a process failed but not which one.
            reason += (
                ": a rank exited with a non-zero code and mpirun did not say which "
                "(its report was cut short); every rank's output is in its rank-N.log"
            )
    return reason, [(f"{r.label} on {r.host}: {r.state}, {r.describe()}", list(r.tail)[-10:]) for r in failed]
