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
