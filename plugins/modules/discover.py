#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: report this host's peer ports and what is at the other end of each."""

from __future__ import annotations

DOCUMENTATION = r"""
module: discover
short_description: Report this host's peer ports and what is cabled to each
description:
  - One round trip per host. Changes nothing; safe in check mode.
  - Linux - candidate ports are the interfaces matching O(peer_ports) (never the management interface or a
    bridge). Each port that is up, has carrier and is not enslaved to a bridge is probed at the link layer,
    all ports at once - an IPv6 all-nodes ping bound to the port names the link-local address that
    answers, then a unicast ping to it has this host resolve the peer's MAC itself - so the neighbour
    MACs identify the port at the other end whatever the neighbour table held before (a reboot empties
    it). Runs as the login user (no root needed). A port whose probe cannot run is reported with
    C(probe_error) and a warning.
  - On thunderbolt-net ports, Thunderbolt sysfs (C(/sys/class/net/<port>/device) up to the peer's XDomain
    device) adds the peer host's UUID and name and the link speed (lane speed times lanes).
  - Ports still enslaved to a bridge are reported with C(in_bridge) and not probed (a probe through a bridge
    can answer from any host behind it).
  - macOS - C(system_profiler SPThunderboltDataType -json) and C(networksetup -listallhardwareports) -
    port identity by domain UUID, peers found at any depth (behind hubs), receptacle to C(enX), link speed.
version_added: 0.1.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
  - meshkit.cluster.management
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
options:
  peer_ports:
    description: Interface name patterns of candidate peer ports (Linux); the playbooks give the inventory's
      C(meshkit_peer_ports), or V(thunderbolt*) when that is empty.
    type: list
    elements: str
    required: true
  probe_seconds:
    description: How long each port's probe may take.
    type: int
    default: 1
"""

EXAMPLES = r"""
- name: Discover the cabling
  meshkit.cluster.discover:
    peer_ports: ["tb*"]
    management_address: "{{ ansible_host }}"
  register: meshkit_discovery
"""

RETURN = r"""
ports:
  description: One entry per candidate port - port, ident (MAC or domain UUID), seen (peer identities), speed,
    rdma device, in_bridge, up, probe_error (Linux - why the port could not be probed, else null).
  returned: always
  type: list
  elements: dict
platform:
  description: Linux or Darwin.
  returned: always
  type: str
management_interface:
  description: The interface found to carry the management connection.
  returned: always
  type: str
"""
from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import host_steps as steps


def main() -> None:
    # The work is host_steps.discover (shared with host_ports and host_network, which run it with others).
    module = AnsibleModule(argument_spec=steps.DISCOVER_ARGS, supports_check_mode=True)
    module.exit_json(**steps.discover(module))


if __name__ == "__main__":
    main()
