"""DDP over meshccl against DDP over Gloo, in one job (the lab tests run it under `meshkit launch -r torch`).

``init_process_group("meshccl")`` makes meshccl the default group; ``new_group(backend="gloo")`` a Gloo
group of the same ranks. Two copies of one small model train side by side for a few steps, one with DDP
on each group, from rank 0's initial parameters (every rank starts from its own seed, so DDP's broadcast
from rank 0 must work) and on the same data: rank r's shard of step s comes from seed (SEED, s, r).
Every rank also trains a third copy without any process group: the reference, stepping with the mean
of every rank's gradient, each computed locally (every rank can make every shard). Then, per rank:

- meshccl's copy must match Gloo's and the reference within TOLERANCE (below);
- meshccl's copy must be bit-identical on every rank (meshccl's reductions give every rank the same
  bits, so DDP's replicas never drift apart);
- training must have moved the parameters by far more than TOLERANCE (else the match proves nothing).

One line per rank on stdout:
  ``ddp-parity rank <r>/<n> on <host> backend=meshccl steps=<s> params=<count> max_diff_gloo=<e>
  max_diff_ref=<e> gloo_diff_ref=<e> moved=<m> tol=<t> same_on_every_rank=yes cables=<k>/<c> ok``
where ``cables`` counts this host's cable addresses that carry one of this process's TCP connections
(meshkit's hostfile: every cable used), of the host's cables in MESHCCL_HOSTFILE. On any failure a
line saying what differs goes to stderr and the rank exits 1.

``--backend gloo`` runs the default group on Gloo instead (the program checking itself without meshccl);
``--perturb R`` nudges one parameter of meshccl's copy on rank R after training, to show that a
difference is caught.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SEED = 20
STEPS = 5
BATCH = 16
LR = 0.1
# float32 sums in a different order: meshccl and Gloo add the ranks' gradients in different orders
# (and the reference in rank order), so an element of the averaged gradient may differ by a few ulp of
# its largest partial sum (about n * 2^-24 * sum|g_i|). Through LR and a few steps (each difference
# also feeds the next forward pass) the parameters differ by ~1e-8: measured 7.5e-9 between Gloo and
# the reference on 4 ranks. Real faults are far above 1e-5: measured with this model and data on 8
# ranks, one rank's gradient left out moves a parameter by 4e-3, a sum instead of a mean by 5e-2.
# The check also requires training to move the parameters by >= 100 x TOLERANCE (measured: 2e-2).
TOLERANCE = 1e-5


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # 215,178 parameters in tensors of several sizes; with a small bucket cap DDP reduces them in several
    # buckets, asynchronously, the largest (512 x 256 floats, 512 KiB) over meshccl's pipelined path.
    return nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Linear(256, 512),
        nn.ReLU(),
        nn.Linear(512, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def shard(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + rank)
    return torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = shard(step, rank)
    return nn.functional.cross_entropy(model(x), y)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def worst(a: nn.Module, b: nn.Module) -> tuple[float, str]:
    """The largest |a - b| over every parameter, and the parameter's name."""
    out = (0.0, "")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        d = (pa.detach() - pb.detach()).abs().max().item()
        if d > out[0]:
            out = (d, name)
    return out


def cable_addresses() -> list[str]:
    """This host's cable addresses, from the job's meshccl.json (none without one)."""
    path = os.environ.get("MESHCCL_HOSTFILE")
    if not path:
        return []
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    me = int(os.environ["MESHCCL_RANK"])
    entry = next(e for e in doc["ranks"] if e["rank"] == me)
    return sorted({link["address"] for link in entry["links"]})


def connected_from() -> set[str]:
    """Local IPv4 addresses of this process's established TCP connections (/proc/self/fd and
    /proc/net/tcp of the host's network namespace)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    with open("/proc/net/tcp", encoding="ascii") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "01" and inode in inodes:  # ESTABLISHED
                ip = bytes.fromhex(local.split(":")[0])[::-1]
                out.add(socket.inet_ntoa(ip))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="meshccl", choices=["meshccl", "gloo"])
    parser.add_argument("--perturb", type=int, default=-1, metavar="RANK")
    args = parser.parse_args()
    torch.set_num_threads(1)  # 8 ranks share the lab machine's cores; also keeps every run's sums the same
    if args.backend == "meshccl":
        import meshccl.torch  # noqa: F401  (registers the "meshccl" backend)

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    where = f"ddp-parity rank {rank}/{world} on {socket.gethostname()}"

    own = make_model(SEED + 100 + rank)  # differs per rank: DDP's broadcast from rank 0 must fix it
    on_default = DDP(copy.deepcopy(own), bucket_cap_mb=0.25)
    on_gloo = DDP(copy.deepcopy(own), process_group=gloo, bucket_cap_mb=0.25)
    reference = make_model(SEED + 100)  # rank 0's initial parameters
    start = flat(reference).clone()
    problems = []
    for name, model in (("meshccl" if args.backend == "meshccl" else "default", on_default), ("gloo", on_gloo)):
        if not torch.equal(flat(model.module), start):
            problems.append(f"after DDP's broadcast the {name} copy is not rank 0's initial parameters")

    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (on_default, on_gloo, reference)]
    for step in range(STEPS):
        for model, opt in zip((on_default, on_gloo), opts[:2], strict=True):
            opt.zero_grad()
            loss_of(model, step, rank).backward()  # DDP averages the gradients over its group
            opt.step()
        opts[2].zero_grad()
        grads: list[torch.Tensor] = [torch.zeros_like(p) for p in reference.parameters()]
        for r in range(world):  # every rank's gradient, in rank order, then the mean
            reference.zero_grad()
            loss_of(reference, step, r).backward()
            for acc, p in zip(grads, reference.parameters(), strict=True):
                acc.add_(p.grad)
        for acc, p in zip(grads, reference.parameters(), strict=True):
            p.grad = acc / world
        opts[2].step()

    if rank == args.perturb:
        with torch.no_grad():
            next(on_default.module.parameters()).view(-1)[0] += 1e-3
    default, gloo_model = on_default.module, on_gloo.module
    diff_gloo, name_gloo = worst(default, gloo_model)
    diff_ref, name_ref = worst(default, reference)
    gloo_ref, _ = worst(gloo_model, reference)
    moved = (flat(reference) - start).abs().max().item()
    digest = hashlib.sha256(flat(default).numpy().tobytes()).hexdigest()
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest, group=gloo)
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if diff_gloo > TOLERANCE:
        problems.append(f"DDP over {args.backend} and over gloo differ: {name_gloo} by {diff_gloo:.3g} > {TOLERANCE:g}")
    if diff_ref > TOLERANCE:
        problems.append(
            f"DDP over {args.backend} and the reference differ: {name_ref} by {diff_ref:.3g} > {TOLERANCE:g}"
        )
    if differing:
        problems.append(f"DDP over {args.backend}: parameters not bit-identical on ranks {differing} and rank 0")
    if moved < 100 * TOLERANCE:
        problems.append(f"training moved the parameters by {moved:.3g} only: the comparison would prove nothing")
    cables = cable_addresses()
    used = connected_from()
    seen = sum(1 for a in cables if a in used)
    if problems:
        for p in problems:
            print(f"{where}: FAILED: {p}", file=sys.stderr, flush=True)
        dist.destroy_process_group()  # local: no collective call, so it cannot wait on the other ranks
        return 1
    dist.barrier()
    print(
        f"{where} backend={dist.get_backend()} steps={STEPS} params={start.numel()} max_diff_gloo={diff_gloo:.3g} "
        f"max_diff_ref={diff_ref:.3g} gloo_diff_ref={gloo_ref:.3g} moved={moved:.3g} tol={TOLERANCE:g} "
        f"same_on_every_rank=yes cables={seen}/{len(cables)} ok",
        flush=True,
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
