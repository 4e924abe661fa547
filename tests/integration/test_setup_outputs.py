"""What setup.yml leaves behind on real labs: every hostfile format on the controller and on each
host, accepted by the real `mlx.launch`; RDMA facts ("no RDMA" here); the cabling picture; the
discovery-only run."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from .conftest import ENV, REPO, kernel_cables, sh
from .test_setup import netns_of, pool_addresses, setup, snapshot

ALL_SUM = """
import socket
import mlx.core as mx
g = mx.distributed.init(backend="ring", strict=True)
x = mx.distributed.all_sum(mx.arange(8, dtype=mx.float32) + 100 * (g.rank() + 1))
mx.eval(x)
print(f"rank {g.rank()}/{g.size()} on {socket.gethostname()}: {x.tolist()}", flush=True)
"""


def left_neighbour_addresses(lab, order: list[str]) -> list[str]:
    """From the kernel alone: each host's address on its veth cabled to the previous host in ``order``."""
    netns = netns_of(lab)
    cables = kernel_cables(netns)
    out = []
    for i, host in enumerate(order):
        left = order[i - 1]
        ports = [mine[1] for a, b in cables for mine, other in ((a, b), (b, a)) if mine[0] == host and other[0] == left]
        out.append(pool_addresses(netns[host])[ports[0]].split("/")[0])
    return out


def test_ring4_hostfiles_everywhere_and_mlx_all_sum_over_them(make_lab, tmp_path):
    # A ring cabled out of name order: node1 - node3 - node2 - node4 - node1.
    lab = make_lab(lab_cables=[[1, 3], [3, 2], [2, 4], [4, 1]])
    assert lab.up().rc == 0
    run = setup(lab, tmp_path)
    assert run.rc == 0, run.output
    for host in ("node1", "node2", "node3", "node4"):
        assert f"rdma {host}: none - no RDMA devices (/sys/class/infiniband is empty or absent)" in run.output
    assert "backend: ring (ring through 4 hosts (no RDMA))" in run.output

    order = ["node1", "node3", "node2", "node4"]
    mgmt = {name: h["ansible_host"] for name, h in lab.hosts().items()}
    files = tmp_path / "hostfiles"
    mlx = json.loads((files / "mlx-hostfile.json").read_text())
    assert mlx["backend"] == "ring"
    assert [h["ssh"] for h in mlx["hosts"]] == [mgmt[h] for h in order]
    assert [h["ips"] for h in mlx["hosts"]] == [[a] for a in left_neighbour_addresses(lab, order)]
    runtime = json.loads((files / "mlx-ring.json").read_text())
    assert runtime == [[f"{h['ips'][0]}:{32323 + i}"] for i, h in enumerate(mlx["hosts"])]
    assert (files / "mpi-hostfile").read_text().splitlines()[1:] == [f"{mgmt[h]} slots=1" for h in order]
    meshccl = json.loads((files / "meshccl.json").read_text())
    manifest = json.loads((files / "manifest.json").read_text())
    assert meshccl["ring"] == order and meshccl["fingerprint"] == manifest["fingerprint"]
    assert [r["host"] for r in meshccl["ranks"]] == order

    # Each host keeps its own set in its state directory (/var/lib/meshkit inside the host).
    for rank, host in enumerate(order):
        state = lab.dir / "hosts" / host / "state" / "hostfiles"
        assert sorted(p.name for p in state.iterdir()) == [
            "manifest.json",
            "meshccl.json",
            "mlx-hostfile.json",
            "mlx-ring.json",
            "mpi-hostfile",
            "torch.env",
        ]
        assert (state / "mlx-hostfile.json").read_text() == (files / "mlx-hostfile.json").read_text()
        env = (state / "torch.env").read_text()
        assert env == (files / "torch" / f"{host}.env").read_text()
        assert f"\nRANK={rank}\n" in env and f"\nMASTER_ADDR={mgmt['node1']}\n" in env
        assert "\nNCCL_IB_DISABLE=1\n" in env and "\nNCCL_SOCKET_IFNAME==tb0,tb1\n" in env

    # ...which is what the host itself reads at /var/lib/meshkit (over its own SSH).
    slurp = lab.ansible(
        "-m", "ansible.builtin.slurp", "-a", "src=/var/lib/meshkit/hostfiles/torch.env", pattern="node2"
    )
    assert slurp.returncode == 0, slurp.stdout
    content = re.search(r"content: (\S+)", slurp.stdout).group(1)
    assert base64.b64decode(content).decode() == (files / "torch" / "node2.env").read_text()

    second = setup(lab, tmp_path)
    assert second.rc == 0, second.output
    assert all(r["changed"] == 0 for r in second.recap.values()), second.output
    # --check on the converged lab: nothing to change, hostfiles and picture included.
    check = setup(lab, tmp_path, "--check", "--diff")
    assert check.rc == 0, check.output
    assert all(r["changed"] == 0 for r in check.recap.values()), check.output

    # The real mlx.launch, over plain ssh (the lab's ssh_config: its keys and known_hosts).
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "ssh").write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {lab.dir}/ssh_config "$@"\n')
    (shim / "ssh").chmod(0o755)
    program = tmp_path / "all_sum.py"
    program.write_text(ALL_SUM)
    launch = subprocess.run(
        [
            str(Path(sys.executable).parent / "mlx.launch"),
            "--hostfile",
            str(files / "mlx-hostfile.json"),
            "--python",
            sys.executable,
            str(program),
        ],
        capture_output=True,
        stdin=subprocess.DEVNULL,  # mlx.launch makes the stdin it inherits non-blocking
        text=True,
        timeout=120,
        cwd=REPO,
        env=dict(ENV, PATH=f"{shim}:{ENV['PATH']}"),
        check=False,
    )
    expected = [1000.0 + 4 * k for k in range(8)]  # sum over ranks of k + 100 * (rank + 1)
    lines = sorted(line for line in launch.stdout.splitlines() if line.startswith("rank "))
    # mlx.launch exits 0 even when a rank fails: judge by what every rank printed.
    assert lines == [f"rank {r}/4 on {order[r]}: {expected}" for r in range(4)], launch.stdout + launch.stderr

    # Pull a cable: the hostfiles on the hosts were made from the older cabling, and the next run
    # says so and replaces them (no ring any more: the MLX files go).
    sh("ip", "-n", netns_of(lab)["node2"], "link", "del", "tb1")
    third = setup(lab, tmp_path)
    assert third.rc == 0, third.output
    assert "the previous set was stale: made from an older cabling" in third.output
    assert "not written: mlx-hostfile.json (no ring through every host (MLX needs one))" in third.output
    state = lab.dir / "hosts" / "node1" / "state" / "hostfiles"
    assert not (state / "mlx-hostfile.json").exists()
    assert json.loads((state / "manifest.json").read_text())["fingerprint"] != manifest["fingerprint"]


def test_mesh_picture_shows_the_missing_cable_and_discovery_only_changes_nothing(make_lab, tmp_path):
    # A 4-host mesh with node1 <-> node3 left out.
    lab = make_lab(lab_cables=[[1, 2], [1, 4], [2, 3], [2, 4], [3, 4]])
    assert lab.up().rc == 0
    run = setup(lab, tmp_path)
    assert run.rc == 0, run.output
    dot = (tmp_path / "cabling.dot").read_text()
    assert '"node1" -- "node3" [style="dashed", color="#9a9a9a", fontcolor="#9a9a9a", label="no cable"' in dot
    assert dot.count(" -- ") == 6  # five cables and the missing one
    svg = (tmp_path / "cabling.svg").read_text()
    assert "<svg" in svg and "no cable" in svg and "node1:tb0 &lt;&#45;&gt; node2:tb0" in svg
    assert (tmp_path / "cabling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"picture: {tmp_path}/cabling.svg" in run.output

    # Discovery only: nothing changes on any host, the plan record stays, the picture is redrawn
    # with a pulled cable drawn as gone.
    plan_before = (tmp_path / "plan.json").read_text()
    sh("ip", "-n", netns_of(lab)["node2"], "link", "del", "tb1")  # node2 <-> node3
    before = snapshot(lab)
    (tmp_path / "cabling.png").unlink()
    discover = setup(lab, tmp_path, "--tags", "discover")
    assert discover.rc == 0, discover.output
    assert snapshot(lab) == before
    assert (tmp_path / "plan.json").read_text() == plan_before
    assert "(not updated: discovery-only run)" in discover.output
    assert "removed node2:tb1 <-> node3:tb0" in discover.output
    assert (tmp_path / "cabling.png").exists()
    dot = (tmp_path / "cabling.dot").read_text()
    assert 'label="gone since last plan"' in dot and '"node2" -- "node3"' in dot


def test_jaccl_on_the_lab_fails_naming_the_runbook_before_any_change(make_lab, tmp_path):
    lab = make_lab(lab_size=3, lab_shape="mesh")
    assert lab.up().rc == 0
    run = setup(lab, tmp_path, "-e", "meshkit_backend=jaccl")
    assert run.rc != 0
    assert "backend jaccl needs RDMA on every cable it uses; no RDMA on: node1:tb0 (no RDMA devices" in run.output
    assert "Fix: see docs/runbooks/rdma-macos.md (macOS) or docs/runbooks/roce-nccl.md (Linux)" in run.output
    for ns in netns_of(lab).values():
        assert pool_addresses(ns) == {}
    assert os.path.exists(REPO / "docs" / "runbooks" / "rdma-macos.md")
    assert os.path.exists(REPO / "docs" / "runbooks" / "roce-nccl.md")
