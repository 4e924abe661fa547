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


def test_the_slurm_jobs_with_a_step_on_the_host_are_read_from_slurmstepds_titles(tmp_path):
    """slurmstepd titles itself `slurmstepd: [<job>.<step>]` (the lab test of meshkit check --if-idle reads a real
    one: tests/integration/test_launch.py); other processes, and ones gone meanwhile, are not jobs."""
    processes = {
        "101": b"slurmstepd: [17.batch]\x00\x00\x00\x00",
        "102": b"slurmstepd: [17.extern]\x00",
        "103": b"slurmstepd: [9.0]\x00",
        "104": b"/usr/sbin/slurmd\x00-D\x00",
        "105": b"python3\x00-c\x00print('slurmstepd: [99.batch]')\x00",
    }
    for pid, cmdline in processes.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(cmdline)
    (tmp_path / "106").mkdir()  # no cmdline: a process that ended while it was read
    (tmp_path / "self").mkdir()
    assert host_facts.slurm_jobs(str(tmp_path)) == ["9", "17"]
    assert host_facts.slurm_jobs(str(tmp_path / "missing")) == []
