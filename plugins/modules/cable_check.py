#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: ping the far end of every cable of this host, bound to that cable's port."""

from __future__ import annotations

DOCUMENTATION = r"""
module: cable_check
short_description: Verify every cable of this host with a ping bound to its port
description:
  - Pings each planned peer address out of the port it is cabled to (Linux C(ping -I port), macOS
    C(ping -b port)), all ports at once, and fails naming every dead cable by host, port and peer.
  - Read-only; runs in check mode too, where a cable not yet addressed is reported, not failed.
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
  ports:
    description: This host's C(per_host) entries of the plan.
    type: list
    elements: dict
    required: true
  count:
    description: Pings per cable; one reply is enough.
    type: int
    default: 3
  fail:
    description: Fail on a dead cable. Off, dead cables are only reported (RV(dead)), e.g. to draw them first.
    type: bool
    default: true
  host:
    description: This host's inventory name, used in messages.
    type: str
    default: this host
"""

EXAMPLES = r"""
- name: Ping across every cable
  meshkit.cluster.cable_check:
    ports: "{{ meshkit_plan.per_host[inventory_hostname] }}"
    host: "{{ inventory_hostname }}"
"""

RETURN = r"""
cables:
  description: Per port - peer, peer address, alive.
  returned: always
  type: list
  elements: dict
dead:
  description: One line per cable that did not answer.
  returned: always
  type: list
  elements: str
dead_ends:
  description: This host's ends (C(host:port)) of the cables that did not answer.
  returned: always
  type: list
  elements: str
"""
from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import host_steps as steps


def main() -> None:
    # The work is host_steps.cable_check (shared with host_ports and host_network, which run it with others).
    module = AnsibleModule(argument_spec=steps.PING_ARGS, supports_check_mode=True)
    module.exit_json(**steps.cable_check(module))


if __name__ == "__main__":
    main()
