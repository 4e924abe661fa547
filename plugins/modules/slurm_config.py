#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: Slurm's slurm.conf and topology.conf from the inventory, the hosts' hardware and the plan."""

from __future__ import annotations

DOCUMENTATION = r"""
module: slurm_config
short_description: Write Slurm's slurm.conf and topology.conf text from hardware facts and the cabling plan
description:
  - Returns the text of C(slurm.conf) (every host gets the same) and C(topology.conf) (topology/tree from the
    cabling plan; see the role's README for what Slurm can and cannot express about a ring or a mesh).
  - Computes only; the C(meshkit.cluster.slurm) role writes the files. Run it once, on the controller.
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
  cluster:
    description: The meshkit cluster name (Slurm's ClusterName is derived from it).
    type: str
    required: true
  controller:
    description: The inventory name of the host slurmctld runs on.
    type: str
    required: true
  nodes:
    description: Per compute node (inventory name) C(addr) (how the other hosts reach it) and C(slurmd_c) (the
      output of C(slurmd -C) there, whose C(NodeName) is the host's short name, how slurmd finds its node).
    type: dict
    required: true
  controller_node:
    description: C(hostname) and C(addr) of the controller when it is not one of O(nodes).
    type: dict
    default: {}
  plan:
    description: The cabling plan (plan.json); its C(ring), C(mesh) and C(hosts) shape the topology.
    type: dict
    required: true
  partition:
    description: The name of the one partition holding every node.
    type: str
    default: meshkit
  options:
    description: C(slurmctld_port), C(slurmd_port), C(proctrack), C(task_plugin), C(select_parameters),
      C(mpi_default).
    type: dict
    required: true
"""

EXAMPLES = r"""
- name: Slurm's configuration
  meshkit.cluster.slurm_config:
    cluster: lab
    controller: node1
    nodes: {node1: {addr: 198.19.1.2, slurmd_c: "NodeName=node1 CPUs=2 ..."}}
    plan: "{{ meshkit_planned.plan }}"
    options: {slurmctld_port: 6817, slurmd_port: 6818, proctrack: proctrack/linuxproc, task_plugin: task/none,
              select_parameters: CR_Core, mpi_default: none}
  run_once: true
  delegate_to: localhost
"""

RETURN = r"""
slurm_conf:
  description: The text of slurm.conf.
  returned: always
  type: str
topology_conf:
  description: The text of topology.conf.
  returned: always
  type: str
topology:
  description: How the cabling was expressed to Slurm, in words.
  returned: always
  type: str
order:
  description: The compute nodes in the cabling's ring order (hosts outside the ring last).
  returned: always
  type: list
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils.naming import natural_key
from ansible_collections.meshkit.cluster.plugins.module_utils.slurm import (
    SlurmConfigError,
    parse_slurmd_c,
    slurm_conf,
    topology_conf,
    topology_tree,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "cluster": {"type": "str", "required": True},
            "controller": {"type": "str", "required": True},
            "nodes": {"type": "dict", "required": True},
            "controller_node": {"type": "dict", "default": {}},
            "plan": {"type": "dict", "required": True},
            "partition": {"type": "str", "default": "meshkit"},
            "options": {"type": "dict", "required": True},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        nodes = {}
        for name, node in p["nodes"].items():
            missing = [key for key in ("addr", "slurmd_c") if key not in node]
            if missing:
                raise SlurmConfigError(f"{name}: no {' and no '.join(missing)} given for this node")
            hardware = parse_slurmd_c(str(node["slurmd_c"]), name)
            # slurmd finds its node by its short host name: slurmd -C prints it as NodeName.
            nodes[name] = {"hostname": hardware["NodeName"], "addr": str(node["addr"]), "hardware": hardware}
        ring = [h for h in p["plan"].get("ring") or [] if h in nodes]
        order = ring + sorted((h for h in nodes if h not in ring), key=natural_key)
        if p["controller"] in nodes:
            ctl = nodes[p["controller"]]
        elif p["controller_node"]:
            ctl = p["controller_node"]
        else:
            raise SlurmConfigError(f"{p['controller']}: the slurmctld host is not a node; give its hostname and addr")
        switches, how = topology_tree(p["plan"], order)
        conf = slurm_conf(
            cluster=p["cluster"],
            controller=p["controller"],
            controller_hostname=str(ctl["hostname"]),
            controller_addr=str(ctl["addr"]),
            nodes=nodes,
            order=order,
            partition=p["partition"],
            options=p["options"],
        )
    except SlurmConfigError as exc:
        module.fail_json(msg=f"Slurm's configuration: {exc}")
    module.exit_json(
        changed=False,
        slurm_conf=conf,
        topology_conf=topology_conf(switches, how, p["cluster"]),
        topology=how,
        order=order,
    )


if __name__ == "__main__":
    main()
