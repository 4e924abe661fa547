"""meshccl with real processes on this machine: bootstraps, every collective, dead and stalled
peers, mismatched calls, strangers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import meshccl
import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import hostfiles

from . import helpers as h

RING4 = [(1, 3), (3, 2), (2, 4), (4, 1)]
MESH4 = [(a, b) for a in range(1, 5) for b in range(a + 1, 5)]


def assert_all_ok(results):
    for r, (code, out, err) in enumerate(results):
        assert code == 0 and "OK" in out, f"rank {r} exit {code}\nstdout: {out}\nstderr: {err}"


def four_rank_hostfile(tmp_path: Path, layout: str) -> Path:
    """ring4 / mesh4: four hosts cabled so; local4: four ranks on one host."""
    if layout == "local4":
        return h.loopback_hostfile(tmp_path, 4)
    return h.meshccl_hostfile(tmp_path, RING4 if layout == "ring4" else MESH4, 4)


def test_the_package_imports():
    done = subprocess.run(
        [sys.executable, "-c", "import meshccl; print(meshccl.DTYPES)"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "bfloat16" in done.stdout


@pytest.mark.parametrize("layout", ["ring4", "mesh4", "local4"])
def test_four_processes_all_reduce_64_mib_exactly(tmp_path, layout):
    path = four_rank_hostfile(tmp_path, layout)
    assert_all_ok(h.finish(h.spawn(4, "sum64", h.hostfile_env(path))))


@pytest.mark.parametrize("n", range(1, 9))
def test_every_collective_and_dtype_on_one_host(tmp_path, n):
    path = h.loopback_hostfile(tmp_path, n)
    assert_all_ok(h.finish(h.spawn(n, "sweep", h.hostfile_env(path))))


def distinct_host_ports(path: Path, per_host: int) -> None:
    """Hosts simulated on one machine share 127.0.0.1: give each host its own port range (a
    real cluster's hosts each have their own loopback, so meshkit writes one range for all)."""
    data = json.loads(path.read_text())
    base = h.free_port_block(len(data["ranks"]))
    order = {host: i for i, host in enumerate(data["hosts"])}
    for rank in data["ranks"]:
        rank["port"] = base + order[rank["host"]] * per_host + rank["local_rank"]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("name", "pairs", "hosts", "per_host"),
    [
        ("ring4", RING4, 4, 1),
        ("mesh4", MESH4, 4, 1),
        ("doubled-pair", [(1, 2), (1, 2)], 2, 1),
        ("ring3-two-ranks-per-host", [(1, 2), (2, 3), (3, 1)], 3, 2),
        ("ring4-two-ranks-per-host", RING4, 4, 2),
    ],
)
def test_every_collective_over_cables(tmp_path, name, pairs, hosts, per_host):
    path = h.meshccl_hostfile(tmp_path, pairs, hosts, per_host)
    if per_host > 1:
        distinct_host_ports(path, per_host)
    n = hosts * per_host
    assert_all_ok(h.finish(h.spawn(n, "sweep", h.hostfile_env(path))))


def transports(results) -> list[dict[int, str]]:
    """Per rank, peer -> "shm"/"tcp" as the worker's "transports" scenario printed it."""
    assert_all_ok(results)
    out = []
    for _, stdout, _ in results:
        line = next(x for x in stdout.splitlines() if x.startswith("TRANSPORTS"))
        out.append({int(q): t for q, t in (item.split(":") for item in line.split()[1:])})
    return out


def single_copy(results) -> list[bool]:
    """Per rank, whether it could read every peer's memory (the "transports" scenario)."""
    assert_all_ok(results)
    return [
        next(x for x in out.splitlines() if x.startswith("SINGLE_COPY")).split()[1] == "True" for _, out, _ in results
    ]


def infos(results) -> list[dict]:
    """Per rank, Communicator.info() as the "transports" scenario printed it."""
    assert_all_ok(results)
    return [json.loads(next(x for x in out.splitlines() if x.startswith("INFO "))[5:]) for _, out, _ in results]


def test_ranks_of_one_host_share_memory_and_hosts_talk_tcp(tmp_path):
    # Single copy where every rank shares the host, in a build that has it (Linux's own: not
    # macOS, not the forced-portable build, whose ranks copy through shared memory).
    built = meshccl.build_info()["single_copy"]
    # One host: every pair in shared memory.
    path = h.loopback_hostfile(tmp_path, 4)
    results = h.finish(h.spawn(4, "transports", h.hostfile_env(path)))
    assert transports(results) == [{q: "shm" for q in range(4) if q != r} for r in range(4)]
    assert single_copy(results) == [built] * 4
    for r, info in enumerate(infos(results)):
        assert info["transport"] == "shm"
        assert info["transports"] == {str(q): "shm" for q in range(4) if q != r}
        assert info["single_copy"] is built
        assert info["build"] == meshccl.build_info()  # the workers run the build this test imported
    # Four hosts in a ring, two ranks each: the host's two ranks share memory, cables are TCP.
    path = h.meshccl_hostfile(tmp_path, RING4, 4, 2)
    distinct_host_ports(path, 2)
    hosts = {x["rank"]: x["host"] for x in json.loads(path.read_text())["ranks"]}
    results = h.finish(h.spawn(8, "transports", h.hostfile_env(path)))
    assert single_copy(results) == [False] * 8  # only where every rank shares one host
    for r, links in enumerate(transports(results)):
        assert links, f"rank {r} has no links"
        for q, t in links.items():
            assert t == ("shm" if hosts[q] == hosts[r] else "tcp"), (r, q, t, hosts)
        assert "shm" in links.values(), (r, links)
    assert [info["transport"] for info in infos(results)] == ["shm+tcp"] * 8
    # transport=tcp keeps one host's ranks on loopback TCP.
    path = h.loopback_hostfile(tmp_path, 2)
    env = h.hostfile_env(path)
    results = h.finish(h.spawn(2, "transports", lambda r: {**env(r), "MESHCCL_TRANSPORT": "tcp"}))
    assert transports(results) == [{1: "tcp"}, {0: "tcp"}]
    assert single_copy(results) == [False, False]
    assert [info["transport"] for info in infos(results)] == ["tcp", "tcp"]


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --pid needs root")
def test_a_rank_in_another_pid_namespace_falls_back_to_copying_through_shared_memory(tmp_path):
    # Rank 1 runs in its own pid namespace: its pid means nothing to rank 0 and rank 0's pid
    # nothing to it, so neither can read the other's memory. Both must find that out at
    # connect time, say so, and still reduce exactly (through the rings).
    path = h.loopback_hostfile(tmp_path, 2)
    results = h.finish(
        h.spawn(2, "transports", h.hostfile_env(path), wrap=lambda r: ["unshare", "--pid", "--fork"] if r == 1 else [])
    )
    assert transports(results) == [{1: "shm"}, {0: "shm"}]
    assert single_copy(results) == [False, False]
    if meshccl.build_info()["single_copy"]:  # a build without it never tries (and says nothing)
        for r, (_, _, err) in enumerate(results):
            assert f"rank {r}: cannot read rank {1 - r}'s memory" in err, err
    assert_all_ok(
        h.finish(h.spawn(2, "sum64", h.hostfile_env(path), wrap=lambda r: ["unshare", "--pid", "--fork"] if r else []))
    )


def test_mlx_ring_hostfile_bootstrap(tmp_path):
    plan = h.plan_of(RING4, 4)
    mlx = hostfiles.mlx_hostfile(plan, {f"node{i}": f"127.0.0.{i}" for i in range(1, 5)})
    runtime = hostfiles.mlx_ring_runtime(mlx, h.free_port_block(4))
    path = tmp_path / "mlx-ring.json"
    path.write_text(json.dumps(runtime))
    env = lambda r: {"MLX_RANK": str(r), "MLX_HOSTFILE": str(path)}  # noqa: E731
    assert_all_ok(h.finish(h.spawn(4, "sweep", env)))


def test_torchrun_environment_and_torch_tensors():
    # PyTorch CPU is part of the test environment (make test installs it): DLPack, bfloat16.
    port = h.free_port_block(2)
    env = lambda r: {  # noqa: E731
        "RANK": str(r),
        "WORLD_SIZE": "3",
        "LOCAL_RANK": str(r),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    assert_all_ok(h.finish(h.spawn(3, "torch", env)))


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"rank exited ({proc.returncode}) before printing {text!r}: {proc.stderr.read()}")
    raise AssertionError(f"no {text!r} within {timeout} s")


def start_looping(path: Path, timeout: float) -> list[subprocess.Popen]:
    """Four ranks in a loop of 16 MiB all_reduces, returned once each has done three."""
    procs = h.spawn(4, "loop", lambda r: {**h.hostfile_env(path)(r), "MESHCCL_TIMEOUT": str(timeout)})
    try:
        for p in procs:
            wait_for_line(p, "iteration 2")
    except BaseException:
        for p in procs:
            p.kill()
            p.communicate()
        raise
    return procs


def shm_names(pids) -> list[str]:
    """Shared-memory segments meshccl created (named after the creating pid) still in /dev/shm."""
    shm = Path("/dev/shm")
    return [p.name for p in shm.iterdir() if any(p.name.startswith(f"mccl.{pid}.") for pid in pids)]


@pytest.mark.parametrize("layout", ["ring4", "local4"])
def test_sigkill_of_a_rank_mid_all_reduce_makes_every_other_rank_raise(tmp_path, layout):
    path = four_rank_hostfile(tmp_path, layout)
    timeout = 10.0
    procs = start_looping(path, timeout)
    try:
        killed_at = time.monotonic()
        procs[2].send_signal(signal.SIGKILL)
        results = h.finish(procs, timeout=timeout + 20)
        elapsed = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert results[2][0] == -signal.SIGKILL
    for r in (0, 1, 3):
        code, out, err = results[r]
        assert code == 3, f"rank {r} exit {code}: {out[-500:]} {err[-500:]}"
        assert "ERROR PeerError" in out or "ERROR TimeoutError" in out, out[-500:]
    assert elapsed < timeout + 5, f"survivors needed {elapsed:.1f} s"
    assert all(p.poll() is not None for p in procs)
    assert shm_names([p.pid for p in procs]) == []


@pytest.mark.parametrize("layout", ["ring4", "local4"])
def test_sigstop_of_a_rank_times_out_every_other_rank(tmp_path, layout):
    path = four_rank_hostfile(tmp_path, layout)
    timeout = 3.0
    procs = start_looping(path, timeout)
    try:
        stopped_at = time.monotonic()
        procs[1].send_signal(signal.SIGSTOP)
        survivors = h.finish([procs[0], procs[2], procs[3]], timeout=timeout + 20)
        elapsed = time.monotonic() - stopped_at
    finally:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].communicate()
    for code, out, err in survivors:
        assert code == 3, f"exit {code}: {out[-500:]} {err[-500:]}"
        assert "ERROR TimeoutError" in out and "timed out after 3" in out, out[-800:]
    assert elapsed < timeout + 5, f"survivors needed {elapsed:.1f} s"


@pytest.mark.parametrize("layout", ["ring4", "mesh4", "local4"])
def test_float32_against_int32_raises_on_every_rank(tmp_path, layout):
    path = four_rank_hostfile(tmp_path, layout)
    results = h.finish(h.spawn(4, "mismatch", h.hostfile_env(path)), timeout=60)
    for r, (code, out, err) in enumerate(results):
        assert code == 3, f"rank {r}: {out} {err}"
        assert "ERROR MismatchError" in out and "int32" in out and "float32" in out, f"rank {r}: {out}"


def test_a_stranger_without_the_token_is_refused_and_logged(tmp_path):
    path = h.loopback_hostfile(tmp_path, 2)

    def env(r):
        e = {**h.hostfile_env(path)(r), "MESHCCL_CONNECT_TIMEOUT": "3"}
        if r == 1:
            e["MESHCCL_TOKEN"] = "wrong-guess"
        return e

    (c0, o0, e0), (c1, o1, e1) = h.finish(h.spawn(2, "barrier", env), timeout=60)
    assert c1 == 3 and "ERROR AuthError" in o1, o1 + e1
    assert c0 == 3 and "ERROR TimeoutError" in o0 and "rank 1 did not connect" in o0, o0 + e0
    assert "rejected a connection from 127.0.0.1" in e0 and "could not prove the job token" in e0, e0
    for text in (o0, e0, o1, e1):
        assert "job-secret-7" not in text and "wrong-guess" not in text


def test_world_size_check_refuses_a_silent_smaller_job(tmp_path):
    path = h.loopback_hostfile(tmp_path, 2)
    env = {**os.environ, "MESHCCL_RANK": "0", "MESHCCL_HOSTFILE": str(path), "MESHCCL_WORLD_SIZE": "4"}
    done = subprocess.run(
        [sys.executable, str(h.WORKER), "barrier"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 3 and "MESHCCL_WORLD_SIZE=4 but" in done.stdout, done.stdout
