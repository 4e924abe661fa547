"""A launch planned from the one topology model: the launch variables checked and named, ranks in ring
order with their environment per runtime (meshccl, MLX ring / JACCL, PyTorch, plain), the files each
host gets and the ports it must have free; staleness, torch.env's NCCL variables, preflight results
across hosts. (The preflight itself on this machine: test_agent_preflight.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import hostfiles

from meshkit.launch_plan import (
    LaunchError,
    build,
    nccl_from_env_file,
    preflight_problems,
    stale_hosts,
    validate,
)

from .test_hostfiles import plan_of

SSH = {f"node{i}": f"10.9.0.{i}" for i in range(1, 6)}
STATE = "/var/lib/meshkit/"
JOB = "job-1"
JOB_DIR = "/var/lib/meshkit/jobs/job-1"


# A ring cabled node1 - node3 - node2 - node4 - node1 (as in test_hostfiles). Cables and /30s:
#   node1:tb0 .1 <-> node3:tb0 .2    node1:tb1 .5 <-> node4:tb1 .6
#   node2:tb0 .9 <-> node3:tb1 .10   node2:tb1 .13 <-> node4:tb0 .14
RING = [(1, 3), (3, 2), (2, 4), (4, 1)]
ORDER = ["node1", "node3", "node2", "node4"]
MESH = [(1, 2), (1, 3), (1, 4), (2, 3), (2, 4), (3, 4)]


@pytest.fixture(scope="module")
def ring() -> dict[str, Any]:
    return plan_of(RING, 4)


def settings(**given: Any) -> dict[str, Any]:
    return validate({"program": "python3 /shared/train.py --epochs 1", **given})


def plan_job(plan: dict[str, Any], **given: Any) -> Any:
    extra = {k: given.pop(k) for k in ("nccl", "management_interface", "master_port", "meshccl_port") if k in given}
    return build(plan, settings(**given), job_id=JOB, state_dir=STATE, cluster="c", ssh=SSH, **extra)


# ---- validate ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "named", "says"),
    [
        ({"program": "x", "ranks_per_host": 0}, "launch_ranks_per_host = 0", "min value is 1"),
        ({"program": "x", "ranks_per_host": 257}, "launch_ranks_per_host = 257", "max value is 256"),
        ({"program": "x", "runtime": "bogus"}, "launch_runtime = 'bogus'", "use one of meshccl, mlx, torch, mpi"),
        ({}, "launch_program = None", "required field"),
        ({"program": ""}, "launch_program = ''", "empty values not allowed"),
        ({"program": "x", "env": {"1BAD": "v"}}, "launch_env = {'1BAD': 'v'}", "does not match regex"),
        ({"program": "x", "env": {"BAD-NAME": "v"}}, "launch_env", "does not match regex"),
        ({"program": "x", "grace": 500}, "launch_grace = 500", "max value is 120"),
        ({"program": "x", "timeout": -1}, "launch_timeout = -1", "min value is 0"),
        ({"program": "x", "host_timeout": 0}, "launch_host_timeout = 0", "min value is 1"),
        ({"program": "x", "host_timeout": "soon"}, "launch_host_timeout = 'soon'", "'soon': not a number; give the"),
        ({"program": "x", "ranks_per_host": "two"}, "launch_ranks_per_host = 'two'", "'two': not a whole number; use"),
        ({"program": "x", "cwd": "relative/dir"}, "launch_cwd = 'relative/dir'", "absolute directory"),
        ({"program": "x", "mlx_port": 80}, "launch_mlx_port = 80", "min value is 1024"),
    ],
)
def test_validation_errors_name_the_variable(given: dict[str, Any], named: str, says: str) -> None:
    with pytest.raises(LaunchError) as info:
        validate(given)
    text = str(info.value)
    assert text.startswith("bad launch settings; nothing was started:")
    assert named in text
    assert says in text


def test_every_bad_variable_is_named_at_once() -> None:
    with pytest.raises(LaunchError) as info:
        validate({"program": "x", "runtime": "bogus", "ranks_per_host": 0})
    lines = str(info.value).splitlines()[1:]
    assert [line.split(" = ")[0].strip(" -") for line in lines] == ["launch_ranks_per_host", "launch_runtime"]


def test_program_string_that_is_not_a_command_is_named() -> None:
    with pytest.raises(LaunchError, match=r"^launch_program = .*No closing quotation"):
        validate({"program": "python3 'unterminated"})
    with pytest.raises(LaunchError, match=r"^launch_program is empty"):
        validate({"program": "   "})


def test_program_string_is_shell_split_and_a_list_is_kept() -> None:
    out = validate({"program": 'python3 -c \'print("a b")\' --flag="x y"'})
    assert out["program"] == ["python3", "-c", 'print("a b")', "--flag=x y"]
    listed = ["python3", "it's one arg", "$HOME"]
    assert validate({"program": listed})["program"] == listed


def test_env_values_become_strings_and_numbers_are_coerced() -> None:
    out = validate(
        {
            "program": ["x"],
            "env": {"A": 1, "B": 2.5, "C": True, "D": False, "E": "text"},
            "ranks_per_host": "2",
            "timeout": 10,
            "grace": "1.5",
            "mlx_port": "40000",
            "host_timeout": "7",
        }
    )
    assert out["env"] == {"A": "1", "B": "2.5", "C": "1", "D": "0", "E": "text"}
    assert out["ranks_per_host"] == 2
    assert out["timeout"] == 10.0 and isinstance(out["timeout"], float)
    assert out["grace"] == 1.5
    assert out["mlx_port"] == 40000
    assert out["host_timeout"] == 7.0


def test_unset_variables_are_left_out_and_cwd_may_be_null() -> None:
    out = validate({"program": "x", "runtime": None, "ranks_per_host": None, "env": None, "cwd": None})
    assert out == {"program": ["x"], "cwd": None, "env": {}, "secret_env": []}


# ---- build: ranks, meshccl ---------------------------------------------------------------------


def test_world_size_and_ranks_in_ring_order_with_local_ranks_together(ring: dict[str, Any]) -> None:
    job = plan_job(ring, ranks_per_host=2)
    assert job.world_size == 8 == len(job.ranks)
    assert job.job_dir == JOB_DIR
    assert job.hosts() == ORDER
    assert [(r["rank"], r["host"], r["node_rank"], r["local_rank"]) for r in job.ranks] == [
        (0, "node1", 0, 0),
        (1, "node1", 0, 1),
        (2, "node3", 1, 0),
        (3, "node3", 1, 1),
        (4, "node2", 2, 0),
        (5, "node2", 2, 1),
        (6, "node4", 3, 0),
        (7, "node4", 3, 1),
    ]
    assert all(r["argv"] == ["python3", "/shared/train.py", "--epochs", "1"] for r in job.ranks)
    assert job.as_dict()["world_size"] == 8


def test_meshccl_is_the_default_with_its_hostfile_and_common_env(ring: dict[str, Any]) -> None:
    job = plan_job(ring, ranks_per_host=2, cwd="/shared")
    assert job.runtime == "meshccl"
    rank5 = job.ranks[5]
    assert rank5["cwd"] == "/shared"
    assert rank5["env"] == {
        "MESHKIT_JOB_ID": JOB,
        "MESHKIT_RANK": "5",
        "MESHKIT_WORLD_SIZE": "8",
        "MESHKIT_LOCAL_RANK": "1",
        "MESHKIT_HOST": "node2",
        "MESHCCL_JOB_ID": JOB,
        "MESHCCL_TOKEN": "<hidden>",  # the launcher puts a fresh one in
        "PYTHONUNBUFFERED": "1",
        "MESHCCL_RANK": "5",
        "MESHCCL_WORLD_SIZE": "8",
        "MESHCCL_HOSTFILE": f"{JOB_DIR}/meshccl.json",
    }
    assert set(job.files) == set(ORDER)
    assert all(set(files) == {"meshccl.json"} for files in job.files.values())
    text = job.files["node1"]["meshccl.json"]
    assert all(files["meshccl.json"] == text for files in job.files.values())
    doc = json.loads(text)
    assert doc["world_size"] == 8 and doc["cluster"] == "c"
    assert doc["fingerprint"] == hostfiles.fingerprint(ring)
    assert [(r["rank"], r["host"], r["port"]) for r in doc["ranks"]] == [
        (0, "node1", 29600),
        (1, "node1", 29601),
        (2, "node3", 29600),
        (3, "node3", 29601),
        (4, "node2", 29600),
        (5, "node2", 29601),
        (6, "node4", 29600),
        (7, "node4", 29601),
    ]
    assert job.notes == []


def test_meshccl_ports_are_every_link_address_and_loopback_per_rank(ring: dict[str, Any]) -> None:
    job = plan_job(ring, ranks_per_host=2, meshccl_port=31000)
    assert job.ports["node3"] == [
        ["10.50.0.2", 31000, "meshccl rank 2"],
        ["10.50.0.10", 31000, "meshccl rank 2"],
        ["127.0.0.1", 31000, "meshccl rank 2"],
        ["10.50.0.2", 31001, "meshccl rank 3"],
        ["10.50.0.10", 31001, "meshccl rank 3"],
        ["127.0.0.1", 31001, "meshccl rank 3"],
    ]
    assert set(job.ports) == set(ORDER)


def test_meshccl_with_one_rank_per_host_needs_no_loopback(ring: dict[str, Any]) -> None:
    job = plan_job(ring)
    assert job.world_size == 4
    assert job.ports["node1"] == [["10.50.0.1", 29600, "meshccl rank 0"], ["10.50.0.5", 29600, "meshccl rank 0"]]
    assert not any(address == "127.0.0.1" for entries in job.ports.values() for address, _, _ in entries)


# ---- build: torch, plain, user env -------------------------------------------------------------


def test_torch_env_master_nccl_and_gloo_interface(ring: dict[str, Any]) -> None:
    nccl = {"node2": {"NCCL_SOCKET_IFNAME": "=tb0,tb1", "NCCL_IB_DISABLE": "1"}}
    job = plan_job(
        ring,
        runtime="torch",
        ranks_per_host=2,
        nccl=nccl,
        management_interface={h: "mgmt0" for h in ORDER},
        master_port=29555,
    )
    rank5 = job.ranks[5]["env"]
    assert {k: rank5[k] for k in rank5 if not k.startswith("MESHKIT_")} == {
        "MESHCCL_JOB_ID": JOB,
        "MESHCCL_TOKEN": "<hidden>",
        "PYTHONUNBUFFERED": "1",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "2",
        "NODE_RANK": "2",
        "MASTER_ADDR": "10.9.0.1",  # the management address of node1, first in ring order
        "MASTER_PORT": "29555",
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "=tb0,tb1",
        "GLOO_SOCKET_IFNAME": "mgmt0",
        "NNODES": "4",
        "NPROC_PER_NODE": "2",
        # meshccl's hostfile of the job, for init_process_group("meshccl"): torch's rank numbers
        "MESHCCL_RANK": "5",
        "MESHCCL_WORLD_SIZE": "8",
        "MESHCCL_HOSTFILE": f"{JOB_DIR}/meshccl.json",
    }
    assert not any(k.startswith("NCCL_") for k in job.ranks[0]["env"])  # node1 has no NCCL settings
    # One builder: a rank's environment is its host's torch.env (as setup.yml writes it, with the
    # same management interface) plus the rank's own RANK and LOCAL_RANK.
    files, _ = hostfiles.render(
        ring, SSH, nccl, "c", ranks_per_host=2, master_port=29555, host="node2", gloo={"node2": "mgmt0"}
    )
    written = {k: v.strip("'") for k, v in (line.split("=", 1) for line in files["torch.env"].splitlines()[3:])}
    assert written == {k: v for k, v in rank5.items() if k not in ("RANK", "LOCAL_RANK", "PYTHONUNBUFFERED")
                       and not k.startswith(("MESHKIT_", "MESHCCL_"))}  # fmt: skip
    assert set(job.files) == set(ORDER) and all(set(files) == {"meshccl.json"} for files in job.files.values())
    # The store's port first, then meshccl's listening addresses (every cable end and loopback per rank).
    assert job.ports["node1"][0] == ["0.0.0.0", 29555, "torch MASTER_PORT (rank 0's store)"]
    assert job.ports == {
        h: ([job.ports["node1"][0]] if h == "node1" else []) + meshccl_ports(ring, 2)[h] for h in ORDER
    }
    assert job.notes == []


def meshccl_ports(plan: dict[str, Any], per_host: int, **given: Any) -> dict[str, list[list[Any]]]:
    """The ports a meshccl job of the same shape must have free."""
    return plan_job(plan, runtime="meshccl", ranks_per_host=per_host, **given).ports


@pytest.mark.parametrize("shape", ["ring", "mesh"])
@pytest.mark.parametrize("per_host", [1, 2, 3])
def test_torch_ranks_get_meshccls_hostfile_with_torchs_rank_numbers(shape: str, per_host: int) -> None:
    """Under `meshkit launch -r torch` a rank's MESHCCL_RANK is its RANK, and the job's meshccl.json (the
    same file a meshccl job of that shape gets) puts that rank on the rank's own host as its LOCAL_RANK:
    so meshccl, reading its hostfile first, is the same rank of the same world as torch."""
    plan = plan_of(RING if shape == "ring" else MESH, 4)
    job = plan_job(plan, runtime="torch", ranks_per_host=per_host, meshccl_port=31000, master_port=29555)
    same_shape = plan_job(plan, runtime="meshccl", ranks_per_host=per_host, meshccl_port=31000)
    assert job.files == same_shape.files
    doc = json.loads(job.files[job.hosts()[0]]["meshccl.json"])
    assert doc["world_size"] == job.world_size == 4 * per_host
    entries = {e["rank"]: e for e in doc["ranks"]}
    for r in job.ranks:
        env = r["env"]
        assert env["MESHCCL_RANK"] == env["RANK"] == str(r["rank"])
        assert env["MESHCCL_WORLD_SIZE"] == env["WORLD_SIZE"] == str(job.world_size)
        assert env["MESHCCL_HOSTFILE"] == f"{JOB_DIR}/meshccl.json"
        entry = entries[r["rank"]]
        assert (entry["host"], str(entry["local_rank"]), str(entry["node_rank"])) == (
            r["host"],
            env["LOCAL_RANK"],
            env["NODE_RANK"],
        )
        assert entry["port"] == 31000 + int(env["LOCAL_RANK"])
        # the job token: every rank gets one, planned hidden, the launcher puts a fresh one in
        assert env["MESHCCL_TOKEN"] == "<hidden>"
    assert job.secret_env == ["MESHCCL_TOKEN"]
    assert [r["host"] for r in job.ranks] == [e["host"] for e in doc["ranks"]]
    # every planned meshccl listener is checked free by the preflight, besides the store's port
    for host in job.hosts():
        assert [p for p in job.ports[host] if p[2].startswith("meshccl")] == same_shape.ports[host]


@pytest.mark.parametrize(("master", "meshccl", "per_host"), [(29600, 29600, 1), (29601, 29600, 2), (29503, 29500, 4)])
def test_torch_store_port_on_a_meshccl_port_is_refused(
    ring: dict[str, Any], master: int, meshccl: int, per_host: int
) -> None:
    with pytest.raises(LaunchError) as err:
        plan_job(ring, runtime="torch", ranks_per_host=per_host, master_port=master, meshccl_port=meshccl)
    last = meshccl + per_host - 1
    assert str(err.value) == (
        f"meshkit_master_port {master} (torch's store, on node1) is one of meshccl's ports {meshccl}-{last} "
        f"(meshkit_meshccl_port {meshccl}, one per rank of a host); set meshkit_master_port or "
        "meshkit_meshccl_port so that they do not overlap"
    )
    # next to them is fine
    plan_job(ring, runtime="torch", ranks_per_host=per_host, master_port=last + 1, meshccl_port=meshccl)
    plan_job(ring, runtime="torch", ranks_per_host=per_host, master_port=meshccl - 1, meshccl_port=meshccl)


def test_torch_user_env_may_point_meshccl_elsewhere(ring: dict[str, Any]) -> None:
    job = plan_job(ring, runtime="torch", env={"MESHCCL_HOSTFILE": "/shared/mine.json"})
    assert {r["env"]["MESHCCL_HOSTFILE"] for r in job.ranks} == {"/shared/mine.json"}


def test_torch_master_follows_the_ring_not_the_names() -> None:
    # The same ring entered at node3: the ranks and MASTER_ADDR follow the plan's ring, not the host names.
    plan = plan_of(RING, 4)
    plan["ring"] = ["node3", "node2", "node4", "node1"]
    job = build(plan, settings(runtime="torch"), job_id=JOB, state_dir=STATE, cluster="c", ssh=SSH)
    assert [r["host"] for r in job.ranks] == ["node3", "node2", "node4", "node1"]
    assert {r["env"]["MASTER_ADDR"] for r in job.ranks} == {"10.9.0.3"}
    assert job.ranks[0]["env"]["RANK"] == "0"


def test_torch_without_a_management_interface_leaves_gloo_unset_and_says_so(ring: dict[str, Any]) -> None:
    job = plan_job(ring, runtime="torch")
    assert all("GLOO_SOCKET_IFNAME" not in r["env"] for r in job.ranks)
    assert job.notes == ["GLOO_SOCKET_IFNAME not set: no management interface known"]


def test_plain_gets_only_meshkit_variables_and_user_env_overrides(ring: dict[str, Any]) -> None:
    job = plan_job(ring, runtime="plain", env={"EXTRA": 7, "PYTHONUNBUFFERED": "0", "MESHKIT_HOST": "mine"})
    env = job.ranks[1]["env"]
    assert env == {
        "MESHKIT_JOB_ID": JOB,
        "MESHKIT_RANK": "1",
        "MESHKIT_WORLD_SIZE": "4",
        "MESHKIT_LOCAL_RANK": "0",
        "MESHKIT_HOST": "mine",
        "MESHCCL_JOB_ID": JOB,
        "MESHCCL_TOKEN": "<hidden>",
        "PYTHONUNBUFFERED": "0",
        "EXTRA": "7",
    }
    assert job.files == {h: {} for h in ORDER}
    assert job.ports == {h: [] for h in ORDER}


def test_user_env_overrides_runtime_variables(ring: dict[str, Any]) -> None:
    job = plan_job(ring, runtime="torch", env={"MASTER_ADDR": "10.0.0.99", "MASTER_PORT": 1234})
    assert {r["env"]["MASTER_ADDR"] for r in job.ranks} == {"10.0.0.99"}
    assert {r["env"]["MASTER_PORT"] for r in job.ranks} == {"1234"}


def test_ranks_get_their_own_copies_of_the_program() -> None:
    plan = plan_of(RING, 4)
    job = plan_job(plan, runtime="plain")
    job.ranks[0]["argv"].append("--changed")
    assert job.ranks[1]["argv"] == ["python3", "/shared/train.py", "--epochs", "1"]


# ---- build: MLX --------------------------------------------------------------------------------


def test_mlx_ring_file_first_rank_on_the_cable_others_on_loopback(ring: dict[str, Any]) -> None:
    assert hostfiles.mlx_ring_runtime(hostfiles.mlx_hostfile(ring, SSH), 5000, ranks_per_host=2) == [
        ["10.50.0.5:5000"],  # node1, its address on the cable to node4 (its left)
        ["127.0.0.1:5001"],
        ["10.50.0.2:5002"],  # node3, to node1
        ["127.0.0.1:5003"],
        ["10.50.0.9:5004"],  # node2, to node3
        ["127.0.0.1:5005"],
        ["10.50.0.14:5006"],  # node4, to node2
        ["127.0.0.1:5007"],
    ]
    # One rank per host: the ring file setup.yml writes (one builder: hostfiles.mlx_ring_runtime).
    files, _skipped = hostfiles.render(ring, SSH, {}, "lab", mlx_starting_port=5000)
    assert hostfiles.mlx_ring_runtime(hostfiles.mlx_hostfile(ring, SSH), 5000, ranks_per_host=1) == json.loads(
        files["mlx-ring.json"]
    )


def test_mlx_ring_job_files_env_and_ports(ring: dict[str, Any]) -> None:
    job = plan_job(ring, runtime="mlx", ranks_per_host=2, mlx_port=40000)
    expected = hostfiles.mlx_ring_runtime(hostfiles.mlx_hostfile(ring, SSH), 40000, ranks_per_host=2)
    assert all(json.loads(files["mlx-ring.json"]) == expected for files in job.files.values())
    assert set(job.files) == set(ORDER)
    assert job.ports["node1"] == [["10.50.0.5", 40000, "MLX ring rank 0"], ["127.0.0.1", 40001, "MLX ring rank 1"]]
    assert job.ports["node4"] == [["10.50.0.14", 40006, "MLX ring rank 6"], ["127.0.0.1", 40007, "MLX ring rank 7"]]
    env = job.ranks[3]["env"]
    assert env["MLX_RANK"] == "3"
    assert env["MLX_WORLD_SIZE"] == "8"
    assert env["MLX_HOSTFILE"] == f"{JOB_DIR}/mlx-ring.json"
    assert "MLX_IBV_DEVICES" not in env and "MESHCCL_RANK" not in env


def test_mlx_ring_on_a_doubled_ring_lists_both_cables_for_the_first_rank() -> None:
    plan = plan_of([(1, 2), (1, 2), (2, 3), (2, 3), (3, 1), (3, 1)], 3)
    ring = hostfiles.mlx_ring_runtime(hostfiles.mlx_hostfile(plan, SSH), 100, ranks_per_host=2)
    assert ring[0] == ["10.50.0.9:100", "10.50.0.13:101"]
    assert ring[1] == ["127.0.0.1:102"]
    assert ring[2][0].endswith(":103")


def test_mlx_without_a_ring_is_refused() -> None:
    line = plan_of([(1, 2), (2, 3)], 3)
    with pytest.raises(LaunchError, match="runtime mlx needs a ring through every host"):
        plan_job(line, runtime="mlx")
    # meshccl runs on the same cabling.
    assert plan_job(line).world_size == 3


def test_mlx_rdma_backend_one_rank_per_host() -> None:
    plan = plan_of([(1, 2), (1, 3), (2, 3)], 3, rdma=True)
    assert plan["backend"] == "jaccl"
    with pytest.raises(
        LaunchError, match=r"backend jaccl \(RDMA\) runs one rank per host; set launch_ranks_per_host=1"
    ):
        plan_job(plan, runtime="mlx", ranks_per_host=2)
    job = plan_job(plan, runtime="mlx", mlx_port=41000)
    devices = [h["rdma"] for h in hostfiles.mlx_hostfile(plan, SSH)["hosts"]]
    assert all(json.loads(files["mlx-ibv-devices.json"]) == devices for files in job.files.values())
    env = job.ranks[2]["env"]
    assert env["MLX_IBV_DEVICES"] == f"{JOB_DIR}/mlx-ibv-devices.json"
    assert env["MLX_JACCL_COORDINATOR"] == "10.9.0.1:41000"
    assert "MLX_HOSTFILE" not in env
    first = job.hosts()[0]
    assert job.ports[first] == [["0.0.0.0", 41000, "JACCL coordinator"]]


# ---- stale_hosts, nccl_from_env_file, preflight_problems -------------------------------------


def test_stale_hosts(ring: dict[str, Any]) -> None:
    current = hostfiles.render(ring, SSH, {}, "c")[0]["manifest.json"]
    moved = json.loads(json.dumps(ring))
    moved["cables"][0]["network"] = "10.99.0.0/30"  # the same backend, another plan
    older = hostfiles.render(moved, SSH, {}, "c")[0]["manifest.json"]
    manifests = {"node1": current, "node2": None, "node3": older, "node4": "{not json"}
    problems = stale_hosts(ring, manifests, "/var/lib/meshkit/")
    assert len(problems) == 3
    by_host = {p.split(":", 1)[0]: p for p in problems}
    assert set(by_host) == {"node2", "node3", "node4"}
    assert by_host["node2"] == "node2: no hostfiles in /var/lib/meshkit/hostfiles; run setup.yml first"
    assert "made from another cabling" in by_host["node3"]
    assert json.loads(older)["fingerprint"] in by_host["node3"]
    assert hostfiles.fingerprint(ring) in by_host["node3"]
    assert "manifest.json is not JSON" in by_host["node4"]
    # In ring order; a host missing from the manifests counts as having none.
    assert [p.split(":")[0] for p in stale_hosts(ring, {}, STATE)] == ORDER
    assert stale_hosts(ring, dict.fromkeys(ORDER, current), STATE) == []


def test_hostfiles_made_for_another_backend_are_refused_by_name(ring: dict[str, Any]) -> None:
    """The fingerprint covers the backend; the refusal says which backend each side has."""
    rdma = dict(ring, backend="jaccl-ring")
    assert hostfiles.fingerprint(rdma) != hostfiles.fingerprint(ring)
    made = hostfiles.render(rdma, SSH, {}, "c")[0]["manifest.json"]
    assert json.loads(made)["backend"] == "jaccl-ring"
    problems = stale_hosts(ring, dict.fromkeys(ORDER, made), STATE)
    assert problems == [
        f"{h}: the hostfiles in {STATE.rstrip('/')}/hostfiles were made for backend 'jaccl-ring' "
        "and the plan says 'ring'; run setup.yml"
        for h in ORDER
    ]


def test_nccl_from_env_file_reads_what_torch_env_writes(ring: dict[str, Any]) -> None:
    nccl = {"NCCL_SOCKET_IFNAME": "=tb0,tb1", "NCCL_IB_HCA": "=rdma 0", "NCCL_IB_DISABLE": "0"}
    text = hostfiles.torch_env(ring, "node3", SSH, 1, 29500, nccl, hostfiles.fingerprint(ring))
    assert nccl_from_env_file(text) == nccl
    assert nccl_from_env_file("NCCL_EMPTY=\n# NCCL_X=1\nOTHER=2\nNCCL_BROKEN\n") == {"NCCL_EMPTY": ""}
    assert nccl_from_env_file(None) == {}
    assert nccl_from_env_file("") == {}


def test_preflight_problems_per_host_then_differences() -> None:
    same = {"program": "/usr/bin/python3.11", "interpreter": "/usr/bin/python3.11", "script": "/shared/t.py"}
    results = {
        "node1": {**same, "problems": []},
        "node2": {**same, "problems": []},
        "node3": {"program": None, "interpreter": None, "script": None, "problems": ["program python3 not found"]},
    }
    # node3's own problem; the hosts without problems agree.
    assert preflight_problems(results) == ["node3: program python3 not found"]
    results["node4"] = {**same, "program": "/opt/py/bin/python3.11", "interpreter": "/opt/py/bin/python3.11"}
    problems = preflight_problems(results)
    assert problems[0] == "node3: program python3 not found"
    assert problems[1] == (
        "the program is not the same on every host (node1, node2: /usr/bin/python3.11; "
        "node4: /opt/py/bin/python3.11); install it at one path everywhere"
    )
    assert problems[2].startswith("its interpreter is not the same on every host (")
    assert len(problems) == 3  # the script is the same everywhere
    assert preflight_problems({"a": {**same}, "b": {**same, "problems": None}}) == []
