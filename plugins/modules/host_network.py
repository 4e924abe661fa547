#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: a host's part of the plan in one call - cable addresses, pings, RDMA, hostfiles."""

from __future__ import annotations

DOCUMENTATION = r"""
module: host_network
short_description: Address every cable, ping across it, read RDMA again and write the hostfiles, in one call
description:
  - setup.yml's per-host work after the plan, as one round trip to the host instead of five; each step is the
    work of the module it is named after, with that module's options, in this order.
  - 1. O(links) (M(meshkit.cluster.peer_link)) gives every cable end its address, host route and MTU.
  - 2. O(ping) (M(meshkit.cluster.cable_check)) pings across every cable, bound to its port; its
    O(meshkit.cluster.cable_check#module:ports) default to O(links)'s. Left out or null, no ping (check mode).
    Not where step 1 changed an address (not in check mode; RV(reping)) - every host runs this module at
    once, so the far end may not have its own address yet - the caller pings again (this module with
    O(ping) only) once every host is done.
  - 3. O(rdma) (M(meshkit.cluster.rdma_facts)) reads RDMA again now that the ports have addresses; its
    O(meshkit.cluster.rdma_facts#module:ports) default to O(links)'s; sets the fact C(meshkit_rdma). Left out
    or null, not read.
  - 4. O(hostfiles) (M(meshkit.cluster.hostfiles)) writes this host's hostfiles; where step 3 ran, this
    host's NCCL environment in them is the one it read.
  - 5. O(directories) are made (owner and mode), as M(ansible.builtin.file) with C(state=directory) would, or
    removed with everything in them (C(state=absent)).
  - A step that fails fails the module, naming the step (RV(step)); the steps after it do not run.
version_added: 0.9.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
options:
  links:
    description: The options of M(meshkit.cluster.peer_link); left out or null, no address is touched.
    type: dict
  ping:
    description:
      - The options of M(meshkit.cluster.cable_check); left out or null, no ping. Sets the fact
        C(meshkit_cable_check) (what M(meshkit.cluster.cable_check) returns).
      - Not where step 1 changed an address (RV(reping)).
    type: dict
  rdma:
    description: The options of M(meshkit.cluster.rdma_facts); left out or null, RDMA is not read.
    type: dict
  hostfiles:
    description: The options of M(meshkit.cluster.hostfiles); left out or null, none are written.
    type: dict
  directories:
    description:
      - Directories to make, each C(path), C(mode) (octal string) and C(owner) (default root); or to remove, each
        C(path) and C(state=absent).
    type: list
    elements: dict
    default: []
"""

EXAMPLES = r"""
- name: Address every cable, ping it, read RDMA, write this host's hostfiles
  meshkit.cluster.host_network:
    links:
      ports: "{{ meshkit_planned.plan.per_host[inventory_hostname] }}"
      pool: 198.18.128.0/17
    ping:
      count: 3
      fail: false
      host: "{{ inventory_hostname }}"
    rdma: {}
    directories:
      - {path: /var/lib/meshkit/jobs, mode: "1777"}
  register: meshkit_network
"""

RETURN = r"""
links:
  description: What M(meshkit.cluster.peer_link) returns.
  returned: when O(links) is given
  type: dict
ping:
  description: What M(meshkit.cluster.cable_check) returns (C(cables), C(dead), C(dead_ends)); absent without O(ping).
  returned: when O(ping) is given
  type: dict
rdma:
  description: This host's RDMA facts, as M(meshkit.cluster.rdma_facts) returns them in its C(rdma).
  returned: when O(rdma) is given
  type: dict
hostfiles:
  description: What M(meshkit.cluster.hostfiles) returns.
  returned: when O(hostfiles) is given
  type: dict
directories:
  description: Per directory - path, mode, changed.
  returned: success
  type: list
  elements: dict
reping:
  description: Step 1 changed an address (not in check mode), so step 2 did not run (see above).
  returned: success
  type: bool
step:
  description: The step that failed (links, ping, rdma, hostfiles or directories).
  returned: failure
  type: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import host_steps as steps


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "links": {"type": "dict"},
            "ping": {"type": "dict"},
            "rdma": {"type": "dict"},
            "hostfiles": {"type": "dict"},
            "directories": {"type": "list", "elements": "dict", "default": []},
        },
        supports_check_mode=True,
    )
    p = module.params

    def body(run: steps.Run) -> None:
        out = run.out
        ports = None
        if p["links"] is not None:
            out["links"] = run.step("links", steps.LINK_ARGS, p["links"], steps.peer_link)
            ports = p["links"].get("ports")
        # A cable end addressed just now: its peer may not have its own address yet (every host runs this
        # at once), so the caller pings again once every host is done; no ping here that would only wait.
        out["reping"] = bool(out.get("links", {}).get("changed")) and not module.check_mode
        if p["ping"] is not None and not out["reping"]:
            ping_args = {"ports": ports, **p["ping"]} if ports is not None else p["ping"]
            out["ping"] = run.step("ping", steps.PING_ARGS, ping_args, steps.cable_check, changes=False)
            out["ansible_facts"] = {"meshkit_cable_check": out["ping"]}
        nccl = None
        if p["rdma"] is not None:
            rdma_args = {"ports": [x["port"] for x in ports or []], **p["rdma"]}
            facts = run.step("rdma", steps.RDMA_ARGS, rdma_args, steps.rdma_facts, changes=False)
            out["rdma"] = facts["rdma"]
            out["ansible_facts"] = {**out.get("ansible_facts", {}), **facts["ansible_facts"]}
            nccl = facts["rdma"].get("nccl_env") or {}
        if p["hostfiles"] is not None:
            args = dict(p["hostfiles"])
            if nccl is not None and args.get("host"):
                args["nccl"] = {**(args.get("nccl") or {}), args["host"]: nccl}
            out["hostfiles"] = run.step("hostfiles", steps.HOSTFILES_ARGS, args, steps.write_hostfiles)
        out["directories"] = []
        for spec in p["directories"]:
            out["directories"].append(run.step("directories", steps.DIRECTORY_ARGS, spec, steps.directory))

    steps.run_steps(module, body)


if __name__ == "__main__":
    main()
