#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the cabling_plan action (it runs entirely on the controller, in ansible-playbook's
Python: plugins/action/cabling_plan.py, meshkit/cabling_plan.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: cabling_plan
short_description: Plan the cluster from every host's discovery - cables, rings, backend, one /30 per cable
description:
  - Runs on the controller (C(run_once); C(delegate_to=localhost) as the examples do).
  - An action plugin - its work is done in ansible-playbook's own Python on the controller (the meshkit package,
    which must be installed there), with no Python started for the task.
  - Matches every port's seen peer identities against the identities of all ports, giving the cables (with
    multiplicity), asymmetric links, rings (the longest, and parallel rings over doubled cables), the full-mesh
    check and the backend.
  - Gives each cable a /30 from O(pool) - deterministic whatever the host order; cables of the last recorded
    plan keep their networks - and records the plan in O(record). A cabling change against that record is
    reported.
  - The record keeps the cables the last cabling change removed (C(removed)) until the cabling changes again,
    so a later run draws them as M(meshkit.cluster.cabling_picture) drew them first, and has nothing to change.
version_added: 0.1.0
author: meshkit contributors (@meshkit)
requirements:
  - the meshkit Python package and networkx (on the controller, where it runs)
extends_documentation_fragment:
  - meshkit.cluster.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
options:
  discovery:
    description: Per host, the C(ports) list returned by M(meshkit.cluster.discover).
    type: dict
    required: true
  pool:
    description: IPv4 pool the cable networks come from (the inventory's C(meshkit_address_pool)).
    type: str
    required: true
  backend:
    description: Backend asked for; empty picks the best the cabling allows and never fails.
    type: str
    default: ""
    choices: ["", ring, jaccl, jaccl-ring]
  rdma:
    description:
      - Per host, the C(ports) of its RDMA facts (M(meshkit.cluster.rdma_facts)) - a cable end can carry RDMA
        when its port has a device whose port is ACTIVE. A bool says the same for every cable at once.
    type: raw
    default: false
  save:
    description: Write the plan to O(record). A discovery-only run reads the record but leaves it as it is.
    type: bool
    default: true
  record:
    description: Path of the plan record on the controller.
    type: path
    required: true
"""

EXAMPLES = r"""
- name: Plan the cluster
  meshkit.cluster.cabling_plan:
    discovery: >-
      {{ dict(ansible_play_hosts | zip(ansible_play_hosts
         | map('extract', hostvars, ['meshkit_discovery', 'ports']))) }}
    record: artifacts/cluster/plan.json
  run_once: true
  delegate_to: localhost
"""

RETURN = r"""
plan:
  description:
    - The topology model, sealed as C(plan.json) records it (the contract M(meshkit.cluster.plan_verify) loads).
  returned: success
  type: dict
  contains:
    format:
      description: Always C(meshkit-plan).
      type: str
      sample: meshkit-plan
    version:
      description: Version of the plan format; a launch refuses any other.
      type: int
      sample: 2
    fingerprint:
      description: SHA-256 over everything a hostfile or a launch depends on (the backend included).
      type: str
      sample: "sha256:0b4f..."
    hosts:
      description: Hosts of the plan.
      type: list
      elements: str
      sample: [node1, node2, node3]
    cables:
      description: Every cable - its two ends (host, port, address, identity, speed, RDMA device) and its /30.
      type: list
      elements: dict
      sample: [{"ends": [{"host": "node1", "port": "tb0", "address": "198.18.128.1", "ident": "02:00:00:00:01:00",
                          "speed": "40000", "rdma": null},
                         {"host": "node2", "port": "tb0", "address": "198.18.128.2", "ident": "02:00:00:00:02:00",
                          "speed": "40000", "rdma": null}],
                "network": "198.18.128.0/30"}]
    ring:
      description: Hosts in ring order (empty without a ring through every host).
      type: list
      elements: str
      sample: [node1, node2, node3]
    rings:
      description: Disjoint rings of cables (parallel rings where cables are doubled).
      type: list
      elements: list
      sample: [["node1:tb0 <-> node2:tb0", "node2:tb1 <-> node3:tb0", "node1:tb1 <-> node3:tb1"]]
    mesh:
      description: Whether every pair of hosts has a cable.
      type: bool
      sample: true
    backend:
      description: MLX backend (C(ring), C(jaccl), C(jaccl-ring)); empty without a ring through every host.
      type: str
      sample: ring
    backend_reason:
      description: Why this backend.
      type: str
      sample: ring through 3 hosts (no RDMA)
    per_host:
      description: Per host, every port's address, prefix, network and peer.
      type: dict
      sample: {"node1": [{"port": "tb0", "address": "198.18.128.1", "prefix": 30, "network": "198.18.128.0/30",
                          "peer_host": "node2", "peer_port": "tb0", "peer_address": "198.18.128.2"}]}
    rdma_ports:
      description: Per host, the ports the backend runs RDMA over.
      type: dict
      sample: {"node1": []}
    removed:
      description:
        - Cables of the plan before the last cabling change that it removed, kept until the cabling changes again
          (descriptive - outside the fingerprint). Absent when the last change removed none.
      type: list
      elements: str
      returned: after a cabling change that removed cables
      sample: ["node1:tb2 <-> node4:tb0"]
changes:
  description:
    - Cables added and removed against the last recorded plan (C(added), C(removed)), and for each
      removed cable what its two ends report now (C(why_removed), e.g. C(node3:tb0 down)).
  returned: success
  type: dict
unprobed:
  description: Ports that could not be probed because they are still in a bridge (check mode on a fresh cluster).
  returned: always
  type: list
  elements: str
"""
