# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""meshkit.cluster.meshccl_wheel's work: group the hosts for meshccl, and build on the controller
what the controller builds.

Run by the action plugin of the same name in ansible-playbook's own Python (no Python of its own
for the task): ``sys.executable`` is the controller's Python, the one whose platform serves the
controller's groups and whose pip builds and fetches the wheels. plugins/modules/meshccl_wheel.py
documents the options and the result.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils.meshccl_archive import (
    ENVIRONMENT,
    WHEELS,
    WHEELS_ARCHIVE,
    pack_environment,
    pack_wheels,
)
from ansible_collections.meshkit.cluster.plugins.module_utils.meshccl_build import (
    CONTROLLER,
    build_id,
    builder_problems,
    gather,
    marker_environment,
    pinned,
    pip_platforms,
    plan,
    platform_label,
    python_tag,
    python_xy,
)
from packaging.markers import default_environment  # ansible-core's requirement
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

MARK = "meshkit-wheelhouse.json"
PENDING = ".meshkit-pending.json"
HEX16 = re.compile(r"^[0-9a-f]{16}$")


def project(source: str) -> tuple[str, list[str]]:
    """(version, build-system requires) from meshccl's pyproject.toml."""
    with open(os.path.join(source, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    req = re.search(r"^requires\s*=\s*\[([^\]]*)\]", text, re.M)
    requires = re.findall(r'"([^"]+)"', req.group(1)) if req else ["scikit-build-core", "nanobind"]
    return (m.group(1) if m else "0"), requires


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]


def run(argv: list[str], cwd: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=False, cwd=cwd, env=env)


class BuildError(Exception):
    def __init__(self, msg: str, proc: subprocess.CompletedProcess | None = None):
        super().__init__(msg)
        self.details = {"stderr": proc.stderr[-4000:], "stdout": proc.stdout[-2000:]} if proc else {}


def wheels_in(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".whl")) if os.path.isdir(path) else []


def wheel_name(filename: str) -> str:
    return filename.split("-", 1)[0].replace("_", "-").lower()


def requires_of(wheel: str) -> list[str]:
    """Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        text = z.read(meta).decode("utf-8", "replace") if meta else ""
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def download(specs: list[str], dest: str, target: dict | None = None) -> list[str]:
    """Binary wheels of ``specs`` and what they depend on into ``dest``; returns the specs that have none.

    ``target`` None: for this Python and platform (pip resolves). Else for that host record: pip's
    --platform/--python-version, one requirement at a time, the dependencies' markers evaluated for the
    target (pip evaluates them for the running interpreter), a pinned version falling back to the newest."""
    os.makedirs(dest, exist_ok=True)
    if target is None:
        proc = run(pip("download", "--quiet", "--only-binary=:all:", *specs, "-d", dest))
        return [] if proc.returncode == 0 else [s for s in specs if not _fetch_one(s, dest, [])]
    platforms = pip_platforms(target)
    flags = [
        "--python-version",
        python_xy(target),
        "--implementation",
        "cp",
        "--abi",
        python_tag(target),
        *(x for p in platforms for x in ("--platform", p)),
    ]
    env = marker_environment(target)
    queue, seen, missing = list(specs), set(), []
    while queue:
        spec = queue.pop(0)
        name = _name(spec)
        if name in seen:
            continue
        seen.add(name)
        before = set(wheels_in(dest))
        got = _fetch_one(spec, dest, flags) if platforms or _pure(spec, dest, flags) else None
        if not got:
            missing.append(spec)
            continue
        new = [w for w in set(wheels_in(dest)) - before if wheel_name(w) == name] or [
            w for w in wheels_in(dest) if wheel_name(w) == name
        ]
        for wheel in new[:1]:
            queue.extend(wanted(requires_of(os.path.join(dest, wheel)), env))
    return missing


def wanted(requires: list[str], env: dict[str, str]) -> list[str]:
    """The Requires-Dist entries that apply on a host with these PEP 508 marker values (no extras),
    without their markers."""
    out = []
    for dep in requires:
        try:
            req = Requirement(dep)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({**default_environment(), **env, "extra": ""}):
            req.marker = None
            out.append(str(req))
    return out


def _name(spec: str) -> str:
    base = re.split(r"[\s<>=!~;\[(]", spec, maxsplit=1)[0]
    return canonicalize_name(base)


def _fetch_one(spec: str, dest: str, flags: list[str]) -> bool:
    argv = pip("download", "--quiet", "--no-deps", "--only-binary=:all:", *flags, "-d", dest)
    if run([*argv, spec]).returncode == 0:
        return True
    bare = re.split(r"[\s<>=!~;\[(]", spec, maxsplit=1)[0]
    return bare != spec and run([*argv, bare]).returncode == 0


def _pure(spec: str, dest: str, flags: list[str]) -> bool:
    """Without platform tags only a pure-Python wheel may be taken (this platform's would be wrong)."""
    probe = tempfile.mkdtemp(dir=dest)
    try:
        if not _fetch_one(spec, probe, flags):
            return False
        return all(w.endswith("-none-any.whl") for w in wheels_in(probe))
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def deps_dir(dest: str, label: str, specs: list[str], target: dict | None) -> tuple[str, list[str]]:
    """A cached directory of the build requirements' wheels (and pip's) for one platform: (path, missing)."""
    key = re.sub(r"[^A-Za-z0-9._-]", "_", label) + "-" + hashlib_hex("\n".join(specs))[:8]
    path = os.path.join(dest, "build-deps", key)
    mark = os.path.join(path, MARK)
    if os.path.isfile(mark):
        with open(mark, encoding="utf-8") as f:
            return path, json.load(f)["missing"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{key}-", dir=os.path.dirname(path))
    missing = download(specs, work, target)
    with open(os.path.join(work, MARK), "w", encoding="utf-8") as f:
        json.dump({"specs": specs, "missing": missing, "wheels": wheels_in(work)}, f)
    publish(work, path)
    return path, missing


def hashlib_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def build_requirements(requires: list[str]) -> list[str]:
    """The build-system requirements pinned to this controller's versions where installed, and pip's."""
    out = []
    for spec in requires:
        name = re.split(r"[\s<>=!~;\[(]", spec, maxsplit=1)[0]
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(spec)
    return [*out, f"pip=={importlib.metadata.version('pip')}"]


def sdist(source: str, build_dir: str, deps: str) -> str:
    """meshccl's source distribution, made once per build with scikit-build-core's build_sdist from
    the unpacked build requirements (no network)."""
    out = os.path.join(build_dir, "sdist")
    made = [f for f in os.listdir(out) if f.endswith(".tar.gz")] if os.path.isdir(out) else []
    if made:
        return os.path.join(out, made[0])
    unpacked = tempfile.mkdtemp(prefix=".sdist-env-", dir=build_dir)
    work = tempfile.mkdtemp(prefix=".sdist-", dir=build_dir)
    try:
        for wheel in wheels_in(deps):
            with zipfile.ZipFile(os.path.join(deps, wheel)) as z:
                z.extractall(unpacked)
        env = {**os.environ, "PYTHONPATH": unpacked}
        proc = run(
            [sys.executable, "-c", "import sys, scikit_build_core.build as b; print(b.build_sdist(sys.argv[1]))", work],
            cwd=source,
            env=env,
        )
        if proc.returncode != 0:
            raise BuildError("making meshccl's source distribution (scikit-build-core build_sdist) failed", proc)
        os.chmod(work, 0o755)
        publish(work, out, complete=lambda d: any(f.endswith(".tar.gz") for f in os.listdir(d)))
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return os.path.join(out, next(f for f in os.listdir(out) if f.endswith(".tar.gz")))


def publish(work: str, path: str, complete: Callable[[str], bool] | None = None) -> None:
    """Move a finished ``work`` directory to ``path``. An incomplete ``path`` (an interrupted run) is
    replaced; a complete one (another run finished the same thing first) is kept and ``work`` dropped."""
    done = complete or (lambda d: os.path.isfile(os.path.join(d, MARK)))
    if os.path.isdir(path) and not done(path):
        shutil.rmtree(path, ignore_errors=True)
    try:
        os.rename(work, path)
    except OSError:
        if not (os.path.isdir(path) and done(path)):
            raise
        shutil.rmtree(work, ignore_errors=True)


def prune(dest: str, keep: str) -> None:
    """Remove every build's wheelhouses but the current build's and the newest other build's."""
    others = []
    for name in os.listdir(dest):
        full = os.path.join(dest, name)
        if name != keep and HEX16.match(name) and os.path.isdir(full):
            others.append((os.path.getmtime(full), full))
    for _mtime, full in sorted(others)[:-1]:
        shutil.rmtree(full, ignore_errors=True)


def read_mark(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MARK), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_mark(path: str, data: dict) -> None:
    with open(os.path.join(path, MARK), "w", encoding="utf-8") as f:
        json.dump(data, f)


def build_here(source: str, path: str, version: str, requirements: list[str], deps: str | None, ctx: dict) -> list[str]:
    """The controller's wheelhouse: meshccl's wheel built here, the requirements' wheels and pip's.

    One build per group at a time on this controller (two setup.yml runs at once, or two test labs): the second
    waits for the first, then takes the wheelhouse it published. pip builds in the group's own directory of the
    cache (``<dest>/.build/<group>-<source>``, kept, so CMake builds again only what changed), never in the source tree,
    which may be read-only (an installed collection) and which another build of the same tree may be using."""
    builds = os.path.join(os.path.dirname(os.path.dirname(path)), ".build")
    os.makedirs(builds, exist_ok=True)
    # Per source tree too: CMake refuses a build directory configured from another source directory.
    name = f"{os.path.basename(path)}-{hashlib_hex(os.path.realpath(source))[:8]}"
    with open(os.path.join(builds, f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mark = read_mark(path)
        if mark:  # another run built it while this one waited
            return mark["wheels"]
        return _build_here(source, path, version, requirements, deps, ctx, os.path.join(builds, name))


def _build_here(
    source: str, path: str, version: str, requirements: list[str], deps: str | None, ctx: dict, build: str
) -> list[str]:
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}-", dir=parent)
    os.chmod(work, 0o755)
    try:
        local = all(importlib.util.find_spec(m) for m in ("scikit_build_core", "nanobind"))
        if local:  # the build requirements are installed here: nothing to fetch
            isolation = ["--no-build-isolation"]
        elif deps:
            isolation = ["--no-index", "--find-links", deps]
        else:
            isolation = []
        steps = [
            pip(
                "wheel",
                "--quiet",
                "--no-deps",
                *isolation,
                "--config-settings",
                f"build-dir={build}",
                source,
                "-w",
                work,
            )
        ]
        if requirements:
            steps.append(pip("download", "--quiet", "--only-binary=:all:", *requirements, "-d", work))
        steps.append(
            pip(
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                f"pip=={importlib.metadata.version('pip')}",
                "-d",
                work,
            )
        )
        for argv in steps:
            proc = run(argv)
            if proc.returncode != 0:
                raise BuildError(
                    f"building the meshccl wheelhouse failed: {' '.join(argv[3:6])} ... exited {proc.returncode}", proc
                )
        wheels = wheels_in(work)
        if not any(w.startswith(f"meshccl-{version}-") for w in wheels):
            raise BuildError(f"pip built no meshccl-{version} wheel from {source} (wheels: {', '.join(wheels)})")
        write_mark(
            work,
            {
                **ctx,
                "wheels": wheels,
                "requirements": requirements,
                "unresolved": [],
                "built_on": CONTROLLER,
                "python": sys.executable,
            },
        )
        publish(work, path)
        return wheels
    finally:
        shutil.rmtree(work, ignore_errors=True)


VENV_MARK = "meshkit-meshccl.json"
# Run by a Python on the controller: may it make an environment for a host whose interpreter is at the same path?
LOCAL_PYTHON = (
    "import json, platform, sys; print(json.dumps([platform.python_implementation(), '%d.%d' % sys.version_info[:2], "
    "getattr(sys, '_base_executable', None) or sys.executable]))"
)


def local_python(path: str, cache: dict) -> list | None:
    """[implementation, X.Y, base executable] of the controller's Python at ``path``, or None."""
    if path not in cache:
        cache[path] = None
        if os.path.isabs(path) and os.path.isfile(path) and os.access(path, os.X_OK):
            try:
                argv = [path, "-c", LOCAL_PYTHON]
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
                cache[path] = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                cache[path] = None
    return cache[path]


def environment_for(record: dict, group: dict, cache: dict) -> tuple[tuple[str, str] | None, str]:
    """((interpreter path, environment path), "") where the controller can make this host's environment as
    the host would make it itself: `python -m venv` links the environment to the interpreter's base
    executable, so the controller needs a CPython of the same X.Y whose base executable is at that same
    path. Else (None, why not)."""
    if group["builder"] != CONTROLLER:
        return None, f"its wheel is built on {group['builder']}"
    if group.get("unresolved"):
        return None, f"{', '.join(group['unresolved'])} come from its own package index"
    base, bin_dir = (record.get("python") or {}).get("base_executable") or "", record.get("bin") or ""
    if not os.path.isabs(base) or not bin_dir:
        return None, "its interpreter or environment path was not read"
    mine = local_python(base, cache)
    if not mine:
        return None, f"the controller has no Python at {base}"
    impl, xy, own_base = mine
    if impl != "CPython" or xy != python_xy(record) or own_base != base:
        why = f"the controller's {base} is {impl} {xy}" + (f" based on {own_base}" if own_base != base else "")
        return None, f"{why}; the host's is CPython {python_xy(record)}"
    return (base, os.path.dirname(bin_dir.rstrip("/"))), ""


def environment_archive(group: dict, python: str, venv: str) -> str:
    return os.path.join(group["path"], f"environment-{hashlib_hex(python + chr(0) + venv)[:12]}.tar.gz")


def make_environment(group: dict, python: str, build: str, work_dir: str) -> str:
    """A virtual environment made here with ``python`` (the hosts' interpreter path) from the group's
    wheelhouse, install record included, in a staging directory (returned; the caller removes it)."""
    house, wheels = group["path"], wheels_in(group["path"])
    pip_wheel = next((w for w in wheels if w.startswith("pip-")), None)
    if not pip_wheel:
        raise BuildError(f"{house} holds no pip wheel to install with")
    staging = tempfile.mkdtemp(prefix=".environment-", dir=work_dir)
    venv = os.path.join(staging, "venv")
    for argv, what in (
        ([python, "-m", "venv", "--without-pip", venv], f"{python} -m venv"),
        (
            [
                os.path.join(venv, "bin", "python"),
                os.path.join(house, pip_wheel, "pip"),
                "install",
                "--isolated",
                "--quiet",
                "--disable-pip-version-check",
                "--no-index",
                "--no-deps",
                *(os.path.join(house, w) for w in wheels),
            ],
            "pip install",
        ),
    ):
        proc = run(argv)
        if proc.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise BuildError(f"making the hosts' environment here failed: {what} exited {proc.returncode}", proc)
    digests = {}
    for wheel in wheels:
        with open(os.path.join(house, wheel), "rb") as f:
            digests[wheel] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(venv, VENV_MARK), "w", encoding="utf-8") as f:
        json.dump(
            {
                "build": build,
                "wheels": wheels,
                "sha256": digests,
                "built_on": group["built_on"],
                "index": [],
                "method": ENVIRONMENT,
            },
            f,
        )
    return venv


def wheels_archive(group: dict, build: str, check: bool) -> str:
    """The group's wheelhouse as one tar (made when missing, unless ``check``)."""
    archive = os.path.join(group["path"], WHEELS_ARCHIVE)
    if not check and group["ready"] and not os.path.isfile(archive):
        pack_wheels(group["path"], wheels_in(group["path"]), archive, {"build": build, "group": group["name"]})
    return archive


def ship(groups: list[dict], records: dict, build: str, check: bool) -> dict[str, dict]:
    """Per host to install: the archive to copy (an environment where the controller can make it, else the
    wheels), what it is, and why not an environment. Archives are made here (not in check mode)."""
    out: dict[str, dict] = {}
    cache: dict = {}
    for group in groups:
        targets: dict[tuple[str, str], list[str]] = {}
        for host in group["needs"]:
            record = records.get(host)
            if record is None:
                continue
            target, why = environment_for(record, group, cache)
            if target:
                targets.setdefault(target, []).append(host)
            else:
                out[host] = {"archive": wheels_archive(group, build, check), "ship": WHEELS, "why_wheels": why}
        by_python: dict[str, list[tuple[str, str]]] = {}
        for target in targets:
            by_python.setdefault(target[0], []).append(target)
        for python, wanted in by_python.items():
            todo = [t for t in wanted if not os.path.isfile(environment_archive(group, *t))]
            staging, failed = None, ""
            if todo and not check and group["ready"]:
                try:
                    venv = make_environment(group, python, build, os.path.dirname(group["path"]))
                    staging = os.path.dirname(venv)
                    for target in todo:
                        manifest = {
                            "build": build,
                            "group": group["name"],
                            "python": python,
                            "tag": python_tag(records[targets[target][0]]),
                            "built_on": group["built_on"],
                        }
                        pack_environment(venv, environment_archive(group, *target), venv, target[1], manifest)
                except (BuildError, OSError) as exc:
                    failed = f"making it here failed: {exc}"
                finally:
                    if staging:
                        shutil.rmtree(staging, ignore_errors=True)
            for target in wanted:
                for host in targets[target]:
                    if failed:
                        how = {"archive": wheels_archive(group, build, check), "ship": WHEELS, "why_wheels": failed}
                    else:
                        how = {"archive": environment_archive(group, *target), "ship": ENVIRONMENT, "why_wheels": ""}
                    out[host] = how
    return out


def finish(check_mode: bool, groups: list[dict], version: str) -> dict[str, Any]:
    """phase=finish: each staged wheelhouse a builder filled checked, packed and published."""
    done, changed = {}, False
    for group in groups:
        staging, path = group.get("staging"), group.get("path")
        if not staging or not path or group.get("builder") == CONTROLLER:
            continue
        if check_mode or not os.path.isdir(staging):
            continue
        wheels = wheels_in(staging)
        if not any(w.startswith(f"meshccl-{version}-") for w in wheels):
            return {
                "failed": True,
                "msg": f"{group['builder']} built no meshccl-{version} wheel for {', '.join(group['hosts'])} "
                f"(found in {staging}: {', '.join(wheels) or 'nothing'})",
            }
        with open(os.path.join(staging, PENDING), encoding="utf-8") as f:
            pending = json.load(f)
        os.remove(os.path.join(staging, PENDING))
        manifest = {"build": pending.get("build"), "group": group["name"]}
        pack_wheels(staging, wheels, os.path.join(staging, WHEELS_ARCHIVE), manifest)
        write_mark(staging, {**pending, "wheels": wheels, "built_on": group["builder"]})
        publish(staging, path)
        shutil.rmtree(group.get("kit") or "", ignore_errors=True)
        done[group["name"]] = {"path": path, "wheels": wheels, "built_on": group["builder"]}
        changed = True
    return {"changed": changed, "wheelhouses": done}


ARGUMENT_SPEC: dict[str, Any] = {
    "source": {"type": "path", "required": True},
    "dest": {"type": "path", "required": True},
    "requirements": {"type": "list", "elements": "str", "default": ["numpy"]},
    "hosts": {"type": "dict", "default": {}},
    "phase": {"type": "str", "choices": ["plan", "finish"], "default": "plan"},
    "groups": {"type": "list", "elements": "dict", "default": []},
}


def run_task(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    """The task's result (plugins/modules/meshccl_wheel.py's RETURN): the groups, per host what to
    install and how, the summary; wheelhouses built and archives made unless ``check_mode``."""
    p = params
    source, dest = p["source"], p["dest"]
    if not os.path.isfile(os.path.join(source, "pyproject.toml")):
        msg = f"source={source}: no pyproject.toml there; point it at meshccl's sources (collective/)"
        return {"failed": True, "msg": msg}
    version, requires = project(source)
    if p["phase"] == "finish":
        return finish(check_mode, p["groups"], version)
    requirements = pinned(p["requirements"])
    build = build_id(source, requirements)
    controller = gather(sys.executable)
    controller["python"]["path"] = sys.executable
    build_dir = os.path.join(dest, build)
    result: dict = {
        "build": build,
        "version": version,
        "source": source,
        "requested": p["requirements"],
        "requirements": requirements,
        "python_tag": f"cp{sys.version_info[0]}{sys.version_info[1]}",
        "controller": controller,
        "path": "",
        "wheels": [],
    }
    records = {h: r for h, r in (p["hosts"] or {}).items() if isinstance(r, dict)}
    if records:
        groups, problems = plan(
            records, {h: r.get("build_on") or CONTROLLER for h, r in records.items()}, controller, build
        )
    else:  # no hosts given: the controller's own wheelhouse
        groups, problems = (
            [
                {
                    "name": f"controller-{platform_label(controller)}",
                    "platform": platform_label(controller),
                    "where": CONTROLLER,
                    "hosts": [],
                    "needs": [CONTROLLER],
                    "builder": CONTROLLER,
                }
            ],
            [],
        )
    for group in groups:
        group["path"] = os.path.join(build_dir, group["name"])
        mark = read_mark(group["path"])
        group["ready"] = bool(mark)
        group["wheels"] = mark["wheels"] if mark else []
        group["built_on"] = mark.get("built_on") if mark else group["builder"]
        group["unresolved"] = mark.get("unresolved", []) if mark else []
        group["build_now"] = bool(group["needs"]) and not group["ready"]
        group["staging"] = group["kit"] = None
        group["index"] = False
        if group["build_now"]:
            problems.extend(builder_problems(group, records, controller))
    if problems:
        return {
            "failed": True,
            "msg": "meshccl cannot be installed; nothing was built or changed:\n  - " + "\n  - ".join(problems),
            "problems": problems,
            "build": build,
        }

    started = time.monotonic()
    changed = False
    try:
        for group in groups:
            if not group["build_now"] or check_mode:
                continue
            changed = True
            ctx = {"build": build, "group": group["name"], "platform": group["platform"]}
            if group["builder"] == CONTROLLER:
                deps = None
                if not all(importlib.util.find_spec(m) for m in ("scikit_build_core", "nanobind")):
                    deps, missing = deps_dir(
                        dest, f"controller-{platform_label(controller)}", build_requirements(requires), None
                    )
                    deps = None if missing else deps
                group["wheels"] = build_here(source, group["path"], version, requirements, deps, ctx)
                group["ready"] = True
                continue
            # Built on a host: a kit (sdist + build requirements for that host's Python) and a staged wheelhouse.
            target = records[group["builder"]]
            own = platform_label(target) == platform_label(controller)
            ctrl_deps, ctrl_missing = deps_dir(
                dest, f"controller-{platform_label(controller)}", build_requirements(requires), None
            )
            if ctrl_missing:
                raise BuildError(
                    f"no wheels of meshccl's build requirements for the controller: {', '.join(ctrl_missing)} "
                    "(pip download failed; check the controller's package index)"
                )
            tarball = sdist(source, build_dir, ctrl_deps)
            host_deps, host_missing = (
                (ctrl_deps, []) if own else deps_dir(dest, platform_label(target), build_requirements(requires), target)
            )
            kit = os.path.join(build_dir, f"kit-{group['name']}")
            shutil.rmtree(kit, ignore_errors=True)
            os.makedirs(kit)
            for f in [tarball, *(os.path.join(host_deps, w) for w in wheels_in(host_deps))]:
                shutil.copy2(f, kit)
            staging = tempfile.mkdtemp(prefix=f".{group['name']}-", dir=build_dir)
            os.chmod(staging, 0o755)
            unresolved = download(
                [*requirements, f"pip=={importlib.metadata.version('pip')}"], staging, None if own else target
            )
            with open(os.path.join(staging, PENDING), "w", encoding="utf-8") as f:
                json.dump({**ctx, "requirements": requirements, "unresolved": unresolved}, f)
            group.update(kit=kit, staging=staging, index=bool(host_missing), unresolved=unresolved)
    except BuildError as exc:
        return {"failed": True, "msg": str(exc), **exc.details, **result}
    if not check_mode and os.path.isdir(dest):
        prune(dest, build)
    shipping = ship(groups, records, build, check_mode)

    hosts: dict = {}
    summary = []
    for group in groups:
        for host in group["hosts"]:
            hosts[host] = {
                "group": group["name"],
                "builder": group["builder"],
                "built_on": group["built_on"],
                "wheelhouse": group["path"],
                "ready": group["ready"],
                "install": host in group["needs"],
                "build_here": group["build_now"] and group["builder"] == host,
                "kit": group["kit"],
                "fetch_to": group["staging"],
                "index": group["index"],
                "unresolved": group["unresolved"],
                "bin": (records.get(host) or {}).get("bin"),
                **shipping.get(host, {"archive": None, "ship": None, "why_wheels": ""}),
            }
        if group["builder"] == CONTROLLER:
            result["path"], result["wheels"] = group["path"], group["wheels"]
        who = (
            "the controller" if group["builder"] == CONTROLLER else f"{group['builder']} (from the source distribution)"
        )
        if group["build_now"]:
            doing = f"{'would build' if check_mode else 'building'} on {who}"
        elif group["ready"]:
            doing = f"built on {group['built_on'] if group['built_on'] != CONTROLLER else 'the controller'}, cached"
        else:
            doing = f"current everywhere; would be built on {who}"
        needs = ""
        if group["needs"] and group["hosts"]:
            kinds: dict[str, list[str]] = {}
            for host in group["needs"]:
                how = shipping.get(host) or {}
                what = "a ready environment" if how.get("ship") == ENVIRONMENT else "its wheels"
                if how.get("why_wheels"):
                    what += f" ({how['why_wheels']})"
                kinds.setdefault(what, []).append(host)
            needs = "; to install on " + "; ".join(f"{', '.join(h)} from {w}" for w, h in kinds.items())
        summary.append(
            f"{', '.join(group['hosts']) or 'controller'} ({group['platform']}): meshccl {build} {doing}{needs}"
        )
    return {
        "changed": changed or (check_mode and any(g["build_now"] for g in groups)),
        "groups": groups,
        "hosts": hosts,
        "summary": summary,
        "msg": "; ".join(summary),
        "seconds": round(time.monotonic() - started, 1),
        **result,
    }
