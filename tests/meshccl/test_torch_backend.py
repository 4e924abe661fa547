"""meshccl as a torch.distributed backend: `import meshccl.torch`, then
`init_process_group("meshccl")`, under the real torchrun on this machine.

Two torchrun jobs carry most checks (tests/meshccl/torch_worker.py makes them on every rank and
prints how many passed):
- three ranks, torchrun's environment: every operation, reduction and dtype against references
  computed from every rank's inputs (small integers: exact in every dtype), async_op, the errors
  of unsupported calls, a Gloo group beside the meshccl one (and, after re-initialising, a meshccl
  group beside a Gloo default), a meshccl group of some ranks, DDP and FSDP2 trained with meshccl
  and with Gloo from one seed, functional collectives, a mismatched call's error through Work.wait();
- four ranks as two simulated hosts of two ranks each (meshccl.json; cables are loopback
  addresses): the world uses both cables between the hosts, a group of some ranks and a second
  world group meet on fresh ports, DDP against Gloo.

DDP (and FSDP2) tolerance: every step all-reduces float32 gradients; Gloo and meshccl may add the ranks'
contributions in different orders, and float32 addition is not associative, so a sum may differ
by about an ulp (6e-8 relative); a few SGD steps (lr 0.05, momentum 0.9) of a model whose
parameters are O(0.1-1) carry that to about 1e-7. The bound asserted is 1e-5: 100x what rounding
does, and 100x less than training moves a parameter (the worker asserts a move > 1e-3).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import meshccl
import pytest
import torch
import torch.distributed as dist

from . import helpers as h

TORCH_WORKER = Path(__file__).with_name("torch_worker.py")
DDP_TOLERANCE = 1e-5


def import_backend() -> Any:
    try:
        import meshccl.torch as mt
    except ModuleNotFoundError as e:
        raise AssertionError(f"{e}: the installed meshccl predates meshccl/torch.py; rebuild it (make venv)") from None
    return mt


def torchrun(n: int, scenario: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """torch_worker.py SCENARIO on n ranks under the real torchrun (--standalone); every rank's
    RESULT, with its CHECKS count, once every rank printed OK."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MESHCCL_")}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    done = subprocess.run(
        [*argv, str(TORCH_WORKER), scenario],
        env={
            **base,
            "MESHCCL_TOKEN": secrets.token_hex(32),
            "MESHCCL_LOG_LEVEL": "1",
            "MESHCCL_CONNECT_TIMEOUT": "60",
            "PYTHONWARNINGS": "ignore::FutureWarning",  # torch's renames of all_gather_into_tensor & co.
            **env,
        },
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    shown = f"exit {done.returncode}\nstdout:\n{done.stdout[-6000:]}\nstderr:\n{done.stderr[-6000:]}"
    assert done.returncode == 0 and done.stdout.split().count("OK") == n, shown
    results = [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    results.sort(key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(n)), shown
    print(f"\n[{scenario}] checks passed per rank: {[r['checks'] for r in results]}")
    return results


def test_every_op_dtype_and_reduction_async_errors_groups_and_ddp_under_torchrun():
    results = torchrun(3, "ops", {})
    for r in results:
        assert r["checks"] >= 350, r  # every rank made its checks (each op x dtype x size)
        assert r["transport"] == "shm", r  # torchrun's ranks on one host share memory
        assert r["ddp_max_diff"] <= DDP_TOLERANCE and r["fsdp_max_diff"] <= DDP_TOLERANCE, r
        assert "mismatched collective calls" in r["mismatch"], r
        errors = r["errors"]
        assert "all_reduce" in errors["bool"] and "torch.bool" in errors["bool"], errors
        assert "broadcast" in errors["int16"] and "torch.int16" in errors["int16"], errors
        assert "sparse" in errors["sparse max"] and "SUM only" in errors["sparse max"], errors
    # What DDP asked of the backend: bucket all-reduces, the parameter broadcast at construction
    # (and BatchNorm's buffers before every forward), one all_gather checking parameter shapes.
    calls = results[0]["ddp_calls"]
    assert set(calls) == {"all_reduce", "broadcast", "all_gather"} and calls["all_reduce"] >= 5, calls
    # FSDP2 (fully_shard): parameters gathered, gradients reduce-scattered.
    fsdp = results[0]["fsdp_calls"]
    assert set(fsdp) == {"all_gather_into_tensor", "reduce_scatter_tensor"}, fsdp
    for name, t in results[0]["timings"].items():
        print(f"[ops] all_reduce {name}: meshccl {t['meshccl'] * 1e6:.0f} us, gloo {t['gloo'] * 1e6:.0f} us (rank 0)")
    print(f"[ops] DDP max |meshccl - gloo| = {results[0]['ddp_max_diff']:g}; calls {calls}")
    print(f"[ops] FSDP2 max |meshccl - gloo| = {results[0]['fsdp_max_diff']:g}; calls {fsdp}")


def test_meshccl_json_under_torchrun_uses_every_cable(tmp_path):
    """Two hosts of two ranks, two cables between them: torchrun starts the four ranks with one
    environment (MESHCCL_HOSTFILE), torch's rank is meshccl's."""
    path = h.meshccl_hostfile(tmp_path, [(1, 2), (1, 2)], 2, ranks_per_host=2)
    data = json.loads(path.read_text())
    base = h.free_port_block(4)
    for rank in data["ranks"]:  # one machine: every simulated host's ranks on ports of their own
        rank["port"] = base + rank["rank"]
    path.write_text(json.dumps(data))
    results = torchrun(4, "hostfile", {"MESHCCL_HOSTFILE": str(path)})
    host = {e["rank"]: e["host"] for e in data["ranks"]}
    for r in results:
        me = r["rank"]
        assert r["source"] == str(path), r
        for q, eps in r["endpoints"].items():
            if host[int(q)] == host[me]:
                assert r["transports"][q] == "shm" and eps == [f"127.0.0.1:{base + int(q)}"], r
            else:  # both cables
                assert r["transports"][q] == "tcp", r
                assert len(eps) == 2 and all(e.startswith("127.64.0.") for e in eps), r
        assert r["again_source"] == f"{path} (ranks [0, 1, 2, 3])", r
        assert r["ddp_max_diff"] <= DDP_TOLERANCE, r
    # The group of one host's ranks (0 and 1) beside the world group: shared memory between them.
    assert host[0] == host[1] and [results[q]["local_transport"] for q in (0, 1)] == ["shm", "shm"], results[:2]
    # The group of ranks 0 and 2 (one per host) runs over the cables, on ports of its own.
    for me, peer, group_peer in ((0, 2, "1"), (2, 0, "0")):
        eps = results[me]["pair_endpoints"][group_peer]
        assert len(eps) == 2 and all(e.startswith("127.64.0.") for e in eps), results[me]
        assert all(int(e.rsplit(":", 1)[1]) != base + peer for e in eps), results[me]


def test_a_barriers_own_timeout_applies_to_it_alone():
    """torch 2.13's `dist.barrier(timeout=...)` (BarrierOptions.timeout) in a group whose timeout is 120 s."""
    results = torchrun(2, "barrier_timeout", {})
    first = results[0]
    assert 1.0 <= first["timed_out_after"] < 10.0, first  # its own 1 s, not the group's 120 s
    assert "timed out" in first["error"].lower(), first
    print(f"[barrier_timeout] rank 0 alone at a barrier with timeout 1 s raised after {first['timed_out_after']:.2f} s")


@pytest.fixture
def one_process_world(monkeypatch):
    """torch.distributed in this process (a HashStore); torn down afterwards."""
    mt = import_backend()
    for k in [k for k in os.environ if k.startswith("MESHCCL_")]:
        monkeypatch.delenv(k)
    yield mt
    if dist.is_initialized():
        dist.destroy_process_group()


def test_without_a_token_init_process_group_raises_meshccls_auth_error(one_process_world):
    with pytest.raises(meshccl.AuthError, match=r"rank 0 of 2: no job token.*MESHCCL_TOKEN"):
        dist.init_process_group("meshccl", store=dist.HashStore(), rank=0, world_size=2)
    assert not dist.is_initialized()


@pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated:FutureWarning")
def test_registration_and_a_one_rank_group(one_process_world):
    mt = one_process_world
    assert "meshccl" in dist.Backend.backend_list
    dist.init_process_group("meshccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    assert dist.get_backend() == "meshccl"
    x = torch.arange(6, dtype=torch.float32)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    assert torch.equal(x, torch.arange(6, dtype=torch.float32))
    with pytest.raises(mt.UnsupportedError, match=r"all_reduce: tensor on device meta: meshccl moves CPU tensors"):
        dist.all_reduce(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"all_gather_into_tensor: the output has 3 elements; it must have"):
        dist.all_gather_into_tensor(torch.empty(3), torch.ones(2))
    with pytest.raises(mt.UnsupportedError, match=r"split_group"):
        dist.distributed_c10d._get_default_group().split_group([0])
