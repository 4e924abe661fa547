"""The collection's molecule scenario (extensions/molecule/default) passes end to end."""

from __future__ import annotations

import re

from .conftest import sh


def test_molecule_default_scenario():
    proc = sh("molecule", "test", "-s", "default", check=False)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out[-4000:]
    for step in ("create", "converge", "idempotence", "verify", "destroy"):
        assert f"{step}: Executed: Successful" in out, step
    # verify really ran its checks on every lab host
    for host in ("node1", "node2", "node3"):
        assert re.search(rf"ok: \[{host}\] => \(item=tb0 ", out), host
    # the slurm role (lab_slurm: true in create.yml) ran in converge and idempotence; verify saw every node idle
    assert "TASK [Check every host is an idle Slurm node]" in out, out[-4000:]
    assert re.search(r"TASK \[meshkit\.cluster\.slurm : Run slurmd", out), out[-4000:]
