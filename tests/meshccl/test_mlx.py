"""meshccl with MLX arrays (meshccl.mlx), in real 2-rank jobs on this machine: arrays go in and
come out without copies (proved by meshccl's own overlap check and by views taken before the
call), every collective is exact for every dtype meshccl has, over shared memory and over TCP,
gradient trees are averaged as a data-parallel step must average them, and what meshccl cannot
take is refused by name before anything is sent.

Run as a script, this file is one rank of a job: ``test_mlx.py SCENARIO [ARGS]`` (prints OK)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import meshccl
import meshccl.mlx as mccl
import mlx.core as mx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
DP_STEP = REPO / "tests" / "integration" / "programs" / "mlx_dp_step.py"
DTYPES = [mx.float32, mx.float64, mx.float16, mx.bfloat16, mx.int8, mx.int32, mx.int64, mx.uint8]
UNSUPPORTED = [mx.bool_, mx.int16, mx.uint16, mx.uint32, mx.uint64, mx.complex64]
OPS = ("sum", "prod", "min", "max")


# --- one rank of a job --------------------------------------------------------------------------


def address(a: mx.array) -> int:
    """Where a's data lies (its buffer, after evaluating it)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(memoryview(a)))


def values(a: mx.array) -> np.ndarray:
    """a's values as float64 (exact for every dtype used here: small integers)."""
    return np.array(a.astype(mx.float32), dtype=np.float64)


def as_mx(v: np.ndarray, dtype) -> mx.array:
    return mx.array(np.asarray(v, dtype=np.float32)).astype(dtype)


def inputs(op: str, rank: int, count: int) -> np.ndarray:
    """Small integers: exact in every dtype, and so are their sums, products, minima, maxima."""
    i = np.arange(count)
    if op == "sum":
        return (rank + 1) * (1 + i % 5)
    if op == "prod":
        return 1 + ((i + rank) % 3 == 0)
    return (i * 3 + rank * 5) % 17


def reduced(op: str, n: int, count: int) -> np.ndarray:
    stack = np.stack([inputs(op, r, count) for r in range(n)])
    return {"sum": stack.sum(0), "prod": stack.prod(0), "min": stack.min(0), "max": stack.max(0)}[op]


def check(what: str, got: mx.array, want: np.ndarray, dtype=None, shape=None) -> None:
    assert isinstance(got, mx.array), f"{what}: got a {type(got).__name__}, not an mx.array"
    if dtype is not None:
        assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    if shape is not None:
        assert tuple(got.shape) == tuple(shape), f"{what}: shape {got.shape}, expected {shape}"
    g = values(got).reshape(-1)
    w = np.asarray(want, dtype=np.float64).reshape(-1)
    bad = np.nonzero(g != w)[0]
    assert g.size == w.size and not bad.size, (
        f"{what}: {bad.size} of {w.size} wrong; first at {bad[:1]}: got {g[bad[:1]]} expected {w[bad[:1]]}"
    )


def scenario_zero_copy(comm: meshccl.Communicator) -> None:
    n, r = comm.size, comm.rank
    for dt in DTYPES:
        x = as_mx(inputs("sum", r, 1000), dt) * 1  # lazy: meshccl.mlx evaluates it
        where = address(x)
        alias = memoryview(x)  # taken before the call: sees x's memory, whatever happens to x
        flat = mccl.buffer(x)
        assert ctypes.addressof(ctypes.c_char.from_buffer(flat)) == where, f"{dt}: buffer() is not x's memory"
        del flat
        assert mccl.all_reduce(comm, x, out=x) is x
        assert address(x) == where, f"{dt}: x moved"
        expected = as_mx(reduced("sum", n, 1000), dt)
        assert bytes(alias) == bytes(memoryview(expected)), f"{dt}: the result is not in x's own memory"
        check(f"{dt} in place", x, reduced("sum", n, 1000))
        # A new output: meshccl writes into the array handed back, which is evaluated, and stays put.
        y = mccl.all_reduce(comm, as_mx(inputs("max", r, 333), dt), op="max")
        where_y = address(y)
        check(f"{dt} out of place", y, reduced("max", n, 333), dt, (333,))
        assert address(y) == where_y
    # Inputs are read where they lie: meshccl refuses an input and an output that overlap without
    # being the same buffer. Two views of one array, one element apart, overlap only if neither
    # was copied on the way in. Refused before anything is sent, on every rank alike.
    base = mx.arange(1001).astype(mx.float32)
    mx.eval(base)
    for call in (
        lambda: mccl.all_reduce(comm, base[0:1000], out=base[1:1001]),
        lambda: comm.all_reduce(base[0:1000], out=base[1:1001]),  # the binding itself (DLPack)
    ):
        try:
            call()
        except meshccl.InvalidArgumentError as e:
            assert "overlap" in str(e), e
        else:
            raise AssertionError("overlapping views of one mx.array were accepted: an input was copied")
    # The same views, apart: the input is read from base's memory while base is written.
    x = mx.array(np.arange(6, dtype=np.float32) + r)
    mccl.all_gather(comm, x, out=base[: 6 * n])
    check("all_gather into a view", base[: 6 * n], np.concatenate([np.arange(6) + q for q in range(n)]))
    comm.barrier()


def scenario_sweep(comm: meshccl.Communicator) -> None:
    n, r = comm.size, comm.rank
    for dt in DTYPES:
        for count in (0, 1, 7, n * 257 + 3, 300_000 if dt == mx.float32 else 5000):
            for op in OPS:
                x = as_mx(inputs(op, r, count), dt)
                check(
                    f"all_reduce {dt} {op} {count}", mccl.all_reduce(comm, x, op), reduced(op, n, count), dt, (count,)
                )
                out = mx.zeros((count,), dtype=dt)
                assert mccl.all_reduce(comm, x, op, out=out) is out
                check(f"all_reduce out= {dt} {op} {count}", out, reduced(op, n, count))
            x = as_mx(inputs("sum", r, count), dt)
            mccl.all_reduce(comm, x, out=x)
            check(f"all_reduce in place {dt} {count}", x, reduced("sum", n, count))
            # Shapes survive: a 2-D array, gathered and scattered along its first axis.
            rows = as_mx(((np.arange(count * 2) + 31 * r) % 100).reshape(count, 2), dt)
            got = mccl.all_gather(comm, rows)
            want = np.concatenate([((np.arange(count * 2) + 31 * q) % 100).reshape(count, 2) for q in range(n)])
            check(f"all_gather {dt} {count}", got, want, dt, (n * count, 2))
            full = as_mx(inputs("max", r, n * count * 2).reshape(n * count, 2), dt)
            part = mccl.reduce_scatter(comm, full, "max")
            check(
                f"reduce_scatter {dt} {count}",
                part,
                reduced("max", n, n * count * 2)[r * count * 2 : (r + 1) * count * 2],
                dt,
                (count, 2),
            )
            root = n - 1
            mine = as_mx((np.arange(count) + 7 * r) % 100, dt)
            got = mccl.broadcast(comm, mine, root=root)
            check(f"broadcast {dt} {count}", got, (np.arange(count) + 7 * root) % 100, dt, (count,))
            assert (got is mine) == (r == root), "root gets its own array back, other ranks a new one"
            buf = as_mx((np.arange(count) + 7 * r) % 100, dt)
            assert mccl.broadcast(comm, buf, root=0, out=buf) is buf
            check(f"broadcast in place {dt} {count}", buf, np.arange(count) % 100)
            out = mx.zeros((count,), dtype=dt)
            mccl.broadcast(comm, as_mx((np.arange(count) + 3 * r) % 100, dt), root=0, out=out)
            check(f"broadcast out= {dt} {count}", out, np.arange(count) % 100)
            # send/recv around the ring, even ranks sending first.
            nxt, prv = (r + 1) % n, (r - 1) % n
            payload = as_mx((np.arange(count) + 11 * r) % 100, dt)
            if r % 2 == 0:
                mccl.send(comm, payload, nxt)
                got = mccl.recv_like(comm, payload, prv)
            else:
                got = mccl.recv(comm, (count,), dt, prv)
                mccl.send(comm, payload, nxt)
            check(f"send/recv {dt} {count}", got, (np.arange(count) + 11 * prv) % 100, dt, (count,))
    # 0-d arrays and an input MLX must make contiguous (transposed, broadcast): results still exact.
    check("0-d all_reduce", mccl.all_reduce(comm, mx.array(float(r + 1))), [n * (n + 1) / 2], shape=())
    check("0-d all_gather", mccl.all_gather(comm, mx.array(r)), np.arange(n), shape=(n,))
    t = (mx.arange(12).reshape(3, 4) * (r + 1)).T
    check("transposed input", mccl.all_reduce(comm, t), np.arange(12).reshape(3, 4).T * n * (n + 1) / 2, shape=(4, 3))
    b = mx.broadcast_to(mx.array([float(r)]), (5,))
    check("broadcast-view input", mccl.all_reduce(comm, b, "max"), np.full(5, n - 1))
    comm.barrier()


def tree_of(rank: int) -> dict:
    """A gradient tree like a model's: nested dicts and lists, three dtypes, odd sizes."""
    return {
        "embed": {"weight": as_mx(inputs("sum", rank, 600).reshape(20, 30), mx.float32)},
        "layers": [
            {
                "weight": as_mx(inputs("sum", rank, 64).reshape(8, 8), mx.bfloat16),
                "bias": as_mx([rank + 1], mx.float32),
            },
            {
                "weight": as_mx(inputs("sum", rank, 45).reshape(5, 9), mx.float16),
                "bias": as_mx([2 * rank], mx.bfloat16),
            },
        ],
        "scale": as_mx(rank + 3, mx.float32),
    }


def scenario_trees(comm: meshccl.Communicator) -> None:
    from mlx.utils import tree_flatten

    n, r = comm.size, comm.rank
    mine = tree_flatten(tree_of(r))
    per_rank = [dict(tree_flatten(tree_of(q))) for q in range(n)]
    for size in (0, 64, 1 << 10, mccl.ALL_REDUCE_SIZE):  # one call per array .. everything in one bucket
        summed = tree_flatten(mccl.all_reduce_tree(comm, tree_of(r), all_reduce_size=size))
        averaged = tree_flatten(mccl.average_gradients(comm, tree_of(r), all_reduce_size=size))
        root = tree_flatten(mccl.broadcast_tree(comm, tree_of(r), root=n - 1, all_reduce_size=size))
        assert [k for k, _ in summed] == [k for k, _ in mine] == [k for k, _ in averaged] == [k for k, _ in root]
        for (key, a), (_, s), (_, m), (_, b) in zip(mine, summed, averaged, root, strict=True):
            total = sum(values(p[key]) for p in per_rank)
            check(f"all_reduce_tree {key} bucket {size}", s, total, a.dtype, a.shape)
            # Halves of small integers: exact in every float dtype, so the average is exact too.
            check(f"average_gradients {key} bucket {size}", m, total / n, a.dtype, a.shape)
            check(f"broadcast_tree {key} bucket {size}", b, values(per_rank[n - 1][key]), a.dtype, a.shape)
    comm.barrier()


def expect_refused(what: str, error: type, words: str, call) -> None:
    try:
        call()
    except error as e:
        assert words in str(e), f"{what}: {type(e).__name__}: {e} (expected it to say {words!r})"
    else:
        raise AssertionError(f"{what}: accepted, expected {error.__name__} saying {words!r}")


def scenario_errors(comm: meshccl.Communicator) -> None:
    n, r = comm.size, comm.rank
    for dt in UNSUPPORTED:
        x = mx.zeros((4,), dtype=dt)
        name = str(dt).split(".")[-1]
        for what, call in (
            ("all_reduce", lambda x=x: mccl.all_reduce(comm, x)),
            ("all_gather", lambda x=x: mccl.all_gather(comm, x)),
            ("reduce_scatter", lambda x=x: mccl.reduce_scatter(comm, x)),
            ("broadcast", lambda x=x: mccl.broadcast(comm, x)),
            ("send", lambda x=x: mccl.send(comm, x, (r + 1) % n)),
            ("recv", lambda dt=dt: mccl.recv(comm, (4,), dt, (r + 1) % n)),
            ("average_gradients", lambda x=x: mccl.average_gradients(comm, {"w": x})),
        ):
            expect_refused(f"{what} {name}", TypeError, f"meshccl has no mlx.core.{name}", call)
    grid = mx.zeros((4, 6))
    expect_refused(
        "transposed out=", ValueError, "not row-contiguous", lambda: mccl.all_reduce(comm, grid.T, out=grid.T)
    )
    expect_refused(
        "strided out=", ValueError, "not row-contiguous", lambda: mccl.all_reduce(comm, grid[:, 0], out=grid[:, 1])
    )
    expect_refused(
        "out of another dtype", TypeError, "dtype", lambda: mccl.all_reduce(comm, grid, out=mx.zeros((4, 6), mx.int32))
    )
    expect_refused("out of another size", ValueError, "must hold 24", lambda: mccl.all_reduce(comm, grid, out=grid[:2]))
    expect_refused(
        "reduce_scatter of an uneven first axis",
        ValueError,
        f"multiple of the world size {n}",
        lambda: mccl.reduce_scatter(comm, mx.zeros((2 * n + 1, 3))),
    )
    expect_refused("a NumPy array", TypeError, "expected an mx.array", lambda: mccl.all_reduce(comm, np.zeros(3)))
    expect_refused(
        "a tree leaf that is not an array", TypeError, "leaf 'lr'", lambda: mccl.all_reduce_tree(comm, {"lr": 0.1})
    )
    # Nothing was sent: the job goes on.
    check("after the refusals", mccl.all_reduce(comm, mx.array([float(r)])), [n * (n - 1) / 2])
    comm.barrier()


SCENARIOS = {
    "zero_copy": scenario_zero_copy,
    "sweep": scenario_sweep,
    "trees": scenario_trees,
    "errors": scenario_errors,
}


def rank_main(argv: list[str]) -> int:
    comm = meshccl.init()
    try:
        for name in argv:
            SCENARIOS[name](comm)
    except meshccl.Error as e:
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        return 3
    finally:
        comm.close()
    print("OK", flush=True)
    return 0


# --- the tests ----------------------------------------------------------------------------------


def hostfile(tmp_path: Path, transport: str) -> Path:
    """Two ranks: on one host (shared memory; large calls read the peer's mx.array directly), or
    on two hosts cabled once (TCP over loopback addresses)."""
    from . import helpers

    if transport == "shm":
        return helpers.loopback_hostfile(tmp_path, 2)
    return helpers.meshccl_hostfile(tmp_path, [(1, 2)], 2)


def job(path: Path, argv: list[str], n: int = 2, timeout: float = 120) -> list[tuple[int, str, str]]:
    from . import helpers

    base = {k: v for k, v in os.environ.items() if k not in ("MESHCCL_ALLOW_NO_TOKEN", "MESHCCL_JOB_ID")}
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            env={
                **base,
                "MESHCCL_TOKEN": helpers.TOKEN,
                "MESHCCL_RANK": str(r),
                "MESHCCL_WORLD_SIZE": str(n),
                "MESHCCL_HOSTFILE": str(path),
                "MESHCCL_TIMEOUT": "60",
            },
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]
    return helpers.finish(procs, timeout)


def assert_all_ok(results: list[tuple[int, str, str]]) -> None:
    for r, (code, out, err) in enumerate(results):
        assert code == 0 and "OK" in out, f"rank {r} exit {code}\nstdout: {out}\nstderr: {err}"


def test_arrays_go_in_and_come_out_without_copies(tmp_path):
    assert_all_ok(job(hostfile(tmp_path, "shm"), [__file__, "zero_copy"]))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_every_collective_exact_for_every_dtype_and_trees(tmp_path, transport):
    assert_all_ok(job(hostfile(tmp_path, transport), [__file__, "sweep", "trees"]))


def test_what_meshccl_cannot_take_is_refused_by_name(tmp_path):
    assert_all_ok(job(hostfile(tmp_path, "tcp"), [__file__, "errors"]))


def test_data_parallel_step_gives_the_expected_average(tmp_path):
    results = job(hostfile(tmp_path, "tcp"), [str(DP_STEP)])
    for r, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {r} exit {code}\nstdout: {out}\nstderr: {err}"
        line = out.strip()
        assert line.startswith(f"mlx-dp rank {r}/2 ok max_err=") and line.endswith("params=76810"), line


def test_data_parallel_step_fails_on_a_wrong_average(tmp_path):
    """The step's check can fail: a gradient sum that is not divided by the world size (rank 1's
    only) is reported by name, and the step exits 1."""
    wrapper = tmp_path / "undivided.py"
    wrapper.write_text(
        "import runpy, sys\n"
        "import meshccl.mlx as mccl\n"
        "from mlx.utils import tree_map\n"
        "average = mccl.average_gradients\n"
        "def undivided(comm, grads, **kw):\n"
        "    out = average(comm, grads, **kw)\n"
        "    return tree_map(lambda g: g * comm.size, out) if comm.rank == 1 else out\n"
        "mccl.average_gradients = undivided\n"
        f"runpy.run_path({str(DP_STEP)!r}, run_name='__main__')\n"
    )
    results = job(hostfile(tmp_path, "tcp"), [str(wrapper)])
    (code0, out0, err0), (code1, out1, err1) = results
    assert code1 == 1 and "mlx-dp rank 1/2 FAILED:" in err1 and "averaged gradients wrong" in err1, (code1, out1, err1)
    assert "ok" not in out1, out1
    # Rank 0 averaged right, and sees that rank 1 holds other values.
    assert code0 == 1 and "ranks [1] hold averaged gradients that differ" in err0, (code0, out0, err0)


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
