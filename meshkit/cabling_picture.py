# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""meshkit.cluster.cabling_picture's work: the cabling picture (meshkit/picture.py) written as DOT
and rendered to SVG and PNG with GraphViz.

Run by the action plugin of the same name in ansible-playbook's own Python (no Python of its own
for the task); plugins/modules/cabling_picture.py documents the options and the result.
Idempotent: renders again only when the DOT text changes or an output is missing.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from ansible.module_utils.common.process import get_bin_path

from meshkit.picture import dot

ARGUMENT_SPEC: dict[str, Any] = {
    "plan": {"type": "dict", "required": True},
    "dest": {"type": "path", "required": True},
    "name": {"type": "str", "default": "cabling"},
    "title": {"type": "str", "default": "cluster"},
    "dead": {"type": "list", "elements": "str", "default": []},
    "removed": {"type": "list", "elements": "str", "default": []},
    "management": {"type": "dict", "default": {}},
    "formats": {"type": "list", "elements": "str", "default": ["svg", "png"]},
}


def run_task(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    """The task's result: ``files``, ``dot``, ``changed`` (and ``warnings`` without GraphViz)."""
    p = params
    # The cables gone since the last plan: the ones given, and the ones plan.json still keeps from
    # the last recabling (cabling_plan), so a run after a recabling draws what the first one drew.
    removed = list(dict.fromkeys([*p["removed"], *(p["plan"].get("removed") or [])]))
    text = dot(p["plan"], p["title"], p["dead"], removed, {k: str(v) for k, v in p["management"].items()})
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
    if not render or check_mode:
        return {"changed": render, "files": files, "dot": text}
    os.makedirs(p["dest"], exist_ok=True)
    with open(dot_path + ".tmp", "w") as handle:
        handle.write(text)
    os.replace(dot_path + ".tmp", dot_path)
    try:
        dot_bin = get_bin_path("dot")
    except ValueError:
        return {
            "changed": True,
            "files": [dot_path],
            "dot": text,
            "warnings": [
                "GraphViz 'dot' not found: wrote the DOT file only (apt-get install graphviz / brew install graphviz)"
            ],
        }
    for fmt in p["formats"]:
        out = f"{base}.{fmt}"
        proc = subprocess.run(
            [dot_bin, f"-T{fmt}", "-o", out + ".tmp", dot_path], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            msg = f"dot -T{fmt} failed (rc={proc.returncode}): {proc.stderr.strip()}"
            return {"failed": True, "msg": msg, "dot": text}
        os.replace(out + ".tmp", out)
    return {"changed": True, "files": files, "dot": text}
