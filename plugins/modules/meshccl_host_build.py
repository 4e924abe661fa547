#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: build meshccl's wheel on this host from its source distribution (no package index)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: meshccl_host_build
short_description: Build meshccl's wheel on this host from the source distribution the controller copied here
description:
  - O(kit) holds meshccl's source distribution and the wheels of its build requirements (scikit-build-core,
    nanobind and what they need, and pip) for this host's Python, as M(meshkit.cluster.meshccl_wheel) prepared them.
  - Makes a throw-away virtual environment with O(python), installs the build requirements into it from O(kit) only
    (C(--no-index)), and builds the wheel with C(pip wheel --no-index --no-build-isolation) into O(dest). With
    O(index), the build requirements come from this host's package index instead (the controller could not get
    wheels of them for this host).
  - Checks first that a C++ compiler and CMake are there (CMake also in C(/opt/homebrew/bin), C(/usr/local/bin)),
    and fails naming what is missing and the command that installs it.
  - The environment and pip's temporary build directories are removed; O(dest) keeps the wheel for the controller
    to fetch.
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
  kit:
    description: Directory on this host with the source distribution and the build requirements' wheels.
    type: path
    required: true
  dest:
    description: Directory the wheel is written to (created).
    type: path
    required: true
  python:
    description: The Python the wheel is built for (the one that makes meshccl's environment here).
    type: str
    default: python3
  index:
    description: Install the build requirements from this host's package index instead of O(kit).
    type: bool
    default: false
  build:
    description: The build id, for messages.
    type: str
"""

EXAMPLES = r"""
- name: Build meshccl here from the source distribution
  meshkit.cluster.meshccl_host_build:
    kit: /var/lib/meshkit/meshccl-wheels/build-0123456789abcdef/kit
    dest: /var/lib/meshkit/meshccl-wheels/build-0123456789abcdef/out
    python: python3
  register: meshccl_built
"""

RETURN = r"""
wheel:
  description: The built wheel's path on this host (absent in check mode).
  returned: success
  type: str
sha256:
  description: The wheel's SHA-256.
  returned: success
  type: str
seconds:
  description: How long the build took.
  returned: success
  type: float
"""

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils.meshccl_build import (
    gather,
    install_command,
    missing_tools,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "kit": {"type": "path", "required": True},
            "dest": {"type": "path", "required": True},
            "python": {"type": "str", "default": "python3"},
            "index": {"type": "bool", "default": False},
            "build": {"type": "str"},
        },
        supports_check_mode=True,
    )
    p = module.params
    kit, dest = p["kit"], p["dest"]
    record = gather(p["python"])
    if record["python"]["error"]:
        module.fail_json(msg=f"{record['python']['error']}: set meshkit_meshccl_python to a Python 3.9 or later")
    lack = missing_tools(record)
    if lack:
        module.fail_json(
            msg=f"cannot build meshccl here: no {', '.join(lack)}; install: {install_command(record, lack)}"
        )
    if module.check_mode:
        module.exit_json(
            changed=True, msg=f"would build meshccl {p['build'] or ''} here for Python {record['python']['version']}"
        )
    sdists = sorted(glob.glob(os.path.join(kit, "*.tar.gz")))
    if not sdists:
        module.fail_json(msg=f"kit={kit}: no source distribution there; copy the controller's kit first")
    python = record["python"]["path"]
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="meshccl-build-", dir=os.path.dirname(kit.rstrip("/")) or None)
    env_dir = os.path.join(work, "env")
    # The build sees CMake wherever it was found (a Mac's sshd PATH lacks /opt/homebrew/bin).
    path_dirs = [os.path.dirname(record["tools"]["cmake"]), os.path.dirname(record["tools"]["cxx"])]
    env = {
        **os.environ,
        "PATH": os.pathsep.join([*path_dirs, os.environ.get("PATH", "/usr/bin:/bin")]),
        "TMPDIR": work,
        "PIP_NO_CACHE_DIR": "1",
    }
    for key in list(env):
        if key.startswith("PIP_") and key != "PIP_NO_CACHE_DIR":
            env.pop(key)

    def step(argv: list[str], what: str) -> None:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
        if proc.returncode != 0:
            shutil.rmtree(work, ignore_errors=True)
            module.fail_json(
                msg=f"{what} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-3000:]}", cmd=argv
            )

    wheels = sorted(glob.glob(os.path.join(kit, "*.whl")))
    pip_wheel = next((w for w in wheels if os.path.basename(w).startswith("pip-")), None)
    venv_python = os.path.join(env_dir, "bin", "python")
    if pip_wheel:
        step([python, "-m", "venv", "--without-pip", env_dir], f"{python} -m venv")
        installer = [venv_python, os.path.join(pip_wheel, "pip")]
    else:
        step([python, "-m", "venv", env_dir], f"{python} -m venv (with its own pip)")
        installer = [venv_python, "-m", "pip"]
    quiet = ["--quiet", "--disable-pip-version-check", "--no-cache-dir"]
    if p["index"]:
        requires = ["scikit-build-core>=0.10,<2", "nanobind>=2.4,<4", *(["pip"] if pip_wheel else [])]
        step([*installer, "install", *quiet, *wheels, *requires], "installing the build requirements from the index")
    else:
        step([*installer, "install", *quiet, "--no-index", *wheels], "installing the build requirements from the kit")
    os.makedirs(dest, exist_ok=True)
    for old in glob.glob(os.path.join(dest, "meshccl-*.whl")):
        os.remove(old)
    step(
        [
            venv_python,
            "-m",
            "pip",
            "wheel",
            *quiet,
            "--no-index",
            "--no-build-isolation",
            "--no-deps",
            sdists[-1],
            "-w",
            dest,
        ],
        f"building meshccl from {os.path.basename(sdists[-1])}",
    )
    shutil.rmtree(work, ignore_errors=True)
    built = sorted(glob.glob(os.path.join(dest, "meshccl-*.whl")))
    if not built:
        module.fail_json(msg=f"pip built no meshccl wheel from {sdists[-1]}")
    with open(built[-1], "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    module.exit_json(
        changed=True,
        wheel=built[-1],
        sha256=digest,
        seconds=round(time.monotonic() - started, 1),
        msg=f"built {os.path.basename(built[-1])} here in {time.monotonic() - started:.0f} s",
    )


if __name__ == "__main__":
    main()
