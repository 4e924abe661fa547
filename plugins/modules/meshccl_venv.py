#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: meshccl installed in a virtual environment on this host, from a copied wheelhouse."""

from __future__ import annotations

DOCUMENTATION = r"""
module: meshccl_venv
short_description: Install meshccl into a virtual environment on this host from a wheelhouse
description:
  - With O(state=query), reads which meshccl build the virtual environment at O(path) holds - the build id recorded
    at install time, and only if C(import meshccl) works there - and whether it is O(build). Changes nothing.
  - With O(state=present), does nothing when the build is current. Otherwise checks that this host's Python can
    run the wheels (same CPython version), creates the virtual environment if needed, installs every wheel of
    O(wheelhouse) with pip (C(--no-index), nothing fetched), installs O(requirements) from this host's own package
    index (only those the controller could not get wheels of for this host), checks C(import meshccl) and records
    the build id, where the wheel was built (O(built_on)) and the SHA-256 of every wheel installed, in
    C(meshkit-meshccl.json) in the environment. The copied wheelhouse is removed afterwards.
  - The build id means the sources and requested requirements the install was made from, whatever machine built
    the wheel; the same on every host of a cluster.
version_added: 0.1.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
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
  wheelhouse:
    description: Directory on this host holding the wheels (needed for O(state=present)).
    type: path
  python:
    description: The Python that creates the virtual environment.
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
- name: Install meshccl
  meshkit.cluster.meshccl_venv:
    path: /var/lib/meshkit/meshccl
    build: 0123456789abcdef
    wheelhouse: /var/lib/meshkit/meshccl-wheels/0123456789abcdef
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

MARK = "meshkit-meshccl.json"
# Prints the recorded build only when meshccl imports from this environment.
PROBE = (
    "import json, pathlib, sys\n"
    "import meshccl\n"
    f"print(json.loads(pathlib.Path(sys.prefix, {MARK!r}).read_text())['build'])\n"
)
TAG = "import sys; print('cp%d%d' % sys.version_info[:2])"
WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<ver>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


def run(module: AnsibleModule, argv: list[str], what: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        module.fail_json(msg=f"{what} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}", cmd=argv)
    return proc.stdout


def installed_build(path: str) -> str | None:
    python = os.path.join(path, "bin", "python")
    if not os.access(python, os.X_OK):
        return None
    proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=False)
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "build": {"type": "str", "required": True},
            "state": {"type": "str", "choices": ["query", "present"], "default": "present"},
            "wheelhouse": {"type": "path"},
            "python": {"type": "str", "default": "python3"},
            "built_on": {"type": "str"},
            "requirements": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    p = module.params
    path, build = p["path"], p["build"]
    bin_dir = os.path.join(path, "bin")
    before = installed_build(path)
    result = {"installed": before, "bin": bin_dir, "path": path}
    if before == build:
        module.exit_json(changed=False, current=True, **result)
    if p["state"] == "query":
        module.exit_json(changed=False, current=False, **result)
    if module.check_mode:
        module.exit_json(changed=True, current=False, msg=f"would install meshccl {build} (now: {before})", **result)

    wheelhouse = p["wheelhouse"]
    wheels = (
        sorted(f for f in os.listdir(wheelhouse) if f.endswith(".whl"))
        if wheelhouse and os.path.isdir(wheelhouse)
        else []
    )
    if not wheels:
        module.fail_json(msg=f"wheelhouse={wheelhouse}: no wheels there; copy the controller's wheels first", **result)
    python = shutil.which(p["python"]) or p["python"]
    if not os.access(python, os.X_OK):
        module.fail_json(msg=f"python={p['python']}: not found on this host; install Python 3 or give a path", **result)
    tag = run(module, [python, "-c", TAG], f"{python} (its version)").strip()
    for wheel in wheels:
        m = WHEEL.match(wheel)
        if m and m["abi"] != "none" and tag not in m["py"].split("."):
            module.fail_json(
                msg=(
                    f"{wheel} was built for {m['py']}, this host's {python} is {tag}: run setup.yml again (meshccl is "
                    f"built per Python version), or set meshkit_meshccl_python to a {m['py']} interpreter here"
                ),
                **result,
            )
    venv_python = os.path.join(bin_dir, "python")
    if os.path.exists(venv_python):
        have = subprocess.run([venv_python, "-c", TAG], capture_output=True, text=True, check=False).stdout.strip()
        if have != tag:  # made by another Python (or broken): make it again
            shutil.rmtree(path)
    pip_wheel = next((os.path.join(wheelhouse, w) for w in wheels if w.startswith("pip-")), None)
    if not os.path.exists(venv_python):
        # pip from the wheelhouse when it holds one; else the environment gets the Python's own (ensurepip).
        run(module, [python, "-m", "venv", *(["--without-pip"] if pip_wheel else []), path], f"{python} -m venv {path}")
    pip = [venv_python, os.path.join(pip_wheel, "pip")] if pip_wheel else [venv_python, "-m", "pip"]
    run(
        module,
        [
            *pip,
            "install",
            "--isolated",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            "--no-deps",
            "--force-reinstall",
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
            module.fail_json(
                msg=f"{spec}: no wheel of it came from the controller for this host, and its own package index has "
                f"none either: {proc.stderr.strip()[-1500:]}",
                **result,
            )
    digests = {}
    for wheel in wheels:
        with open(os.path.join(wheelhouse, wheel), "rb") as f:
            digests[wheel] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(path, MARK), "w", encoding="utf-8") as f:
        json.dump(
            {
                "build": build,
                "wheels": wheels,
                "sha256": digests,
                "built_on": p["built_on"],
                "index": p["requirements"],
            },
            f,
        )
    after = installed_build(path)
    if after != build:
        module.fail_json(msg=f"meshccl does not import from {path} after installing {', '.join(wheels)}", **result)
    shutil.rmtree(wheelhouse, ignore_errors=True)
    module.exit_json(changed=True, current=True, msg=f"installed meshccl {build} (was: {before})", **result)


if __name__ == "__main__":
    main()
