# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where the meshkit.cluster collection this package runs with is, and the environment that makes
ansible-playbook (through ansible-runner) use that same copy."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def collection_root() -> Path:
    """The meshkit.cluster collection this process imports (a regular install carries it in
    site-packages; an editable one is the checkout, through .collections/)."""
    from ansible_collections.meshkit import cluster  # a namespace package: no __file__

    return Path(next(iter(cluster.__path__)))


def runner_env() -> dict[str, str]:
    """Environment for ansible-playbook: this collection first on the collections path (then what
    Ansible is configured with), this interpreter's tools on PATH, and an ansible.cfg found in the
    current directory kept although ansible-runner starts the playbook elsewhere."""
    from ansible import constants

    ours = str(collection_root().parents[2])
    paths = [ours, *(p for p in constants.COLLECTIONS_PATHS if os.path.realpath(p) != os.path.realpath(ours))]
    env = {
        "ANSIBLE_COLLECTIONS_PATH": os.pathsep.join(paths),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    cfg = os.environ.get("ANSIBLE_CONFIG") or ("ansible.cfg" if Path("ansible.cfg").is_file() else "")
    if cfg:
        env["ANSIBLE_CONFIG"] = str(Path(cfg).resolve())
    return env
