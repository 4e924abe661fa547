#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: write every hostfile format from the one topology model."""

from __future__ import annotations

DOCUMENTATION = r"""
module: hostfiles
short_description: Write the MLX, MPI, torchrun/NCCL and meshccl hostfiles from the cabling plan
description:
  - Renders every format from the plan of M(meshkit.cluster.cabling_plan) - the MLX hostfile (object form,
    C(ring), C(jaccl) or C(jaccl-ring)), the MLX runtime ring file (C(MLX_HOSTFILE)), an MPI hostfile, a
    torchrun/NCCL env file per host and meshccl's own versioned JSON - and a C(manifest.json) holding the
    fingerprint of the cabling and a SHA-256 per file.
  - Without O(host) it writes the controller's set (every host's env file) into O(dest); with O(host), the
    set that host keeps (its own C(torch.env)).
  - Idempotent - a file is rewritten only when its content changes. A set made from an older cabling, or
    edited by hand, is reported as stale (RV(stale)) and rewritten; with O(state=verify) nothing is written
    and a stale or missing set fails.
version_added: 0.1.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
options:
  plan:
    description: The plan (RV(meshkit.cluster.cabling_plan#module:plan)).
    type: dict
    required: true
  dest:
    description: Directory the files go into.
    type: path
    required: true
  host:
    description: Write the set of this inventory host only (its own C(torch.env)); empty writes the controller's set.
    type: str
  ssh:
    description: Per host, the name or address other tools reach it by (the inventory's C(ansible_host)).
    type: dict
    default: {}
  nccl:
    description: Per host, the NCCL variables of its RDMA facts (C(meshkit_rdma.nccl_env)).
    type: dict
    default: {}
  gloo:
    description:
      - Per host, its management interface, written as C(GLOO_SOCKET_IFNAME) into its C(torch.env) (Gloo connects
        every pair of ranks on one interface; point-to-point cables reach only their peer).
    type: dict
    default: {}
  cluster:
    description: Cluster name recorded in the files.
    type: str
    required: true
  ranks_per_host:
    description: Ranks per host (MPI slots, torchrun processes per node, meshccl ranks).
    type: int
    default: 1
  master_port:
    description: torchrun rendezvous port (the inventory's C(meshkit_master_port)).
    type: int
    required: true
  meshccl_port:
    description: First meshccl listen port; local rank k listens on this plus k (C(meshkit_meshccl_port)).
    type: int
    required: true
  mlx_starting_port:
    description: First port of the MLX runtime ring file (as C(mlx.launch --starting-port)).
    type: int
    default: 32323
  envs:
    description: C(K=V) strings for the MLX hostfile's C(envs).
    type: list
    elements: str
    default: []
  state:
    description: C(present) writes; C(verify) only checks that the set in O(dest) is current and unedited.
    type: str
    default: present
    choices: [present, verify]
"""

EXAMPLES = r"""
- name: Write the hostfiles on the controller
  meshkit.cluster.hostfiles:
    plan: "{{ meshkit_planned.plan }}"
    dest: artifacts/lab-lab/hostfiles
    cluster: lab-lab
  run_once: true
  delegate_to: localhost

- name: Fail when a host's hostfiles were made from another cabling
  meshkit.cluster.hostfiles:
    plan: "{{ meshkit_planned.plan }}"
    dest: /var/lib/meshkit/hostfiles
    host: "{{ inventory_hostname }}"
    cluster: lab-lab
    state: verify
"""

RETURN = r"""
fingerprint:
  description: Fingerprint of the cabling the files are made from.
  returned: always
  type: str
files:
  description: Per file - name, path, changed.
  returned: always
  type: list
  elements: dict
skipped:
  description: Formats not written and why (e.g. MLX without a ring through every host).
  returned: always
  type: dict
stale:
  description: Why the set found in O(dest) was out of date (older cabling, edited by hand); empty if it was current.
  returned: always
  type: str
"""
from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import host_steps as steps


def main() -> None:
    # The work is host_steps.write_hostfiles (shared with host_ports and host_network, which run it with others).
    module = AnsibleModule(argument_spec=steps.HOSTFILES_ARGS, supports_check_mode=True)
    module.exit_json(**steps.write_hostfiles(module))


if __name__ == "__main__":
    main()
