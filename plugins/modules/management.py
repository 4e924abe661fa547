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

import contextlib
import functools
import platform

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import linux_net, macos
from ansible_collections.meshkit.cluster.plugins.module_utils import management as mg
from ansible_collections.meshkit.cluster.plugins.module_utils.common import runner


def establish(params: dict, run, system: str, resolve: mg.Resolve, environ: dict | None = None) -> dict:
    """The module's work, without AnsibleModule: {"interface", "findings", "failed"?, "msg"?}."""
    host = params.get("host") or params.get("address") or "this host"
    if system == "Darwin":
        net = mg.darwin_hostnet(run)
        route = functools.partial(mg.darwin_route_interface, run)
        rc, out, _err = run(list(macos.HARDWARE_PORTS))
        hardware = macos.parse_hardware_ports(out) if rc == 0 else {}
        peers = [dev for name, dev in hardware.items() if name.startswith("Thunderbolt ") and name[-1:].isdigit()]
    else:
        net = mg.linux_hostnet(run)
        route = functools.partial(mg.linux_route_interface, run)
        peers = list(params.get("peer_ports") or [])
    found = mg.findings(
        params.get("address"), params.get("controller_addresses") or [], net, route, resolve, environ, peers
    )
    result: dict = {"findings": [f.as_dict() for f in found], "interface": None}
    try:
        mgmt = mg.decide(host, params.get("interface"), found, net)
    except mg.ManagementError as exc:
        return {**result, "failed": True, "msg": str(exc)}
    result["interface"] = mgmt
    bridge = params.get("bridge")
    # What the management interface rests on (a VLAN's lower device, a bond's ports) counts as it.
    rests_on = linux_net.protected(net.links, mgmt) if net.links else {mgmt}
    inside = sorted(n for n in rests_on if n == bridge or n in net.bridge_members.get(bridge or "", []))
    if bridge and inside:
        what = (
            f"{bridge} itself"
            if mgmt == bridge
            else f"{mgmt}, a member of {bridge}"
            if inside == [mgmt]
            else f"{mgmt}, which rests on {', '.join(i for i in inside if i != mgmt)} ({bridge} or a member)"
        )
        return {
            **result,
            "failed": True,
            "msg": f"{host}: the management connection runs over {what}; taking {bridge} apart would cut the "
            "connection this play runs over. Move management off the bridge first (docs/runbooks/"
            "thunderbolt-bridge.md); nothing was changed on any host",
        }
    if params.get("pool"):
        ssh_client = mg.ssh_connection(environ)[0]
        addresses = {
            "the controller's address": params.get("controller_addresses") or [],
            "SSH_CONNECTION's client": [ssh_client] if ssh_client else [],
        }
        if params.get("address"):
            with contextlib.suppress(OSError, UnicodeError):
                # Answers on peer ports are cable addresses meshkit itself gave (mDNS names them too).
                addresses["ansible_host"] = [
                    a
                    for a, _scope in resolve(params["address"])
                    if not any(mg.matches(h, peers) for h in net.holders(a)) or not peers
                ]
        conflicts = mg.pool_conflicts(params["pool"], net, peers, mgmt, addresses)
        if conflicts:
            return {**result, "failed": True, "msg": mg.refuse_pool(host, params["pool"], conflicts)}
    return result


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
