"""Data-parallel training of a small MLX model, gradients averaged by meshccl over every cable.

    meshkit launch -i inventory/lab.yml -r meshccl --cwd "$PWD" -- .venv/bin/python examples/mlx_data_parallel.py

(-n 2 before the -- for two ranks per host; --steps 100 after the script for longer training.)
Ranks start in a job directory of their own: --cwd (or absolute paths) makes the relative script
path resolve, on every host, where it does here. The interpreter must have MLX and meshccl (the
checkout's .venv does: requirements-dev.txt has mlx[cpu]; on Macs, `pip install mlx` into the
environment that has meshccl). `meshkit launch -r meshccl` gives every rank MESHCCL_RANK,
MESHCCL_WORLD_SIZE, MESHCCL_HOSTFILE and the job token, which is all meshccl.init() reads.

Every rank builds the same MLP, takes rank 0's initial parameters (broadcast), and trains on its own
shard of one synthetic dataset (labels from a fixed random "teacher" network, the same on every
rank; rank r keeps samples r, r + n, r + 2n, ...). Each step: loss and gradients on the rank's own
batch, gradients averaged over all ranks with meshccl.mlx.average_gradients (packed into buckets,
one all-reduce per bucket, no copy on the way in or out), then the same optimizer update on every
rank. Rank 0 prints the loss of each step (averaged over the ranks) and the time the gradient
all-reduce took. At the end every rank checks that all ranks hold bit-identical parameters (SHA-256
digests, all-gathered); the program exits 1 if they do not.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import meshccl
import meshccl.mlx as mccl
import mlx.core as mx
import numpy as np
from mlx import nn, optimizers
from mlx.utils import tree_flatten

FEATURES, CLASSES, SAMPLES = 32, 8, 8192


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.layers = [nn.Linear(FEATURES, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, CLASSES)]

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers[:-1]:
            x = nn.relu(layer(x))
        return self.layers[-1](x)


def dataset(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and labels of the whole dataset, the same on every rank (NumPy, seeded)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    w1 = rng.standard_normal((FEATURES, 64)).astype(np.float32)
    w2 = rng.standard_normal((64, CLASSES)).astype(np.float32)
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype(np.int32)
    return x, y


def loss_fn(model: MLP, x: mx.array, y: mx.array) -> mx.array:
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def digest(tree: dict) -> mx.array:
    """SHA-256 of every parameter's bytes, in tree order, as 32 uint8."""
    h = hashlib.sha256()
    for key, value in tree_flatten(tree):
        h.update(key.encode())
        h.update(bytes(memoryview(value)))
    return mx.array(np.frombuffer(h.digest(), dtype=np.uint8))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    comm = meshccl.init()
    rank, size = comm.rank, comm.size
    say = print if rank == 0 else (lambda *a, **k: None)

    mx.random.seed(args.seed + rank)  # different on purpose: the broadcast below makes them equal
    model = MLP(args.hidden)
    model.update(mccl.broadcast_tree(comm, model.parameters(), root=0))
    optimizer = optimizers.Adam(learning_rate=args.lr)
    mx.eval(model.parameters())
    count = sum(value.size for _key, value in tree_flatten(model.parameters()))

    x_all, y_all = dataset(args.seed)
    x_mine, y_mine = mx.array(x_all[rank::size]), mx.array(y_all[rank::size])
    shard = x_mine.shape[0]
    say(
        f"mlx data parallel: {size} ranks, {count} parameters, {shard} samples per rank, "
        f"global batch {args.batch * size}, transport {comm.info()['transport'] or 'none'}",
        flush=True,
    )
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    order = np.random.default_rng(args.seed + 1000 + rank).permutation(shard)
    reduce_seconds = 0.0
    start = time.monotonic()
    for step in range(args.steps):
        first = (step * args.batch) % shard
        idx = mx.array(order[np.arange(first, first + args.batch) % shard])
        loss, grads = loss_and_grad(model, x_mine[idx], y_mine[idx])
        mx.eval(loss, grads)  # compute first, so the time below is the all-reduce's
        t0 = time.monotonic()
        grads = mccl.average_gradients(comm, grads)
        mx.eval(grads)
        reduce_seconds += time.monotonic() - t0
        optimizer.update(model, grads)
        mean_loss = mccl.all_reduce(comm, loss).item() / size
        mx.eval(model.parameters(), optimizer.state)
        say(f"step {step + 1:4d}/{args.steps} loss {mean_loss:.4f}", flush=True)
    elapsed = time.monotonic() - start

    logits = model(mx.array(x_all))
    accuracy = mx.mean(mx.argmax(logits, axis=1) == mx.array(y_all)).item()
    digests = np.array(mccl.all_gather(comm, digest(model.parameters()))).reshape(size, -1)
    comm.barrier()
    comm.close()
    differing = [r for r in range(size) if not np.array_equal(digests[r], digests[rank])]
    if differing:
        print(f"rank {rank}: parameters differ from those of ranks {differing}", file=sys.stderr, flush=True)
        return 1
    say(
        f"done: {args.steps} steps in {elapsed:.2f} s ({1000 * elapsed / max(args.steps, 1):.1f} ms/step, gradient "
        f"all-reduce {1000 * reduce_seconds / max(args.steps, 1):.2f} ms/step); accuracy on the whole dataset "
        f"{accuracy:.3f}; parameters identical on all {size} ranks (sha256 {bytes(digests[0].tolist()).hex()[:16]})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
