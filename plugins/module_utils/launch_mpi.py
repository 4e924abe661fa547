# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""MPI jobs: one ``mpirun`` on the controller, reaching every host through the inventory's own
connection.

mpirun's remote shell agent (``plm_rsh_agent``) is launch_connection.py run as a program, with
the job's connections file, and tree spawning is off: only the controller starts the hosts'
daemons, over the same connections Ansible uses, so no host needs SSH to another (plain mpirun
does). meshkit supervises mpirun like any rank (timeout, Ctrl-C, stdin); mpirun stops every rank
when one fails, and meshkit names that rank from mpirun's report. ``--tag-output`` lines are
shown as the rank's own (``[5|node3] ...``); ``--output-filename`` keeps each rank's output on
the controller, in ``<log dir>/mpi/1/rank.N/``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils import launch_connection
from ansible_collections.meshkit.cluster.plugins.module_utils.launcher import HostJob, agent_argv, host_jobs

TAG = re.compile(r"^\[\d+,(\d+)\]<(?:stdout|stderr|stddiag)>:(.*)$", re.S)
ANY_TAG = re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr|stddiag)>:")
FIRST_FAILURE = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*\n\s*Exit code:\s*(-?\d+)")
# Set per rank by the plan; an MPI rank has OMPI_COMM_WORLD_RANK / _LOCAL_RANK from mpirun instead.
PER_RANK = ("MESHKIT_RANK", "MESHKIT_LOCAL_RANK", "MESHKIT_HOST")


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


def mpirun_argv(job: dict[str, Any], log_dir: Path, connections_file: Path, *, mpirun: str, as_root: bool) -> list[str]:
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
        "--output-filename", str(log_dir / "mpi"),
        "-mca", "plm_rsh_agent", " ".join(agent),
        "-mca", "plm_rsh_no_tree_spawn", "1",
    ]  # fmt: skip
    if as_root:
        argv.append("--allow-run-as-root")
    if first.get("cwd"):
        argv += ["--wdir", first["cwd"]]
    for name in common_env(job):
        argv += ["-x", name]
    return [*argv, "--", *first["argv"]]


def host_job(
    job: dict[str, Any], connections: dict[str, dict[str, Any]], log_dir: Path, host_timeout: float | None = None
) -> HostJob:
    """The job's one process, mpirun, run by a local agent on the controller (as rank -1). Writes
    the MPI hostfile and the hosts' connections (mode 0600) into the log directory; with
    ``host_timeout``, each ssh connection to an orted gets keepalives within it."""
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
    env = common_env(job)
    argv = mpirun_argv(job, log_dir, connections_file, mpirun=mpirun, as_root=os.geteuid() == 0)
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


def rank_tail(log_dir: Path, rank: int, lines: int = 10) -> list[str]:
    """The last lines a rank wrote (stdout then stderr), from mpirun's per-rank files."""
    out: list[str] = []
    for name in ("stdout", "stderr"):
        path = log_dir / "mpi" / "1" / f"rank.{rank}" / name
        if path.exists():
            out += [split_line(line)[1] if split_line(line) else line for line in path.read_text().splitlines()]
    return out[-lines:]


# --- what the action and the CLI share ---------------------------------------------------------


def hosts_for(
    job: dict[str, Any],
    connections: dict[str, dict[str, Any]],
    token: str,
    log_dir: Path,
    host_timeout: float | None = None,
) -> list[HostJob]:
    """The job's HostJobs: one agent per host, or for MPI the one mpirun on the controller."""
    if job["runtime"] == "mpi":
        return [host_job(job, connections, log_dir, host_timeout)]
    return host_jobs(job, connections, token, host_timeout)


class Lines:
    """Output lines as shown: ``[rank|host] text``. mpirun's ``--tag-output`` tags every write of a
    rank, not every line, so writes of several ranks can share one line of mpirun's output (an
    unbuffered Python ``print`` writes its text and its newline apart). The pieces are put back
    together per rank: a piece that ends mpirun's line completes its rank's line, the others wait
    in that rank's buffer. Untagged text is mpirun's own."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.hosts = {r["rank"]: r["host"] for r in job["ranks"]}
        self.partial: dict[int, str] = {}

    def __call__(self, rank: Any, line: str) -> list[str]:
        if rank.rank >= 0:
            return [f"[{rank.rank}|{rank.host}] {line}"]
        tags = list(ANY_TAG.finditer(line))
        out = [f"[mpirun] {line[: tags[0].start()] if tags else line}"] if not tags or tags[0].start() > 0 else []
        for i, tag in enumerate(tags):
            r = int(tag.group(1))
            piece = line[tag.end() : tags[i + 1].start() if i + 1 < len(tags) else len(line)]
            if i + 1 < len(tags):
                self.partial[r] = self.partial.get(r, "") + piece
            else:
                out.append(f"[{r}|{self.hosts.get(r, '?')}] {self.partial.pop(r, '')}{piece}")
        return out


def explain(job: dict[str, Any], outcome: Any) -> tuple[str, list[tuple[str, list[str]]]]:
    """Why the job failed and, per failed rank, (heading, last lines). For MPI the rank mpirun
    reported first, with its own last lines from mpirun's per-rank files."""
    failed = outcome.failed or [r for r in outcome.ranks if r.state == "timeout"]
    if job["runtime"] == "mpi" and failed:
        mpirun = failed[0]
        found = first_failure("\n".join(mpirun.tail))
        if found is not None:
            rank, code = found
            host = {r["rank"]: r["host"] for r in job["ranks"]}.get(rank, "?")
            reason = f"rank {rank} ({host}) exit code {code} (reported by mpirun, {mpirun.describe()})"
            return reason, [(f"rank {rank} on {host}: failed, exit code {code}", rank_tail(outcome.log_dir, rank))]
    return outcome.reason, [(f"{r.label} on {r.host}: {r.state}, {r.describe()}", list(r.tail)[-10:]) for r in failed]
