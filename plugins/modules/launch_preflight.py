#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: check that this host can run its share of a launch, changing nothing."""

from __future__ import annotations

DOCUMENTATION = r"""
module: launch_preflight
short_description: Check a host before a launch - program, interpreter, working directory, free ports
description:
  - Resolves the program (through C(PATH), the job's own C(PATH) when it sets one) to the real path it runs,
    and its interpreter - a script's C(#!) line (C(/usr/bin/env NAME) resolved too), or the script or C(-m) module
    a Python interpreter is given. The launch compares the results across hosts, so a program that exists at
    different paths (or not at all) on some host stops the launch before any rank starts.
  - Tries to bind every planned listening address and port, and reports one that is taken (with the process that
    holds it, where C(ss) can tell) or an address the host does not have.
  - Read-only; runs in check mode too.
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
  argv:
    description: The command every rank runs.
    type: list
    elements: str
    required: true
  path:
    description: The C(PATH) the ranks get, when the job sets one; else the host's own.
    type: str
  path_prepend:
    description: Directories put in front of that C(PATH) for the ranks (meshccl's virtual environment).
    type: list
    elements: str
    default: []
  cwd:
    description: The ranks' working directory.
    type: str
  require:
    description: Further commands that must be on the ranks' C(PATH) (C(orted) for an MPI job).
    type: list
    elements: str
    default: []
  ports:
    description: "C([address, port, what]) entries this host's ranks will listen on."
    type: list
    elements: raw
    default: []
"""

EXAMPLES = r"""
- name: Preflight
  meshkit.cluster.launch_preflight:
    argv: [python3, /shared/train.py]
    ports: [[198.18.128.1, 29600, meshccl rank 0]]
"""

RETURN = r"""
program:
  description: The real path of the program (symbolic links resolved), null when it is missing.
  returned: always
  type: str
interpreter:
  description: The real path of its interpreter (a script's C(#!), or the Python it is), null when there is none.
  returned: always
  type: str
script:
  description: The real path of the script or the module file a Python interpreter runs, when there is one.
  returned: always
  type: str
problems:
  description: One line per problem found; empty when the host is ready.
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils.launch_agent import preflight


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "argv": {"type": "list", "elements": "str", "required": True},
            "path": {"type": "str"},
            "path_prepend": {"type": "list", "elements": "str", "default": []},
            "cwd": {"type": "str"},
            "require": {"type": "list", "elements": "str", "default": []},
            "ports": {"type": "list", "elements": "raw", "default": []},
        },
        supports_check_mode=True,
    )
    p = module.params
    found = preflight(
        p["argv"],
        path=p["path"],
        path_prepend=p["path_prepend"],
        cwd=p["cwd"],
        require=p["require"],
        ports=p["ports"],
    )
    module.exit_json(changed=False, **found)


if __name__ == "__main__":
    main()
