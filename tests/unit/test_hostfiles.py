"""Every hostfile format from the one plan, against hand-checked expectations: a ring cabled out of
name order, a full mesh, doubled cables, two hosts, JACCL's RDMA matrix; staleness; the module
writing, staying idempotent, and verifying."""

from __future__ import annotations

import json
import shlex

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import hostfiles
from ansible_collections.meshkit.cluster.plugins.modules import hostfiles as hostfiles_module

from meshkit.topology import Observation, build_plan

from .module_harness import patch_exits, run_module

SSH = {f"node{i}": f"10.9.0.{i}" for i in range(1, 6)}


def plan_of(pairs: list[tuple[int, int]], n: int, backend: str = "", rdma=False, network: str = "10.50.0.0/24") -> dict:
    """A plan for cables between host numbers, ports tb0, tb1, ... in cable order per host."""
    used = dict.fromkeys(range(1, n + 1), 0)
    obs = []
    for a, b in pairs:
        pa, pb = f"tb{used[a]}", f"tb{used[b]}"
        used[a] += 1
        used[b] += 1
        obs.append(Observation(f"node{a}", pa, f"id-{a}-{pa}", [f"id-{b}-{pb}"], rdma=f"rdma_{pa}"))
        obs.append(Observation(f"node{b}", pb, f"id-{b}-{pb}", [f"id-{a}-{pa}"], rdma=f"rdma_{pb}"))
    return build_plan([f"node{i}" for i in range(1, n + 1)], obs, network, backend, rdma).as_dict()


# A ring cabled node1 - node3 - node2 - node4 - node1. Cable order (sorted by ends) and /30s:
#   node1:tb0 .1 <-> node3:tb0 .2   10.50.0.0/30
#   node1:tb1 .5 <-> node4:tb1 .6   10.50.0.4/30
#   node2:tb0 .9 <-> node3:tb1 .10  10.50.0.8/30
#   node2:tb1 .13 <-> node4:tb0 .14 10.50.0.12/30
RING = [(1, 3), (3, 2), (2, 4), (4, 1)]


def test_ring_order_follows_the_cabling_and_ips_face_the_left_neighbour():
    plan = plan_of(RING, 4)
    assert plan["ring"] == ["node1", "node3", "node2", "node4"]
    mlx = hostfiles.mlx_hostfile(plan, SSH)
    assert mlx == {
        "backend": "ring",
        "envs": [],
        "hosts": [
            {"ssh": "10.9.0.1", "ips": ["10.50.0.5"]},  # node1, left neighbour node4
            {"ssh": "10.9.0.3", "ips": ["10.50.0.2"]},  # node3, left node1
            {"ssh": "10.9.0.2", "ips": ["10.50.0.9"]},  # node2, left node3
            {"ssh": "10.9.0.4", "ips": ["10.50.0.14"]},  # node4, left node2
        ],
    }
    # mlx.launch numbers one port per (rank, ip, connection) from the starting port.
    assert hostfiles.mlx_ring_runtime(mlx, 5000) == [
        ["10.50.0.5:5000"],
        ["10.50.0.2:5001"],
        ["10.50.0.9:5002"],
        ["10.50.0.14:5003"],
    ]
    assert hostfiles.mlx_ring_runtime(mlx, 5000, connections_per_ip=2)[1] == ["10.50.0.2:5002", "10.50.0.2:5003"]


def test_mesh_uses_name_order_and_the_cable_to_the_left():
    plan = plan_of([(1, 2), (1, 3), (1, 4), (2, 3), (2, 4), (3, 4)], 4)
    # cables in order: 1-2 .0/30, 1-3 .4/30, 1-4 .8/30, 2-3 .12/30, 2-4 .16/30, 3-4 .20/30
    mlx = hostfiles.mlx_hostfile(plan, SSH)
    assert [h["ips"] for h in mlx["hosts"]] == [["10.50.0.9"], ["10.50.0.2"], ["10.50.0.14"], ["10.50.0.22"]]


def test_doubled_ring_gives_two_ips_per_host():
    plan = plan_of([(1, 2), (1, 2), (2, 3), (2, 3), (3, 1), (3, 1)], 3)
    assert len(plan["rings"]) == 2
    mlx = hostfiles.mlx_hostfile(plan, SSH)
    # node1's cables to node3 (its left): node1:tb2 <-> node3:tb2 (.8/30), node1:tb3 <-> node3:tb3 (.12/30)
    assert mlx["hosts"][0]["ips"] == ["10.50.0.9", "10.50.0.13"]
    assert all(len(h["ips"]) == 2 for h in mlx["hosts"])
    runtime = hostfiles.mlx_ring_runtime(mlx)
    assert runtime[0] == ["10.50.0.9:32323", "10.50.0.13:32324"]
    assert runtime[2][1].endswith(":32328")


def test_two_hosts_one_cable_is_a_ring_of_two():
    plan = plan_of([(1, 2)], 2)
    assert plan["backend"] == "ring"
    mlx = hostfiles.mlx_hostfile(plan, SSH)
    assert [h["ips"] for h in mlx["hosts"]] == [["10.50.0.1"], ["10.50.0.2"]]


def test_jaccl_rdma_matrix_and_coordinator():
    plan = plan_of([(1, 2), (1, 3), (2, 3)], 3, rdma=True)
    assert plan["backend"] == "jaccl"
    mlx = hostfiles.mlx_hostfile(plan, SSH)
    assert mlx["backend"] == "jaccl"
    assert mlx["hosts"][0]["ips"] == ["10.9.0.1"]  # the coordinator: rank 0's management address
    assert [h["rdma"] for h in mlx["hosts"]] == [
        [None, "rdma_tb0", "rdma_tb1"],
        ["rdma_tb0", None, "rdma_tb1"],
        ["rdma_tb0", "rdma_tb1", None],
    ]
    files, skipped = hostfiles.render(plan, SSH, {}, "c")
    assert "mlx-ring.json" not in files
    assert "RDMA" in skipped["mlx-ring.json"]


def test_jaccl_ring_leaves_non_neighbours_null():
    plan = plan_of([(1, 2), (1, 3), (1, 4), (2, 3), (2, 4), (3, 4)], 4, backend="jaccl-ring", rdma=True)
    rows = [h["rdma"] for h in hostfiles.mlx_hostfile(plan, SSH)["hosts"]]
    assert rows[0] == [None, "rdma_tb0", None, "rdma_tb2"]
    assert rows[1] == ["rdma_tb0", None, "rdma_tb1", None]


def test_no_ring_skips_mlx_but_writes_the_rest():
    plan = plan_of([(1, 2), (2, 3)], 3)
    files, skipped = hostfiles.render(plan, SSH, {}, "c")
    assert "mlx-hostfile.json" not in files and "mlx-ring.json" not in files
    assert skipped["mlx-hostfile.json"] == "no ring through every host (MLX needs one)"
    assert {"mpi-hostfile", "meshccl.json", "manifest.json", "torch/node1.env"} <= set(files)


def test_mpi_and_torch_env_follow_ring_order_and_quote_nccl():
    plan = plan_of(RING, 4)
    nccl = {"node2": {"NCCL_SOCKET_IFNAME": "=tb0,tb1", "NCCL_IB_DISABLE": "1"}}
    files, _ = hostfiles.render(plan, SSH, nccl, "c", ranks_per_host=2)
    assert files["mpi-hostfile"].splitlines()[1:] == [
        "10.9.0.1 slots=2",
        "10.9.0.3 slots=2",
        "10.9.0.2 slots=2",
        "10.9.0.4 slots=2",
    ]
    env = dict(
        line.split("=", 1) for line in files["torch/node2.env"].splitlines() if line and not line.startswith("#")
    )
    assert env["MASTER_ADDR"] == "10.9.0.1"
    assert env["NODE_RANK"] == "2"  # third in ring order
    assert env["WORLD_SIZE"] == "8"
    assert env["NPROC_PER_NODE"] == "2"
    assert "RANK" not in env  # torchrun sets it per process when there are several per host
    assert shlex.split(env["NCCL_SOCKET_IFNAME"]) == ["=tb0,tb1"]
    host_files, _ = hostfiles.render(plan, SSH, nccl, "c", ranks_per_host=2, host="node2")
    assert host_files["torch.env"] == files["torch/node2.env"]
    assert not any(name.startswith("torch/") for name in host_files)


def test_meshccl_file_lists_every_cable_of_every_rank():
    plan = plan_of([(1, 2), (1, 2), (2, 3), (3, 1)], 3)
    data = hostfiles.meshccl_hostfile(plan, SSH, 2, 29600, "c", hostfiles.fingerprint(plan))
    assert data["format"] == "meshccl-hostfile" and data["version"] == 1
    assert data["world_size"] == 6
    assert [(r["rank"], r["host"], r["local_rank"], r["port"]) for r in data["ranks"][:3]] == [
        (0, "node1", 0, 29600),
        (1, "node1", 1, 29601),
        (2, "node2", 0, 29600),
    ]
    node1 = data["ranks"][0]["links"]
    assert [(x["port"], x["address"], x["peer_host"], x["peer_address"]) for x in node1] == [
        ("tb0", "10.50.0.1", "node2", "10.50.0.2"),
        ("tb1", "10.50.0.5", "node2", "10.50.0.6"),
        ("tb2", "10.50.0.9", "node3", "10.50.0.10"),
    ]
    assert data["hosts"]["node2"] == {"management": "10.9.0.2", "ranks": [2, 3]}


def test_fingerprint_changes_with_the_cabling_only():
    a = plan_of(RING, 4)
    same = json.loads(json.dumps(a))
    same["backend_reason"] = "anything"
    assert hostfiles.fingerprint(same) == hostfiles.fingerprint(a)
    b = plan_of([*RING, (1, 2)], 4)
    assert hostfiles.fingerprint(b) != hostfiles.fingerprint(a)


def test_staleness_tells_older_cabling_from_hand_edits():
    plan = plan_of(RING, 4)
    files, _ = hostfiles.render(plan, SSH, {}, "c")
    fp = hostfiles.fingerprint(plan)
    assert hostfiles.staleness(files["manifest.json"], files, fp) is None
    assert hostfiles.staleness(None, {}, fp) is None
    older = hostfiles.render(plan_of(RING[:3], 4), SSH, {}, "c")[0]["manifest.json"]
    assert hostfiles.staleness(older, files, fp).startswith("made from an older cabling (sha256:")
    edited = dict(files, **{"mpi-hostfile": files["mpi-hostfile"] + "extra slots=1\n"})
    assert (
        hostfiles.staleness(files["manifest.json"], edited, fp)
        == "mpi-hostfile was edited by hand since it was written"
    )


# ---- the module --------------------------------------------------------------------------


@pytest.fixture
def module(monkeypatch):
    patch_exits(monkeypatch)
    # The ports come from the inventory (setup.yml passes them; the module has no defaults of its own).
    ports = {"master_port": 29500, "meshccl_port": 29600}
    return lambda check=False, **args: run_module(hostfiles_module, ports | args, check)


def test_module_writes_once_then_is_idempotent_then_detects_an_older_cabling(module, tmp_path):
    args = {"plan": plan_of(RING, 4), "dest": str(tmp_path), "cluster": "c", "ssh": SSH}
    ok, out = module(check=True, **args)
    assert ok and out["changed"] and not list(tmp_path.iterdir())  # check mode writes nothing
    ok, out = module(**args)
    assert ok and out["changed"] and out["stale"] == ""
    names = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert names == sorted(
        [
            "manifest.json",
            "meshccl.json",
            "mlx-hostfile.json",
            "mlx-ring.json",
            "mpi-hostfile",
            "torch/node1.env",
            "torch/node2.env",
            "torch/node3.env",
            "torch/node4.env",
        ]
    )
    ok, out = module(**args)
    assert ok and not out["changed"]
    ok, out = module(state="verify", **args)
    assert ok and not out["changed"]

    # The cabling changes (node1 <-> node4 pulled): the set on disk is stale, verify says so...
    broken = dict(args, plan=plan_of(RING[:3], 4))
    ok, out = module(state="verify", **broken)
    assert not ok
    assert "are not current: made from an older cabling" in out["msg"]
    # ...and writing replaces it, removing the MLX files a line of hosts cannot use.
    ok, out = module(**broken)
    assert ok and out["changed"] and out["stale"].startswith("made from an older cabling")
    assert not (tmp_path / "mlx-hostfile.json").exists()
    assert json.loads((tmp_path / "manifest.json").read_text())["fingerprint"] == out["fingerprint"]


def test_module_verify_fails_on_a_hand_edit_and_unknown_host(module, tmp_path):
    args = {"plan": plan_of(RING, 4), "dest": str(tmp_path), "cluster": "c", "host": "node3"}
    assert module(**args)[0]
    assert (tmp_path / "torch.env").exists()
    (tmp_path / "mpi-hostfile").write_text("node9 slots=64\n")
    ok, out = module(state="verify", **args)
    assert not ok and "mpi-hostfile was edited by hand" in out["msg"]
    ok, out = module(**dict(args, host="node9"))
    assert not ok and out["msg"].startswith("host node9 is not in the plan")
