#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: build meshccl's wheelhouse once on the controller, keyed by its sources."""

from __future__ import annotations

DOCUMENTATION = r"""
module: meshccl_wheel
short_description: Build the meshccl wheelhouse on the controller (once per source change)
description:
  - Hashes meshccl's sources (the C(collective) directory, its build directories left out), the Python that builds
    and the extra requirements into a build id. When C(dest/<build id>) holds a finished wheelhouse nothing is done.
  - Otherwise builds meshccl's wheel with this Python's pip (C(--no-build-isolation) when scikit-build-core and
    nanobind are importable here, so nothing is fetched), and adds binary wheels of the extra requirements and of
    pip itself, so hosts install with C(--no-index) and need no package index.
  - The wheel is for this Python and platform; hosts must run the same Python version (the host side checks).
  - Older wheelhouses in O(dest) are removed, the previous one kept.
  - "Run it on the controller (C(delegate_to: localhost), C(run_once))."
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
  source:
    description: meshccl's source directory (the one holding its C(pyproject.toml)).
    type: path
    required: true
  dest:
    description: Where wheelhouses are kept, one directory per build id.
    type: path
    required: true
  requirements:
    description:
      - Further packages hosts get, as binary wheels. A bare name is pinned to the version installed here, if any.
    type: list
    elements: str
    default: [numpy]
"""

EXAMPLES = r"""
- name: Build the wheelhouse
  meshkit.cluster.meshccl_wheel:
    source: "{{ role_path }}/../../collective"
    dest: "{{ lookup('ansible.builtin.env', 'HOME') }}/.cache/meshkit/meshccl-wheels"
  run_once: true
  delegate_to: localhost
  register: meshccl_wheelhouse
"""

RETURN = r"""
build:
  description: The build id (16 hex digits), a hash of the sources, the building Python and the requirements.
  returned: always
  type: str
path:
  description: The wheelhouse directory (absent in check mode before a build).
  returned: always
  type: str
wheels:
  description: The wheel file names in it; empty in check mode before a build.
  returned: always
  type: list
  elements: str
python_tag:
  description: The CPython tag the meshccl wheel needs, e.g. C(cp311).
  returned: always
  type: str
version:
  description: meshccl's version.
  returned: always
  type: str
"""

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

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils.meshccl_build import build_id, pinned


def project_version(source: str) -> str:
    with open(os.path.join(source, "pyproject.toml"), encoding="utf-8") as f:
        m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
    return m.group(1) if m else "0"


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]


MARK = "meshkit-wheelhouse.json"


def prune(dest: str, keep: str) -> None:
    """Remove all wheelhouses but the current and the newest other one."""
    others = []
    for name in os.listdir(dest):
        full = os.path.join(dest, name)
        if name != keep and os.path.isdir(full) and os.path.isfile(os.path.join(full, MARK)):
            others.append((os.path.getmtime(full), full))
    for _mtime, full in sorted(others)[:-1]:
        shutil.rmtree(full, ignore_errors=True)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "source": {"type": "path", "required": True},
            "dest": {"type": "path", "required": True},
            "requirements": {"type": "list", "elements": "str", "default": ["numpy"]},
        },
        supports_check_mode=True,
    )
    source, dest = module.params["source"], module.params["dest"]
    if not os.path.isfile(os.path.join(source, "pyproject.toml")):
        module.fail_json(msg=f"source={source}: no pyproject.toml there; point it at meshccl's sources (collective/)")
    requirements = pinned(module.params["requirements"])
    build = build_id(source, requirements)
    version = project_version(source)
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    path = os.path.join(dest, build)
    result = {
        "build": build,
        "path": path,
        "python_tag": tag,
        "version": version,
        "requirements": requirements,
        "source": source,
        "requested": module.params["requirements"],
    }
    mark = os.path.join(path, MARK)
    if os.path.isfile(mark):
        with open(mark, encoding="utf-8") as f:
            module.exit_json(changed=False, wheels=json.load(f)["wheels"], **result)
    if module.check_mode:
        module.exit_json(changed=True, wheels=[], msg=f"would build meshccl {version} ({build})", **result)

    os.makedirs(dest, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{build}-", dir=dest)
    os.chmod(work, 0o755)
    started = time.monotonic()
    isolation = [] if all(importlib.util.find_spec(m) for m in ("scikit_build_core", "nanobind")) else None
    steps = [
        pip(
            "wheel",
            "--quiet",
            "--no-deps",
            *(["--no-build-isolation"] if isolation is not None else []),
            source,
            "-w",
            work,
        ),
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
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            shutil.rmtree(work, ignore_errors=True)
            module.fail_json(
                msg=f"building the meshccl wheelhouse failed: {' '.join(argv[3:6])} ... exited {proc.returncode}",
                stderr=proc.stderr[-4000:],
                stdout=proc.stdout[-2000:],
                **result,
            )
    wheels = sorted(f for f in os.listdir(work) if f.endswith(".whl"))
    if not any(w.startswith(f"meshccl-{version}-") for w in wheels):
        shutil.rmtree(work, ignore_errors=True)
        module.fail_json(msg=f"pip built no meshccl-{version} wheel from {source}", wheels=wheels, **result)
    with open(os.path.join(work, MARK), "w", encoding="utf-8") as f:
        json.dump({"build": build, "wheels": wheels, "requirements": requirements, "python": sys.executable}, f)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(work, path)
    prune(dest, build)
    module.exit_json(changed=True, wheels=wheels, seconds=round(time.monotonic() - started, 1), **result)


if __name__ == "__main__":
    main()
