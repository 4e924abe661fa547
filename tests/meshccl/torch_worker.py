"""One rank of a torch.distributed job on the meshccl backend, started by torchrun.

Usage: torch_worker.py SCENARIO. Each check compares against a reference computed here from
what every rank contributes (inputs are small integers, so every dtype and reduction is exact).
Prints "RESULT <json>" (with "checks": how many passed) and "OK" on success; on any failure "FAIL <type>: <message>"
and exits 3.

Scenarios:
  ops      every operation, reduction and dtype; async_op; errors; a Gloo group beside the meshccl
           one and a meshccl group of some ranks; DDP with meshccl and with Gloo from one seed.
  hostfile a meshccl.json layout (MESHCCL_HOSTFILE set, MESHCCL_RANK taken from torch's rank):
           all-reduces large and small, groups of some ranks and a second world group on
           fresh ports, DDP against Gloo.
  barrier_timeout  dist.barrier(timeout=...) in a group with a long timeout of its own: passed, after an
           async all_reduce a rank comes to late, and alone on rank 0 (meshccl.TimeoutError after its own timeout).
"""

from __future__ import annotations

import datetime
import functools
import json
import operator
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import meshccl
import meshccl.torch as mt
import torch
import torch.distributed as dist
from torch import nn


def say(line: str) -> None:
    """One line in one write(): the workers share torchrun's stdout, and print() writes the text
    and its newline separately, so another worker's line could land in between."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


R = dist.ReduceOp
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}


class Checks:
    def __init__(self) -> None:
        self.n = 0

    def eq(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.n += 1
        if got.dtype == want.dtype and got.shape == want.shape and not torch.equal(got, want):
            bad = (got != want).flatten().nonzero().flatten()
            i = int(bad[0])
            raise AssertionError(
                f"{what}: {bad.numel()} of {want.numel()} elements wrong, the first at {i}: "
                f"expected {want.flatten()[i].item()} got {got.flatten()[i].item()}"
            )
        if got.dtype != want.dtype or got.shape != want.shape:
            raise AssertionError(
                f"{what}: expected {want.flatten()[:8].tolist()} ({want.dtype}, {tuple(want.shape)}) "
                f"got {got.flatten()[:8].tolist()} ({got.dtype}, {tuple(got.shape)})"
            )

    def true(self, what: str, cond: bool) -> None:
        self.n += 1
        if not cond:
            raise AssertionError(what)

    def raises(self, what: str, fn: Callable[[], Any], exc: type[BaseException], *words: str) -> str:
        self.n += 1
        try:
            fn()
        except exc as e:
            text = str(e)
            missing = [w for w in words if w not in text]
            if missing:
                raise AssertionError(f"{what}: error {text!r} does not name {missing}") from None
            return text
        raise AssertionError(f"{what}: no {exc.__name__} raised")


def value(rank: int, count: int, op: str = "sum") -> torch.Tensor:
    """Rank `rank`'s input (int64; small enough to be exact in every dtype once reduced)."""
    i = torch.arange(count, dtype=torch.int64)
    if op == "prod":
        return 1 + ((i + rank) % 3 == 0).long()
    if op in ("min", "max"):
        return (i * 3 + rank * 5) % 17
    return (rank + 1) * (1 + i % 5)


def reference(op: str, n: int, count: int) -> torch.Tensor:
    stack = torch.stack([value(r, count, op) for r in range(n)])
    if op == "sum":
        return stack.sum(0)
    if op == "prod":
        return stack.prod(0)
    if op == "min":
        return stack.min(0).values
    return stack.max(0).values


TORCH_OPS = {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}


def check_ops(c: Checks, group: Any = None) -> None:
    """Every operation on `group` (default: the world), against references."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    for dt in DTYPES:
        for count in (0, 1, 13, 4099):
            for name, op in TORCH_OPS.items():
                x = value(me, count, name).to(dt)
                dist.all_reduce(x, op=op, group=group)
                c.eq(f"all_reduce {dt} {name} {count}", x, reference(name, n, count).to(dt))
        if dt in FLOATS:
            x = value(me, 1000).to(dt)
            dist.all_reduce(x, op=R.AVG, group=group)
            c.eq(f"all_reduce {dt} avg", x, (reference("sum", n, 1000).double() / n).to(dt))
        else:
            x = value(me, 10).to(dt)
            c.raises(
                f"all_reduce {dt} avg",
                lambda x=x: dist.all_reduce(x, op=R.AVG, group=group),
                mt.UnsupportedError,
                "all_reduce",
                "AVG",
                str(dt),
            )
        # Non-contiguous: a transposed view is reduced in place through a copy.
        base = value(me, 6 * 5).to(dt).view(6, 5)
        view = base.t()
        dist.all_reduce(view, group=group)
        c.eq(f"all_reduce non-contiguous {dt}", base, reference("sum", n, 30).to(dt).view(6, 5))
        # all_gather (list), equal blocks and uneven ones.
        x = value(me, 7).to(dt)
        outs = [torch.empty(7, dtype=dt) for _ in range(n)]
        dist.all_gather(outs, x, group=group)
        for q in range(n):
            c.eq(f"all_gather {dt} block {q}", outs[q], value(q, 7).to(dt))
        x = value(me, 3 + me).to(dt)
        outs = [torch.empty(3 + q, dtype=dt) for q in range(n)]
        dist.all_gather(outs, x, group=group)
        for q in range(n):
            c.eq(f"all_gather uneven {dt} block {q}", outs[q], value(q, 3 + q).to(dt))
        # all_gather_into_tensor.
        x = value(me, 5).to(dt)
        out = torch.empty(n * 5, dtype=dt)
        dist.all_gather_into_tensor(out, x, group=group)
        c.eq(f"all_gather_into_tensor {dt}", out, torch.cat([value(q, 5) for q in range(n)]).to(dt))
        out2 = torch.empty(n, 5, dtype=dt)
        dist.all_gather_into_tensor(out2, x, group=group)
        c.eq(f"all_gather_into_tensor 2-D {dt}", out2, torch.stack([value(q, 5) for q in range(n)]).to(dt))
        # reduce_scatter (list) and reduce_scatter_tensor, SUM, MAX and (floats) AVG.
        full = {name: reference(name, n, n * 6) for name in ("sum", "max")}
        ins = [value(me, n * 6).to(dt)[q * 6 : (q + 1) * 6].clone() for q in range(n)]
        out = torch.empty(6, dtype=dt)
        dist.reduce_scatter(out, ins, group=group)
        c.eq(f"reduce_scatter {dt}", out, full["sum"][me * 6 : (me + 1) * 6].to(dt))
        for name in ("sum", "max"):
            x = value(me, n * 6, name).to(dt)
            out = torch.empty(6, dtype=dt)
            dist.reduce_scatter_tensor(out, x, op=TORCH_OPS[name], group=group)
            c.eq(f"reduce_scatter_tensor {dt} {name}", out, full[name][me * 6 : (me + 1) * 6].to(dt))
        if dt in FLOATS:
            x = value(me, n * 6).to(dt)
            out = torch.empty(6, dtype=dt)
            dist.reduce_scatter_tensor(out, x, op=R.AVG, group=group)
            want = (full["sum"][me * 6 : (me + 1) * 6].double() / n).to(dt)
            c.eq(f"reduce_scatter_tensor {dt} avg", out, want)
        # broadcast from the last rank.
        root = n - 1
        x = value(me, 9).to(dt) if me == root else torch.zeros(9, dtype=dt)
        dist.broadcast(x, group_src=root, group=group)
        c.eq(f"broadcast {dt}", x, value(root, 9).to(dt))
        # reduce to rank 0 (MAX): the others keep their input.
        x = value(me, 11, "max").to(dt)
        before = x.clone()
        dist.reduce(x, group_dst=0, op=R.MAX, group=group)
        c.eq(f"reduce {dt}", x, reference("max", n, 11).to(dt) if me == 0 else before)
        # gather to the last rank, scatter from rank 0.
        x = value(me, 4).to(dt)
        glist = [torch.empty(4, dtype=dt) for _ in range(n)] if me == root else None
        dist.gather(x, glist, group_dst=root, group=group)
        if glist is not None:
            for q in range(n):
                c.eq(f"gather {dt} block {q}", glist[q], value(q, 4).to(dt))
        slist = [value(q, 3).to(dt) for q in range(n)] if me == 0 else None
        out = torch.empty(3, dtype=dt)
        dist.scatter(out, slist, group_src=0, group=group)
        c.eq(f"scatter {dt}", out, value(me, 3).to(dt))
        # all_to_all_single, equal and uneven splits, and the list form.
        x = torch.arange(n * 2, dtype=torch.int64).add(100 * me).to(dt)
        out = torch.empty(n * 2, dtype=dt)
        dist.all_to_all_single(out, x, group=group)
        want = torch.cat([torch.arange(2 * me, 2 * me + 2) + 100 * q for q in range(n)]).to(dt)
        c.eq(f"all_to_all_single {dt}", out, want)
        # rank q sends (q + p + 1) rows to rank p
        in_splits = [me + p + 1 for p in range(n)]
        out_splits = [q + me + 1 for q in range(n)]
        x = torch.cat([torch.full((s,), 10 * me + p, dtype=torch.int64) for p, s in enumerate(in_splits)]).to(dt)
        out = torch.empty(sum(out_splits), dtype=dt)
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        want = torch.cat([torch.full((s,), 10 * q + me, dtype=torch.int64) for q, s in enumerate(out_splits)]).to(dt)
        c.eq(f"all_to_all_single uneven {dt}", out, want)
        outs = [torch.empty(2, dtype=dt) for _ in range(n)]
        dist.all_to_all(outs, [torch.full((2,), 10 * me + p, dtype=torch.int64).to(dt) for p in range(n)], group=group)
        for q in range(n):
            c.eq(f"all_to_all {dt} from {q}", outs[q], torch.full((2,), 10 * q + me, dtype=torch.int64).to(dt))
        # send/recv: a ring shift with batch_isend_irecv (everyone sends first), then blocking pairs.
        if n > 1:
            right, left = (me + 1) % n, (me - 1) % n
            gr = dist.get_global_rank(group, right) if group is not None else right
            gl = dist.get_global_rank(group, left) if group is not None else left
            for count in (3, 300_000):
                send = value(me, count).to(dt)
                recv = torch.empty(count, dtype=dt)
                reqs = dist.batch_isend_irecv(
                    [dist.P2POp(dist.isend, send, gr, group), dist.P2POp(dist.irecv, recv, gl, group)]
                )
                for q in reqs:
                    q.wait()
                c.eq(f"batch_isend_irecv ring shift {dt} {count}", recv, value(left, count).to(dt))
            x = value(me, 5).to(dt)
            if me % 2 == 0:
                dist.send(x, gr, group=group)
                y = torch.empty(5, dtype=dt)
                dist.recv(y, gl, group=group)
            else:
                y = torch.empty(5, dtype=dt)
                dist.recv(y, gl, group=group)
                dist.send(x, gr, group=group)
            c.eq(f"send/recv {dt}", y, value(left, 5).to(dt))
            # Batches that differ on the two sides: blocking sends one by one against receives
            # posted together (and the other way round).
            a, b = value(me, 4).to(dt), value(me, 6).to(dt)
            ya, yb = torch.empty(4, dtype=dt), torch.empty(6, dtype=dt)
            if me % 2 == 0:
                dist.send(a, gr, group=group)
                dist.send(b, gr, group=group)
                works = [dist.irecv(ya, gl, group=group), dist.irecv(yb, gl, group=group)]
                for w in works:
                    w.wait()
            else:
                works = [dist.irecv(ya, gl, group=group), dist.irecv(yb, gl, group=group)]
                for w in works:
                    w.wait()
                dist.send(a, gr, group=group)
                dist.send(b, gr, group=group)
            c.eq(
                f"send/recv split batches {dt}", torch.cat([ya, yb]), torch.cat([value(left, 4), value(left, 6)]).to(dt)
            )
    dist.barrier(group=group)
    c.n += 1


def check_async(c: Checks) -> None:
    n, me = dist.get_world_size(), dist.get_rank()
    xs = [value(me, 50_000 + k).float() for k in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    out = torch.empty(n * 8, dtype=torch.int32)
    wg = dist.all_gather_into_tensor(out, value(me, 8).int(), async_op=True)
    wb = dist.barrier(async_op=True)
    c.true("async_op returns Work objects", all(isinstance(w, dist.Work) for w in [*works, wg, wb]))
    for w in works:
        c.true("Work.wait() is True", w.wait() is True)
    wg.wait()
    wb.wait()
    for k, x in enumerate(xs):
        c.eq(f"async all_reduce {k}", x, reference("sum", n, 50_000 + k).float())
    c.eq("async all_gather_into_tensor", out, torch.cat([value(q, 8) for q in range(n)]).int())
    c.true("Work.is_completed() after wait", all(w.is_completed() for w in [*works, wg, wb]))
    # Async calls nobody waits on still finish (AVG's division, a non-contiguous tensor's copy
    # back) once a later call is waited on, as with torch's own backends.
    a = value(me, 10).float()
    dist.all_reduce(a, op=R.AVG, async_op=True)
    base = value(me, 12).float().view(3, 4)
    dist.all_reduce(base.t(), async_op=True)
    dist.all_reduce(torch.ones(1))
    c.eq("unwaited async AVG", a, reference("sum", n, 10).float() / n)
    c.eq("unwaited async non-contiguous", base, reference("sum", n, 12).float().view(3, 4))
    fut = dist.all_reduce(value(me, 10).double(), async_op=True).get_future()
    c.eq("async all_reduce through get_future()", fut.wait()[0], reference("sum", n, 10).double())


def check_objects(c: Checks) -> None:
    """torch's object collectives (pickles in uint8 tensors, sizes in int64 ones)."""
    n, me = dist.get_world_size(), dist.get_rank()
    objs: list[Any] = [None] * n
    dist.all_gather_object(objs, {"rank": me, "text": "x" * (10 * me)})
    c.true("all_gather_object", objs == [{"rank": q, "text": "x" * (10 * q)} for q in range(n)])
    box = [{"from": "root", "n": n}] if me == n - 1 else [None]
    dist.broadcast_object_list(box, src=n - 1)
    c.true("broadcast_object_list", box == [{"from": "root", "n": n}])
    got: list[Any] = [None] * n if me == 0 else []
    dist.gather_object(("rank", me), got if me == 0 else None, dst=0)
    if me == 0:
        c.true("gather_object", got == [("rank", q) for q in range(n)])
    out: list[Any] = [None]
    dist.scatter_object_list(out, [f"for {q}" for q in range(n)] if me == 0 else None, src=0)
    c.true("scatter_object_list", out == [f"for {me}"])


def check_errors(c: Checks) -> dict[str, str]:
    me = dist.get_rank()
    texts = {}
    texts["bool"] = c.raises(
        "bool all_reduce",
        lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool)),
        mt.UnsupportedError,
        "all_reduce",
        "torch.bool",
    )
    texts["int16"] = c.raises(
        "int16 broadcast",
        lambda: dist.broadcast(torch.ones(3, dtype=torch.int16), 0),
        mt.UnsupportedError,
        "broadcast",
        "torch.int16",
    )
    # Complex tensors: torch itself hands SUM and broadcast over as float pairs (view_as_real).
    z = torch.full((3,), 1 + 2j, dtype=torch.complex64)
    dist.all_reduce(z)
    c.eq(
        "complex all_reduce (as float pairs)",
        z,
        torch.full((3,), (1 + 2j) * dist.get_world_size(), dtype=torch.complex64),
    )
    texts["band"] = c.raises(
        "BAND", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=R.BAND), mt.UnsupportedError, "BAND"
    )
    texts["sparse max"] = c.raises(
        "sparse MAX",
        lambda: dist.all_reduce(torch.sparse_coo_tensor([[0]], [1.0], (4,), check_invariants=True), op=R.MAX),
        mt.UnsupportedError,
        "sparse",
        "SUM only",
    )
    texts["tag range"] = c.raises(
        "a negative tag", lambda: dist.send(torch.ones(3), (me + 1) % 2, tag=-1), ValueError, "tag -1"
    )
    texts["uneven reduce_scatter"] = c.raises(
        "uneven reduce_scatter",
        lambda: dist.reduce_scatter(torch.empty(2), [torch.ones(2 + q) for q in range(dist.get_world_size())]),
        mt.UnsupportedError,
        "reduce_scatter",
        "sizes",
    )
    texts["monitored_barrier"] = c.raises("monitored_barrier", dist.monitored_barrier, Exception)
    # The group still works after refused calls (they were refused before anything was sent).
    x = torch.ones(4)
    dist.all_reduce(x)
    c.eq("all_reduce after refusals", x, torch.full((4,), float(dist.get_world_size())))
    return texts


# --- DDP: meshccl against Gloo -----------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def train(group: Any, steps: int, seed: int = 1234) -> tuple[list[torch.Tensor], float]:
    """DDP over `group`, the same model, data and optimizer whatever the backend."""
    torch.manual_seed(seed)
    model = Net()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed + 1000 * dist.get_rank())
    t0 = time.perf_counter()
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
    elapsed = time.perf_counter() - t0
    return [p.detach().clone() for p in model.parameters()], elapsed


def check_ddp(c: Checks, mesh_pg: Any, gloo: Any, steps: int = 5) -> dict[str, Any]:
    before = dict(mesh_pg.calls)
    mesh_params, t_mesh = train(None, steps)
    calls = {k: v - before.get(k, 0) for k, v in mesh_pg.calls.items() if v - before.get(k, 0)}
    gloo_params, t_gloo = train(gloo, steps)
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(mesh_params, gloo_params, strict=True))
    c.true(f"DDP meshccl vs Gloo: max |difference| {diff:g} <= 1e-5", diff <= 1e-5)
    # Every rank holds the same parameters (gathered over Gloo, compared exactly).
    flat = torch.cat([p.double().reshape(-1) for p in mesh_params])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat, group=gloo)
    c.true("DDP: every rank holds the same parameters", all(torch.equal(e, flat) for e in every))
    torch.manual_seed(1234)
    start = [p.detach() for p in Net().parameters()]
    moved = max(float((a.double() - b.double()).abs().max()) for a, b in zip(mesh_params, start, strict=True))
    c.true("DDP: training moved the parameters", moved > 1e-3)
    return {"ddp_max_diff": diff, "ddp_calls": calls, "ddp_seconds_meshccl": t_mesh, "ddp_seconds_gloo": t_gloo}


def timed(group: Any, elements: int, reps: int) -> float:
    """Median seconds of one float32 all_reduce of `elements` over `group` (figures for the
    report; nothing asserts on them)."""
    x = torch.ones(elements)
    dist.all_reduce(x, group=group)
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# --- FSDP2 (fully_shard) and functional collectives: meshccl against Gloo -------------------------------


def train_fsdp(group: Any, steps: int, seed: int = 99) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8))
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(torch.randn(8, 24, generator=gen)), torch.randn(8, 8, generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.to_local().detach().clone() for p in model.parameters()]  # this rank's shards


def check_fsdp(c: Checks, mesh_pg: Any, gloo: Any) -> dict[str, Any]:
    world = dist.group.WORLD
    before = dict(mesh_pg.calls)
    mesh_shards = train_fsdp(world, 3)
    calls = {k: v - before.get(k, 0) for k, v in mesh_pg.calls.items() if v - before.get(k, 0)}
    gloo_shards = train_fsdp(gloo, 3)
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(mesh_shards, gloo_shards, strict=True))
    c.true(f"FSDP2 meshccl vs Gloo: max |difference| {diff:g} <= 1e-5", diff <= 1e-5)
    # Functional collectives (DTensor, torch.compile) reach the group through torch's C++ ops.
    import torch.distributed._functional_collectives as fc

    n, me = dist.get_world_size(), dist.get_rank()
    got = fc.all_reduce(value(me, 10).float(), "sum", world).wait()
    c.eq("functional all_reduce", got, reference("sum", n, 10).float())
    got = fc.all_gather_tensor(value(me, 4).float(), 0, world).wait()
    c.eq("functional all_gather_tensor", got, torch.cat([value(q, 4) for q in range(n)]).float())
    return {"fsdp_max_diff": diff, "fsdp_calls": calls}


def check_groups(c: Checks) -> None:
    """Groups the suite does not form: ranks that are not contiguous, and one rank in two groups used alternately
    (each group its own communicator; calls on one never meet the other's)."""
    n, me = dist.get_world_size(), dist.get_rank()
    ends = [0, n - 1]  # not contiguous when n > 2
    a = dist.new_group([0, 1], backend="meshccl")
    b = dist.new_group([1, n - 1] if n > 2 else [0, 1], backend="meshccl")
    e = dist.new_group(ends, backend="meshccl")
    for k in range(3):
        for name, members, group in (("[0, 1]", [0, 1], a), ("[1, n-1]", [1, n - 1] if n > 2 else [0, 1], b)):
            if me in members:
                x = value(members.index(me), 1000 + k).float()
                dist.all_reduce(x, group=group)
                c.eq(f"group {name} round {k}", x, reference("sum", 2, 1000 + k).float())
    if me in ends:
        y = torch.empty(2 * 5, dtype=torch.int64)
        dist.all_gather_into_tensor(y, value(me, 5), group=e)
        c.eq("group of the first and last ranks", y, torch.cat([value(0, 5), value(n - 1, 5)]))
        dist.send(torch.full((3,), float(me)), ends[1 - ends.index(me)], group=e, tag=4)
        z = torch.empty(3)
        dist.recv(z, ends[1 - ends.index(me)], group=e, tag=4)
        c.eq("send/recv inside that group", z, torch.full((3,), float(ends[1 - ends.index(me)])))


# --- tagged messages, any source, sparse all_reduce -------------------------------------------------------------


def check_messages(c: Checks, gloo: Any) -> None:
    """Messages as torch matches them, the same on the meshccl group and on Gloo: a receive takes its tag whatever
    the sender sent first (sizes that differ, so a wrong match cannot pass), and a receive without a source takes
    each rank's messages in the order that rank sent them and says who sent each."""
    n, me = dist.get_world_size(), dist.get_rank()
    sizes = {1: 5, 2: 3000, 3: 300_000}  # one frame, a few segments, segments over every connection
    for name, group in (("meshccl", None), ("gloo", gloo)):
        if me == 0:
            works = [dist.isend(torch.full((k,), 10.0 * tag + me), 1, group=group, tag=tag) for tag, k in sizes.items()]
            for w in works:
                w.wait()
        elif me == 1:
            for tag in (3, 1, 2):  # not the order sent
                y = torch.full((sizes[tag],), -1.0)
                dist.recv(y, 0, group=group, tag=tag)
                c.eq(f"{name}: tag {tag} received out of order", y, torch.full((sizes[tag],), 10.0 * tag))
        dist.barrier(group=group)
        # Everyone sends two messages to rank 0, which receives from any rank: recv() and irecv().
        if me == 0:
            got: list[int] = []
            for k in range(2 * (n - 1)):
                y = torch.full((7,), -1.0)
                if k % 2:
                    w = dist.irecv(y, group=group)
                    w.wait()
                    src = w._source_rank()
                else:
                    src = dist.recv(y, group=group)
                c.true(f"{name}: a receive from any rank says who sent it ({src})", 0 < src < n)
                c.eq(
                    f"{name}: message {got.count(src)} of rank {src}", y, torch.full((7,), 100.0 * src + got.count(src))
                )
                got.append(src)
            c.true(
                f"{name}: two messages from every rank ({sorted(got)})", sorted(got) == sorted(2 * list(range(1, n)))
            )
        else:
            for k in range(2):
                dist.send(torch.full((7,), 100.0 * me + k), 0, group=group)
        dist.barrier(group=group)
    # Sparse SUM, as Gloo gives it: counts of entries differ per rank, and a dense dimension.
    for dense in ((), (2,)):
        idx = torch.tensor([list(range(me + 1))])
        vals = torch.ones((me + 1, *dense)) * (me + 1)
        mine = torch.sparse_coo_tensor(idx, vals, (n + 1, *dense), check_invariants=True)
        a, b = mine.clone(), mine.clone()
        dist.all_reduce(a)
        dist.all_reduce(b, group=gloo)
        c.eq(f"sparse all_reduce {dense}", a.to_dense(), b.to_dense())
        parts = [
            torch.sparse_coo_tensor([list(range(q + 1))], torch.ones((q + 1, *dense)) * (q + 1), (n + 1, *dense))
            for q in range(n)
        ]
        want = functools.reduce(operator.add, parts)
        c.eq(f"sparse all_reduce {dense} against the sum", a.to_dense(), want.to_dense())


# --- scenarios -------------------------------------------------------------------------------------------------


def check_gather_coalesced(c: Checks, gloo: Any) -> None:
    """all_gather_coalesced fills one output list per rank (rank q's inputs, in order), as Gloo does: as many inputs
    of one shape as ranks (where reading the lists the other way round gives no error, only a wrong answer), and
    inputs of several shapes."""
    n, me = dist.get_world_size(), dist.get_rank()
    for shapes in (tuple((3,) for _ in range(n)), ((2, 2), (1,), (3,)), ((4,),)):
        mine = [torch.arange(float(torch.Size(s).numel())).reshape(s) + 100 * me + 10 * i for i, s in enumerate(shapes)]
        got = [[torch.full(s, -1.0) for s in shapes] for _ in range(n)]
        gloos = [[torch.full(s, -1.0) for s in shapes] for _ in range(n)]
        dist.all_gather_coalesced(got, mine)
        dist.all_gather_coalesced(gloos, mine, group=gloo)
        for q in range(n):
            for i, s in enumerate(shapes):
                want = torch.arange(float(torch.Size(s).numel())).reshape(s) + 100 * q + 10 * i
                c.eq(f"all_gather_coalesced {shapes}: rank {q}'s input {i}", got[q][i], want)
                c.eq(f"all_gather_coalesced {shapes}: rank {q}'s input {i} as Gloo gives it", got[q][i], gloos[q][i])
    # Lists that are not one per rank, or not one tensor per input: an error naming the layout, never a guess.
    c.raises(
        "all_gather_coalesced with one list per input",
        lambda: dist.all_gather_coalesced([[torch.zeros(3) for _ in range(n)]], [torch.zeros(3)]),
        ValueError,
        "one output list per rank",
    )


def scenario_ops(c: Checks) -> dict[str, Any]:
    t0 = time.perf_counter()
    dist.init_process_group("meshccl", timeout=datetime.timedelta(seconds=120))
    out: dict[str, Any] = {"init_seconds": time.perf_counter() - t0}
    pg = dist.distributed_c10d._get_default_group()
    c.true("the default group is meshccl's", isinstance(pg, mt.ProcessGroupMeshccl) and dist.get_backend() == "meshccl")
    out["transport"] = pg.communicator.info()["transport"]
    n, me = dist.get_world_size(), dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    c.true("the Gloo group is Gloo's", dist.get_backend(gloo) == "gloo")
    t0 = time.perf_counter()
    check_ops(c)
    out["ops_seconds"] = time.perf_counter() - t0
    check_async(c)
    check_objects(c)
    out["errors"] = check_errors(c)
    # A Gloo group and the meshccl group side by side: the same reduction, the same result.
    a = value(me, 777).float()
    b = a.clone()
    dist.all_reduce(a)
    dist.all_reduce(b, group=gloo)
    c.eq("Gloo group and meshccl group agree", a, b)
    check_gather_coalesced(c, gloo)
    check_messages(c, gloo)
    check_groups(c)
    # A meshccl group of some of the ranks (its own communicator, met through torch's store).
    members = list(range(n - 1))
    sub = dist.new_group(members, backend="meshccl")
    if me in members:
        c.true("subgroup is meshccl's", dist.get_backend(sub) == "meshccl")
        x = value(me, 1001).float()
        dist.all_reduce(x, group=sub)
        c.eq("subgroup all_reduce", x, reference("sum", n - 1, 1001).float())
        y = torch.empty((n - 1) * 3, dtype=torch.int64)
        dist.all_gather_into_tensor(y, value(me, 3), group=sub)
        c.eq("subgroup all_gather", y, torch.cat([value(q, 3) for q in members]))
    out.update(check_ddp(c, pg, gloo))
    out.update(check_fsdp(c, pg, gloo))
    out["calls"] = dict(pg.calls)
    out["timings"] = {
        name: {"meshccl": timed(None, elements, reps), "gloo": timed(gloo, elements, reps)}
        for name, elements, reps in (("4KiB", 1024, 200), ("16MiB", 4 << 20, 5))
    }
    # A failed call: its error reaches Work.wait() (async) and names the mismatch; then the group
    # is unusable, as meshccl's communicators are after an error.
    work = dist.all_reduce(torch.ones(100 + me), async_op=True)
    out["mismatch"] = c.raises("mismatched all_reduce", work.wait, meshccl.MismatchError, "mismatch")
    dist.destroy_process_group()
    # Again, the other way round: Gloo the default group, meshccl a group beside it (a new
    # communicator, met on a port agreed through torch's store again).
    dist.init_process_group("gloo")
    mesh = dist.new_group(backend="meshccl")
    c.true("meshccl group beside a Gloo default", dist.get_backend() == "gloo" and dist.get_backend(mesh) == "meshccl")
    x = value(me, 3001).double()
    dist.all_reduce(x, group=mesh)
    c.eq("all_reduce on a meshccl group beside a Gloo default", x, reference("sum", n, 3001).double())
    dist.destroy_process_group()
    return out


def scenario_hostfile(c: Checks) -> dict[str, Any]:
    dist.init_process_group("meshccl", timeout=datetime.timedelta(seconds=120))
    pg = dist.distributed_c10d._get_default_group()
    n, me = dist.get_world_size(), dist.get_rank()
    info = pg.communicator.info()
    plan = pg.communicator.plan
    out: dict[str, Any] = {
        "source": plan.source,
        "transports": info["transports"],
        "endpoints": {q: [f"{a}:{p}" for a, p in eps] for q, (eps, _who) in plan.peers.items()},
    }
    for count in (1, 4099, 3 << 20):
        x = value(me, count).float()
        dist.all_reduce(x)
        c.eq(f"all_reduce {count}", x, reference("sum", n, count).float())
    x = value(me, 2 << 20, "max").to(torch.bfloat16)
    dist.all_reduce(x, op=R.MAX)
    c.eq("all_reduce bfloat16 max", x, reference("max", n, 2 << 20).to(torch.bfloat16))
    # Groups of meshccl.json's ranks on fresh ports: two ranks on different hosts (over their
    # cables), and the whole world a second time (the first group holds the file's ports).
    pair = [0, n // 2]
    sub = dist.new_group(pair, backend="meshccl")
    if me in pair:
        out["pair_endpoints"] = {
            q: [f"{a}:{p}" for a, p in eps] for q, (eps, _who) in sub.communicator.plan.peers.items()
        }
        x = value(pair.index(me), 100_000).float()
        dist.all_reduce(x, group=sub)
        c.eq("cross-host pair all_reduce", x, reference("sum", 2, 100_000).float())
    # The ranks of one host, a group beside the world group: shared memory between them, the world's cables unused.
    local = [q for q in range(n) if q // 2 == 0]
    near = dist.new_group(local, backend="meshccl")
    if me in local:
        out["local_transport"] = near.communicator.info()["transport"]
        x = value(local.index(me), 70_000).float()
        dist.all_reduce(x, group=near)
        c.eq("one host's group all_reduce", x, reference("sum", len(local), 70_000).float())
    x = value(me, 900).float()
    dist.all_reduce(x)  # the world group, in between
    c.eq("world all_reduce beside the host's group", x, reference("sum", n, 900).float())
    again = dist.new_group(backend="meshccl")
    x = value(me, 5000).double()
    dist.all_reduce(x, group=again)
    c.eq("second world group all_reduce", x, reference("sum", n, 5000).double())
    out["again_source"] = again.communicator.plan.source
    gloo = dist.new_group(backend="gloo")
    out.update(check_ddp(c, pg, gloo, steps=3))
    dist.destroy_process_group()
    return out


def scenario_barrier_timeout(c: Checks) -> dict[str, Any]:
    """`dist.barrier(timeout=...)` in a group whose own timeout is 120 s: the barrier's timeout is its alone."""
    group_timeout = 120.0
    dist.init_process_group("meshccl", timeout=datetime.timedelta(seconds=group_timeout))
    comm = dist.distributed_c10d._get_default_group().communicator
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    dist.barrier(timeout=datetime.timedelta(seconds=30))
    c.true(f"the group's timeout is back after a barrier with its own: {comm.timeout}", comm.timeout == group_timeout)
    # An all_reduce posted before a barrier with a 1 s timeout, rank 1 coming to it 1.5 s late: the all_reduce runs
    # under the group's timeout, the barrier after it under its own.
    if me == 1:
        time.sleep(1.5)
    x = value(me, 1000).float()
    work = dist.all_reduce(x, async_op=True)
    dist.barrier(timeout=datetime.timedelta(seconds=1))
    work.wait()
    c.eq(
        "all_reduce posted before a barrier with a shorter timeout",
        x,
        reference("sum", dist.get_world_size(), 1000).float(),
    )
    out: dict[str, Any] = {}
    if me == 0:  # the only rank at the barrier
        start = time.monotonic()
        out["error"] = c.raises(
            "barrier no other rank comes to",
            lambda: dist.barrier(timeout=datetime.timedelta(seconds=1)),
            meshccl.TimeoutError,
        )
        out["timed_out_after"] = time.monotonic() - start
        store.set("barrier_timeout_seen", "1")
    else:
        store.get("barrier_timeout_seen")
    dist.destroy_process_group()
    return out


def main() -> int:
    scenario = sys.argv[1]
    c = Checks()
    try:
        scenarios = {"ops": scenario_ops, "hostfile": scenario_hostfile, "barrier_timeout": scenario_barrier_timeout}
        result = scenarios[scenario](c)
    except Exception as e:  # reported for the test to show
        say(f"FAIL {type(e).__name__}: {e}")
        traceback.print_exc()
        return 3
    say("RESULT " + json.dumps({"rank": int(os.environ.get("RANK", "0")), "checks": c.n, **result}))
    say("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
