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
    bridge). Each port that is up and not enslaved to a bridge is probed at the link layer (an IPv6
    all-nodes ping bound to the port, all ports at once); the neighbour MACs it learns identify the port
    at the other end, matched later against the MACs gathered from every host.
  - On thunderbolt-net ports, Thunderbolt sysfs (C(/sys/class/net/<port>/device) up to the peer's XDomain
    device) adds the peer host's UUID and name and the link speed (lane speed times lanes).
  - Ports still enslaved to a bridge are reported with C(in_bridge) and not probed (a probe through a bridge
    can answer from any host behind it).
  - macOS - C(system_profiler SPThunderboltDataType -json) and C(networksetup -listallhardwareports) -
    port identity by domain UUID, peers found at any depth (behind hubs), receptacle to C(enX), link speed.
version_added: 0.1.0
author: meshkit contributors
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
    description: Interface name patterns of candidate peer ports (Linux).
    type: list
    elements: str
    default: ["thunderbolt*"]
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
    rdma device, in_bridge, up.
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

import platform
import subprocess
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import linux_net, macos
from ansible_collections.meshkit.cluster.plugins.module_utils.common import (
    MANAGEMENT_ARGS,
    find_management_interface,
    runner,
)


def probe_linux(ports: list[dict], seconds: int) -> None:
    """Ping IPv6 all-nodes on every port at once; the replies fill the neighbour table."""
    procs = [
        subprocess.Popen(
            ["ping", "-6", "-n", "-q", "-L", "-c", "3", "-i", "0.2", "-w", str(seconds), "-I", p["ifname"], "ff02::1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    for proc in procs:
        proc.wait(timeout=seconds + 5)


def wait_for_link_local(run, names: list[str], seconds: float) -> list[str]:
    """Wait until every port in names has a usable IPv6 link-local address (duplicate-address
    detection done: the probe's source); the ports still without one at the deadline. A port that
    has just left a bridge (networkd reconfiguring it) gets its address a second or two later."""
    deadline = time.monotonic() + seconds
    while True:
        ready = {
            a["ifname"]
            for a in linux_net.addresses(run)
            if any(
                i.get("family") == "inet6" and i.get("scope") == "link" and not i.get("tentative")
                for i in a.get("addr_info", [])
            )
        }
        waiting = [n for n in names if n not in ready]
        if not waiting or time.monotonic() > deadline:
            return waiting
        time.sleep(0.1)


def discover_linux(module, run, params: dict) -> tuple[list[dict], str | None]:
    all_links = linux_net.links(run)
    mgmt = find_management_interface(module, run, darwin=False)
    candidates = linux_net.candidate_ports(all_links, params["peer_ports"], mgmt)
    probe = [p for p in candidates if not p.get("master") and "UP" in p.get("flags", [])]
    if probe:
        # Only ports with carrier will get a link-local address; an unplugged one is not waited for.
        wait_for_link_local(run, [p["ifname"] for p in probe if "LOWER_UP" in p.get("flags", [])], 10)
        probe_linux(probe, params["probe_seconds"])
    neigh = linux_net.neighbours(run)
    own_macs = {link.get("address", "").lower() for link in all_links}
    ports = []
    for link in candidates:
        name = link["ifname"]
        seen = sorted(
            {
                n["lladdr"].lower()
                for n in neigh
                if n.get("dev") == name and n.get("lladdr") and n["lladdr"].lower() not in own_macs
            }
        )
        speed = None
        try:
            with open(f"/sys/class/net/{name}/speed") as handle:
                value = int(handle.read().strip())
                speed = f"{value} Mb/s" if value > 0 else None
        except (OSError, ValueError):
            pass
        thunderbolt = linux_net.thunderbolt_peer("/sys", name)
        if thunderbolt and thunderbolt["speed"]:
            speed = thunderbolt["speed"]
        ports.append(
            {
                "port": name,
                "ident": link.get("address", "").lower(),
                "seen": seen if not link.get("master") else [],
                "in_bridge": link.get("master"),
                "up": "UP" in link.get("flags", []),
                "speed": speed,
                "mtu": link.get("mtu"),
                "rdma": None,
                "generation": macos.thunderbolt_generation(thunderbolt["speed"]) if thunderbolt else None,
                "thunderbolt": thunderbolt,
            }
        )
    return ports, mgmt


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "peer_ports": {"type": "list", "elements": "str", "default": ["thunderbolt*"]},
            **MANAGEMENT_ARGS,
            "probe_seconds": {"type": "int", "default": 1},
        },
        supports_check_mode=True,
    )
    run = runner(module)
    system = platform.system()
    try:
        if system == "Darwin":
            ports = macos.discover(run)
            mgmt = find_management_interface(module, run, darwin=True)
            ports = [p for p in ports if p["port"] != mgmt]
        else:
            ports, mgmt = discover_linux(module, run, module.params)
    except (linux_net.NetError, macos.MacError, ValueError) as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(changed=False, ports=ports, platform=system, management_interface=mgmt)


if __name__ == "__main__":
    main()
