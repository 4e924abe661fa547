"""meshccl under Slurm: a task that srun started finds its rank from Slurm's environment and
meshkit's meshccl.json. The node lists are expanded by the real `scontrol show hostnames` (Slurm's
client, with a slurm.conf of the test's own: no daemon is needed), and real jobs run on loopback
with each task given the environment srun gives it."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import meshccl
import pytest
from meshccl import bootstrap
from meshccl.bootstrap import expand_nodelist, job_id_from_env, parse_tasks_per_node, plan_from_env

from . import helpers as h

RING4 = [(1, 3), (3, 2), (2, 4), (4, 1)]  # ring order node1 node3 node2 node4
MESH4 = [(a, b) for a in range(1, 5) for b in range(a + 1, 5)]  # ring order node1 .. node4


@pytest.fixture
def slurm_conf(tmp_path: Path) -> Path:
    """A minimal slurm.conf: enough for scontrol to expand node lists, no daemon. Tests that use
    it need Slurm's scontrol (slurm-client, in scripts/system-deps; not on a Mac)."""
    if shutil.which("scontrol") is None:
        pytest.skip("needs Slurm's scontrol (Debian/Ubuntu: slurm-client)")
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        textwrap.dedent(
            """\
            ClusterName=meshtest
            SlurmctldHost=localhost
            NodeName=node[1-6] CPUs=2 State=UNKNOWN
            PartitionName=all Nodes=ALL Default=YES State=UP
            """
        )
    )
    return conf


def hostfile(tmp_path: Path, pairs, hosts: int, per_host: int = 1) -> Path:
    """meshkit's meshccl.json for cables between host numbers, addresses on loopback."""
    return h.meshccl_hostfile(tmp_path, pairs, hosts, per_host)


def loopback_hostfile(tmp_path: Path, pairs, hosts: int, per_host: int) -> Path:
    """As hostfile(), for a real job: "hosts" simulated on one machine share 127.0.0.1, where
    ranks of one host meet, so each host gets its own free port range (a real cluster's hosts
    each have their own loopback, and meshkit writes one range for all)."""
    path = hostfile(tmp_path, pairs, hosts, per_host)
    data = json.loads(path.read_text())
    base = h.free_port_block(len(data["ranks"]))
    order = {host: i for i, host in enumerate(data["hosts"])}
    for rank in data["ranks"]:
        rank["port"] = base + order[rank["host"]] * per_host + rank["local_rank"]
    path.write_text(json.dumps(data))
    return path


def task_env(
    conf: Path,
    path: Path | None,
    nodelist: str,
    tasks_per_node: str,
    ntasks: int,
    node: str,
    local: int,
    procid: int = 0,
    job: str = "4242",
    step: str = "0",
) -> dict[str, str]:
    """The environment srun gives one task of a step (the variables meshccl reads, and the
    obsolete/job-level twins srun also sets)."""
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "SLURM_CONF": str(conf),
        "SLURM_JOB_ID": job,
        "SLURM_STEP_ID": step,
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(local),
        "SLURMD_NODENAME": node,
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_TASKS_PER_NODE": tasks_per_node,
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NTASKS": str(ntasks),
    }
    if path is not None:
        env["MESHCCL_HOSTFILE"] = str(path)
    return env


def block_tasks(nodes: list[str], counts: list[int]) -> list[tuple[str, int, int]]:
    """(node, local id, SLURM_PROCID) of every task as Slurm's default block distribution
    numbers them: node by node in Slurm's node order."""
    out = []
    for node, count in zip(nodes, counts, strict=True):
        for local in range(count):
            out.append((node, local, len(out)))
    return out


def plans(conf, path, nodelist, tpn, nodes, counts, **kw) -> dict[tuple[str, int], meshccl.Plan]:
    """Every task's plan of one step, keyed by (node, local id)."""
    n = sum(counts)
    return {
        (node, local): plan_from_env(task_env(conf, path, nodelist, tpn, n, node, local, procid, **kw), token=h.TOKEN)
        for node, local, procid in block_tasks(nodes, counts)
    }


# --- the pieces ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "counts"),
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,2(x2),3", [1, 2, 2, 3]), ("10(x2)", [10, 10])],
)
def test_slurms_compressed_task_counts(text, counts):
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x0)", "2(3)", "x2", "2(x2", "two", "2,,1"])
def test_malformed_task_counts_are_refused_naming_the_variable(text):
    with pytest.raises(meshccl.BootstrapError, match=r"^SLURM_TASKS_PER_NODE=.*not a task count in Slurm's form"):
        parse_tasks_per_node(text, "SLURM_TASKS_PER_NODE")


def test_scontrol_expands_node_lists_in_slurms_order(slurm_conf):
    env = {"PATH": os.environ["PATH"], "SLURM_CONF": str(slurm_conf)}
    assert expand_nodelist("node[3-4,1],node6", env) == ["node3", "node4", "node1", "node6"]
    # a list without ranges needs no scontrol
    assert expand_nodelist("node2,node1", {"PATH": ""}) == ["node2", "node1"]


# --- the layout ---------------------------------------------------------------------------------


def test_two_hosts_two_tasks_each(tmp_path, slurm_conf):
    path = hostfile(tmp_path, [(1, 2)], 2, per_host=2)
    data = json.loads(path.read_text())
    port = data["ranks"][0]["port"]
    got = plans(slurm_conf, path, "node[1-2]", "2(x2)", ["node1", "node2"], [2, 2])
    assert {k: p.rank for k, p in got.items()} == {("node1", 0): 0, ("node1", 1): 1, ("node2", 0): 2, ("node2", 1): 3}
    assert all(p.size == 4 for p in got.values())
    p = got[("node2", 1)]
    assert sorted(p.listen) == sorted([("127.64.0.2", port + 1), ("127.0.0.1", port + 1)])
    assert p.peers[2] == ([("127.0.0.1", port)], -1)  # its host's other task
    assert p.peers[0] == ([("127.64.0.1", port)], -1)  # node1's first task, across the cable
    assert p.same_host == {2}
    assert p.source == f"{path} under Slurm job 4242 step 0 (hosts node1, node2)"
    # the same layout as meshkit's own hostfile gives MESHCCL_RANK = r
    for r in range(4):
        mine = meshccl.plan_from_meshccl_hostfile(data, r)
        slurm = next(x for x in got.values() if x.rank == r)
        assert (sorted(slurm.listen), slurm.peers, slurm.ring, slurm.complete) == (
            sorted(mine.listen),
            mine.peers,
            mine.ring,
            mine.complete,
        )


def test_ranks_follow_the_ring_order_not_slurms_numbering(tmp_path, slurm_conf):
    # Slurm orders node[1-4] by name and numbers tasks block-wise; the cables run node1 node3 node2 node4.
    path = hostfile(tmp_path, RING4, 4, per_host=2)
    nodes = ["node1", "node2", "node3", "node4"]
    got = plans(slurm_conf, path, "node[1-4]", "2(x4)", nodes, [2] * 4)
    ring_index = {"node1": 0, "node3": 1, "node2": 2, "node4": 3}
    assert {k: p.rank for k, p in got.items()} == {(n, i): 2 * ring_index[n] + i for n in nodes for i in (0, 1)}
    procid = {(n, i): p for n, i, p in block_tasks(nodes, [2] * 4)}
    assert procid[("node2", 0)] == 2 and got[("node2", 0)].rank == 4  # Slurm task 2 is meshccl rank 4
    assert all(p.ring and not p.complete and p.size == 8 for p in got.values())


def test_uneven_task_counts(tmp_path, slurm_conf):
    path = hostfile(tmp_path, RING4, 4)  # one rank per host in the file; the step asks for more on some
    port = json.loads(path.read_text())["ranks"][0]["port"]
    nodes = ["node1", "node2", "node3", "node4"]
    counts = [2, 2, 1, 1]
    got = plans(slurm_conf, path, "node[1-4]", "2(x2),1(x2)", nodes, counts)
    # ring order node1 (2) node3 (1) node2 (2) node4 (1)
    assert {k: p.rank for k, p in got.items()} == {
        ("node1", 0): 0,
        ("node1", 1): 1,
        ("node3", 0): 2,
        ("node2", 0): 3,
        ("node2", 1): 4,
        ("node4", 0): 5,
    }
    assert all(p.size == 6 and p.ring for p in got.values())
    # local rank l listens on the host's lowest port + l
    assert {port_ for _a, port_ in got[("node2", 1)].listen} == {port + 1}
    assert {port_ for _a, port_ in got[("node3", 0)].listen} == {port}


def test_a_step_on_part_of_the_hosts(tmp_path, slurm_conf):
    # Three hosts of a 4-host mesh still form a mesh.
    path = hostfile(tmp_path, MESH4, 4)
    got = plans(slurm_conf, path, "node[1,3-4]", "1(x3)", ["node1", "node3", "node4"], [1, 1, 1])
    assert {k[0]: p.rank for k, p in got.items()} == {"node1": 0, "node3": 1, "node4": 2}
    assert all(p.complete and p.size == 3 for p in got.values())
    # Two neighbours of a 4-host ring form a ring of two.
    path = hostfile(tmp_path, RING4, 4)
    got = plans(slurm_conf, path, "node[2-3]", "1(x2)", ["node2", "node3"], [1, 1])
    assert {k[0]: p.rank for k, p in got.items()} == {"node3": 0, "node2": 1}  # ring order: node3 before node2
    assert all(p.ring and p.size == 2 for p in got.values())
    # node1 and node2 share no cable in the ring: no job can run over them.
    with pytest.raises(meshccl.BootstrapError) as err:
        plan_from_env(task_env(slurm_conf, path, "node[1-2]", "1(x2)", 2, "node1", 0), token=h.TOKEN)
    assert str(err.value) == (
        f"{path} under Slurm job 4242 step 0 (hosts node1, node2): the cables form neither a ring through the "
        "ranks in order nor a full mesh"
    )


def test_job_level_variables_stand_in_for_the_steps(tmp_path, slurm_conf):
    path = hostfile(tmp_path, RING4, 4)
    env = task_env(slurm_conf, path, "node[1-4]", "1(x4)", 4, "node2", 0)
    for name in ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS"):
        del env[name]
    assert plan_from_env(env, token=h.TOKEN).rank == 2
    # the step's own win over the job's (srun --preserve-env keeps the job's)
    env = task_env(slurm_conf, path, "node[1-4]", "1(x4)", 4, "node2", 0)
    env.update(SLURM_JOB_NODELIST="node[1-6]", SLURM_TASKS_PER_NODE="2(x6)", SLURM_NTASKS="12")
    plan = plan_from_env(env, token=h.TOKEN)
    assert (plan.rank, plan.size) == (2, 4)


def test_meshkits_default_hostfile_path(tmp_path, slurm_conf, monkeypatch):
    path = hostfile(tmp_path, RING4, 4)
    env = task_env(slurm_conf, None, "node[1-4]", "1(x4)", 4, "node4", 0)
    monkeypatch.setattr(bootstrap.slurm, "MESHKIT_HOSTFILE", str(path))  # where plan_from_slurm reads it
    plan = plan_from_env(env, token=h.TOKEN)
    assert plan.rank == 3 and plan.source.startswith(f"{path} under Slurm job 4242")
    missing = tmp_path / "nowhere" / "meshccl.json"
    monkeypatch.setattr(bootstrap.slurm, "MESHKIT_HOSTFILE", str(missing))
    with pytest.raises(meshccl.BootstrapError) as err:
        plan_from_env(env, token=h.TOKEN)
    assert f"{missing} does not exist on this node; set MESHCCL_HOSTFILE" in str(err.value)
    assert "<meshkit_state_dir>/hostfiles/meshccl.json" in str(err.value)


# --- errors -------------------------------------------------------------------------------------


def slurm_error(env: dict[str, str]) -> str:
    with pytest.raises(meshccl.BootstrapError) as err:
        plan_from_env(env, token=h.TOKEN)
    return str(err.value)


def test_a_step_node_the_hostfile_does_not_list(tmp_path, slurm_conf):
    path = hostfile(tmp_path, RING4, 4)
    env = task_env(slurm_conf, path, "node[1-5]", "1(x5)", 5, "node1", 0)
    assert slurm_error(env) == (
        "Slurm runs this step on node(s) node5 (SLURM_STEP_NODELIST='node[1-5]'), which "
        f"{path} does not list: its hosts are node1, node3, node2, node4. Slurm's node names must be the hosts' "
        "names in meshkit's inventory; run the job on those hosts only (srun -w / --nodelist)"
    )


def test_this_tasks_node_and_local_id(tmp_path, slurm_conf):
    path = hostfile(tmp_path, RING4, 4)
    env = task_env(slurm_conf, path, "node[1-4]", "2,1(x3)", 5, "node1", 0)
    del env["SLURMD_NODENAME"]
    assert slurm_error(env).startswith("SLURMD_NODENAME is not set")
    env["SLURMD_NODENAME"] = "node6"
    assert slurm_error(env) == (
        "SLURMD_NODENAME=node6 is not one of the step's nodes (SLURM_STEP_NODELIST='node[1-4]': node1, node2, node3, "
        "node4)"
    )
    env["SLURMD_NODENAME"] = "node3"
    env["SLURM_LOCALID"] = "1"
    assert slurm_error(env) == (
        "SLURM_LOCALID=1 but the step has 1 task(s) on node node3 (SLURM_STEP_TASKS_PER_NODE='2,1(x3)'): local ids "
        "run 0..0"
    )
    env["SLURM_LOCALID"] = "one"
    assert slurm_error(env) == "SLURM_LOCALID='one' is not an integer"
    del env["SLURM_LOCALID"]
    assert slurm_error(env).startswith("SLURM_LOCALID is not set")


def test_counts_that_do_not_describe_the_step(tmp_path, slurm_conf):
    path = hostfile(tmp_path, RING4, 4)
    env = task_env(slurm_conf, path, "node[1-4]", "2(x4)", 6, "node1", 0)
    assert slurm_error(env) == (
        "SLURM_STEP_TASKS_PER_NODE='2(x4)' adds up to 8 task(s) but SLURM_STEP_NUM_TASKS=6: the two must describe "
        "the same step"
    )
    env = task_env(slurm_conf, path, "node[1-4]", "2(x3)", 6, "node1", 0)
    assert slurm_error(env) == (
        "SLURM_STEP_TASKS_PER_NODE='2(x3)' gives task counts for 3 node(s) but SLURM_STEP_NODELIST='node[1-4]' "
        "names 4: node1, node2, node3, node4"
    )
    env = task_env(slurm_conf, path, "node[1-4]", "1(x4)", 4, "node1", 0)
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        del env[name]
    assert slurm_error(env) == (
        "under Slurm (SLURM_PROCID='0') meshccl needs SLURM_STEP_NODELIST or SLURM_JOB_NODELIST, which srun sets for "
        "every task: start the program with srun"
    )


def test_meshccl_world_size_must_agree(tmp_path, slurm_conf):
    path = hostfile(tmp_path, RING4, 4)
    env = task_env(slurm_conf, path, "node[1-4]", "1(x4)", 4, "node1", 0)
    env["MESHCCL_WORLD_SIZE"] = "3"
    assert slurm_error(env) == (
        f"MESHCCL_WORLD_SIZE=3 but {path} under Slurm job 4242 step 0 (hosts node1, node3, node2, node4) "
        "describes 4 ranks"
    )


def test_scontrol_missing_or_failing(tmp_path, slurm_conf):
    path = hostfile(tmp_path, RING4, 4)
    empty = tmp_path / "bin"
    empty.mkdir()
    env = task_env(slurm_conf, path, "node[1-4]", "1(x4)", 4, "node1", 0)
    env["PATH"] = str(empty)
    assert slurm_error(env).startswith(
        f"cannot expand SLURM_STEP_NODELIST='node[1-4]': scontrol is not on PATH ('{empty}'); install Slurm's client "
        "commands"
    )
    bad = tmp_path / "bad.conf"
    bad.write_text("this is not slurm.conf\n")
    env = task_env(bad, path, "node[1-4]", "1(x4)", 4, "node1", 0)
    msg = slurm_error(env)
    assert msg.startswith(
        "`scontrol show hostnames node[1-4]` (expanding SLURM_STEP_NODELIST) failed with exit status 1"
    )
    assert f'Parse error in file {bad} line 1: "this is not slurm.conf"' in msg  # scontrol's own words
    # a missing SLURM_CONF is named at once (scontrol itself would retry it for a minute)
    env = task_env(tmp_path / "absent.conf", path, "node[1-4]", "1(x4)", 4, "node1", 0)
    assert slurm_error(env) == (
        f"SLURM_CONF={tmp_path / 'absent.conf'} is not a file: scontrol needs Slurm's configuration to expand "
        "SLURM_STEP_NODELIST='node[1-4]'"
    )


# --- which convention wins ----------------------------------------------------------------------


def test_meshccl_rank_wins_over_slurm(tmp_path, slurm_conf):
    path = hostfile(tmp_path, RING4, 4)
    env = task_env(slurm_conf, path, "node[1-4]", "1(x4)", 4, "node1", 0)
    env["MESHCCL_RANK"] = "3"
    plan = plan_from_env(env, token=h.TOKEN)
    assert (plan.rank, plan.source) == (3, str(path))


def test_torchrun_and_mlx_win_over_slurm(tmp_path, slurm_conf):
    # torchrun started by srun: its workers carry both; torchrun's numbering is the one they use.
    path = hostfile(tmp_path, RING4, 4)
    env = task_env(slurm_conf, path, "node[1-4]", "1(x4)", 4, "node2", 0)
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    plan = plan_from_env(env, token=h.TOKEN)
    assert (plan.rank, plan.size, plan.source) == (0, 1, "torchrun")
    mlx = tmp_path / "mlx-ring.json"
    mlx.write_text(json.dumps([["127.64.0.1:5000"], ["127.64.0.2:5001"]]))
    env = task_env(slurm_conf, path, "node[1-4]", "1(x4)", 4, "node2", 0)
    env.update(MLX_RANK="1", MLX_HOSTFILE=str(mlx))
    plan = plan_from_env(env, token=h.TOKEN)
    assert (plan.rank, plan.size, plan.source) == (1, 2, str(mlx))


def test_meshccl_hostfile_alone_outside_slurm_still_asks_for_the_rank(tmp_path):
    path = hostfile(tmp_path, RING4, 4)
    with pytest.raises(meshccl.BootstrapError, match=r"^set both MESHCCL_RANK and MESHCCL_HOSTFILE"):
        plan_from_env({"MESHCCL_HOSTFILE": str(path)}, token=h.TOKEN)


def test_the_token_rule_holds_under_slurm(tmp_path, slurm_conf):
    path = hostfile(tmp_path, RING4, 4)
    env = task_env(slurm_conf, path, "node[1-4]", "1(x4)", 4, "node1", 0)
    with pytest.raises(meshccl.AuthError, match=r"^rank 0 of 4: no job token"):
        plan_from_env(env)
    assert plan_from_env(env, allow_no_token=True).size == 4
    one = task_env(slurm_conf, path, "node1", "1", 1, "node1", 0)
    assert plan_from_env(one).size == 1  # one rank needs none


def test_job_id_from_slurm():
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"}
    assert job_id_from_env(slurm) == "slurm-4242.3"
    assert job_id_from_env({**slurm, "TORCHELASTIC_RUN_ID": "tr"}) == "tr"
    assert job_id_from_env({**slurm, "MESHCCL_JOB_ID": "mk", "TORCHELASTIC_RUN_ID": "tr"}) == "mk"
    assert job_id_from_env({"SLURM_JOB_ID": "4242"}) == ""  # the batch script itself: no step
    assert job_id_from_env({}) == ""


# --- real jobs ----------------------------------------------------------------------------------

WORKER = """\
import json, os, sys
import meshccl
import numpy as np

try:
    comm = meshccl.init()
    r, n = comm.rank, comm.size
    x = (r + 1) * (1 + np.arange(1001, dtype=np.int64))
    comm.all_reduce(x)
    procids = comm.all_gather(np.array([int(os.environ["SLURM_PROCID"])], dtype=np.int64))
    print("RESULT " + json.dumps({"rank": r, "size": n, "sum": x.tolist(), "procids": procids.tolist(),
                                  "source": comm.plan.source}), flush=True)
    comm.close()
except meshccl.Error as e:
    print(f"ERROR {type(e).__name__}: {e}", flush=True)
    sys.exit(3)
"""


@pytest.mark.parametrize(
    ("numbering", "counts"),
    [
        ("block", [2, 2, 2, 2]),  # Slurm's default: tasks numbered node by node in name order
        ("ring", [2, 1, 2, 1]),  # meshkit launch's: SLURM_HOSTFILE + --distribution=arbitrary in ring order
    ],
)
def test_a_job_started_as_srun_starts_it(tmp_path, slurm_conf, numbering, counts):
    """Every task gets what srun gives it (the same MESHCCL_HOSTFILE and token, its own
    SLURM_PROCID, SLURM_LOCALID and SLURMD_NODENAME); each "host" listens on its own cable
    addresses on loopback."""
    path = loopback_hostfile(tmp_path, RING4, 4, per_host=2)
    worker = tmp_path / "slurm_worker.py"
    worker.write_text(WORKER)
    nodes = ["node1", "node2", "node3", "node4"]
    ring = ["node1", "node3", "node2", "node4"]
    per_node = dict(zip(nodes, counts, strict=True))
    tpn = ",".join(str(c) for c in counts)
    if numbering == "block":
        tasks = block_tasks(nodes, counts)
    else:
        tasks = [
            (n, local, procid) for procid, (n, local) in enumerate((n, i) for n in ring for i in range(per_node[n]))
        ]
    want_rank = {}
    for n in ring:
        for local in range(per_node[n]):
            want_rank[(n, local)] = len(want_rank)
    size = sum(counts)
    envs = [task_env(slurm_conf, path, "node[1-4]", tpn, size, n, local, procid) for n, local, procid in tasks]
    procs = h.spawn(len(envs), "unused", lambda i: envs[i], worker=worker)
    results = h.finish(procs, timeout=120)
    got = []
    for (n, local, procid), (code, out, err) in zip(tasks, results, strict=True):
        assert code == 0, f"task {procid} ({n} local {local}) exit {code}\nstdout: {out}\nstderr: {err}"
        got.append(json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:]))
    want_sum = [size * (size + 1) // 2 * (1 + i) for i in range(1001)]
    by_rank = {}
    for (n, local, procid), g in zip(tasks, got, strict=True):
        assert g["rank"] == want_rank[(n, local)], (n, local, procid, g["rank"])
        assert g["size"] == size
        assert g["sum"] == want_sum
        assert g["source"].startswith(f"{path} under Slurm job 4242 step 0")
        by_rank[g["rank"]] = procid
    # every rank agrees which Slurm task holds which meshccl rank
    assert all(g["procids"] == [by_rank[r] for r in range(size)] for g in got)
    if numbering == "ring":
        assert all(g["procids"] == list(range(size)) for g in got)  # meshccl rank == SLURM_PROCID
    else:
        assert got[0]["procids"] != list(range(size))  # the two numberings differ, and that is fine


def test_a_task_of_another_step_cannot_join(tmp_path, slurm_conf):
    """The job id (slurm-<job>.<step>) is bound into the token proofs: a task whose step differs is
    refused even with the right token."""
    path = hostfile(tmp_path, [(1, 2)], 2)
    worker = tmp_path / "slurm_worker.py"
    worker.write_text(WORKER)
    envs = [
        {**task_env(slurm_conf, path, "node[1-2]", "1(x2)", 2, "node1", 0, 0), "MESHCCL_CONNECT_TIMEOUT": "5"},
        {
            **task_env(slurm_conf, path, "node[1-2]", "1(x2)", 2, "node2", 0, 1, step="1"),
            "MESHCCL_CONNECT_TIMEOUT": "5",
        },
    ]
    results = h.finish(h.spawn(2, "unused", lambda i: envs[i], worker=worker), timeout=60)
    assert [code for code, _out, _err in results] == [3, 3], results
    (_c0, _out0, err0), (_c1, out1, _err1) = results
    assert "claims to be rank 1 but could not prove the job token" in err0, results
    assert out1.startswith("ERROR AuthError: rank 1: rank 0 at "), results
    assert "different MESHCCL_TOKEN values or job ids" in out1, results
