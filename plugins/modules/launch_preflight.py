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
  - With O(links) (the plan's cables of this host), checks that no cable port is a member of a bridge (macOS - the
    Thunderbolt Bridge active again, which JACCL answers with C(errno 22); Linux - C(/sys/class/net/<port>/master)),
    and connects to every peer's cable address from the ranks' own interpreter. A refusal with C(EHOSTUNREACH)
    (C(No route to host), errno 65) on macOS to a peer on the cable's own network is classified as Local Network
    Privacy blocking the program (started inside tmux/screen or from an app's terminal), with the fix. A peer that
    refuses the connection answered, so it counts as reachable; one that does not answer in time is only a note.
  - Read-only; runs in check mode too (the probe opens and closes one TCP connection per peer and sends one empty UDP
    datagram to its port 9).
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
  links:
    description:
      - This host's cables as the plan has them (C(per_host[host]) of plan.json) - each with C(port), C(address),
        C(prefix), C(peer_address), C(peer_host). Empty - no cable checks.
    type: list
    elements: dict
    default: []
  probe_port:
    description: The TCP port connected to on every peer (a refusal proves the peer reachable as well as an accept).
    type: int
    default: 22
  probe_timeout:
    description: Seconds to wait for each peer.
    type: float
    default: 2.0
  system:
    description: C(auto) detects; C(Linux) or C(Darwin) forces a platform (tests).
    type: str
    default: auto
    choices: [auto, Linux, Darwin]
  sysfs_root:
    description: Root of the sysfs tree whose C(class/net/*/master) tells bridge members (Linux).
    type: path
    default: /sys
"""

EXAMPLES = r"""
- name: Preflight
  meshkit.cluster.launch_preflight:
    argv: [python3, /shared/train.py]
    ports: [[198.18.128.1, 29600, meshccl rank 0]]

- name: Preflight with the cables checked (bridge members, peers reachable from the ranks' Python)
  meshkit.cluster.launch_preflight:
    argv: [python3, /shared/train.py]
    links: "{{ meshkit_planned.plan.per_host[inventory_hostname] }}"
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
notes:
  description: What was found but does not stop a launch (a peer that did not answer in time, a check skipped).
  returned: always
  type: list
  elements: str
peers:
  description:
    - Per link, the probe's answer (C(probe) - result, errno name, elapsed seconds), the route read, and the verdict -
      C(kind) (reachable, local_network_privacy, wrong_route, unreachable, no_answer, error), C(problem), C(note).
  returned: always
  type: list
  elements: dict
bridged:
  description: Cable ports that are members of a bridge, with the bridge.
  returned: always
  type: dict
context:
  description: Where the ranks would be started from (C(via) - inside tmux, from an app, over SSH, from Terminal).
  returned: always
  type: dict
probed_with:
  description: The Python the peers were probed from (the ranks' interpreter when it is a Python), null without links.
  returned: always
  type: str
"""

import platform

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import macos
from ansible_collections.meshkit.cluster.plugins.module_utils.common import runner
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
            "links": {"type": "list", "elements": "dict", "default": []},
            "probe_port": {"type": "int", "default": 22},
            "probe_timeout": {"type": "float", "default": 2.0},
            "system": {"type": "str", "default": "auto", "choices": ["auto", "Linux", "Darwin"]},
            "sysfs_root": {"type": "path", "default": "/sys"},
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
    system = platform.system() if p["system"] == "auto" else p["system"]
    checks = {"problems": [], "notes": [], "peers": [], "bridged": {}, "context": {}, "probed_with": None}
    if p["links"]:
        checks = macos.launch_checks(
            p["links"],
            runner(module),
            system,
            interpreter=found["interpreter"],
            probe_port=p["probe_port"],
            probe_timeout=p["probe_timeout"],
            sysfs_root=p["sysfs_root"],
        )
    found["problems"] = list(found["problems"]) + checks["problems"]
    module.exit_json(changed=False, **found, **{k: v for k, v in checks.items() if k != "problems"})


if __name__ == "__main__":
    main()
