#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: what may have drifted on a host since setup.yml, read without changing anything."""

from __future__ import annotations

DOCUMENTATION = r"""
module: check_facts
short_description: Read what may have drifted on a host since setup.yml - ports, MTU, addresses, routes, RDMA
description:
  - For every planned cable port of the host (O(links), the plan's C(per_host) entries), reports whether it exists
    and is up, its MAC, MTU, negotiated speed, IPv4 addresses, the routes that leave through it, the route to the
    peer's address and the MAC that answers for it; cable-candidate ports that are up but not planned; with
    O(rdma), the RDMA ports as sysfs shows them and the C(NCCL_IB_*) variables of the host's C(torch.env).
  - The same facts C(meshkit check) and C(meshkit launch) ask every host for (module_utils C(host_facts), which
    the launch agent runs too); the meshkit package's C(check_drift) compares them with the plan.
  - Linux only; on macOS only the hostfiles' fingerprint and the meshccl build are read (the launch preflight
    checks the Thunderbolt Bridge and Local Network Privacy there).
  - Read-only (one UDP datagram to the discard port of a peer whose neighbour entry is missing, so the kernel
    resolves it).
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
  links:
    description: This host's cables (the plan's C(per_host) entries - port, address, prefix, peer_host, peer_port,
      peer_address).
    type: list
    elements: dict
    required: true
  peer_ports:
    description: Interface name patterns that may carry a cable (the inventory's C(meshkit_discover_ports)).
    type: list
    elements: str
    default: []
  management_interface:
    description: The interface that carries the management address (never a cable).
    type: str
    default: ""
  state_dir:
    description: meshkit's state directory on the host (its C(hostfiles/)).
    type: str
    default: /var/lib/meshkit
  rdma:
    description: Also read the RDMA ports and the host's C(NCCL_IB_*) settings.
    type: bool
    default: true
  sysfs_root:
    description: Where sysfs is (tests give a recorded tree).
    type: path
    default: /sys
"""

EXAMPLES = r"""
- name: Read what may have drifted
  meshkit.cluster.check_facts:
    links: "{{ meshkit_planned.plan.per_host[inventory_hostname] }}"
    peer_ports: ["thunderbolt*"]
  register: meshkit_check_facts
"""

RETURN = r"""
facts:
  description: The host's facts - C(platform), C(fingerprint), C(ports) (per planned port - exists, up, mac, mtu,
    speed_mbps, addresses, routes, route, neighbour), C(unplanned), C(management_up), C(rdma).
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils.host_facts import host_facts


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "links": {"type": "list", "elements": "dict", "required": True},
            "peer_ports": {"type": "list", "elements": "str", "default": []},
            "management_interface": {"type": "str", "default": ""},
            "state_dir": {"type": "str", "default": "/var/lib/meshkit"},
            "rdma": {"type": "bool", "default": True},
            "sysfs_root": {"type": "path", "default": "/sys"},
        },
        supports_check_mode=True,
    )
    p = module.params
    facts = host_facts(
        {
            "links": p["links"],
            "peer_ports": p["peer_ports"],
            "management_interface": p["management_interface"],
            "state_dir": p["state_dir"],
            "rdma": p["rdma"],
            "sysfs_root": p["sysfs_root"],
        }
    )
    module.exit_json(changed=False, facts=facts)


if __name__ == "__main__":
    main()
