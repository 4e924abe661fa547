#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: draw the cabling - GraphViz DOT, SVG and PNG - from the one plan."""

from __future__ import annotations

DOCUMENTATION = r"""
module: cabling_picture
short_description: Draw hosts and cables (DOT, SVG, PNG) from the cabling plan
description:
  - Runs on the controller. Writes C(<dest>/<name>.dot) and renders C(.svg) and C(.png) with GraphViz
    C(dot) - hosts, and cables labelled with port and address at each end and the cable's network.
  - Cables of parallel ring k share a colour; host pairs without a cable (mesh incomplete) are dashed grey;
    dead cables (no ping reply) and cables gone since the last plan are red; one-way links dotted orange.
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
    description: Cables (C(a:p <-> b:q)) of the last plan that discovery no longer finds.
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

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils.picture import dot


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "plan": {"type": "dict", "required": True},
            "dest": {"type": "path", "required": True},
            "name": {"type": "str", "default": "cabling"},
            "title": {"type": "str", "default": "cluster"},
            "dead": {"type": "list", "elements": "str", "default": []},
            "removed": {"type": "list", "elements": "str", "default": []},
            "management": {"type": "dict", "default": {}},
            "formats": {"type": "list", "elements": "str", "default": ["svg", "png"]},
        },
        supports_check_mode=True,
    )
    p = module.params
    text = dot(p["plan"], p["title"], p["dead"], p["removed"], {k: str(v) for k, v in p["management"].items()})
    base = os.path.join(p["dest"], p["name"])
    dot_path = base + ".dot"
    try:
        with open(dot_path) as handle:
            old = handle.read()
    except OSError:
        old = None
    outputs = [f"{base}.{fmt}" for fmt in p["formats"]]
    render = old != text or not all(os.path.exists(o) for o in outputs)
    files = [dot_path, *outputs]
    if not render or module.check_mode:
        module.exit_json(changed=render, files=files, dot=text)
    os.makedirs(p["dest"], exist_ok=True)
    with open(dot_path + ".tmp", "w") as handle:
        handle.write(text)
    os.replace(dot_path + ".tmp", dot_path)
    dot_bin = module.get_bin_path("dot")
    if not dot_bin:
        module.warn(
            "GraphViz 'dot' not found: wrote the DOT file only (apt-get install graphviz / brew install graphviz)"
        )
        module.exit_json(changed=True, files=[dot_path], dot=text)
    for fmt in p["formats"]:
        out = f"{base}.{fmt}"
        rc, _out, err = module.run_command([dot_bin, f"-T{fmt}", "-o", out + ".tmp", dot_path])
        if rc != 0:
            module.fail_json(msg=f"dot -T{fmt} failed (rc={rc}): {err.strip()}", dot=text)
        os.replace(out + ".tmp", out)
    module.exit_json(changed=True, files=files, dot=text)


if __name__ == "__main__":
    main()
