"""One data-parallel MLX training step over meshccl, checked against what it must give.

Every rank computes the gradients of one fixed model (weights from a fixed seed) on its own
deterministic shard of data (seeded by its rank), averages them over the job with
meshccl.mlx.average_gradients, then recomputes locally, in this process, the gradients of every
rank's shard and their average in float64, and compares. It prints exactly one line,

    mlx-dp rank <r>/<n> ok max_err=<e> params=<count>

and exits 0, or prints what is wrong to stderr and exits 1.

Tolerance (per element, float32 gradients): meshccl sums the n ranks' float32 values in some
order (n - 1 roundings of at most u = 2**-24 relative each) and the average divides once more, so
|got - want| <= u * ((n - 1) * sum_r |g_r| + |sum_r g_r|) / n to first order (Higham's bound for
recursive summation). The check allows twice that: a gap of 2**-24 relative, not a loose rtol; an
element whose gradients are all zero must be exactly zero. This holds because the gradients the
job averaged are the ones recomputed here, bit for bit (same program, same MLX, same inputs); that
is checked too (this rank's own gradients, computed twice), and so is that every rank holds the
same averaged bits (their SHA-256 digests, all-gathered).

Buckets of 32 KiB split the 76,810 parameters into one single-array bucket (sent as is) and two
packed ones (one above meshccl's small-message threshold, one below), so every path of
average_gradients runs.
"""

from __future__ import annotations

import hashlib
import os
import sys

import meshccl
import meshccl.mlx as mccl
import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

IN, HIDDEN, OUT, BATCH = 32, 256, 10, 24
BUCKET_BYTES = 32 << 10
U32 = 2.0**-24  # float32 unit roundoff


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, OUT)]

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers[:-1]:
            x = nn.relu(layer(x))
        return self.layers[-1](x)


def fixed_model() -> MLP:
    """The same weights on every rank, from a fixed seed (never from MLX's own initialiser)."""
    model = MLP()
    rng = np.random.default_rng(20)
    params = [
        (key, mx.array((rng.standard_normal(value.shape) / np.sqrt(value.shape[-1])).astype(np.float32)))
        for key, value in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def shard(rank: int) -> tuple[mx.array, mx.array]:
    """Rank's own batch: inputs and class labels, from a seed of its own."""
    rng = np.random.default_rng(1000 + rank)
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    y = rng.integers(0, OUT, size=BATCH).astype(np.int32)
    return mx.array(x), mx.array(y)


def loss_fn(model: MLP, x: mx.array, y: mx.array) -> mx.array:
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def gradients(model: MLP, rank: int) -> dict:
    _, grads = nn.value_and_grad(model, loss_fn)(model, *shard(rank))
    mx.eval(grads)
    return grads


def flat64(tree: dict) -> tuple[list[str], list[tuple[int, ...]], np.ndarray]:
    leaves = tree_flatten(tree)
    keys = [k for k, _ in leaves]
    shapes = [tuple(v.shape) for _, v in leaves]
    return keys, shapes, np.concatenate([np.array(v, dtype=np.float64).reshape(-1) for _, v in leaves])


def locate(index: int, keys: list[str], shapes: list[tuple[int, ...]]) -> str:
    for key, shape in zip(keys, shapes, strict=True):
        size = int(np.prod(shape))
        if index < size:
            return f"{key}{[int(i) for i in np.unravel_index(index, shape)]}"
        index -= size
    return f"element {index}"


def fail(rank: int, size: int, message: str) -> int:
    print(f"mlx-dp rank {rank}/{size} FAILED: {message}", file=sys.stderr, flush=True)
    return 1


def main() -> int:
    rank_hint = os.environ.get("MESHCCL_RANK", "?")
    try:
        comm = meshccl.init()
    except meshccl.Error as e:
        print(f"mlx-dp rank {rank_hint}: meshccl.init() failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    rank, size = comm.rank, comm.size
    try:
        model = fixed_model()
        mine = gradients(model, rank)
        averaged = mccl.average_gradients(comm, mine, all_reduce_size=BUCKET_BYTES)
        mx.eval(averaged)
        keys, shapes, got = flat64(averaged)
        got32 = np.concatenate([np.array(v, dtype=np.float32).reshape(-1) for _, v in tree_flatten(averaged)])
        digest = mx.array(np.frombuffer(hashlib.sha256(got32.tobytes()).digest(), dtype=np.uint8))
        digests = np.array(mccl.all_gather(comm, digest)).reshape(size, -1)
        comm.barrier()
    except meshccl.Error as e:
        return fail(rank, size, f"meshccl {type(e).__name__}: {e}")
    finally:
        comm.close()

    # The expectation, computed here: every rank's gradients on its own shard, averaged in float64.
    per_rank = []
    for r in range(size):
        _, _, g = flat64(gradients(model, r))
        per_rank.append(g)
    stack = np.stack(per_rank)
    _, _, mine64 = flat64(mine)
    if not np.array_equal(mine64, stack[rank]):
        return fail(rank, size, "MLX gave this rank's gradients differently twice in one process: cannot check")
    total = stack.sum(axis=0)
    want = total / size
    tolerance = 2 * U32 * ((size - 1) * np.abs(stack).sum(axis=0) + np.abs(total)) / size
    err = np.abs(got - want)
    bad = np.nonzero(err > tolerance)[0]
    if bad.size:
        i = int(bad[np.argmax(err[bad] - tolerance[bad])])
        return fail(
            rank,
            size,
            f"{bad.size} of {got.size} averaged gradients wrong; worst {locate(i, keys, shapes)}: "
            f"got {float(got[i])!r} expected {float(want[i])!r} (error {err[i]:.3g} > tolerance {tolerance[i]:.3g})",
        )
    differing = [r for r in range(size) if not np.array_equal(digests[r], digests[rank])]
    if differing:
        return fail(rank, size, f"ranks {differing} hold averaged gradients that differ from this rank's")
    print(f"mlx-dp rank {rank}/{size} ok max_err={float(err.max()):.3g} params={got.size}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
