#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: establish the interface that carries the management connection, or refuse."""

from __future__ import annotations

DOCUMENTATION = r"""
module: management
short_description: Establish which interface carries the management connection, or refuse
description:
  - Changes nothing. Run first on every host (C(setup.yml) does), so that when any host's management interface
    cannot be established, no host has been changed.
  - The answer comes from facts that do not depend on the login environment (sudo drops C(SSH_CONNECTION)).
    O(address) (the inventory's C(ansible_host)) is resolved on the host itself and the interface holding one of
    its addresses is taken; loopback answers tell nothing. The route from the host back to each of
    O(controller_addresses) names an interface (C(ip route get) on Linux, C(route -n get) on macOS). When the
    login environment still has C(SSH_CONNECTION), its two addresses are asked too.
  - O(interface) (the inventory's C(meshkit_management_interface)) wins, but must exist on the host.
  - Fails when no answer names an interface, when two answers disagree, when the management interface is
    O(bridge) or one of its members, or when O(pool) overlaps an address or route of the host that is not on a
    peer port (default routes excepted), or contains the controller's address or O(address).
  - The action plugin of the same name fills O(controller_addresses) with the controller's source address toward
    the host, so playbooks do not pass it.
version_added: 0.2.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: N/A
options:
  host:
    description: The host's inventory name, for messages.
    type: str
  address:
    description: How the controller reaches the host (C(ansible_host)) - a name or an address.
    type: str
  controller_addresses:
    description: The controller's own addresses as the host sees them (filled in by the action plugin).
    type: list
    elements: str
    default: []
  interface:
    description: The management interface, when detection should be overridden (C(meshkit_management_interface)).
    type: str
  bridge:
    description:
      - The bridge whose ports meshkit takes apart; the management interface must not be it or one of its members.
        Unset, no bridge is checked (read-only uses such as C(launch.yml)).
    type: str
  pool:
    description: The cable address pool; refused when it overlaps the host's addresses or routes.
    type: str
  peer_ports:
    description:
      - Interface name patterns of peer ports (Linux); their pool addresses and routes are meshkit's own.
      - On macOS the Thunderbolt ports of C(networksetup -listallhardwareports) are the peer ports.
    type: list
    elements: str
    default: []
"""

EXAMPLES = r"""
- name: Find the management interface of every host (nothing changes anywhere if one cannot be found)
  meshkit.cluster.management:
    host: "{{ inventory_hostname }}"
    address: "{{ ansible_host | default(inventory_hostname) }}"
    interface: "{{ meshkit_management_interface | default(omit) }}"
    pool: 198.18.128.0/17
    peer_ports: ["tb*"]
  register: meshkit_management
"""

RETURN = r"""
interface:
  description: The interface that carries the management connection.
  returned: success
  type: str
findings:
  description: Every answer the host gave (source, detail, interface).
  returned: always
  type: list
  elements: dict
platform:
  description: Linux or Darwin.
  returned: always
  type: str
"""

import platform

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import management as mg
from ansible_collections.meshkit.cluster.plugins.module_utils.common import runner

# The work itself, in module_utils: launch_facts runs it with discovery in one call (host_steps.establish).
from ansible_collections.meshkit.cluster.plugins.module_utils.management import establish


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "host": {"type": "str"},
            "address": {"type": "str"},
            "controller_addresses": {"type": "list", "elements": "str", "default": []},
            "interface": {"type": "str"},
            "bridge": {"type": "str"},
            "pool": {"type": "str"},
            "peer_ports": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    system = platform.system()
    try:
        result = establish(module.params, runner(module), system, mg.system_resolve)
    except (mg.ManagementError, ValueError) as exc:
        module.fail_json(msg=str(exc), platform=system)
    if result.pop("failed", False):
        module.fail_json(platform=system, **result)
    module.exit_json(changed=False, platform=system, **result)


if __name__ == "__main__":
    main()
