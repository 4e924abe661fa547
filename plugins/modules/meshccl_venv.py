#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: meshccl installed in a virtual environment on this host, from a copied wheelhouse."""

from __future__ import annotations

DOCUMENTATION = r"""
module: meshccl_venv
short_description: Install meshccl into a virtual environment on this host from one archive (or a wheelhouse)
description:
  - With O(state=query), reads which meshccl build the virtual environment at O(path) holds - the build id recorded
    at install time, and only if C(import meshccl) works there - and whether it is O(build). Changes nothing.
  - With O(state=present), does nothing when the build is current (one C(import meshccl) in the environment).
    Otherwise installs it from O(archive), or from the wheels of O(wheelhouse).
  - An O(archive) of kind C(environment) (M(meshkit.cluster.meshccl_wheel) packs one where the hosts' interpreter
    path and Python match the controller's) is a ready environment for O(path), install record included - it is
    unpacked, nothing is installed. It needs the interpreter it was made with at the same path here, of the same
    Python X.Y; otherwise the task fails naming both.
  - An O(archive) of kind C(wheels), or O(wheelhouse) - checks that this host's Python can run the wheels (same
    CPython version), makes a new environment, installs every wheel with pip (C(--no-index), nothing fetched),
    installs O(requirements) from this host's own package index (only those the controller could not get wheels
    of for this host), and records the build id, where the wheel was built (O(built_on)) and the SHA-256 of every
    wheel installed, in C(meshkit-meshccl.json) in the environment.
  - Either way the new environment is made beside the old one (a hidden sibling of O(path)), renamed into place,
    and checked there (C(import meshccl), the recorded build); only then is the old one removed. On any failure
    the old environment is put back as it was. The archive and any unpacked or copied wheels are removed.
  - The build id means the sources and requested requirements the install was made from, whatever machine built
    the wheel; the same on every host of a cluster.
  - The action plugin of the same name copies O(src) from the controller (one file, one transfer) into the task's
    temporary directory and passes it as O(archive); in check mode nothing is copied.
version_added: 0.1.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
attributes:
  action:
    description: An action plugin of the same name copies O(src) from the controller first.
    support: full
  check_mode:
    support: full
  diff_mode:
    support: full
    details: The build recorded in the environment, before and after.
options:
  path:
    description: The virtual environment's directory.
    type: path
    required: true
  build:
    description: The build id wanted (from M(meshkit.cluster.meshccl_wheel)).
    type: str
    required: true
  state:
    description: C(query) to read, C(present) to install when not current.
    type: str
    choices: [query, present]
    default: present
  src:
    description:
      - An archive on the controller (a group's C(environment) or C(wheels) archive from
        M(meshkit.cluster.meshccl_wheel)), copied to this host by the action plugin and installed as O(archive).
    type: path
  archive:
    description: An archive on this host (of either kind; removed after use). O(src) sets it.
    type: path
  wheelhouse:
    description: A directory on this host holding the wheels (removed after use); instead of O(archive).
    type: path
  python:
    description: The Python that creates the virtual environment (from the wheels).
    type: str
    default: python3
  built_on:
    description: Where the wheel was built (C(controller) or a host's name), recorded with the build.
    type: str
  requirements:
    description:
      - Packages to install from this host's package index after the wheels (a pinned one that the index does not
        have falls back to its newest version there).
    type: list
    elements: str
    default: []
"""

EXAMPLES = r"""
- name: Install meshccl from the group's archive (copied from the controller by the action plugin)
  meshkit.cluster.meshccl_venv:
    path: /var/lib/meshkit/meshccl
    build: 0123456789abcdef
    src: "{{ meshccl_wheelhouse.hosts[inventory_hostname].archive }}"
"""

RETURN = r"""
current:
  description: Whether the virtual environment holds O(build) (after this task).
  returned: always
  type: bool
installed:
  description: The build id found before this task, null when none (or meshccl does not import).
  returned: always
  type: str
method:
  description: How it was installed - C(environment) (a ready environment unpacked) or C(wheels) (pip); absent when
    nothing was installed.
  returned: changed
  type: str
bin:
  description: The virtual environment's C(bin) directory.
  returned: always
  type: str
"""

import hashlib
import json
import os
import re
import shutil
import subprocess

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils.meshccl_archive import (
    ENVIRONMENT,
    WHEELS,
    extract,
    read_manifest,
    relocate_tree,
    restore,
    sibling,
    swap_in,
)

MARK = "meshkit-meshccl.json"
# Prints the recorded build only when meshccl imports from this environment.
PROBE = (
    "import json, pathlib, sys\n"
    "import meshccl\n"
    f"print(json.loads(pathlib.Path(sys.prefix, {MARK!r}).read_text())['build'])\n"
)
TAG = "import sys; print('cp%d%d' % sys.version_info[:2])"
WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<ver>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


class InstallError(Exception):
    pass


def run(argv: list[str], what: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise InstallError(f"{what} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def installed_build(path: str) -> str | None:
    python = os.path.join(path, "bin", "python")
    if not os.access(python, os.X_OK):
        return None
    proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=False)
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def wheels_in(path: str | None) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".whl")) if path and os.path.isdir(path) else []


def python_tag(python: str) -> str:
    return run([python, "-c", TAG], f"{python} (its version)").strip()


def record(build: str, wheelhouse: str, wheels: list[str], built_on: str | None, index: list[str]) -> dict:
    """The install record written into the environment (meshkit-meshccl.json)."""
    digests = {}
    for wheel in wheels:
        with open(os.path.join(wheelhouse, wheel), "rb") as f:
            digests[wheel] = hashlib.sha256(f.read()).hexdigest()
    return {"build": build, "wheels": wheels, "sha256": digests, "built_on": built_on, "index": index}


def put_in_place(new: str, path: str, build: str) -> None:
    """Rename the finished environment ``new`` to ``path``, check meshccl imports there with ``build``
    recorded, and only then remove the old one; on failure the old one is back in place."""
    old = swap_in(new, path)
    after = installed_build(path)
    if after != build:
        restore(path, old)
        raise InstallError(f"meshccl does not import from {path} with build {build} recorded (found: {after})")
    if old:
        shutil.rmtree(old, ignore_errors=True)


def install_environment(archive: str, manifest: dict, path: str, build: str) -> None:
    """Unpack a ready environment made on the controller for ``path``."""
    if manifest.get("venv") != path:
        raise InstallError(f"{archive} holds an environment for {manifest.get('venv')}, not {path}")
    python, tag = manifest.get("python") or "", manifest.get("tag") or ""
    if not os.access(python, os.X_OK):
        raise InstallError(
            f"{archive} holds an environment made with {python}, which this host lacks: run setup.yml again "
            "(its host facts decide what is shipped)"
        )
    have = python_tag(python)
    if have != tag:
        raise InstallError(f"{archive} holds an environment made with a {tag} {python}; this host's is {have}")
    new = sibling(path, "new")
    try:
        extract(archive, new)
        put_in_place(new, path, build)
    finally:
        shutil.rmtree(new, ignore_errors=True)


def install_wheels(p: dict, wheelhouse: str, path: str, build: str) -> None:
    """A new environment at ``path`` from the wheels of ``wheelhouse`` (pip, no index)."""
    wheels = wheels_in(wheelhouse)
    if not wheels:
        raise InstallError(f"wheelhouse={wheelhouse}: no wheels there; copy the controller's wheels first")
    python = shutil.which(p["python"]) or p["python"]
    if not os.access(python, os.X_OK):
        raise InstallError(f"python={p['python']}: not found on this host; install Python 3 or give a path")
    tag = python_tag(python)
    for wheel in wheels:
        m = WHEEL.match(wheel)
        if m and m["abi"] != "none" and tag not in m["py"].split("."):
            raise InstallError(
                f"{wheel} was built for {m['py']}, this host's {python} is {tag}: run setup.yml again (meshccl is "
                f"built per Python version), or set meshkit_meshccl_python to a {m['py']} interpreter here"
            )
    pip_wheel = next((os.path.join(wheelhouse, w) for w in wheels if w.startswith("pip-")), None)
    new = sibling(path, "new")
    try:
        # pip from the wheelhouse when it holds one; else the environment gets the Python's own (ensurepip).
        run([python, "-m", "venv", *(["--without-pip"] if pip_wheel else []), new], f"{python} -m venv {path}")
        venv_python = os.path.join(new, "bin", "python")
        pip = [venv_python, os.path.join(pip_wheel, "pip")] if pip_wheel else [venv_python, "-m", "pip"]
        run(
            [
                *pip,
                "install",
                "--isolated",
                "--quiet",
                "--disable-pip-version-check",
                "--no-index",
                "--no-deps",
                *(os.path.join(wheelhouse, w) for w in wheels),
            ],
            f"pip install into {path}",
        )
        for spec in p["requirements"]:
            bare = re.split(r"[\s<>=!~;\[(]", spec, maxsplit=1)[0]
            argv = [*pip, "install", "--quiet", "--disable-pip-version-check"]
            proc = subprocess.run([*argv, spec], capture_output=True, text=True, check=False)
            if proc.returncode != 0 and bare != spec:
                proc = subprocess.run([*argv, bare], capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise InstallError(
                    f"{spec}: no wheel of it came from the controller for this host, and its own package index has "
                    f"none either: {proc.stderr.strip()[-1500:]}"
                )
        with open(os.path.join(new, MARK), "w", encoding="utf-8") as f:
            json.dump({**record(build, wheelhouse, wheels, p["built_on"], p["requirements"]), "method": WHEELS}, f)
        # Made at the sibling's path: its scripts and pyvenv.cfg are made to name the environment's own.
        relocate_tree(new, new, path)
        put_in_place(new, path, build)
    finally:
        shutil.rmtree(new, ignore_errors=True)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "build": {"type": "str", "required": True},
            "state": {"type": "str", "choices": ["query", "present"], "default": "present"},
            "src": {"type": "path"},
            "archive": {"type": "path"},
            "wheelhouse": {"type": "path"},
            "python": {"type": "str", "default": "python3"},
            "built_on": {"type": "str"},
            "requirements": {"type": "list", "elements": "str", "default": []},
        },
        mutually_exclusive=[["archive", "wheelhouse"]],
        supports_check_mode=True,
    )
    p = module.params
    path, build = p["path"].rstrip("/"), p["build"]
    bin_dir = os.path.join(path, "bin")
    before = installed_build(path)
    result = {"installed": before, "bin": bin_dir, "path": path}
    if before == build:
        module.exit_json(changed=False, current=True, **result)
    if p["state"] == "query":
        module.exit_json(changed=False, current=False, **result)
    archive, wheelhouse = p["archive"], p["wheelhouse"]
    if module._diff:
        result["diff"] = {
            "before_header": f"{path}/{MARK}",
            "after_header": f"{path}/{MARK}",
            "before": f"meshccl build {before}\n" if before else "",
            "after": f"meshccl build {build}\n",
        }
    if module.check_mode:
        module.exit_json(changed=True, current=False, msg=f"would install meshccl {build} (now: {before})", **result)

    unpacked = None
    try:
        if archive:
            try:
                manifest = read_manifest(archive)
            except (OSError, ValueError) as exc:
                raise InstallError(f"archive={archive}: {exc}") from exc
            if manifest.get("build") != build:
                raise InstallError(f"{archive} holds meshccl build {manifest.get('build')}, not {build}")
            if manifest.get("kind") == ENVIRONMENT:
                install_environment(archive, manifest, path, build)
                method = ENVIRONMENT
            else:
                unpacked = sibling(path, "wheels")
                extract(archive, unpacked)
                install_wheels(p, unpacked, path, build)
                method = WHEELS
        else:
            install_wheels(p, wheelhouse, path, build)
            method = WHEELS
    except InstallError as exc:
        module.fail_json(msg=str(exc), **result)
    finally:
        if unpacked:
            shutil.rmtree(unpacked, ignore_errors=True)
        if archive and os.path.isfile(archive):
            os.remove(archive)
    if wheelhouse:
        shutil.rmtree(wheelhouse, ignore_errors=True)
    module.exit_json(
        changed=True, current=True, method=method, msg=f"installed meshccl {build} (was: {before})", **result
    )


if __name__ == "__main__":
    main()
