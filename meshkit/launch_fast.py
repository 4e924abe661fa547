# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""`meshkit launch` without Ansible in front: the checked context of the last full launch, and
the checks that tell whether it still holds.

A full launch (launch.yml up to the preflight) validates the inventory, discovers the cabling on
every host, compares it with the recorded plan, reads every host's hostfiles manifest and
torch.env, installs meshccl where it is not current and checks the program and ports. `meshkit
launch` remembers what that run planned from (the context: the plan, the inventory's settings,
every host's connection), keyed by the inventory's files, ansible.cfg and the runtime. The next
launch with the same key plans from the context and asks every host, over the same connection the
ranks then use, to check what the context rests on:

- its hostfiles' fingerprint is the plan's, torch.env is the one planned from, meshccl's installed
  build is the controller's current build (recomputed from the sources);
- every planned cable: the port is up, has its planned address, the route to the peer's address
  leaves through it, and the MAC that answers for that address there is the peer's port's own
  (as the peer's check reports it); no other candidate port is up (a new cable);
- the preflight, the same checks launch.yml runs (program, interpreter, script, ports, orted).

Anything the context rests on that does not hold (Stale) sends the launch through launch.yml
again, which rediscovers and reports or repairs; a preflight problem (Refused) is reported as
launch.yml would report it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils import hostfiles, linux_net, macos, meshccl_build
from ansible_collections.meshkit.cluster.plugins.module_utils.defaults import DISCOVER_PORTS

from meshkit import launch_connection, topology
from meshkit.launch_plan import host_preflight, make_job, preflight_problems, record_job, refusal, validate
from meshkit.launch_settings import default
from meshkit.launcher import agent_argv, agent_input

# Bumped when the context's shape or meaning changes: older caches are then not used.
VERSION = 1
CHECK_TIMEOUT = 90.0  # the preflight's `python -m` probe may take 60 s
EMPTY_SHA = hashlib.sha256(b"").hexdigest()


class Stale(Exception):
    """The remembered context does not hold (or cannot be used): run the full launch."""


class Refused(Exception):
    """A problem the full launch would report the same way; nothing was started."""


# --- the key ---------------------------------------------------------------------------------------


def inventory_files(inventory: Path, playbook_dir: Path) -> list[Path]:
    """The files an inventory's variables come from: the inventory (a file or a directory) and
    the group_vars/host_vars beside it and beside the playbooks. Stale when it is dynamic (a
    script or an inventory plugin), whose hosts no file holds."""
    files: list[Path] = []
    if inventory.is_dir():
        files += sorted(p for p in inventory.rglob("*") if p.is_file())
    elif inventory.is_file():
        files.append(inventory)
    else:
        raise Stale(f"inventory {inventory} does not exist")
    for path in files:
        if os.access(path, os.X_OK) and path.read_bytes()[:2] == b"#!":
            raise Stale(f"{path} is a dynamic inventory (a script)")
        if path.suffix in (".yml", ".yaml") and re.search(r"^plugin:", path.read_text(errors="replace"), re.M):
            raise Stale(f"{path} is a dynamic inventory (an inventory plugin)")
    base = inventory if inventory.is_dir() else inventory.parent
    for where in {base, playbook_dir}:
        for name in ("group_vars", "host_vars"):
            if (where / name).is_dir():
                files += sorted(p for p in (where / name).rglob("*") if p.is_file())
    return files


def cache_key(inventory: Path, runtime: str, collection: Path, ansible_cfg: Path | None) -> str:
    """What a remembered launch must match: the inventory's files, Ansible's settings, and meshkit's
    own launch code (the collection's launch playbook and plugins, this package)."""
    h = hashlib.sha256(f"{VERSION}\0{runtime}\0{inventory.resolve()}\0".encode())
    for path in inventory_files(inventory, collection / "playbooks"):
        h.update(str(path.resolve()).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    # meshkit's own launch code: a check added there is not skipped by an older record.
    code = [
        collection / "playbooks" / "launch.yml",
        *sorted((collection / "plugins").rglob("*.py")),
        *sorted(Path(__file__).parent.glob("*.py")),
    ]
    for path in code:
        if path.is_file():
            h.update(b"code\0" + hashlib.sha256(path.read_bytes()).digest())
    if ansible_cfg is not None and ansible_cfg.is_file():
        h.update(b"cfg\0" + ansible_cfg.read_bytes())
    for name in sorted(os.environ):
        if name.startswith("ANSIBLE_"):
            h.update(f"{name}={os.environ[name]}\0".encode())
    return h.hexdigest()


def cache_path(cache_dir: Path, inventory: Path, runtime: str) -> Path:
    name = hashlib.sha256(str(inventory.resolve()).encode()).hexdigest()[:16]
    return cache_dir / f"{name}-{runtime}.json"


def save(path: Path, key: str, context: dict[str, Any], connections: dict[str, Any]) -> None:
    """Keep a full launch's context (0600: it names hosts, users and key files)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    record = {"version": VERSION, "key": key, "saved": time.time(), "context": context, "connections": connections}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # 0600, a new file
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load(path: Path, key: str) -> dict[str, Any]:
    """The record at ``path`` if its key is ``key``. Its connections become command lines, so it
    must be this user's own and writable by nobody else (nor its directory)."""
    try:
        for where in (path.parent, path):
            st = where.stat()
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise Stale(f"{where} is not this user's own or others may write it; not used")
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise Stale("no checked plan remembered for this inventory and runtime yet") from None
    except (OSError, ValueError) as exc:
        raise Stale(f"{path} is unreadable ({exc})") from None
    if not isinstance(record, dict):
        raise Stale(f"{path} is unreadable (not a remembered launch)")
    if record.get("version") != VERSION or record.get("key") != key:
        raise Stale("the inventory, ansible.cfg or meshkit changed since the last full check")
    return record


def file_sha(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


# --- what a full launch leaves -------------------------------------------------------------------


def context_of(given: dict[str, Any]) -> dict[str, Any]:
    """The context launch.yml hands the launch action, with the plan file's hash added."""
    out = dict(given)
    out["plan_sha"] = file_sha(str(given.get("plan_record") or ""))
    meshccl = out.get("meshccl") or None
    if meshccl:
        out["meshccl"] = {k: meshccl.get(k) for k in ("build", "source", "requested")}
    return out


# --- the checks ----------------------------------------------------------------------------------


def check_specs(job: dict[str, Any], context: dict[str, Any]) -> dict[str, dict[str, Any]]:
    plan, config = context["plan"], context["config"]
    management = (context["inputs"].get("management_interface")) or {}
    specs = {}
    for host in dict.fromkeys(r["host"] for r in job["ranks"]):
        cfg = config.get(host) or {}
        spec = {
            "preflight": host_preflight(job, host),
            "state_dir": cfg.get("meshkit_state_dir") or "/var/lib/meshkit",
            "links": plan.get("per_host", {}).get(host) or [],
            "peer_ports": cfg.get("meshkit_discover_ports") or cfg.get("meshkit_peer_ports") or DISCOVER_PORTS,
            "management_interface": management.get(host) or "",
        }
        if context.get("meshccl") and job["runtime"] == "meshccl" and cfg.get("meshkit_meshccl_install", True):
            spec["meshccl_venv"] = cfg.get("meshkit_meshccl_venv")
        specs[host] = spec
    return specs


def run_checks(
    connections: dict[str, dict[str, Any]], specs: dict[str, dict[str, Any]], timeout: float = CHECK_TIMEOUT
) -> dict[str, dict[str, Any]]:
    """Every host's check, all at once, over its connection: {host: {"preflight", "facts"}} or
    {host: {"error": text}}."""
    program = agent_input()

    def one(host: str) -> dict[str, Any]:
        conn = connections[host]
        data = program + (json.dumps({"check": specs[host]}) + "\n").encode()
        # stderr goes to a file: an ssh that starts a persistent master leaves that master holding
        # its stderr open (the launcher reads only stdout to its end for the same reason).
        with tempfile.TemporaryFile() as errors:
            try:
                proc = subprocess.run(
                    agent_argv(conn, conn.get("python") or "python3"),
                    input=data,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    timeout=timeout,
                    check=False,
                    start_new_session=True,
                )
            except subprocess.TimeoutExpired:
                return {"error": f"no answer within {timeout:g} s"}
            except OSError as exc:
                return {"error": f"cannot start its connection: {exc}"}
            errors.seek(0)
            stderr = errors.read()
        for line in proc.stdout.decode(errors="replace").splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # a login banner
            if isinstance(msg, dict) and msg.get("t") == "checked":
                return msg
            if isinstance(msg, dict) and msg.get("t") == "error":
                return {"error": str(msg.get("msg"))}
        err = stderr.decode(errors="replace").strip().splitlines()
        return {"error": f"connection exited {proc.returncode}: {' / '.join(err[-3:]) or 'no output'}"}

    with ThreadPoolExecutor(max_workers=min(32, len(specs) or 1)) as pool:
        answers = dict(zip(specs, pool.map(one, specs), strict=True))
    return answers


def preflight_specs(job: dict[str, Any], cables: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per host of the job, what its agent's preflight checks (agent_preflight.check_host): the
    program, interpreter, working directory and ports, its cables (``cables``: the plan's per_host)
    included, no facts. The cable checks are the collection's own (macos.launch_checks, and linux_net
    it imports), their sources sent with the spec."""
    modules = {name: Path(module.__file__).read_text() for name, module in (("macos", macos), ("linux_net", linux_net))}
    specs = {}
    for host in dict.fromkeys(r["host"] for r in job["ranks"]):
        specs[host] = {"preflight": host_preflight(job, host), "cables": cables.get(host) or [], "facts": False}
        specs[host]["modules"] = modules
    return specs


def preflight_everywhere(
    job: dict[str, Any], connections: dict[str, dict[str, Any]], cables: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """launch.yml's preflight on every host of the job at once, in one round trip each over the
    connection its ranks then use (the agent's check mode): per host, what its preflight reports
    (agent_preflight.check_host). A host that cannot be checked gets that as its problem."""
    answers = run_checks(connections, preflight_specs(job, cables))
    out = {}
    for host, answer in answers.items():
        out[host] = answer.get("preflight") or {"problems": [f"cannot be checked: {answer.get('error')}"]}
    return out


def stale_reasons(
    answers: dict[str, dict[str, Any]], specs: dict[str, dict[str, Any]], context: dict[str, Any]
) -> list[str]:
    """Where what the hosts report differs from what the context was planned from."""
    plan = context["plan"]
    fp = hostfiles.fingerprint(plan)
    torch_env = context["inputs"].get("torch_env") or {}
    build = (context.get("meshccl") or {}).get("build")
    out: list[str] = []
    macs: dict[tuple[str, str], str] = {}
    for host, answer in answers.items():
        for port, info in ((answer.get("facts") or {}).get("ports") or {}).items():
            if info.get("mac"):
                macs[(host, port)] = info["mac"]
    for host, answer in answers.items():
        if "error" in answer:
            out.append(f"{host}: {answer['error']}")
            continue
        facts = answer.get("facts") or {}
        if not str(facts.get("platform", "")).startswith("linux"):
            out.append(f"{host}: the quick checks need Linux (this host is {facts.get('platform')})")
            continue
        if facts.get("fingerprint") != fp:
            out.append(f"{host}: its hostfiles were not made from the remembered plan")
        planned_env = hashlib.sha256((torch_env.get(host) or "").encode()).hexdigest()
        if (facts.get("torch_env") or EMPTY_SHA) != planned_env:
            out.append(f"{host}: its torch.env changed")
        if "meshccl_venv" in specs[host] and facts.get("meshccl_build") != build:
            out.append(f"{host}: meshccl there is missing, incomplete or not build {build}")
        if facts.get("management_up") is False:
            out.append(f"{host}: management interface {specs[host]['management_interface']} is not up")
        ports = facts.get("ports") or {}
        for link in specs[host]["links"]:
            port, info = link["port"], ports.get(link["port"]) or {}
            where = f"{host}:{port}"
            peer = f"{link['peer_host']}:{link['peer_port']}"
            peer_mac = macs.get((link["peer_host"], link["peer_port"]))
            if not info.get("exists"):
                out.append(f"{where} is gone")
            elif not info.get("up"):
                out.append(f"{where} is down")
            elif f"{link['address']}/{link['prefix']}" not in (info.get("addresses") or []):
                out.append(f"{where} lacks its address {link['address']}/{link['prefix']}")
            elif info.get("route") != port:
                out.append(f"{where}: the route to {link['peer_address']} leaves through {info.get('route')}")
            elif not info.get("neighbour"):
                out.append(f"{where}: nothing answers for {link['peer_address']} ({peer})")
            elif peer_mac and info["neighbour"] != peer_mac:
                out.append(f"{where}: {link['peer_address']} answers from {info['neighbour']}, not {peer} ({peer_mac})")
        if facts.get("unplanned"):
            out.append(f"{host}: {', '.join(facts['unplanned'])} up but not in the plan (a new cable?)")
    return out


def plan_change(remembered: dict[str, Any], plan_record: str | None) -> str:
    """ ": " and what setup.yml changed in the plan since it was remembered (hosts and cables added and
    removed), or "" when that cannot be read or nothing of it changed."""
    try:
        current = json.loads(Path(plan_record or "").read_text())
    except (OSError, ValueError):
        return ""
    changes = topology.plan_changes(remembered, current) if isinstance(current, dict) else []
    return f": {'; '.join(changes)}" if changes else ""


def prepare(
    record: dict[str, Any],
    settings_given: dict[str, Any],
    on_event: Callable[[str], None] = lambda _text: None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(job, connections) planned from a remembered context and checked on every host."""
    context, connections = record["context"], record["connections"]
    started = time.monotonic()
    if file_sha(context.get("plan_record") or "") != context.get("plan_sha"):
        raise Stale(
            f"{context.get('plan_record')} changed since the last full check (setup.yml ran"
            f"{plan_change(context['plan'], context.get('plan_record'))}); the job planned from the old plan is not "
            "started"
        )
    for host, conn in connections.items():
        why = launch_connection.still_valid(conn)
        if why:
            raise Stale(f"{host}: {why}")
    meshccl = context.get("meshccl")
    if settings_given.get("runtime") == "meshccl" and meshccl:
        # The build id hashes the sources and requested requirements only, not the platform: every host
        # records the same id whether its wheel was built on the controller or on a host of its group.
        current = meshccl_build.build_id(meshccl["source"], meshccl_build.pinned(meshccl.get("requested") or []))
        if current != meshccl.get("build"):
            raise Stale(f"meshccl's sources changed (build {current}); the hosts need it installed")
    settings = dict(settings_given)
    if settings.get("ranks_per_host") is None:
        settings["ranks_per_host"] = context.get("ranks_per_host") or default("ranks_per_host")
    try:
        job = make_job(context["plan"], validate(settings), context["inputs"])
    except ValueError as exc:  # LaunchError: bad settings, or a job this cabling cannot run
        raise Refused(str(exc)) from None
    specs = check_specs(job, context)
    answers = run_checks(connections, specs)
    reasons = stale_reasons(answers, specs, context)
    if reasons:
        raise Stale("; ".join(reasons))
    problems = preflight_problems({host: answer["preflight"] for host, answer in answers.items()})
    if problems:
        raise Refused(refusal(job["job_id"], problems))
    job = record_job(job, context["inputs"].get("dest"))
    on_event(
        f"checked {len(answers)} hosts against the plan of the last full check in "
        f"{time.monotonic() - started:.2f} s (--recheck runs every check of launch.yml)"
    )
    return job, connections
