"""Real meshccl jobs on this machine: processes, hostfiles written by meshkit's own hostfile
code, cables as loopback addresses (127.64.0.0/24 routes to lo, so every "host" listens on
its own addresses and nowhere else)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ansible_collections.meshkit.cluster.plugins.module_utils import hostfiles

from tests.unit.test_hostfiles import plan_of as unit_plan_of

WORKER = Path(__file__).with_name("worker.py")


def _ephemeral_low() -> int:
    """The first port the kernel hands out as a connection's source port."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(count: int) -> int:
    """A base port such that base..base+count-1 are free on loopback right now.

    Drawn below the kernel's ephemeral range: a port from inside it (bind to port 0) can be
    taken as the source port of an outgoing connection -- another rank's connect() -- between
    this check and the rank's own bind, which then fails with "Address already in use"."""
    draw = random.SystemRandom()
    low, top = 15000, _ephemeral_low() - count
    if top <= low:
        raise RuntimeError(f"no room for {count} ports between {low} and the ephemeral range")
    for _ in range(500):
        base = draw.randrange(low, top)
        ok = True
        for p in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block")


def plan_of(pairs: list[tuple[int, int]], n: int) -> dict:
    """meshkit's plan for cables between host numbers, cable addresses on loopback."""
    return unit_plan_of(pairs, n, network="127.64.0.0/24")


def meshccl_hostfile(tmp: Path, pairs: list[tuple[int, int]], hosts: int, ranks_per_host: int = 1) -> Path:
    plan = plan_of(pairs, hosts)
    ssh = {f"node{i}": f"127.0.0.{i}" for i in range(1, hosts + 1)}
    port = free_port_block(ranks_per_host)
    data = hostfiles.meshccl_hostfile(plan, ssh, ranks_per_host, port, "test", hostfiles.fingerprint(plan))
    path = tmp / "meshccl.json"
    path.write_text(json.dumps(data))
    return path


def loopback_hostfile(tmp: Path, n: int) -> Path:
    """All ranks on one host: every pair linked over 127.0.0.1 (a complete graph)."""
    plan = plan_of([], 1)
    port = free_port_block(n)
    data = hostfiles.meshccl_hostfile(plan, {"node1": "127.0.0.1"}, n, port, "test", hostfiles.fingerprint(plan))
    path = tmp / f"meshccl-local{n}.json"
    path.write_text(json.dumps(data))
    return path


TOKEN = "job-secret-7"  # every test job has a token (a job without one is refused)


def spawn(
    n: int, scenario: str, env_of, *args: str, wrap=None, ranks=None, worker: Path = WORKER
) -> list[subprocess.Popen]:
    """Worker processes (`worker`, default worker.py) for ranks 0..n-1 (or only `ranks`);
    env_of(rank) gives each one's extra environment, wrap(rank) a command line to run the worker
    under (e.g. unshare)."""
    procs = []
    base = {k: v for k, v in os.environ.items() if k not in ("MESHCCL_ALLOW_NO_TOKEN", "MESHCCL_JOB_ID")}
    for r in range(n) if ranks is None else ranks:
        env = {**base, "MESHCCL_TOKEN": TOKEN, "MESHCCL_LOG_LEVEL": "1", **env_of(r)}
        procs.append(
            subprocess.Popen(
                [*(wrap(r) if wrap else []), sys.executable, str(worker), scenario, *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def hostfile_env(path: Path):
    return lambda r: {"MESHCCL_RANK": str(r), "MESHCCL_HOSTFILE": str(path)}


def torchrun_env(n: int, master_port: int, **extra: str):
    """torchrun's variables for rank r of n on this machine (meshccl's rendezvous on
    master_port + 1), plus `extra`."""
    return lambda r: {
        "RANK": str(r),
        "WORLD_SIZE": str(n),
        "LOCAL_RANK": str(r),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        **extra,
    }


def read_line(sock: socket.socket, deadline: float) -> bytes:
    """One line from sock (b"" if it closed first); TimeoutError past the deadline."""
    buf = b""
    while not buf.endswith(b"\n"):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            return buf
        buf += chunk
    return buf


def greeting(port: int, timeout: float = 30.0) -> dict:
    """Waits until rank 0's rendezvous on 127.0.0.1:port greets; returns the greeting."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
                line = read_line(s, time.monotonic() + 5)
                if line:
                    return json.loads(line)
        except OSError as e:
            last = e
        time.sleep(0.05)  # polling for the port to open: the condition is checked each round
    raise AssertionError(f"no rendezvous greeting on 127.0.0.1:{port} within {timeout} s: {last}")


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str, str]]:
    """Waits for every process (killing all of them past `timeout`); (returncode, out, err)."""
    deadline = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.send_signal(signal.SIGKILL)
            o, e = p.communicate()
            e += "\n[test] killed: still running past the test's deadline"
        out.append((p.returncode, o, e))
    return out
