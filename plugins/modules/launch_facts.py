#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: what a launch needs to know of a host, in one call - management, cabling, hostfiles."""

from __future__ import annotations

DOCUMENTATION = r"""
module: launch_facts
short_description: A host's management interface, cabling and hostfiles for a launch, in one call
description:
  - C(launch.yml)'s per-host reading before the job is planned, as one round trip to the host instead of four;
    each step is the work of the module it is named after, with that module's options, in this order.
    Changes nothing; safe in check mode.
  - 1. O(management) (M(meshkit.cluster.management)) establishes the interface that carries the management
    connection, or refuses naming the host. The action plugin of the same name fills its
    C(controller_addresses), as M(meshkit.cluster.management)'s does.
  - 2. O(discover) (M(meshkit.cluster.discover)) finds which port is cabled to which host; its
    C(management_interface) is the one step 1 established unless given.
  - 3. O(hostfiles) - C(manifest.json) and C(torch.env) of the host's hostfiles directory are read (as
    C(ansible.builtin.slurp) would, as the login user); a file that is missing or unreadable reads as empty.
  - A step that fails fails the module, naming the step (RV(step)); the steps after it do not run.
version_added: 0.9.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
options:
  management:
    description: The options of M(meshkit.cluster.management).
    type: dict
    required: true
  discover:
    description: The options of M(meshkit.cluster.discover).
    type: dict
    required: true
  hostfiles:
    description: The host's hostfiles directory (C(<meshkit_state_dir>/hostfiles)). Left out, nothing is read.
    type: path
"""

EXAMPLES = r"""
- name: Read the host's management interface, its cabling and its hostfiles in one call
  meshkit.cluster.launch_facts:
    management:
      host: "{{ inventory_hostname }}"
      address: "{{ ansible_host | default(inventory_hostname) }}"
    discover:
      peer_ports: [thunderbolt*]
    hostfiles: /var/lib/meshkit/hostfiles
  register: meshkit_host
"""

RETURN = r"""
management:
  description:
    - What M(meshkit.cluster.management) returns (C(interface), C(findings), C(platform)), with the action's
      C(controller_addresses).
  returned: always
  type: dict
discovery:
  description: What M(meshkit.cluster.discover) returns (C(ports), C(platform), C(management_interface)).
  returned: success
  type: dict
hostfiles:
  description: The text of C(manifest.json) and C(torch.env), by name; empty where the file is missing or unreadable.
  returned: success
  type: dict
  sample: {"manifest.json": "{...}", "torch.env": "MASTER_ADDR=..."}
step:
  description: The step that failed (management or discover).
  returned: failure
  type: str
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import host_steps as steps

HOSTFILES = ("manifest.json", "torch.env")


def read_hostfiles(directory: str) -> dict[str, str]:
    """The hostfiles a launch plans from, by name: their text, or "" where missing or unreadable."""
    out = {}
    for name in HOSTFILES:
        try:
            with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as handle:
                out[name] = handle.read()
        except OSError:
            out[name] = ""
    return out


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "management": {"type": "dict", "required": True},
            "discover": {"type": "dict", "required": True},
            "hostfiles": {"type": "path"},
        },
        supports_check_mode=True,
    )
    p = module.params
    out: dict = {"changed": False}
    try:
        out["management"] = steps.establish(steps.Step(module, "management", steps.ESTABLISH_ARGS, p["management"]))
        discover = dict(p["discover"])
        discover["management_interface"] = discover.get("management_interface") or out["management"]["interface"]
        out["discovery"] = steps.discover(steps.Step(module, "discover", steps.DISCOVER_ARGS, discover))
    except steps.StepFailed as failed:
        module.fail_json(**{**out, **failed.result, "changed": False, "step": failed.step})
    out["hostfiles"] = read_hostfiles(p["hostfiles"]) if p["hostfiles"] else {}
    module.exit_json(**out)


if __name__ == "__main__":
    main()
