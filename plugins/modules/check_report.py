#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the check_report action (it runs entirely on the controller)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: check_report
short_description: The report of a cluster check - every cable's figures and flags, the all_reduce verdict, drift
description:
  - Runs on the controller (action plugin) and touches no host.
  - Reads the records C(python3 -m meshccl.linkcheck) printed in the check job's rank logs (O(log_dir)) and compares
    every host's facts (M(meshkit.cluster.check_facts)) with the plan - the same report as C(meshkit check).
  - Flags a cable below O(threshold) of the rate it should carry (O(link_rate), else the inventory's
    C(meshkit_link_rate), else its negotiated speed), asymmetric, losing packets, unreachable, or drifted (MTU,
    addresses, routes, RDMA); and an all_reduce busbw below what the cabling allows.
  - Writes C(check.json) and the cabling picture coloured by bandwidth to O(dest) (and a Prometheus textfile to
    O(prometheus)); not in check mode. Fails when anything is flagged; C(table) holds the terminal table.
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
  plan:
    description: The topology model the check ran on (M(meshkit.cluster.plan_verify)'s C(plan)).
    type: dict
    required: true
  log_dir:
    description: The check job's log directory (M(meshkit.cluster.launch)'s C(log_dir)).
    type: path
    required: true
  facts:
    description: Per host, M(meshkit.cluster.check_facts)'s result.
    type: dict
    default: {}
  config:
    description: Per host, its validated inventory variables (M(meshkit.cluster.inventory_check)'s C(config)).
    type: dict
    default: {}
  cluster:
    description: The cluster's name.
    type: str
    default: ""
  quick:
    description: The job measured latency and loss only (C(--quick)).
    type: bool
    default: false
  threshold:
    description: Flag a cable below this share of the rate it should carry.
    type: float
    default: 0.8
  max_loss:
    description: Flag a cable losing more than this share of its probes.
    type: float
    default: 0.01
  asymmetry:
    description: Flag a cable whose two directions differ by more than this share.
    type: float
    default: 0.2
  link_rate:
    description: The rate every cable should carry (C(80gbit), C(40Gb/s)); over the inventory's and the links' own.
    type: str
  dest:
    description: Where C(check.json) and the picture go on the controller.
    type: path
    required: true
  picture:
    description: The picture's path (C(.svg), C(.png) or C(.dot)); default C(<dest>/cabling-check.svg).
    type: path
  prometheus:
    description: A Prometheus textfile to write atomically (node_exporter's textfile collector directory).
    type: path
"""

EXAMPLES = r"""
- name: Report
  meshkit.cluster.check_report:
    plan: "{{ meshkit_planned.plan }}"
    log_dir: "{{ meshkit_launch.log_dir }}"
    dest: artifacts/lab/check
  run_once: true
"""

RETURN = r"""
report:
  description: The report (version 1) - cables with figures, expected rate and flags, the all_reduce table and
    verdict, drift, C(flagged) (the flagged cables by name), C(problems), C(ok).
  returned: always
  type: dict
table:
  description: The report as the terminal table C(meshkit check) prints, line by line.
  returned: always
  type: list
  elements: str
written:
  description: The files written.
  returned: always
  type: list
  elements: str
"""
