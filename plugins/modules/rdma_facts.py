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

import os
import platform

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import macos, rdma
from ansible_collections.meshkit.cluster.plugins.module_utils.common import runner


def tool(module: AnsibleModule, name: str) -> str | None:
    """A command's path: ``name`` itself when it holds a slash (None when that is no executable), else PATH's."""
    if "/" in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    return module.get_bin_path(name)


def darwin_facts(module: AnsibleModule, run) -> dict:
    p = module.params
    tools = {}
    for key in ("rdma_ctl", "ibv_devices", "ibv_devinfo"):
        tools[key] = tool(module, p[key])
        if not tools[key]:
            return rdma.host_facts("Darwin", [], p["ports"], tool_missing=p[key], generations=p["generations"])
    rc, out, err = run([tools["rdma_ctl"], "status"])
    enabled = rdma.parse_rdma_ctl(out + err)
    rc, out, _err = run([tools["ibv_devices"]])
    devices = rdma.parse_ibv_devices(out) if rc == 0 else []
    ports = []
    if devices:
        rc, out, err = run([tools["ibv_devinfo"], "-v"])
        if rc != 0:
            module.fail_json(msg=f"{tools['ibv_devinfo']} -v failed (rc={rc}): {err.strip()}")
        ports = rdma.parse_ibv_devinfo(out)
    notes = []
    links = None
    profiler, networksetup = tool(module, p["system_profiler"]), tool(module, p["networksetup"])
    if profiler and networksetup:
        named = {"system_profiler": profiler, "networksetup": networksetup}

        def through(argv: list[str]) -> tuple[int, str, str]:
            return run([named.get(argv[0], argv[0]), *argv[1:]])

        try:
            links = macos.read_thunderbolt_links(through)
        except (macos.MacError, ValueError) as exc:
            notes.append(f"link speeds not read ({exc}); a Thunderbolt 4 link is only told by discovery's generation")
    else:
        notes.append("system_profiler or networksetup not found: link speeds not read")
    bridges = None
    ifconfig = tool(module, p["ifconfig"])
    if ifconfig:
        rc, out, err = run([ifconfig, "-a"])
        if rc == 0:
            bridges = macos.parse_ifconfig_bridges(out)
        else:
            notes.append(f"{ifconfig} -a failed (rc={rc}): {err.strip()}; bridge members not checked")
    else:
        notes.append("ifconfig not found: bridge members not checked")
    return rdma.host_facts(
        "Darwin",
        ports,
        p["ports"],
        enabled,
        devices,
        generations=p["generations"],
        links=links,
        bridges=bridges,
        notes=notes,
    )


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "ports": {"type": "list", "elements": "str", "default": []},
            "generations": {"type": "dict", "default": {}},
            "require": {"type": "bool", "default": False},
            "backend": {"type": "str", "default": ""},
            "system": {"type": "str", "default": "auto", "choices": ["auto", "Linux", "Darwin"]},
            "sysfs_root": {"type": "path", "default": "/sys"},
            "rdma_ctl": {"type": "str", "default": "rdma_ctl"},
            "ibv_devices": {"type": "str", "default": "ibv_devices"},
            "ibv_devinfo": {"type": "str", "default": "ibv_devinfo"},
            "system_profiler": {"type": "str", "default": "system_profiler"},
            "networksetup": {"type": "str", "default": "networksetup"},
            "ifconfig": {"type": "str", "default": "ifconfig"},
        },
        supports_check_mode=True,
    )
    p = module.params
    system = platform.system() if p["system"] == "auto" else p["system"]
    if system == "Darwin":
        facts = darwin_facts(module, runner(module))
    else:
        facts = rdma.host_facts("Linux", rdma.read_sysfs(p["sysfs_root"]), p["ports"])
    result = {"changed": False, "rdma": facts, "ansible_facts": {"meshkit_rdma": facts}}
    if p["require"] and not facts["usable"]:
        what = f"backend {p['backend']}" if p["backend"] else "this run"
        reasons = "; ".join(facts["problems"]) or facts["message"] or "no cabled port"
        module.fail_json(
            msg=f"{what} needs RDMA on every cable, and this host cannot: {reasons}. "
            f"Fix: see {' and '.join(facts['runbooks']) or facts['runbook']}",
            **result,
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
