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

import platform
import re
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import linux_net, macos
from ansible_collections.meshkit.cluster.plugins.module_utils.common import (
    MANAGEMENT_ARGS,
    find_management_interface,
    run_parallel,
    runner,
)

# A reply in ping's output: "64 bytes from fe80::1c2:3ff:fe04:506%tb1: icmp_seq=1 ttl=64 time=0.07 ms".
REPLY = re.compile(r"\bfrom (fe80:[0-9a-fA-F:]+)%([^:\s]+):")


def probe_linux(module, ports: list[str], seconds: int) -> dict[str, str]:
    """Find who answers on every port (all at once), then resolve each answerer's MAC ourselves.

    First an IPv6 all-nodes ping bound to the port: its replies name the link-local address at the
    other end. Then one unicast ping to that address, so this host asks for the peer's MAC itself
    (neighbour solicitation and advertisement) and its neighbour table holds it whatever state the
    table was in: a reboot or a cable taken out empties it, and the peer may answer the multicast
    ping from a cache of its own without asking anything. One echo each, no interval: iputils ping
    refuses multicast intervals under 1 s to users other than root, and discovery runs as the login
    user. A port with no answer is asked once more (a single lost echo). Returns what went wrong
    per port (ping's own error), for ports that could not be probed at all."""
    errors: dict[str, str] = {}
    answering: dict[str, set[str]] = {port: set() for port in ports}
    silent = list(ports)
    for _round in range(2):
        # Each ping at once (a killed one, past its own deadline, reads as not sent).
        runs = run_parallel(
            module,
            {port: ["ping", "-6", "-n", "-L", "-c", "1", "-w", str(seconds), "-I", port, "ff02::1"] for port in silent},
            timeout=seconds + 5,
        )
        for port, (rc, out, err) in runs.items():
            for address, dev in REPLY.findall(out):
                if dev == port:
                    answering[port].add(address)
            if rc not in (0, 1):  # 1: sent, nothing came back; 2 and more: not sent
                errors[port] = (err.strip().splitlines() or [f"ping exit {rc}"])[-1]
        silent = [port for port in silent if not answering[port] and port not in errors]
        if not silent:
            break
    run_parallel(
        module,
        {
            f"{address}%{port}": ["ping", "-6", "-n", "-c", "1", "-w", str(seconds), f"{address}%{port}"]
            for port, addresses in answering.items()
            for address in sorted(addresses)
        },
        timeout=seconds + 5,
    )
    return errors


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
    errors: dict[str, str] = {}
    if probe:
        # Only ports with carrier will get a link-local address; an unplugged one is not waited for
        # (nor is its probe's failure news: it has no cable).
        carrier = [p["ifname"] for p in probe if linux_net.has_carrier(p)]
        wait_for_link_local(run, carrier, 10)
        errors = probe_linux(module, carrier, params["probe_seconds"])
    for port, why in sorted(errors.items()):
        module.warn(f"{port}: the probe could not run ({why}); what is cabled to it is not known")
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
                "probe_error": errors.get(name),
            }
        )
    return ports, mgmt


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "peer_ports": {"type": "list", "elements": "str", "required": True},
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
