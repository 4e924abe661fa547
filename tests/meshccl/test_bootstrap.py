"""Hostfile and environment parsing: what a rank makes of meshkit's files, and the errors
bad ones get."""

from __future__ import annotations

import copy
import json
import re
import socket
import threading

import meshccl
import pytest
from meshccl.bootstrap import plan_from_env

from . import helpers as h

RING4 = [(1, 3), (3, 2), (2, 4), (4, 1)]


@pytest.fixture
def ring4(tmp_path):
    return json.loads(h.meshccl_hostfile(tmp_path, RING4, 4).read_text())


def test_a_rank_listens_on_its_cable_addresses_only_and_reaches_neighbours_across_them(ring4):
    # ring order node1 node3 node2 node4: rank 1 is node3, cabled to node1 and node2
    plan = meshccl.plan_from_meshccl_hostfile(ring4, 1)
    port = ring4["ranks"][1]["port"]
    assert sorted(plan.listen) == sorted([("127.64.0.2", port), ("127.64.0.10", port)])
    assert plan.peers == {0: ([("127.64.0.1", port)], -1), 2: ([("127.64.0.9", port)], -1)}
    assert (plan.ring, plan.complete, plan.size) == (True, False, 4)


def test_doubled_cables_are_two_links_and_ranks_of_one_host_meet_on_loopback(tmp_path):
    data = json.loads(h.meshccl_hostfile(tmp_path, [(1, 2), (1, 2)], 2, ranks_per_host=2).read_text())
    plan = meshccl.plan_from_meshccl_hostfile(data, 0)
    port = data["ranks"][0]["port"]
    assert ("127.0.0.1", port) in plan.listen
    assert plan.peers[1] == ([("127.0.0.1", port + 1)], -1)
    assert len(plan.peers[2][0]) == 2  # two cables to node2
    assert plan.complete and plan.ring_links == 1  # ranks 1-2 share two cables, 0-1 loopback
    assert plan.same_host == {1}  # node1's other rank; node2's ranks are across the cables


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["ranks"].pop(2), "ranks must be numbered 0..3; missing rank(s) [2]"),
        (lambda d: d["ranks"][1]["links"][0].update(address="10.0.0.300"), "'10.0.0.300' is not a numeric"),
        (lambda d: d["ranks"][1]["links"][0].update(peer_address="node1"), "'node1' is not a numeric"),
        (lambda d: d["ranks"][1].update(port=70000), "port 70000 is not a TCP port"),
        (lambda d: d.update(version=2), "version 2 is not supported"),
        (lambda d: d.update(format="mlx"), "not a meshccl hostfile"),
        (lambda d: d["ranks"].append(copy.deepcopy(d["ranks"][0])), "rank 0 is listed twice"),
        (lambda d: d.update(world_size=3), "world_size is 3 but rank(s) [3] are listed"),
    ],
)
def test_bad_hostfiles_get_a_clear_error(ring4, mutate, message):
    mutate(ring4)
    with pytest.raises(meshccl.BootstrapError) as err:
        meshccl.plan_from_meshccl_hostfile(ring4, 0, "meshccl.json")
    assert message in str(err.value)
    assert str(err.value).startswith("meshccl.json")


def test_two_ranks_of_one_host_on_one_port_is_refused(tmp_path):
    data = json.loads(h.meshccl_hostfile(tmp_path, RING4, 4, ranks_per_host=2).read_text())
    data["ranks"][1]["port"] = data["ranks"][0]["port"]
    with pytest.raises(meshccl.BootstrapError, match=r"rank 0 and rank 1 on host node1 both listen on"):
        meshccl.plan_from_meshccl_hostfile(data, 0)


def test_a_rank_outside_the_file_is_refused(ring4):
    with pytest.raises(meshccl.BootstrapError, match="this process is rank 9"):
        meshccl.plan_from_meshccl_hostfile(ring4, 9)


def test_cables_forming_a_line_are_refused(tmp_path):
    data = json.loads(h.meshccl_hostfile(tmp_path, [(1, 2), (2, 3)], 3).read_text())
    with pytest.raises(meshccl.BootstrapError, match="neither a ring"):
        meshccl.plan_from_meshccl_hostfile(data, 0)


def test_torchrun_ranks_compare_host_identities(monkeypatch):
    from meshccl import bootstrap
    from meshccl.bootstrap import rendezvous

    identity = bootstrap.host_identity()
    assert identity == bootstrap.host_identity() and identity.startswith(socket.gethostname())
    # Ranks 0 and 2 report one identity, rank 1 another (as if from another machine).
    ids = {0: "host-a", 1: "host-b", 2: "host-a"}
    per_thread = threading.local()
    monkeypatch.setattr(rendezvous, "host_identity", lambda: per_thread.id)  # where torchrun reads it
    port = h.free_port_block(1)
    plans: dict[int, meshccl.Plan] = {}

    def rank(r: int) -> None:
        per_thread.id = ids[r]
        plans[r] = bootstrap.plan_from_torchrun(r, 3, "127.0.0.1", port, "tok", 20.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert {r: p.same_host for r, p in plans.items()} == {0: {2}, 1: set(), 2: {0}}


def test_mlx_ring_file_connects_right_and_accepts_from_left():
    hosts = [["127.0.0.1:5000"], ["127.0.0.2:5001", "127.0.0.2:5002"], ["127.0.0.3:5003"], ["127.0.0.4:5004"]]
    plan = meshccl.plan_from_mlx_hostfile(hosts, 1)
    assert plan.listen == [("127.0.0.2", 5001), ("127.0.0.2", 5002)]
    assert plan.peers == {2: ([("127.0.0.3", 5003)], 1), 0: ([("127.0.0.2", 5001), ("127.0.0.2", 5002)], 0)}
    assert plan.ring and not plan.complete and plan.ring_links == 1
    assert plan.same_host == set()
    # The MLX file names no hosts: ranks listening on the same addresses share one.
    local = [["127.0.0.1:5000"], ["127.0.0.1:5001"], ["127.0.0.1:5002"]]
    assert meshccl.plan_from_mlx_hostfile(local, 1).same_host == {0, 2}
    with pytest.raises(meshccl.BootstrapError, match=re.escape("'127.0.0.1' is not 'ip:port'")):
        meshccl.plan_from_mlx_hostfile([["127.0.0.1"], ["127.0.0.2:1"]], 0)


def test_environment_errors_name_what_to_set(tmp_path):
    with pytest.raises(meshccl.BootstrapError, match="no rank in the environment"):
        plan_from_env({})
    with pytest.raises(meshccl.BootstrapError, match="set both MESHCCL_RANK and MESHCCL_HOSTFILE"):
        plan_from_env({"MESHCCL_RANK": "0"})
    with pytest.raises(meshccl.BootstrapError, match="MESHCCL_RANK='x' is not an integer"):
        plan_from_env({"MESHCCL_RANK": "x", "MESHCCL_HOSTFILE": str(tmp_path / "none.json")})
    with pytest.raises(meshccl.BootstrapError, match="cannot read hostfile"):
        plan_from_env({"MESHCCL_RANK": "0", "MESHCCL_HOSTFILE": str(tmp_path / "none.json")})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(meshccl.BootstrapError, match="is not valid JSON"):
        plan_from_env({"MESHCCL_RANK": "0", "MESHCCL_HOSTFILE": str(bad)})


def test_a_hostfile_rank_that_is_not_torchs_rank_is_refused(tmp_path):
    path = h.meshccl_hostfile(tmp_path, [(1, 2)], 2, 2)  # 4 ranks
    env = {"MESHCCL_RANK": "1", "MESHCCL_HOSTFILE": str(path), "MESHCCL_TOKEN": "t"}
    assert plan_from_env({**env, "RANK": "1", "WORLD_SIZE": "4"}, token="t").rank == 1
    # torchrun started inside a launched rank: its workers all inherit MESHCCL_RANK=1.
    with pytest.raises(meshccl.BootstrapError, match=r"MESHCCL_RANK=1 of 4 .* but torch's RANK=3 of WORLD_SIZE=8"):
        plan_from_env({**env, "RANK": "3", "WORLD_SIZE": "8"}, token="t")


def test_unknown_options_and_values_are_refused():
    with pytest.raises(meshccl.BootstrapError, match="MESHCCL_TIMEOUT='soon'"):
        meshccl.init(env={"MESHCCL_TIMEOUT": "soon"})
    with pytest.raises(TypeError, match="unknown option"):
        meshccl.Communicator(meshccl.Plan(0, 1), colour="blue")


def test_job_id_and_the_no_token_opt_out_come_from_the_environment():
    from meshccl import bootstrap

    assert bootstrap.job_id_from_env({"MESHCCL_JOB_ID": "a", "TORCHELASTIC_RUN_ID": "b"}) == "a"
    assert bootstrap.job_id_from_env({"MESHCCL_JOB_ID": "", "TORCHELASTIC_RUN_ID": "b"}) == "b"
    assert bootstrap.job_id_from_env({}) == ""
    for value, allowed in (("1", True), ("yes", True), ("0", False), ("", False), (None, False)):
        env = {} if value is None else {"MESHCCL_ALLOW_NO_TOKEN": value}
        assert bootstrap.allow_no_token_from_env(env) is allowed, value
    with pytest.raises(meshccl.BootstrapError, match="MESHCCL_ALLOW_NO_TOKEN='2'"):
        bootstrap.allow_no_token_from_env({"MESHCCL_ALLOW_NO_TOKEN": "2"})


def test_ranks_of_one_host_handed_the_same_port_pick_again_before_anyone_listens(monkeypatch):
    """torch's store path probes a free port per rank and closes it until meshccl listens, so two
    ranks of one host can be handed the same one (seen in the suite at 8 ranks: rank 7 reached rank 1
    where it expected rank 6, and the handshake refused it). Every rank sees the whole table: the
    later rank of a clash picks again and all publish once more. Here the first two picks of every
    rank are the same port: the plans end with distinct ports, each rank's own among its peers'."""
    import threading

    import torch.distributed as torch
    from meshccl.bootstrap import torch_store

    store = torch.HashStore()
    picks: dict[int, int] = {}
    lock = threading.Lock()
    rank_of_thread: dict[int, int] = {}

    def pick(_addresses):
        rank = rank_of_thread[threading.get_ident()]
        with lock:
            picks[rank] = picks.get(rank, 0) + 1
            return 40000 if picks[rank] <= 2 else 41000 + rank

    monkeypatch.setattr(torch_store, "_free_port_on_all", pick)
    env = {"MASTER_ADDR": "127.0.0.1"}
    plans, errors = {}, []

    def run(rank):
        rank_of_thread[threading.get_ident()] = rank
        try:
            plans[rank] = torch_store.plan_from_store(store, rank, 4, 0, env, "token", "job")
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    ports = {r: p.listen[0][1] for r, p in plans.items()}
    assert len(set(ports.values())) == 4, ports
    for r, p in plans.items():
        assert {q: e[0][0][1] for q, e in p.peers.items()} == {q: ports[q] for q in ports if q != r}
    assert max(picks.values()) >= 3, picks  # the clash was seen and resolved, not avoided
