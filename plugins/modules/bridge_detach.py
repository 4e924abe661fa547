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
  - On Linux the change is made at runtime with C(ip) and persisted through systemd-networkd or NetworkManager
    where the host runs one (O(persist)); the result's C(persistence) says which.
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
            "bridge": {"type": "str", "default": "bridge0"},
            "peer_ports": {"type": "list", "elements": "str", "default": []},
            "service": {"type": "str", "default": "Thunderbolt Bridge"},
            **MANAGEMENT_ARGS,
            **linux_persist.PERSIST_ARGS,
        },
        supports_check_mode=True,
    )
    p = module.params
    run = runner(module)
    files = linux_persist.FileSet()
    try:
        if platform.system() == "Darwin":
            state = macos.read_bridge_state(run, p["bridge"], p["service"])
            mgmt = find_management_interface(module, run, darwin=True)
            plan = macos.plan_bridge(state, p["bridge"], p["service"], mgmt)
            persistence = plan["persistence"]
        else:
            all_links = linux_net.links(run)
            mgmt = find_management_interface(module, run, darwin=False)
            plan = linux_net.plan_bridge(all_links, p["bridge"], p["peer_ports"], mgmt)
            manager = linux_persist.module_manager(module, run)
            persistence = linux_persist.describe(manager)
            # Every peer port, detached now or in an earlier run, stays out of the bridge at boot.
            ports = sorted(
                set(plan["detach"])
                | {
                    link["ifname"]
                    for link in linux_net.candidate_ports(all_links, p["peer_ports"], mgmt)
                    if p["peer_ports"] and not link.get("master")
                }
            )
            if manager == "networkd" and not plan["refused"]:
                for port in ports:
                    path, content = linux_persist.networkd_port(p["networkd_dir"], port)
                    files.wanted[path] = content
                if p["bridge"] in {link["ifname"] for link in all_links} and not plan["kept"]:
                    # The bridge stays down at boot too, as it is left now.
                    path, content = linux_persist.networkd_bridge_down(p["networkd_dir"], p["bridge"])
                    files.wanted[path] = content
            elif manager == "networkmanager" and not plan["refused"]:
                plan["commands"] += linux_persist.nm_bridge_commands(run, ports, p["bridge"])
    except (linux_net.NetError, macos.MacError, RuntimeError) as exc:
        module.fail_json(msg=str(exc))
    file_changes = files.changes()
    result = {
        "changed": bool(plan["commands"] or file_changes),
        "members": plan["members"],
        "detached": plan["detach"],
        "kept": plan["kept"],
        "commands": plan["commands"],
        "management_interface": mgmt,
        "persistence": persistence,
        "notes": plan.get("notes", []),
        "files": [c["path"] for c in file_changes],
    }
    if plan["refused"]:
        module.fail_json(msg=plan["refused"], **{**result, "changed": False})
    if plan["commands"] or file_changes:
        before = f"{p['bridge']} members: {', '.join(plan['members']) or '(none)'}\n"
        after = (
            f"{p['bridge']} members: {', '.join(plan['kept']) or '(none)'}"
            + ("" if plan["kept"] else f"; {p['bridge']} disabled")
            + "\n"
        )
        for c in file_changes:
            before += f"--- {c['path']}\n{c['before']}"
            after += f"+++ {c['path']}\n{c['after']}"
        result["diff"] = {"before": before, "after": after}
    apply(module, run, plan["commands"])
    linux_persist.module_write(module, run, files, file_changes)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
