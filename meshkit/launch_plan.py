# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A launch, planned on the controller from the one topology model: ranks, their environment
per runtime, the files each host needs and the ports that must be free.

Global ranks are in ring order (hostfiles.ranks): host by host along the ring, each host's ranks
together, so rank r and r+1 share a cable or a host. Every runtime gets the same rank numbers.
meshccl and torch ranks both get the job's meshccl.json (MESHCCL_RANK, MESHCCL_WORLD_SIZE,
MESHCCL_HOSTFILE): under torch, ``init_process_group("meshccl")`` then connects over every cable as
planned, MESHCCL_RANK being torch's RANK.

Secrets: the plan never holds a secret value. Every rank of every runtime gets ``MESHCCL_JOB_ID``
(the job id) and ``MESHCCL_TOKEN``, a fresh job token made when the ranks start; the user's
variables that are secrets (is_secret(): a name with TOKEN, KEY, SECRET or PASSWORD in it, or one
marked secret) are planned as HIDDEN and listed in the job's ``secret_env``. Only the launcher puts
the values in (launcher.host_jobs), in memory, on their way to the ranks: job.json, the logs, the
summaries and Ansible's results show HIDDEN.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils import hostfiles
from ansible_collections.meshkit.cluster.plugins.module_utils.defaults import MASTER_PORT, MESHCCL_PORT

from meshkit.launch_settings import (
    HINTS,
    RUNTIMES,  # noqa: F401 - launch_plan.RUNTIMES, as it was
    default,
    plain,
    validator,
)

# The runtimes whose ranks get meshccl's hostfile of the job (MESHCCL_RANK, MESHCCL_WORLD_SIZE,
# MESHCCL_HOSTFILE): meshccl's own, and torch's, for the "meshccl" process-group backend.
MESHCCL_HOSTFILE_RUNTIMES = ("meshccl", "torch")

# What a secret's value is shown as, wherever the environment is displayed or written.
HIDDEN = "<hidden>"
# A variable whose name holds one of these (any case) is a secret.
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
# Every rank of every runtime: the job's token (a secret, fresh per job) and its id (meshccl mixes
# the id into its authentication, so a token of another job is no use).
TOKEN_ENV = "MESHCCL_TOKEN"
JOB_ID_ENV = "MESHCCL_JOB_ID"


def is_secret(name: str, marked: Iterable[str] = ()) -> bool:
    """Whether the value of environment variable ``name`` is a secret: its name holds TOKEN, KEY,
    SECRET or PASSWORD (any case), or it is one of ``marked`` (--secret / launch_secret_env). The
    one rule: every place that shows, writes or withholds an environment asks here."""
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS) or upper in {str(m).upper() for m in marked}


def redact(env: Mapping[str, Any], marked: Iterable[str] = ()) -> dict[str, Any]:
    """``env`` as it may be shown: every secret's value HIDDEN."""
    marked = list(marked)
    return {k: (HIDDEN if is_secret(k, marked) else v) for k, v in env.items()}


def new_token() -> str:
    """A fresh job token: 32 random bytes, hex."""
    return secrets.token_hex(32)


class LaunchError(ValueError):
    """Bad launch input, named by its variable."""


def validate(given: dict[str, Any]) -> dict[str, Any]:
    """The launch variables (without their ``launch_`` prefix; launch_settings' table), checked
    and normalised. Unset ones stay unset: their defaults are the table's, where they are used."""
    doc = {k: v for k, v in given.items() if v is not None or k == "cwd"}
    checked = validator()
    if not checked.validate(doc):
        problems = [
            f"launch_{name} = {_shown(name, doc)!r}: {'; '.join(plain(errs))}; {HINTS.get(name, '')}".rstrip("; ")
            for name, errs in sorted(checked.errors.items())
        ]
        raise LaunchError("bad launch settings; nothing was started:\n  - " + "\n  - ".join(problems))
    out = checked.document
    program = out["program"]
    if isinstance(program, str):
        try:
            program = shlex.split(program)
        except ValueError as exc:
            raise LaunchError(f"launch_program = {out['program']!r}: {exc}; {HINTS['program']}") from exc
        if not program:
            raise LaunchError(f"launch_program is empty; {HINTS['program']}")
    out["program"] = program
    out["env"] = {k: _env_value(v) for k, v in (out.get("env") or {}).items()}
    out["secret_env"] = list(dict.fromkeys(out.get("secret_env") or []))
    return out


def _shown(name: str, doc: dict[str, Any]) -> Any:
    """A setting's value as an error message may show it: an environment's secrets hidden."""
    value = doc.get(name)
    if name == "env" and isinstance(value, Mapping):
        marked = doc.get("secret_env")
        return redact({str(k): v for k, v in value.items()}, marked if isinstance(marked, list) else [])
    return value


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


@dataclass
class Job:
    job_id: str
    runtime: str
    world_size: int
    ranks: list[dict[str, Any]]  # rank, host, node_rank, local_rank, argv, env, cwd
    files: dict[str, dict[str, str]]  # host -> name -> text, written into the job directory
    job_dir: str
    ports: dict[str, list[list[Any]]] = field(default_factory=dict)  # host -> [[address, port, what], ...]
    notes: list[str] = field(default_factory=list)
    # The variables every rank gets whose values are secrets, HIDDEN in ``ranks``: the launcher puts
    # the values in (launcher.host_jobs). TOKEN_ENV always; then the user's secrets.
    secret_env: list[str] = field(default_factory=lambda: [TOKEN_ENV])

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "runtime": self.runtime,
            "world_size": self.world_size,
            "job_dir": self.job_dir,
            "ranks": self.ranks,
            "files": self.files,
            "ports": self.ports,
            "notes": self.notes,
            "secret_env": self.secret_env,
        }

    def hosts(self) -> list[str]:
        seen: list[str] = []
        for r in self.ranks:
            if r["host"] not in seen:
                seen.append(r["host"])
        return seen


def build(
    plan: dict[str, Any],
    settings: dict[str, Any],
    *,
    job_id: str,
    state_dir: str,
    cluster: str,
    ssh: dict[str, str],
    nccl: dict[str, dict[str, str]] | None = None,
    management_interface: dict[str, str] | None = None,
    master_port: int = MASTER_PORT,
    meshccl_port: int = MESHCCL_PORT,
    bin_dirs: dict[str, str] | None = None,
) -> Job:
    """Plan every rank of a job. ``settings`` comes from validate(). ``bin_dirs``: per host, a
    directory put in front of the ranks' PATH (meshccl's virtual environment), unless the user's
    own env sets PATH. No secret value is kept: the user's secrets (is_secret(), with the
    settings' ``secret_env`` marked) and the job token are HIDDEN and named in ``secret_env``."""
    runtime = settings.get("runtime") or default("runtime")
    per_host = int(settings.get("ranks_per_host") or default("ranks_per_host"))
    mlx_port = int(settings.get("mlx_port") or default("mlx_port"))
    nccl = nccl or {}
    management_interface = management_interface or {}
    order = hostfiles.ring_order(plan)
    if len(order) < 1:
        raise LaunchError("the topology model has no hosts; run setup.yml first")
    ranks = hostfiles.ranks(plan, per_host)
    world = len(ranks)
    job_dir = f"{state_dir.rstrip('/')}/jobs/{job_id}"
    fp = hostfiles.fingerprint(plan)
    files: dict[str, dict[str, str]] = {h: {} for h in order}
    ports: dict[str, list[list[Any]]] = {h: [] for h in order}
    notes: list[str] = []

    if runtime in MESHCCL_HOSTFILE_RUNTIMES:
        # torch too: a program that calls init_process_group("meshccl") (or meshccl.init()) under
        # torch's variables then connects over every cable as planned, not through a rendezvous on
        # the management network. Its ranks are torch's: RANK and MESHCCL_RANK are the same number.
        if runtime == "torch" and meshccl_port <= master_port < meshccl_port + per_host:
            raise LaunchError(
                f"meshkit_master_port {master_port} (torch's store, on {order[0]}) is one of meshccl's ports "
                f"{meshccl_port}-{meshccl_port + per_host - 1} (meshkit_meshccl_port {meshccl_port}, one per rank "
                "of a host); set meshkit_master_port or meshkit_meshccl_port so that they do not overlap"
            )
        doc = hostfiles.meshccl_hostfile(plan, ssh, per_host, meshccl_port, cluster, fp)
        text = hostfiles.dumps(doc)
        for h in order:
            files[h]["meshccl.json"] = text
        for r in doc["ranks"]:
            addresses = [link["address"] for link in r["links"]]
            if per_host > 1:
                addresses.append("127.0.0.1")
            for address in addresses:
                ports[r["host"]].append([address, r["port"], f"meshccl rank {r['rank']}"])
    if runtime == "mlx":
        backend = plan.get("backend") or "ring"
        if backend == "ring":
            if not hostfiles.has_full_ring(plan) and len(order) > 1:
                raise LaunchError(
                    "runtime mlx needs a ring through every host and the cabling has none; "
                    "run with launch_runtime=meshccl or torch, or cable a ring"
                )
            ring = hostfiles.mlx_ring_runtime(hostfiles.mlx_hostfile(plan, ssh), mlx_port, ranks_per_host=per_host)
            text = json.dumps(ring) + "\n"
            for h in order:
                files[h]["mlx-ring.json"] = text
            for r, row in zip(ranks, ring, strict=True):
                for entry in row:
                    address, port = entry.rsplit(":", 1)
                    ports[r["host"]].append([address, int(port), f"MLX ring rank {r['rank']}"])
        else:
            if per_host != 1:
                raise LaunchError(f"backend {backend} (RDMA) runs one rank per host; set launch_ranks_per_host=1")
            devices = [entry["rdma"] for entry in hostfiles.mlx_hostfile(plan, ssh)["hosts"]]
            text = json.dumps(devices) + "\n"
            for h in order:
                files[h]["mlx-ibv-devices.json"] = text
            ports[order[0]].append(["0.0.0.0", mlx_port, "JACCL coordinator"])
    elif runtime == "torch":
        ports[order[0]].insert(0, ["0.0.0.0", master_port, "torch MASTER_PORT (rank 0's store)"])

    marked = list(settings.get("secret_env") or [])
    user_env = dict(settings.get("env") or {})
    hidden = [TOKEN_ENV, *(name for name in user_env if name != TOKEN_ENV and is_secret(name, marked))]
    user_env = {name: (HIDDEN if name in hidden else value) for name, value in user_env.items()}
    out_ranks = []
    for r in ranks:
        host = r["host"]
        env = {
            "MESHKIT_JOB_ID": job_id,
            # Every runtime: meshccl may be used under any of them (torchrun's variables, MLX's).
            JOB_ID_ENV: job_id,
            TOKEN_ENV: HIDDEN,
            "MESHKIT_RANK": str(r["rank"]),
            "MESHKIT_WORLD_SIZE": str(world),
            "MESHKIT_LOCAL_RANK": str(r["local_rank"]),
            "MESHKIT_HOST": host,
            # Ranks' output is read through a pipe; without this Python holds it in 8 KiB blocks.
            "PYTHONUNBUFFERED": "1",
        }
        if runtime == "mlx":
            env["MLX_RANK"] = str(r["rank"])
            env["MLX_WORLD_SIZE"] = str(world)
            if (plan.get("backend") or "ring") == "ring":
                env["MLX_HOSTFILE"] = f"{job_dir}/mlx-ring.json"
            else:
                env["MLX_IBV_DEVICES"] = f"{job_dir}/mlx-ibv-devices.json"
                env["MLX_JACCL_COORDINATOR"] = f"{ssh.get(order[0], order[0])}:{mlx_port}"
        elif runtime == "torch":
            env |= hostfiles.torch_vars(
                plan,
                host,
                ssh,
                per_host,
                master_port,
                nccl.get(host) or {},
                management_interface.get(host),
                r["local_rank"],
            )
        elif runtime == "mpi" and management_interface:
            # Open MPI's TCP transport wants every pair of ranks reachable on the interfaces it
            # uses; point-to-point cables reach only the hosts they join, the management network
            # reaches all (as for Gloo).
            env["OMPI_MCA_btl_tcp_if_include"] = ",".join(sorted(set(filter(None, management_interface.values()))))
        if runtime in MESHCCL_HOSTFILE_RUNTIMES:
            env |= {
                "MESHCCL_RANK": str(r["rank"]),
                "MESHCCL_WORLD_SIZE": str(world),
                "MESHCCL_HOSTFILE": f"{job_dir}/meshccl.json",
            }
        env |= user_env
        spec = {"argv": list(settings["program"]), "env": env, "cwd": settings.get("cwd")}
        if (bin_dirs or {}).get(host) and "PATH" not in env:
            spec["path_prepend"] = [bin_dirs[host]]
        out_ranks.append(r | spec)
    if runtime == "mpi":
        notes.append("MPI ranks: MESHKIT_RANK is not set per rank; use MPI's own rank (OMPI_COMM_WORLD_RANK)")
    if runtime == "torch" and not management_interface:
        notes.append("GLOO_SOCKET_IFNAME not set: no management interface known")
    return Job(job_id, runtime, world, out_ranks, files, job_dir, ports, notes, hidden)


def stale_hosts(plan: dict[str, Any], manifests: dict[str, str | None], state_dir: str) -> list[str]:
    """Hosts whose hostfiles (their manifest.json) were not made from this cabling."""
    fp = hostfiles.fingerprint(plan)
    out = []
    for host in hostfiles.ring_order(plan):
        text = manifests.get(host)
        where = f"{state_dir.rstrip('/')}/hostfiles"
        if not text:
            out.append(f"{host}: no hostfiles in {where}; run setup.yml first")
            continue
        try:
            manifest = json.loads(text)
            found = manifest.get("fingerprint")
        except (ValueError, AttributeError):
            out.append(f"{host}: {where}/manifest.json is not JSON; run setup.yml")
            continue
        made_for = manifest.get("backend")
        planned = plan.get("backend") or ""
        if made_for is not None and made_for != planned:
            out.append(
                f"{host}: the hostfiles in {where} were made for backend {made_for or 'none'!r} and the plan "
                f"says {planned or 'none'!r}; run setup.yml"
            )
        elif found != fp:
            out.append(
                f"{host}: the hostfiles in {where} were made from another cabling ({found}; now {fp}); run setup.yml"
            )
    return out


def nccl_from_env_file(text: str | None) -> dict[str, str]:
    """The NCCL_* variables of a host's torch.env (written by setup.yml from its RDMA facts)."""
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        if line.startswith("NCCL_") and "=" in line:
            name, value = line.split("=", 1)
            parts = shlex.split(value)
            out[name] = parts[0] if parts else ""
    return out


def preflight_problems(results: dict[str, dict[str, Any]]) -> list[str]:
    """Every host's own problems, then what differs between hosts (program, interpreter, script)."""
    problems = [f"{host}: {p}" for host, r in results.items() for p in r.get("problems") or []]
    for key, what in (("program", "the program"), ("interpreter", "its interpreter"), ("script", "the script")):
        seen: dict[str, list[str]] = {}
        for host, r in results.items():
            if r.get("problems"):
                continue
            seen.setdefault(str(r.get(key)), []).append(host)
        if len(seen) > 1:
            shown = "; ".join(f"{', '.join(hosts)}: {path}" for path, hosts in seen.items())
            problems.append(f"{what} is not the same on every host ({shown}); install it at one path everywhere")
    return problems


def refusal(job_id: str, problems: list[str]) -> str:
    """What a launch the preflight refused says (launch.yml, `meshkit launch`, the remembered checks)."""
    return f"preflight failed; no rank of job {job_id} was started:\n  - " + "\n  - ".join(problems)


# The planning inputs besides the cabling plan and the settings: what launch.yml gathers (the
# inventory's settings, every host's torch.env, management interface and meshccl programs).
INPUTS = (
    "state_dir",
    "cluster",
    "ssh",
    "nccl",
    "torch_env",
    "management_interface",
    "master_port",
    "meshccl_port",
    "bin_dirs",
    "dest",
)


def new_job_id() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def make_job(
    plan: dict[str, Any], settings: dict[str, Any], inputs: dict[str, Any], job_id: str | None = None
) -> dict[str, Any]:
    """The job as launch.yml and `meshkit launch` run it, from the plan, validate()'s settings
    and the INPUTS."""
    nccl = dict(inputs.get("nccl") or {})  # given outright, else from each host's torch.env
    for host, text in (inputs.get("torch_env") or {}).items():
        nccl.setdefault(host, nccl_from_env_file(text))
    job = build(
        plan,
        settings,
        job_id=job_id or new_job_id(),
        state_dir=inputs["state_dir"],
        cluster=inputs["cluster"],
        ssh=dict(inputs.get("ssh") or {}),
        nccl=nccl,
        management_interface=dict(inputs.get("management_interface") or {}),
        master_port=int(inputs.get("master_port") or MASTER_PORT),
        meshccl_port=int(inputs.get("meshccl_port") or MESHCCL_PORT),
        bin_dirs=dict(inputs.get("bin_dirs") or {}),
    )
    out = job.as_dict() | {
        "timeout": settings.get("timeout") or default("timeout"),
        "grace": settings.get("grace", default("grace")),
    }
    if settings.get("host_timeout"):
        out["host_timeout"] = settings["host_timeout"]
    return out


def secret_values(job: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, str]:
    """The values of the job's ``secret_env``, for the launcher to put into the ranks' environment:
    a fresh job token (unless ``given`` has one), and each of the user's secrets from ``given``
    (the environment as the user gave it: launch_env, -x). LaunchError naming any without a value."""
    token = given.get(TOKEN_ENV)
    out = {TOKEN_ENV: new_token() if token in (None, "", HIDDEN) else _env_value(token)}
    missing = []
    for name in job.get("secret_env") or []:
        if name == TOKEN_ENV:
            continue
        value = given.get(name)
        if value is None or value == HIDDEN:
            missing.append(name)
        else:
            out[name] = _env_value(value)
    if missing:
        raise LaunchError(
            f"job {job.get('job_id')}: no value for the secret variable {', '.join(missing)}; give it in launch_env "
            "(meshkit launch: -x NAME=VALUE); nothing was started"
        )
    return out


def shown(data: Mapping[str, Any]) -> dict[str, Any]:
    """The job as it may be written or shown: every rank's secrets HIDDEN (the job's ``secret_env``
    and whatever else is_secret() says is one). The plan holds no secret value anyway
    (build()); this is the last word before anything is written."""
    marked = list(data.get("secret_env") or [])
    out = dict(data)
    out["ranks"] = [dict(r, env=redact(r.get("env") or {}, marked)) for r in data.get("ranks") or []]
    return out


def record_job(data: dict[str, Any], dest: str | None) -> dict[str, Any]:
    """Write the job as planned to <dest>/<job id>/job.json (secrets HIDDEN: shown()), the directory
    its logs go to; the job with its log_dir. Never called in check mode: that writes nothing."""
    if not dest:
        return data
    where = Path(dest) / data["job_id"]
    where.mkdir(parents=True, exist_ok=True)
    os.chmod(where, 0o700)
    (where / "job.json").write_text(json.dumps(shown(data), indent=1) + "\n")
    return data | {"log_dir": str(where)}


def describe(job: dict[str, Any]) -> str:
    hosts = list(dict.fromkeys(r["host"] for r in job["ranks"]))
    return (
        f"job {job['job_id']}: {job['world_size']} ranks of {job['runtime']} on {len(hosts)} hosts ({', '.join(hosts)})"
    )


def host_preflight(job: dict[str, Any], host: str) -> dict[str, Any]:
    """The launch_preflight arguments of one host (launch.yml passes the same)."""
    first = next(r for r in job["ranks"] if r["host"] == host)
    return {
        "argv": first["argv"],
        "path": first["env"].get("PATH"),
        "path_prepend": first.get("path_prepend") or [],
        "cwd": first.get("cwd") or None,
        "require": ["orted"] if job["runtime"] == "mpi" else [],
        "ports": job["ports"].get(host) or [],
    }
