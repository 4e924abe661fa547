#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: this host's RDMA devices, per cabled port whether RDMA can run, and the NCCL env."""

from __future__ import annotations

DOCUMENTATION = r"""
module: rdma_facts
short_description: Report RDMA devices, per-port readiness and the NCCL environment of a host
description:
  - Read-only; safe in check mode. Sets the fact C(meshkit_rdma).
  - Linux - reads C(<sysfs_root>/class/infiniband/<dev>/ports/<p>/) - state, link layer, rate, the GID table
    with types and netdevs - and the device's netdev. The RoCE v2 GID whose value is IPv4-mapped gives
    C(NCCL_IB_GID_INDEX); C(NCCL_IB_HCA) lists the ACTIVE device ports; C(NCCL_SOCKET_IFNAME) names the
    cabled ports exactly (never C(lo) or C(docker0)); C(NCCL_IB_DISABLE=1) where no port is ACTIVE.
  - macOS - C(rdma_ctl status), C(ibv_devices), C(ibv_devinfo -v). Tells RDMA not enabled (enable it from
    Recovery) from not capable (enabled but no device - Thunderbolt 4) from a port that is down or has no
    IPv4 GID yet (only link-local C(fe80::) GIDs - JACCL fails with C(errno 22)).
  - macOS - also reads each port's negotiated link speed (C(system_profiler SPThunderboltDataType -json) with
    C(networksetup -listallhardwareports)) and rules out a cable linked at Thunderbolt 4/3 speed (40 Gb/s) even
    where macOS lists an C(rdma_enX) for it, naming the port, the speed and what is at the other end; and reads
    C(ifconfig -a) to rule out a cabled port that is a member of a bridge (the Thunderbolt Bridge active again).
    Where one of these commands is missing or fails, the check is skipped and C(notes) says so.
  - With O(require), fails naming every cabled port that cannot carry RDMA and the runbook that fixes it.
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
    description: This host's cabled ports (interface names); readiness is judged for these.
    type: list
    elements: str
    default: []
  generations:
    description:
      - Thunderbolt generation per port (C(tb5), C(tb4), C(tb3-or-older)), from discovery.
      - Explains a missing device (no RDMA over Thunderbolt 4).
    type: dict
    default: {}
  require:
    description: Fail unless every port in O(ports) can carry RDMA now (the chosen backend needs it).
    type: bool
    default: false
  backend:
    description: The backend that needs RDMA, for the failure message.
    type: str
    default: ""
  system:
    description: C(auto) detects; C(Linux) or C(Darwin) forces a platform (tests on recorded outputs).
    type: str
    default: auto
    choices: [auto, Linux, Darwin]
  sysfs_root:
    description: Root of the sysfs tree to read (Linux).
    type: path
    default: /sys
  rdma_ctl:
    description: Name or path of C(rdma_ctl) (macOS).
    type: str
    default: rdma_ctl
  ibv_devices:
    description: Name or path of C(ibv_devices) (macOS).
    type: str
    default: ibv_devices
  ibv_devinfo:
    description: Name or path of C(ibv_devinfo) (macOS).
    type: str
    default: ibv_devinfo
  system_profiler:
    description: Name or path of C(system_profiler) (macOS), for the link speed of every Thunderbolt port.
    type: str
    default: system_profiler
  networksetup:
    description: Name or path of C(networksetup) (macOS), for the port behind each C(Thunderbolt N).
    type: str
    default: networksetup
  ifconfig:
    description: Name or path of C(ifconfig) (macOS), for bridge members.
    type: str
    default: ifconfig
"""

EXAMPLES = r"""
- name: RDMA facts for the cabled ports
  meshkit.cluster.rdma_facts:
    ports: "{{ meshkit_plan.per_host[inventory_hostname] | map(attribute='port') }}"

- name: Fail unless every cabled port can carry RDMA
  meshkit.cluster.rdma_facts:
    ports: [en3, en5]
    require: true
    backend: jaccl
"""

RETURN = r"""
rdma:
  description:
    - Status (none, disabled, not_capable, enabled), message, runbook (the first of runbooks), runbooks, devices,
      per-port readiness (device, listed_device, state, gid_index, gid_ipv4, link, bridge, usable, problem),
      usable, problems, notes, bridges, nccl_env.
    - C(device) is the RDMA device that can serve the cable; it is null on a port linked at Thunderbolt 4/3 speed
      even where macOS lists one (C(listed_device)).
  returned: always
  type: dict
ansible_facts:
  description: C(meshkit_rdma), the same as RV(rdma).
  returned: always
  type: dict
"""
from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import host_steps as steps


def main() -> None:
    # The work is host_steps.rdma_facts (shared with host_ports and host_network, which run it with others).
    module = AnsibleModule(argument_spec=steps.RDMA_ARGS, supports_check_mode=True)
    module.exit_json(**steps.rdma_facts(module))


if __name__ == "__main__":
    main()
