#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: take the peer ports out of the Thunderbolt bridge and disable it."""

from __future__ import annotations

DOCUMENTATION = r"""
module: bridge_detach
short_description: Take peer ports out of the Thunderbolt bridge and disable the bridge
description:
  - On Linux, every member of O(bridge) that matches O(peer_ports) (all members when empty) leaves the bridge
    (C(ip link set dev X nomaster)); a bridge left with no members is brought down.
  - On macOS, the members of O(bridge) are removed now (C(ifconfig bridge0 deletem enX)) and from the member
    list macOS saves for the bridge (C(VirtualNetworkInterfaces) in
    C(/Library/Preferences/SystemConfiguration/preferences.plist), emptied with C(PlistBuddy)), and the
    C(Thunderbolt Bridge) network service is disabled; both are saved, so the ports stay out of the bridge after
    a reboot.
  - Refuses, with no change at all, when the management connection runs over the bridge or one of its members.
  - With O(state=absent) (undo), puts every port back into the bridge it was in as the host's record says (Linux -
    C(ip link set dev X master bridge0), with the IPv6 address generation and link-local addresses it had, each
    bridge up or down as it was), removes meshkit's networkd files or NetworkManager profiles, then the record.
    Refuses while the cables' addresses (from O(pool)) are still on a port - undo those first
    (M(meshkit.cluster.peer_link) with O(state=absent)).
  - On Linux the change is made at runtime with C(ip) and persisted through systemd-networkd or NetworkManager
    where the host runs one (O(persist)); the result's C(persistence) says which.
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
  bridge:
    description: The bridge the peer ports start in.
    type: str
    default: bridge0
  peer_ports:
    description: Interface name patterns of peer ports (Linux); empty means every member of the bridge.
    type: list
    elements: str
    default: []
  service:
    description: macOS network service of the bridge.
    type: str
    default: Thunderbolt Bridge
  persist:
    description:
      - Linux - how the change survives a reboot. V(auto) uses systemd-networkd when it runs (a
        C(00-meshkit-<port>.network) file per peer port, so the port is no bridge member at boot), else
        NetworkManager when it runs (bridge-slave profiles of the ports stop autoconnecting; a C(meshkit-<port>)
        profile per port), else the change is runtime only.
    type: str
    choices: [auto, networkd, networkmanager, runtime]
    default: auto
  networkd_dir:
    description: Directory of systemd-networkd files.
    type: path
    default: /etc/systemd/network
  pool:
    description: With O(state=absent) - the cables' address pool; undo refuses while a port has one of its addresses.
    type: str
"""

EXAMPLES = r"""
- name: Take the peer ports out of bridge0
  meshkit.cluster.bridge_detach:
    management_address: "{{ ansible_host }}"
"""

RETURN = r"""
members:
  description: Members of the bridge before the change.
  returned: always
  type: list
  elements: str
detached:
  description: Ports taken (or in check mode, to be taken) out of the bridge.
  returned: always
  type: list
  elements: str
commands:
  description: The commands run (or in check mode, that would run).
  returned: always
  type: list
  elements: list
management_interface:
  description: The interface found to carry the management connection.
  returned: always
  type: str
persistence:
  description: How the change survives a reboot.
  returned: always
  type: str
notes:
  description: What could not be made to survive a reboot on this host, and why.
  returned: always
  type: list
  elements: str
record:
  description: The host's record (C(<state_dir>/record.json)); null without O(state_dir).
  returned: O(state=present)
  type: str
removed:
  description: With O(state=absent) - what was removed last (the record, and the state directory where setup made it).
  returned: O(state=absent)
  type: list
  elements: str
"""
from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import host_steps as steps


def main() -> None:
    # The work is host_steps.bridge_detach (shared with host_ports and host_network, which run it with others).
    module = AnsibleModule(argument_spec=steps.BRIDGE_ARGS, supports_check_mode=True)
    module.exit_json(**steps.bridge_detach(module))


if __name__ == "__main__":
    main()
