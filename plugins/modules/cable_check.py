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

import platform

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils.common import run_parallel


def ping_argv(system: str, port: str, peer: str, count: int) -> list[str]:
    if system == "Darwin":
        return ["ping", "-n", "-q", "-c", str(count), "-i", "0.2", "-t", "3", "-b", port, peer]
    return ["ping", "-n", "-q", "-c", str(count), "-i", "0.2", "-w", "3", "-I", port, peer]


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "ports": {"type": "list", "elements": "dict", "required": True},
            "count": {"type": "int", "default": 3},
            "fail": {"type": "bool", "default": True},
            "host": {"type": "str", "default": "this host"},
        },
        supports_check_mode=True,
    )
    p = module.params
    system = platform.system()
    # Every cable's ping at once: a dead cable costs its deadline (3 s), not one per cable.
    runs = run_parallel(
        module,
        {i: ping_argv(system, port["port"], port["peer_address"], p["count"]) for i, port in enumerate(p["ports"])},
        timeout=30,
    )
    cables, dead, dead_ends = [], [], []
    for i, port in enumerate(p["ports"]):
        alive = runs[i][0] == 0
        cables.append(
            {
                "port": port["port"],
                "peer": f"{port['peer_host']}:{port['peer_port']}",
                "peer_address": port["peer_address"],
                "alive": alive,
            }
        )
        if not alive:
            dead_ends.append(f"{p['host']}:{port['port']}")
            dead.append(
                f"{p['host']}:{port['port']} -> {port['peer_host']}:{port['peer_port']} "
                f"({port['peer_address']}): no reply"
            )
    if dead and p["fail"] and not module.check_mode:
        module.fail_json(msg="dead cable(s): " + "; ".join(dead), cables=cables, dead=dead, dead_ends=dead_ends)
    module.exit_json(changed=False, cables=cables, dead=dead, dead_ends=dead_ends)


if __name__ == "__main__":
    main()
