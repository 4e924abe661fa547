"""Every layout meshccl's bootstraps produce, at small scale, with large calls checked exactly.

A layout is hosts x ranks per host and how the ranks learn it: meshkit's meshccl.json (ring and
full-mesh cabling), MLX's ring file (as mlx.launch writes it, a host's ranks on the host's
addresses, and as meshkit writes it, a host's later ranks on loopback) and torchrun's
rendezvous. Every rank must agree on how calls are cut into pipeline segments, though ranks
see different neighbours: in a ring of two hosts with three ranks each, each host's middle rank
has only neighbours on its own host (shared memory) and the others have one across the cable
(TCP). A rank choosing its segment from its own neighbours cuts its frames unlike its
neighbour's, and every large call fails. Each job here runs all_reduce (float32 and int64 sum,
int32 max), all_gather, reduce_scatter and broadcast at several MiB, of sizes no segment
divides, and every rank checks every element (layout_worker.py).

"Hosts" are simulated on this machine as in test_jobs.py: cables are loopback addresses
(127.64.0.0/24), and a host's ranks really share memory with each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import hostfiles

from . import helpers as h

LAYOUT_WORKER = Path(__file__).with_name("layout_worker.py")

RING3 = [(1, 2), (2, 3), (3, 1)]
RING4 = [(1, 3), (3, 2), (2, 4), (4, 1)]
MESH4 = [(a, b) for a in range(1, 5) for b in range(a + 1, 5)]

Env = Callable[[int], dict[str, str]]


def spawn(n: int, env_of: Env) -> list[subprocess.Popen]:
    """layout_worker.py for ranks 0..n-1, each with the test job's token and env_of(rank)."""
    base = {k: v for k, v in os.environ.items() if k not in ("MESHCCL_ALLOW_NO_TOKEN", "MESHCCL_JOB_ID")}
    return [
        subprocess.Popen(
            [sys.executable, str(LAYOUT_WORKER)],
            env={
                **base,
                "MESHCCL_TOKEN": h.TOKEN,
                "MESHCCL_LOG_LEVEL": "1",
                "MESHCCL_TIMEOUT": "60",
                "MESHCCL_CONNECT_TIMEOUT": "60",
                **env_of(r),
            },
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]


def run_job(n: int, env_of: Env) -> list[dict[int, str]]:
    """Runs the job; asserts every rank printed OK; returns per rank its links (peer -> transport)."""
    results = h.finish(spawn(n, env_of), timeout=90)
    failed = [
        f"rank {r}: exit {code}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
        for r, (code, out, err) in enumerate(results)
        if code != 0 or "OK" not in out.split()
    ]
    assert not failed, "\n".join(failed)
    links = []
    for _, out, _ in results:
        line = next(x for x in out.splitlines() if x.startswith("LINKS "))
        links.append({int(q): t for q, t in json.loads(line[6:]).items()})
    return links


def assert_links(links: list[dict[int, str]], host_of: Callable[[int], int], shares: Callable[[int, int], bool]):
    """No rank uses shared memory to a rank of another host; shares(r, q): r and q must share memory."""
    for r, peers in enumerate(links):
        assert peers or len(links) == 1, f"rank {r} has no links"
        for q, t in peers.items():
            want = "shm" if shares(r, q) else "tcp"
            assert host_of(r) == host_of(q) or t == "tcp", f"rank {r} -> rank {q} (another host) over {t}"
            assert t == want, f"rank {r} -> rank {q}: {t}, expected {want} (links {links})"


# --- meshccl.json (meshkit launch) ----------------------------------------------------------------


def meshccl_json(tmp_path: Path, pairs: list[tuple[int, int]], hosts: int, per_host: int) -> Path:
    """meshkit's meshccl.json; with several ranks per host, each simulated host gets its own
    ports (on a real cluster each host has its own loopback and one port range serves all)."""
    path = h.meshccl_hostfile(tmp_path, pairs, hosts, per_host)
    if hosts > 1 and per_host > 1:
        data = json.loads(path.read_text())
        base = h.free_port_block(len(data["ranks"]))
        order = {host: i for i, host in enumerate(data["hosts"])}
        for rank in data["ranks"]:
            rank["port"] = base + order[rank["host"]] * per_host + rank["local_rank"]
        path.write_text(json.dumps(data))
    return path


# algorithm "auto" takes the direct paths where every rank reaches every rank (the complete
# layouts) and the pipelined ring elsewhere; "ring" forces the ring through the complete ones too.
RING = {"MESHCCL_ALGORITHM": "ring"}
# Pairs with different numbers of connections (two cables between two hosts and one elsewhere;
# or two cables to each rank of the other host and one shared-memory link within a host) and,
# with UNEVEN, one connection per link and many segments per call: the direct all-reduce
# finishes its chunk's segments out of order (their last contributions came on different
# connections), and each must still reach every peer as itself, also over a pair with fewer
# connections (sent there in the order they finished, each landed in the place of another
# segment of the same size: wrong sums, no error). The ring variant takes the same layout
# through the ring.
UNEVEN = {"MESHCCL_CONNS_PER_LINK": "1", "MESHCCL_SEGMENT_BYTES": "4096"}


@pytest.mark.parametrize(
    ("pairs", "hosts", "per_host", "options"),
    [
        pytest.param([], 1, 2, {}, id="1x2"),
        pytest.param([], 1, 3, {}, id="1x3"),
        pytest.param([], 1, 3, RING, id="1x3-ring-algorithm"),
        pytest.param([], 1, 4, {}, id="1x4"),
        pytest.param([(1, 2)], 2, 1, {}, id="2x1"),
        pytest.param(RING3, 3, 1, {}, id="3x1-ring"),
        pytest.param([*RING3, (1, 2)], 3, 1, {}, id="3x1-ring-one-doubled-cable"),
        pytest.param([*RING3, (1, 2)], 3, 1, UNEVEN, id="3x1-ring-one-doubled-cable-uneven-connections"),
        pytest.param(RING4, 4, 1, {}, id="4x1-ring"),
        pytest.param(MESH4, 4, 1, {}, id="4x1-mesh"),
        pytest.param(MESH4, 4, 1, RING, id="4x1-mesh-ring-algorithm"),
        pytest.param([(1, 2)], 2, 2, {}, id="2x2"),
        pytest.param([(1, 2)], 2, 3, {}, id="2x3"),
        pytest.param([(1, 2)], 2, 3, RING, id="2x3-ring-algorithm"),
        pytest.param([(1, 2), (1, 2)], 2, 3, {}, id="2x3-doubled-cable"),
        pytest.param([(1, 2), (1, 2)], 2, 3, UNEVEN, id="2x3-doubled-cable-uneven-connections"),
        pytest.param([(1, 2), (1, 2)], 2, 3, {**UNEVEN, **RING}, id="2x3-doubled-cable-uneven-connections-ring"),
        pytest.param(RING3, 3, 2, {}, id="3x2-ring"),
        pytest.param(RING3, 3, 2, RING, id="3x2-ring-algorithm"),
        pytest.param(RING4, 4, 2, {}, id="4x2-ring"),
    ],
)
def test_meshccl_hostfile_layouts(tmp_path, pairs, hosts, per_host, options):
    path = meshccl_json(tmp_path, pairs, hosts, per_host)
    host = {x["rank"]: x["host"] for x in json.loads(path.read_text())["ranks"]}
    env = {"MESHCCL_HOSTFILE": str(path), **options}
    links = run_job(hosts * per_host, lambda r: {**env, "MESHCCL_RANK": str(r)})
    assert_links(links, host.__getitem__, lambda r, q: host[r] == host[q])


# --- MLX ring files (mlx.launch, meshkit launch -r mlx) ---------------------------------------------


def mlx_host_ips(hosts: int) -> list[list[str]]:
    """Per host, in ring order, the addresses MLX's hostfile gives it (meshkit's mlx_hostfile
    of a ring of `hosts` cabled on loopback); one host alone: 127.0.0.1 (mlx.launch -n)."""
    if hosts == 1:
        return [["127.0.0.1"]]
    pairs = [(1, 2)] if hosts == 2 else [(i, i % hosts + 1) for i in range(1, hosts + 1)]
    ssh = {f"node{i}": f"127.0.0.{i}" for i in range(1, hosts + 1)}
    return [entry["ips"] for entry in hostfiles.mlx_hostfile(h.plan_of(pairs, hosts), ssh)["hosts"]]


def mlx_launch_ring(hosts: int, per_host: int) -> list[list[str]]:
    """The ring file mlx.launch writes for a hostfile listing each host `per_host` times (its
    launch_ring: per entry, each of the host's ips with the next port): a host's ranks all
    listen on the host's addresses."""
    port = h.free_port_block(hosts * per_host)
    ring = []
    for ips in mlx_host_ips(hosts):
        for _ in range(per_host):
            ring.append([f"{ip}:{port}" for ip in ips])
            port += 1
    return ring


def mlx_env(tmp_path: Path, ring: list[list[str]]) -> Env:
    path = tmp_path / "mlx-ring.json"
    path.write_text(json.dumps(ring))
    return lambda r: {"MLX_RANK": str(r), "MLX_HOSTFILE": str(path)}


@pytest.mark.parametrize(
    ("hosts", "per_host"),
    [
        pytest.param(1, 3, id="1x3"),
        pytest.param(2, 1, id="2x1"),
        pytest.param(4, 1, id="4x1"),
        pytest.param(2, 2, id="2x2"),
        pytest.param(3, 2, id="3x2"),
        pytest.param(2, 4, id="2x4"),
    ],
)
def test_mlx_launch_ring_file_layouts(tmp_path, hosts, per_host):
    links = run_job(hosts * per_host, mlx_env(tmp_path, mlx_launch_ring(hosts, per_host)))
    same = lambda r, q: r // per_host == q // per_host  # noqa: E731
    assert_links(links, lambda r: r // per_host, same)


def test_mlx_ring_file_of_two_hosts_with_three_ranks_each_large_calls_are_exact(tmp_path):
    # The layout of the segment bug: ranks 1 and 4 (each host's middle rank) reach both their
    # neighbours through shared memory, the other four reach one across the cable, over TCP.
    # Every large call must still be exact on every rank (before the fix: MismatchError).
    links = run_job(6, mlx_env(tmp_path, mlx_launch_ring(2, 3)))
    assert [sorted(set(peers.values())) for peers in links] == [
        ["shm", "tcp"],
        ["shm"],
        ["shm", "tcp"],
        ["shm", "tcp"],
        ["shm"],
        ["shm", "tcp"],
    ], links
    assert_links(links, lambda r: r // 3, lambda r, q: r // 3 == q // 3)


@pytest.mark.parametrize("per_host", [3, 4])
def test_meshkit_mlx_ring_file_layouts(tmp_path, per_host):
    # meshkit's own ring file (hostfiles.mlx_ring_runtime, as `meshkit launch -r mlx` writes it):
    # a host's first rank listens on its cable address, the others on loopback. The file names
    # no hosts, so only ranks listening on the same addresses are known to share a host: the
    # loopback ones. With four per host, ranks 2 and 6 have only such neighbours.
    ring = hostfiles.mlx_ring_runtime(
        hostfiles.mlx_hostfile(h.plan_of([(1, 2)], 2), {"node1": "127.0.0.1", "node2": "127.0.0.2"}),
        h.free_port_block(2 * per_host),
        ranks_per_host=per_host,
    )
    links = run_job(2 * per_host, mlx_env(tmp_path, ring))

    def shares(r: int, q: int) -> bool:
        return r // per_host == q // per_host and r % per_host > 0 and q % per_host > 0

    assert_links(links, lambda r: r // per_host, shares)


# --- torchrun -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hosts", "per_host", "options"),
    [
        pytest.param(1, 3, {}, id="1x3"),
        pytest.param(2, 2, {}, id="2x2"),
        pytest.param(2, 3, {}, id="2x3"),
        pytest.param(2, 3, RING, id="2x3-ring-algorithm"),
        pytest.param(3, 2, {}, id="3x2"),
    ],
)
def test_torchrun_layouts(hosts, per_host, options):
    # Every rank linked to every rank; ranks compare host identities (LAYOUT_HOST_ID plays a
    # host's: layout_worker.py) to pick shared memory.
    n = hosts * per_host
    env = h.torchrun_env(n, h.free_port_block(2), **options)
    links = run_job(n, lambda r: {**env(r), "LOCAL_RANK": str(r % per_host), "LAYOUT_HOST_ID": f"host{r // per_host}"})
    assert_links(links, lambda r: r // per_host, lambda r, q: r // per_host == q // per_host)
