"""One rank of a DDP training job (PyTorch DistributedDataParallel on CPU), driven by bench/ddp.py.

The rank joins its process group with ``torch.distributed.init_process_group(BACKEND)`` (``gloo``,
or ``meshccl`` after ``import meshccl.torch``; the only difference between the two jobs), builds
the same model from the same seed as every other rank and job, wraps it in DDP and registers a
comm hook that does what DDP's default all-reduce hook does (divide the bucket by the world size,
``all_reduce(async_op=True)``) and time-stamps each bucket when it is issued and when its future
completes. Then it connects to the driver's control socket (a UNIX socket on the shared
filesystem, so ranks inside lab namespaces reach it too) and does what the driver says, one
JSON line at a time:

- ``{"cmd": "train", "steps": k, "warmup": w}``: w untimed training steps, a barrier, k timed
  steps. Replies per-step lists: ``step_s`` (zero_grad + forward + backward, which returns only
  once DDP has every bucket reduced, + optimizer step), ``fb_s`` (forward + backward),
  ``opt_s`` (optimizer step), ``ar_busy_s`` (time during which at least one gradient bucket's
  all-reduce was in flight: the union of the buckets' issue-to-completion intervals),
  ``ar_span_s`` (first bucket issued to last bucket completed), ``ar_sum_s`` (the buckets'
  intervals added up), the mean loss, the bucket sizes and, per bucket (mean over steps), its
  issue-to-completion time ``bucket_ddp_s`` and when it was issued after the step began
  ``bucket_issued_s``.
- ``{"cmd": "compute", "steps": k}``: k forward + backward passes under ``ddp.no_sync()`` (no
  all-reduce, no optimizer step: parameters do not change); replies ``fb_s`` per pass.
- ``{"cmd": "buckets", "iters": k}``: the same all-reduces outside DDP: a tensor of each bucket's
  size (as the hook saw them, in DDP's order), blocking ``dist.all_reduce`` one after the other,
  k passes after one untimed pass and a barrier; replies ``pass_s`` per pass and ``bucket_s``
  (per bucket, mean over passes).
- ``{"cmd": "params", "save": path or ""}``: a SHA-256 of every parameter's bytes (the ranks of
  one job must agree bit for bit), the step count, and with ``save`` rank 0 writes its flat
  parameter vector there (``torch.save``).
- ``{"cmd": "quit"}``.

Between commands every rank blocks reading its control socket, never inside a collective, so an
idle job costs no CPU while the other library is measured.

Environment: BENCH_RANK, BENCH_SIZE, BENCH_STORE (host:port of the ``tcp://`` rendezvous, rank 0
listens), BENCH_MODEL (JSON: width, depth, inputs, classes, batch, bucket_mb, lr, seed, threads);
Gloo reads GLOO_SOCKET_IFNAME itself, meshccl its MESHCCL_* variables.
"""

import argparse
import glob
import hashlib
import itertools
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# Buffers Gloo's shared-memory all-reduce creates (pytorch/gloo PR #458: gloo/allreduce_shm.cc
# names them shm_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>).
GLOO_SHM_GLOB = f"/dev/shm/shm_allreduce_buffer_{os.getuid()}_*"


def build_model(cfg: dict[str, Any]) -> nn.Module:
    """An MLP: inputs -> width (ReLU) x (depth - 1) -> classes, from cfg['seed'] on every rank."""
    torch.manual_seed(cfg["seed"])
    layers: list[nn.Module] = []
    fan_in = cfg["inputs"]
    for _ in range(cfg["depth"] - 1):
        layers += [nn.Linear(fan_in, cfg["width"]), nn.ReLU()]
        fan_in = cfg["width"]
    layers.append(nn.Linear(fan_in, cfg["classes"]))
    return nn.Sequential(*layers)


def parameter_count(cfg: dict[str, Any]) -> int:
    dims = [cfg["inputs"]] + [cfg["width"]] * (cfg["depth"] - 1) + [cfg["classes"]]
    return sum(a * b + b for a, b in itertools.pairwise(dims))


class Data:
    """Synthetic classification this rank trains on: a fixed pool of batches (seeded by rank),
    labelled by a fixed random linear teacher, so the loss has something to learn. Batch i of a
    rank is the same in every job: both libraries train on exactly the same data."""

    POOL = 8

    def __init__(self, cfg: dict[str, Any], rank: int) -> None:
        g = torch.Generator().manual_seed(cfg["seed"] + 1)
        teacher = torch.randn(cfg["inputs"], cfg["classes"], generator=g)
        g.manual_seed(cfg["seed"] + 1000 + rank)
        self.batches = []
        for _ in range(self.POOL):
            x = torch.randn(cfg["batch"], cfg["inputs"], generator=g)
            self.batches.append((x, (x @ teacher).argmax(dim=1)))

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[step % self.POOL]


class Trainer:
    def __init__(self, backend: str, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.rank, self.size = int(os.environ["BENCH_RANK"]), int(os.environ["BENCH_SIZE"])
        torch.set_num_threads(int(cfg["threads"]))
        if backend == "meshccl":
            import meshccl.torch  # noqa: F401  (registers the "meshccl" backend)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{os.environ['BENCH_STORE']}",
            rank=self.rank,
            world_size=self.size,
            timeout=timedelta(seconds=float(cfg.get("pg_timeout", 600))),
        )
        self.backend = backend
        self.model = DDP(build_model(cfg), bucket_cap_mb=cfg["bucket_mb"])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg["lr"], momentum=0.9)
        self.loss_fn = nn.CrossEntropyLoss()
        self.data = Data(cfg, self.rank)
        self.step_no = 0  # training steps done (the same count in every job at the same point)
        self.events: list[tuple[int, float, float, int]] = []  # (bucket, issued, completed, numel)
        self.bucket_numel: list[int] = []
        self.model.register_comm_hook(None, self._hook)
        self.info = self._describe()

    def _hook(self, _state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's default all-reduce hook (default_hooks.allreduce_hook), with two time stamps.

        DDP compares these annotations with the real classes: this module must not use
        `from __future__ import annotations` (strings would fail its check)."""
        tensor = bucket.buffer()
        tensor.div_(self.size)
        index, numel = bucket.index(), tensor.numel()
        issued = time.perf_counter()
        fut = dist.all_reduce(tensor, async_op=True).get_future()

        def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            self.events.append((index, issued, time.perf_counter(), numel))
            return f.value()[0]

        return fut.then(done)

    def _describe(self) -> str:
        parts = [f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s) per rank"]
        if self.backend == "gloo":
            # Gloo's shared-memory all-reduce, where this torch's Gloo has it, runs on the first
            # all-reduce and leaves its buffers in /dev/shm: look for them after one.
            x = torch.ones(1024)
            dist.all_reduce(x)
            found = glob.glob(GLOO_SHM_GLOB)
            parts.append(
                "Gloo shared-memory all-reduce: "
                + (f"IN USE ({len(found)} buffers in /dev/shm)" if found else "not used (no /dev/shm buffers)")
            )
        return "; ".join(parts)

    # --- commands ---------------------------------------------------------------------------

    def _step(self) -> dict[str, Any]:
        x, y = self.data[self.step_no]
        self.events.clear()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()  # returns once DDP has every bucket all-reduced and copied into .grad
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        self.step_no += 1
        by_bucket = sorted(self.events)  # in bucket order (DDP's: the last layers' bucket first)
        self.bucket_numel = [numel for _, _, _, numel in by_bucket]
        events = sorted(self.events, key=lambda e: e[1])
        return {
            "step": t2 - t0,
            "fb": t1 - t0,
            "opt": t2 - t1,
            "busy": _union(events),
            "span": (max(e[2] for e in events) - events[0][1]) if events else 0.0,
            "sum": sum(e[2] - e[1] for e in events),
            "loss": float(loss.detach()),
            "bucket": [done - issued for _, issued, done, _ in by_bucket],
            "issued": [issued - t0 for _, issued, _, _ in by_bucket],
        }

    def train(self, steps: int, warmup: int) -> dict[str, Any]:
        for _ in range(warmup):
            self._step()
        dist.barrier()
        rows = [self._step() for _ in range(steps)]
        nb = len(self.bucket_numel)
        same = [r for r in rows if len(r["bucket"]) == nb]  # after warm-up DDP's buckets no longer change
        return {
            "step_s": [r["step"] for r in rows],
            "fb_s": [r["fb"] for r in rows],
            "opt_s": [r["opt"] for r in rows],
            "ar_busy_s": [r["busy"] for r in rows],
            "ar_span_s": [r["span"] for r in rows],
            "ar_sum_s": [r["sum"] for r in rows],
            "loss": sum(r["loss"] for r in rows) / max(1, len(rows)),
            "bucket_numel": self.bucket_numel,
            # per bucket, mean over steps: issue to completion in DDP, and when it was issued
            "bucket_ddp_s": [sum(r["bucket"][i] for r in same) / max(1, len(same)) for i in range(nb)],
            "bucket_issued_s": [sum(r["issued"][i] for r in same) / max(1, len(same)) for i in range(nb)],
            "steps_done": self.step_no,
        }

    def compute(self, steps: int) -> dict[str, Any]:
        out = []
        dist.barrier()
        with self.model.no_sync():
            for i in range(steps):
                x, y = self.data[i]
                t0 = time.perf_counter()
                self.opt.zero_grad(set_to_none=True)
                self.loss_fn(self.model(x), y).backward()
                out.append(time.perf_counter() - t0)
        self.opt.zero_grad(set_to_none=True)
        return {"fb_s": out}

    def buckets(self, iters: int, cache: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
        if not self.bucket_numel:
            raise RuntimeError("no bucket sizes yet: run a training step first")
        key = ",".join(map(str, self.bucket_numel))
        if key not in cache:
            cache.clear()
            cache[key] = [torch.zeros(n) for n in self.bucket_numel]
        tensors = cache[key]
        for t in tensors:  # one untimed pass
            dist.all_reduce(t)
        dist.barrier()
        passes, per_bucket = [], [0.0] * len(tensors)
        for _ in range(iters):
            t0 = time.perf_counter()
            for i, t in enumerate(tensors):
                b0 = time.perf_counter()
                dist.all_reduce(t)
                per_bucket[i] += time.perf_counter() - b0
            passes.append(time.perf_counter() - t0)
        return {"pass_s": passes, "bucket_s": [b / iters for b in per_bucket], "bucket_numel": self.bucket_numel}

    def params(self, save: str) -> dict[str, Any]:
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
        if save and self.rank == 0:  # the other ranks' digests say whether theirs are the same
            torch.save(flat.clone(), save)
        return {"sha256": digest, "steps_done": self.step_no, "numel": flat.numel()}

    def close(self) -> None:
        dist.destroy_process_group()


def _union(events: list[tuple[int, float, float, int]]) -> float:
    """Length of the union of [issued, completed] intervals (sorted by issue time)."""
    total, end = 0.0, float("-inf")
    for _, a, b, _ in events:
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def serve(tr: Trainer, ctl: str, job: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(ctl)
    f = sock.makefile("rw", encoding="utf-8")
    hello = {"job": job, "rank": tr.rank, "size": tr.size, "pid": os.getpid(), "info": tr.info}
    f.write(json.dumps(hello) + "\n")
    f.flush()
    cache: dict[str, list[torch.Tensor]] = {}
    for line in f:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "quit":
            break
        if cmd == "train":
            reply = tr.train(int(msg["steps"]), int(msg.get("warmup", 0)))
        elif cmd == "compute":
            reply = tr.compute(int(msg["steps"]))
        elif cmd == "buckets":
            reply = tr.buckets(int(msg["iters"]), cache)
        elif cmd == "params":
            reply = tr.params(str(msg.get("save") or ""))
        else:
            reply = {"error": f"unknown command {cmd!r}"}
        f.write(json.dumps(reply) + "\n")
        f.flush()
    cache.clear()
    tr.close()
    sock.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", required=True, choices=("gloo", "meshccl"))
    p.add_argument("--ctl", required=True, help="the driver's control socket")
    p.add_argument("--job", required=True, help="job id to present to the driver")
    args = p.parse_args()
    try:
        tr = Trainer(args.backend, json.loads(os.environ["BENCH_MODEL"]))
    except Exception as e:  # reported by the driver from this process's output
        print(f"ddp worker {args.backend}: cannot set up: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 3
    serve(tr, args.ctl, args.job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
