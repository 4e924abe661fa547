"""One rank of a test job. Usage: worker.py SCENARIO [ARGS]; reads its rank from the
environment like any meshccl program. Prints OK on success; on a meshccl error prints
"ERROR <ExceptionType>: <message>" and exits 3."""

from __future__ import annotations

import json
import sys
import time

import meshccl
import numpy as np

NP = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "int8": np.int8,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
}


def bf16(values: np.ndarray) -> np.ndarray:
    """Small integers as bfloat16 bit patterns in a uint16 array (exact)."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def inputs(op: str, rank: int, count: int) -> np.ndarray:
    i = np.arange(count, dtype=np.int64)
    if op == "sum":
        return (rank + 1) * (1 + i % 5)
    if op == "prod":
        return 1 + ((i + rank) % 3 == 0)
    return (i * 3 + rank * 5) % 17


def expected(op: str, n: int, count: int) -> np.ndarray:
    stack = np.stack([inputs(op, r, count) for r in range(n)])
    return {"sum": stack.sum(0), "prod": stack.prod(0), "min": stack.min(0), "max": stack.max(0)}[op]


def as_type(values: np.ndarray, name: str) -> np.ndarray:
    return bf16(values) if name == "bfloat16" else values.astype(NP[name])


def check(what: str, got: np.ndarray, want: np.ndarray, name: str) -> None:
    got_v = from_bf16(got) if name == "bfloat16" else got
    want_v = as_type(want, name)
    want_v = from_bf16(want_v) if name == "bfloat16" else want_v
    bad = np.nonzero(got_v != want_v)[0]
    if bad.size:
        i = int(bad[0])
        raise AssertionError(f"{what}: element {i} expected {want_v[i]} got {got_v[i]} ({bad.size} wrong)")


def sweep(comm: meshccl.Communicator) -> None:
    n, r = comm.size, comm.rank
    for name in [*NP, "bfloat16"]:
        dt = "bfloat16" if name == "bfloat16" else None
        for count in (0, 1, 7, n * 257 + 3):
            for op in ("sum", "prod", "min", "max"):
                x = as_type(inputs(op, r, count), name)
                out = np.empty_like(x)
                comm.all_reduce(x, op=op, out=out, dtype=dt)
                check(f"all_reduce {name} {op} {count}", out, expected(op, n, count), name)
            x = as_type(inputs("sum", r, count), name)
            comm.all_reduce(x, dtype=dt)
            check(f"all_reduce in place {name} {count}", x, expected("sum", n, count), name)
            blocks = [as_type((np.arange(count) + 31 * q) % 100, name) for q in range(n)]
            got = comm.all_gather(blocks[r], dtype=dt)
            check(
                f"all_gather {name} {count}",
                got,
                np.concatenate([(np.arange(count) + 31 * q) % 100 for q in range(n)]),
                name,
            )
            full = as_type(inputs("max", r, n * count), name)
            part = comm.reduce_scatter(full, op="max", dtype=dt)
            check(
                f"reduce_scatter {name} {count}", part, expected("max", n, n * count)[r * count : (r + 1) * count], name
            )
            buf = blocks[r].copy() if r == n - 1 else np.zeros_like(blocks[r])
            comm.broadcast(buf, root=n - 1, dtype=dt)
            check(f"broadcast {name} {count}", buf, (np.arange(count) + 31 * (n - 1)) % 100, name)
    comm.barrier()


def main() -> int:
    scenario = sys.argv[1]
    try:
        comm = meshccl.init()
        r, n = comm.rank, comm.size
        if scenario == "sum64":
            x = np.full((64 << 20) // 4, r + 1, dtype=np.float32)
            comm.all_reduce(x)
            want = n * (n + 1) / 2
            if not (x == want).all():
                raise AssertionError(f"rank {r}: 64 MiB sum wrong: {x[:4]} expected {want}")
        elif scenario == "sweep":
            sweep(comm)
        elif scenario == "loop":
            x = np.ones((16 << 20) // 4, dtype=np.float32)
            for i in range(10_000):
                comm.all_reduce(x)
                print(f"iteration {i}", flush=True)
        elif scenario == "mismatch":
            x = np.ones(1024, dtype=np.int32 if r == 1 else np.float32)
            comm.all_reduce(x)
        elif scenario == "transports":
            x = np.full(300_000, r + 1, dtype=np.float32)
            comm.all_reduce(x)
            assert (x == n * (n + 1) / 2).all(), x[:4]
            links = {q: comm.transport(q) for q in range(n) if q != r and comm.transport(q)}
            print("TRANSPORTS " + " ".join(f"{q}:{t}" for q, t in sorted(links.items())), flush=True)
            print(f"SINGLE_COPY {comm.single_copy}", flush=True)
            print("INFO " + json.dumps(comm.info(), sort_keys=True), flush=True)
        elif scenario == "barrier":
            comm.barrier()
        elif scenario == "allreduce":
            x = np.arange(1000, dtype=np.float64) * (r + 1)
            comm.all_reduce(x)
            want = np.arange(1000, dtype=np.float64) * (n * (n + 1) / 2)
            if not (x == want).all():
                raise AssertionError(f"rank {r}: all_reduce wrong: {x[:4]} expected {want[:4]}")
        elif scenario == "torch":
            import torch

            t = torch.full((1 << 20,), float(r + 1), dtype=torch.float32)
            comm.all_reduce(t)  # DLPack, in place
            assert torch.all(t == n * (n + 1) / 2), t[:4]
            b = torch.full((1001,), float(r + 1), dtype=torch.bfloat16)
            out = torch.empty_like(b)
            comm.all_reduce(b, out=out, op="max")
            assert torch.all(out == float(n)), out[:4]
            g = comm.all_gather(torch.tensor([r, r], dtype=torch.int64))
            assert g.tolist() == [q for q in range(n) for _ in range(2)], g
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        comm.close()
    except meshccl.Error as e:
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        return 3
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    code = main()
    sys.exit(code)
