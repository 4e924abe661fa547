#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the plan_verify action (it runs entirely on the controller, in ansible-playbook's
Python: plugins/action/plan_verify.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: plan_verify
short_description: Load the recorded cabling plan and check the live cabling against it
description:
  - Reads the plan C(setup.yml) wrote (C(plan.json)), checks its format, version, fields and fingerprint, and
    compares it with the cabling discovered now (M(meshkit.cluster.discover) on every host) cable end by cable
    end, by port and by the identity (MAC address, Thunderbolt UUID) each end had and each peer saw.
  - Never plans again. Any difference fails the task, naming each cable and what its ends report, and says to
    run C(setup.yml); launches then run on exactly what C(setup.yml) configured and wrote hostfiles for.
  - Run it on the controller (C(delegate_to) localhost, C(run_once)). Changes nothing.
  - An action plugin - its work is done in ansible-playbook's own Python on the controller (the meshkit package,
    which must be installed there), with no Python started for the task.
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
  record:
    description: Path of C(plan.json) on the controller.
    type: path
    required: true
  discovery:
    description:
      - Per host, the C(ports) list M(meshkit.cluster.discover) returned now.
      - Hosts left out (not in this play) are not checked.
    type: dict
    required: true
"""

EXAMPLES = r"""
- name: Load the plan and check the cabling against it
  meshkit.cluster.plan_verify:
    record: "{{ meshkit_artifacts }}/plan.json"
    discovery: >-
      {{ dict(ansible_play_hosts
              | zip(ansible_play_hosts | map('extract', hostvars, ['meshkit_discovery', 'ports']))) }}
  run_once: true
  delegate_to: localhost
  register: meshkit_planned
"""

RETURN = r"""
plan:
  description:
    - The plan as C(setup.yml) recorded it, validated; its fields are those of M(meshkit.cluster.cabling_plan)'s
      C(plan).
  returned: success
  type: dict
  contains:
    version:
      description: Version of the plan format (this meshkit reads 2).
      type: int
      sample: 2
    fingerprint:
      description: The plan's fingerprint; every host's hostfiles must carry the same.
      type: str
      sample: "sha256:5f0c..."
    backend:
      description: The backend the cabling was planned for; hostfiles made for another are refused.
      type: str
      sample: jaccl-ring
differences:
  description: How the live cabling differs from the plan, one line per cable end (empty on success).
  returned: always
  type: list
  elements: str
  sample: ["node1:tb1 <-> node3:tb0: node3:tb0 is down"]
"""
