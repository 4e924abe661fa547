#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: give every cabled port of this host its planned address, host route and MTU."""

from __future__ import annotations

DOCUMENTATION = r"""
module: peer_link
short_description: Apply this host's part of the cabling plan - one address per cable end, host route, MTU
description:
  - Linux - C(ip addr) with the planned /30 on each port, C(ip route replace <peer>/32 dev <port>), the MTU when
    asked, the port up. Addresses from the pool on peer ports that no longer have a cable are removed; addresses
    outside the pool are never touched. Runtime configuration.
  - macOS - a network service per port (the existing one for the device, enabled, or C(meshkit enX) on the port's
    hardware port) set to a manual address with no router (C(networksetup -setmanual)), and the MTU
    (C(networksetup -setMTU)); both are saved and come back at boot, with the port's /30. A host route to the peer
    out of that port (C(route add -host)) is runtime only; C(notes) says so whenever one is added.
  - With O(state=absent) (undo) - takes the pool's addresses and the host routes to peers off every peer port,
    gives each port back the MTU and up/down state the host's record holds, and removes meshkit's address drop-ins
    (networkd) or profile addresses (NetworkManager). The record stays, for the bridge's undo
    (M(meshkit.cluster.bridge_detach) with O(state=absent)).
  - Never touches the management interface.
version_added: 0.1.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
  - meshkit.cluster.management
  - meshkit.cluster.undo
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
options:
  ports:
    description:
      - This host's C(per_host) entries of the plan (port, address, prefix, peer_address, ...).
      - Required with O(state=present).
    type: list
    elements: dict
  pool:
    description: The address pool of the plan; only its addresses are ever removed.
    type: str
    required: true
  peer_ports:
    description: Interface name patterns of peer ports (Linux), for removing stale addresses.
    type: list
    elements: str
    default: []
  mtu:
    description: MTU for every peer port; unset keeps the interface's.
    type: int
  persist:
    description:
      - Linux - V(auto) persists through systemd-networkd when it runs (a drop-in
        C(00-meshkit-<port>.network.d/50-address.conf) with Address, the peer route and MTU; drop-ins of ports
        without a cable are removed), else NetworkManager (the C(meshkit-<port>) profile gets the manual address,
        route and MTU), else runtime only.
    type: str
    choices: [auto, networkd, networkmanager, runtime]
    default: auto
  networkd_dir:
    description: Directory of systemd-networkd files.
    type: path
    default: /etc/systemd/network
  bridge:
    description: The bridge the peer ports start in, for the host's record (its state before the first change).
    type: str
"""

EXAMPLES = r"""
- name: Address every cable end
  meshkit.cluster.peer_link:
    ports: "{{ meshkit_plan.per_host[inventory_hostname] }}"
    pool: 198.18.128.0/17
"""

RETURN = r"""
commands:
  description: The commands run (or in check mode, that would run).
  returned: always
  type: list
  elements: list
persistence:
  description: How the configuration survives a reboot.
  returned: always
  type: str
notes:
  description: Stale addresses removed and similar remarks.
  returned: always
  type: list
  elements: str
record:
  description: The host's record (C(<state_dir>/record.json)); null without O(state_dir).
  returned: O(state=present)
  type: str
removed_addresses:
  description: With O(state=absent) - per port, the pool's addresses taken off (or, in check mode, to be).
  returned: O(state=absent)
  type: dict
"""
from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import host_steps as steps


def main() -> None:
    # The work is host_steps.peer_link (shared with host_ports and host_network, which run it with others).
    module = AnsibleModule(argument_spec=steps.LINK_ARGS, supports_check_mode=True)
    module.exit_json(**steps.peer_link(module))


if __name__ == "__main__":
    main()
