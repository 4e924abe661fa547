#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: what this host is, for building and installing meshccl (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: meshccl_host_facts
short_description: Read what this host is for meshccl's build and install (changes nothing)
description:
  - Reports the OS, the architecture, the version of the Python that makes meshccl's virtual environment
    (O(python)), libc (glibc's version on Linux, macOS's version on a Mac), and the build tools there - a C++
    compiler (on macOS only once the Xcode Command Line Tools are installed, per C(xcode-select -p)), CMake and its
    version (also looked for in C(/opt/homebrew/bin) and C(/usr/local/bin)), Python's and OpenSSL's headers.
  - Also reads which meshccl build the virtual environment O(venv) holds (only if C(import meshccl) works there)
    and the version of the Python it was made with.
  - The controller groups hosts by these facts (M(meshkit.cluster.meshccl_wheel)); nothing here fails on a missing
    tool or Python, so that every host's gap is reported at once, by name, before anything changes.
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
  python:
    description: The Python (a name on the PATH or a path) that makes meshccl's virtual environment.
    type: str
    default: python3
  venv:
    description: meshccl's virtual environment on this host.
    type: path
  build_on:
    description: This host's O(build_on) choice, passed through to the result for the controller to group by.
    type: str
    choices: [controller, group, host]
    default: controller
"""

EXAMPLES = r"""
- name: Read this host's platform, Python and build tools
  meshkit.cluster.meshccl_host_facts:
    python: python3
    venv: /var/lib/meshkit/meshccl
  register: meshccl_host
"""

RETURN = r"""
system:
  description: C(Linux) or C(Darwin).
  returned: always
  type: str
machine:
  description: The architecture, as C(uname -m) says it (C(x86_64), C(aarch64), C(arm64)).
  returned: always
  type: str
os_version:
  description: macOS's version on a Mac, empty elsewhere.
  returned: always
  type: str
libc:
  description: C({name, version}), e.g. glibc 2.36; null on macOS.
  returned: always
  type: dict
pkg_mgr:
  description: The system package manager (C(apt), C(dnf), C(homebrew), ...), for the command that installs a tool.
  returned: always
  type: str
python:
  description:
    - C({path, version, implementation, python_h, base_executable, error}) of O(python); C(base_executable) - the
      interpreter a virtual environment made by it links to (itself, unless it is a wrapper or a virtual
      environment's).
  returned: always
  type: dict
tools:
  description: C({cxx, cmake, cmake_version, openssl, developer_dir}); a missing tool is null.
  returned: always
  type: dict
installed:
  description: The meshccl build recorded in O(venv), null when none or when meshccl does not import there.
  returned: always
  type: str
venv_python:
  description: The X.Y version of the Python O(venv) was made with, null when there is none.
  returned: always
  type: str
bin:
  description: O(venv)'s C(bin) directory.
  returned: always
  type: str
build_on:
  description: O(build_on), as given.
  returned: always
  type: str
read_id:
  description: A random id of this read (the meshccl role tells a read it has used from a new one by it).
  returned: always
  type: str
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils.meshccl_build import BUILD_ON, gather


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "python": {"type": "str", "default": "python3"},
            "venv": {"type": "path"},
            "build_on": {"type": "str", "choices": list(BUILD_ON), "default": "controller"},
        },
        supports_check_mode=True,
    )
    venv = module.params["venv"]
    record = gather(module.params["python"], venv)
    module.exit_json(
        changed=False,
        bin=os.path.join(venv, "bin") if venv else None,
        build_on=module.params["build_on"],
        read_id=os.urandom(8).hex(),
        **record,
    )


if __name__ == "__main__":
    main()
