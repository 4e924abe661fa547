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
  - Never touches the management interface.
version_added: 0.1.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
  - meshkit.cluster.management
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
options:
  ports:
    description: This host's C(per_host) entries of the plan (port, address, prefix, peer_address, ...).
    type: list
    elements: dict
    required: true
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
"""

import platform

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import linux_net, linux_persist, macos
from ansible_collections.meshkit.cluster.plugins.module_utils.common import (
    MANAGEMENT_ARGS,
    apply,
    find_management_interface,
    runner,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "ports": {"type": "list", "elements": "dict", "required": True},
            "pool": {"type": "str", "required": True},
            "peer_ports": {"type": "list", "elements": "str", "default": []},
            "mtu": {"type": "int"},
            **MANAGEMENT_ARGS,
            **linux_persist.PERSIST_ARGS,
        },
        supports_check_mode=True,
    )
    p = module.params
    run = runner(module)
    notes: list[str] = []
    files = linux_persist.FileSet()
    persistence = "network services set with networksetup persist across reboots"
    try:
        if platform.system() == "Darwin":
            mgmt = find_management_interface(module, run, darwin=True)
            plan = macos.plan_peer_links(run, p["ports"], p["mtu"], mgmt)
            if plan["refused"]:
                module.fail_json(msg=plan["refused"], changed=False, commands=[])
            commands, notes, persistence = plan["commands"], plan["notes"], plan["persistence"]
        else:
            all_links = linux_net.links(run)
            addrs = linux_net.addresses(run)
            mgmt = find_management_interface(module, run, darwin=False)
            commands, notes = linux_net.plan_peer_links(
                all_links,
                addrs,
                p["ports"],
                p["pool"],
                p["peer_ports"],
                p["mtu"],
                mgmt,
                linux_net.routes_by_device(run),
            )
            manager = linux_persist.module_manager(module, run)
            persistence = linux_persist.describe(manager)
            if manager == "networkd":
                for port in p["ports"]:
                    path, content = linux_persist.networkd_address(p["networkd_dir"], port, p["mtu"])
                    files.wanted[path] = content
                for stale in linux_persist.networkd_stale_dropins(p["networkd_dir"], {x["port"] for x in p["ports"]}):
                    files.wanted[stale] = None
            elif manager == "networkmanager":
                commands += linux_persist.nm_address_commands(run, p["ports"], p["mtu"])
    except (linux_net.NetError, macos.MacError, RuntimeError) as exc:
        module.fail_json(msg=str(exc))
    file_changes = files.changes()
    result = {
        "changed": bool(commands or file_changes),
        "commands": commands,
        "notes": notes,
        "persistence": persistence,
        "files": [c["path"] for c in file_changes],
    }
    if commands or file_changes:
        before = "".join(f"--- {c['path']}\n{c['before']}" for c in file_changes)
        after = "".join(" ".join(c) + "\n" for c in commands)
        after += "".join(f"+++ {c['path']}\n{c['after']}" for c in file_changes)
        result["diff"] = {"before": before, "after": after}
    apply(module, run, commands)
    linux_persist.module_write(module, run, files, file_changes)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
