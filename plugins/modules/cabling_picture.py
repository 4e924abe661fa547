#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the cabling_picture action (it runs entirely on the controller, in ansible-playbook's
Python: plugins/action/cabling_picture.py, meshkit/cabling_picture.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: cabling_picture
short_description: Draw hosts and cables (DOT, SVG, PNG) from the cabling plan
description:
  - Runs on the controller (an action plugin, in ansible-playbook's own Python). Writes C(<dest>/<name>.dot)
    and renders C(.svg) and C(.png) with GraphViz C(dot) - hosts, and cables labelled with port and address at
    each end and the cable's network.
  - Cables of parallel ring k share a colour; host pairs without a cable (mesh incomplete) are dashed grey;
    dead cables (no ping reply) and cables gone since the last plan are red; one-way links dotted orange.
  - The cables gone are O(removed) and those the plan still keeps from the last cabling change (its C(removed)),
    so the run after a change draws the same picture and changes nothing.
  - Idempotent - renders again only when the DOT text changes or an output is missing. Without GraphViz it
    writes the DOT file and warns.
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
    description: The plan (RV(meshkit.cluster.cabling_plan#module:plan)).
    type: dict
    required: true
  dest:
    description: Directory of the picture files.
    type: path
    required: true
  name:
    description: Base name of the files.
    type: str
    default: cabling
  title:
    description: Title line of the picture (the cluster name).
    type: str
    default: cluster
  dead:
    description: Cable ends (C(host:port)) whose ping got no reply.
    type: list
    elements: str
    default: []
  removed:
    description:
      - Cables (C(a:p <-> b:q)) of the last plan that discovery no longer finds.
      - Drawn with those of O(plan)'s C(removed).
    type: list
    elements: str
    default: []
  management:
    description: Per host, the management address shown under its name.
    type: dict
    default: {}
  formats:
    description: Formats rendered from the DOT file.
    type: list
    elements: str
    default: [svg, png]
"""

EXAMPLES = r"""
- name: Draw the cabling
  meshkit.cluster.cabling_picture:
    plan: "{{ meshkit_planned.plan }}"
    dest: artifacts/lab-lab
    title: lab-lab
  run_once: true
  delegate_to: localhost
"""

RETURN = r"""
files:
  description: Paths written (or that would be written in check mode).
  returned: always
  type: list
  elements: str
dot:
  description: The DOT text.
  returned: always
  type: str
"""
