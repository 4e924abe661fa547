"""What a host says about what setup.yml left (module_utils/host_facts.py) on recorded inputs. (Read by the
agent in two real network namespaces, and compared with the plan: test_check_drift.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import host_facts, rdma

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "rdma" / "sysfs"


@pytest.mark.parametrize("case", sorted(p.name for p in SYSFS.iterdir()))
def test_the_agents_sysfs_reading_is_rdma_py_s(case):
    """The agent reimplements the part of rdma.read_sysfs it needs: same ports, states, netdevs and the
    same IPv4 GID on every recorded tree."""
    mine = host_facts.rdma_sysfs(str(SYSFS / case))
    theirs = rdma.read_sysfs(str(SYSFS / case))
    assert mine, case
    assert [(p["device"], p["port"], p["state"], p["link_layer"], p["netdev"]) for p in mine] == [
        (p.device, p.port, p.state, p.link_layer, p.netdev) for p in theirs
    ]
    gids = [p.ipv4_gid() for p in theirs]
    assert [(p["gid_index"], p["gid_ipv4"]) for p in mine] == [(g.index, g.ipv4) if g else (None, None) for g in gids]
