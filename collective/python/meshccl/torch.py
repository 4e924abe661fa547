"""meshccl as a ``torch.distributed`` backend: one word changed, every cable used.

    import meshccl.torch                      # registers the backend "meshccl"
    torch.distributed.init_process_group("meshccl")

Under torchrun the ranks meet through meshccl's own rendezvous (rank 0 on MASTER_ADDR, both
ends proving the job token); under ``meshkit launch`` (MESHCCL_RANK + MESHCCL_HOSTFILE) the
world group uses meshccl's hostfile, so every cable. Every job of more than one rank needs
the job token in MESHCCL_TOKEN, the same on every rank (meshccl.AuthError otherwise).

What torch's store is used for: agreeing on the port of meshccl's rendezvous (rank 0 picks a
free one, so MASTER_PORT + 1 need not be free and several meshccl groups can meet one after
the other), on a job id when the environment gives none (a rank of an earlier job holding the
same token cannot join), and, for groups of a subset of the ranks, on each member's address
and port. The store is not authenticated, but nothing it carries is trusted: every meshccl
connection proves the job token at both ends.

CPU tensors only. Supported: all_reduce (SUM, PRODUCT, MIN, MAX; AVG for floating types),
all_gather (blocks of any size), all_gather_into_tensor, reduce_scatter (equal blocks),
reduce_scatter_tensor, broadcast, barrier, send/recv (any tag; recv from any rank), reduce, gather, scatter,
all_to_all / all_to_all_single (every pair of ranks linked: torchrun, one host, a full mesh),
the coalesced forms DDP and FSDP use, and async_op=True; dtypes float32, float64, float16,
bfloat16, int8, int32, int64, uint8. Anything else raises :class:`UnsupportedError` naming
the operation. Non-contiguous tensors are copied to contiguous ones and back.

meshccl has no native reduce, gather, scatter or all-to-all: reduce is an all-reduce into a
scratch buffer on the ranks that are not the root, gather an all-gather that the root keeps,
scatter a broadcast of the root's blocks (each rank keeps its own), all-to-all one batch of
sends and receives.

Sends and receives are held back until one of them is waited on (or another operation comes),
then posted together as one batch of meshccl's tagged messages, so a ring shift
(batch_isend_irecv: every rank sends first) cannot deadlock and either side may group its
messages as it likes. A receive takes the oldest message from its peer (or, recv without src,
from any rank) with its tag; messages that come first wait in the communicator. A rank's
messages must be received before the pair's next collective (meshccl.MismatchError names it).
Waiting on a Work completes it on the waiting thread; a Future asked for (DDP's) is completed
by the group's own thread.

The group is a Python subclass of torch.distributed.ProcessGroup (c10d's Backend class cannot
be subclassed from Python), so it serves a whole group: "cpu:meshccl,cuda:nccl" cannot be made.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import secrets
import threading
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.futures import Future

import meshccl
from meshccl import bootstrap
from meshccl.bootstrap import torch_store

__all__ = ["BACKEND", "ProcessGroupMeshccl", "UnsupportedError", "register"]

BACKEND = "meshccl"

DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
}
_FLOATING = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_R = dist.ReduceOp.RedOpType
_OPS = {_R.SUM: "sum", _R.PRODUCT: "prod", _R.MIN: "min", _R.MAX: "max", _R.AVG: "sum"}


class UnsupportedError(NotImplementedError):
    """An operation, reduction, dtype or argument the meshccl backend does not support."""


_MONITOR_TAG = 2**32 - 1  # monitored_barrier's messages


def _unsupported(op: str, what: str) -> UnsupportedError:
    return UnsupportedError(f"meshccl backend: {op}: {what}")


# --- tensors in and out -----------------------------------------------------------------------------


def _check_tensor(op: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"meshccl backend: {op}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise _unsupported(op, f"tensor on device {t.device}: meshccl moves CPU tensors only (use NCCL for GPUs)")
    if t.dtype not in DTYPES:
        raise _unsupported(op, f"dtype {t.dtype} is not supported; meshccl has {', '.join(str(d) for d in DTYPES)}")
    if t.is_sparse or t.layout != torch.strided:
        raise _unsupported(op, f"{t.layout} tensors are not supported (dense tensors only)")
    return t


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous 1-D view of t's data (t's own storage when it can be: the bool says whether it
    is a copy that must be copied back). Detached: DLPack refuses tensors that require grad."""
    d = t.detach()
    if d.is_contiguous():
        return d.reshape(-1), False
    return d.contiguous().reshape(-1), True


def _same_dtype(op: str, tensors: Sequence[torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"meshccl backend: {op}: tensors of different dtypes {sorted(map(str, dtypes))}")
    return tensors[0].dtype


def _reduction(op: str, opts_op: Any, dtype: torch.dtype) -> tuple[str, bool]:
    """meshccl's reduction for torch's ReduceOp, and whether to divide by the group size (AVG)."""
    kind = getattr(opts_op, "op", opts_op)
    if kind not in _OPS:
        raise _unsupported(op, f"reduction {kind} is not supported; meshccl has SUM, PRODUCT, MIN, MAX and AVG")
    if kind == _R.AVG and dtype not in _FLOATING:
        raise _unsupported(
            op, f"ReduceOp.AVG of {dtype} tensors is not supported (an integer mean would be truncated): use SUM"
        )
    return _OPS[kind], kind == _R.AVG


def _divide(t: torch.Tensor, n: int) -> None:
    with torch.no_grad():
        t.div_(n)


def _timeout_seconds(timeout: Any) -> float | None:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None


# --- Work -------------------------------------------------------------------------------------------


Finish = Callable[[], Any]


class _Op:
    """One operation: the meshccl calls it posted and its finishing step (copy back, divide),
    completed exactly once by whoever comes first: the thread that waits on its Work (waiting
    on meshccl's Works itself, no hand-off) or the group's completer thread (for Futures that
    must complete by themselves: DDP's)."""

    def __init__(self, name: str, handles: list[Any], finish: Finish | None) -> None:
        self.name = name
        self.fut: Future = Future()
        self._lock = threading.Lock()
        self._handles = handles
        self._finish = finish
        if finish is not None and not handles:
            self.complete()

    @property
    def done(self) -> bool:
        return self._finish is None

    def ready(self) -> bool:
        """Every posted call has ended (nothing to wait for)."""
        return self._finish is None or all(h.is_completed() for h in self._handles)

    def complete(self) -> None:
        with self._lock:
            if self._finish is None:
                return
            handles, finish = self._handles, self._finish
            self._handles, self._finish = [], None
            try:
                for h in handles:
                    h.wait()
                result = finish()
            except BaseException as e:  # the operation's error goes to whoever waits on it
                # Without this frame: it would keep the operation's buffers and meshccl's Works
                # alive for as long as the error is kept.
                self.fut.set_exception(e.with_traceback(None))
            else:
                self.fut.set_result(result)


class _Completer:
    """One thread per group that completes the operations whose Futures were asked for, in the
    order they were asked for (through `complete`: the group's, which completes earlier ones too)."""

    def __init__(self, name: str, complete: Callable[[_Op], None]) -> None:
        self._name = name
        self._complete = complete
        self._cv = threading.Condition()
        self._queue: list[_Op | None] = []
        self._thread: threading.Thread | None = None

    def submit(self, op: _Op) -> None:
        if op.done:
            return
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"meshccl-torch-{self._name}", daemon=True)
                self._thread.start()
            self._queue.append(op)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            if self._thread is None:
                return
            self._queue.append(None)
            self._cv.notify()
            thread = self._thread
        thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                op = self._queue.pop(0)
            if op is None:
                return
            self._complete(op)
            del op


class _Work(dist._Work):
    """torch's Work for one operation (or one send/receive). `source` gives the _Op that
    completes it (for a send or receive: after posting the held-back batch it belongs to);
    `fut` is its Future (the output tensors)."""

    def __init__(
        self,
        name: str,
        fut: Future,
        source: Callable[[], _Op],
        group: ProcessGroupMeshccl,
        p2p: _P2P | None = None,
    ) -> None:
        super().__init__()
        self._p2p = p2p
        self._name = name
        self._fut = fut
        self._source = source
        self._completer = group._completer
        self._complete = group._complete_through

    def wait(self, timeout: Any = None) -> bool:
        op = self._source()
        seconds = _timeout_seconds(timeout)
        if seconds is None:
            self._complete(op)
        else:
            done = threading.Event()
            self._fut.add_done_callback(lambda _f: done.set())
            self._completer.submit(op)
            if not done.wait(seconds):
                raise meshccl.TimeoutError(f"meshccl backend: {self._name} did not complete within {seconds:g} s")
        self._fut.wait()  # raises the operation's error
        return True

    def get_future(self) -> Future:
        self._completer.submit(self._source())
        return self._fut

    def _source_rank(self) -> int:
        """A receive's sender (torch asks after a receive from any rank), once it completed."""
        if self._p2p is None or self._p2p.kind != "recv":
            raise ValueError(f"meshccl backend: {self._name}: only a receive has a source rank")
        if not self._fut.done():
            raise ValueError(f"meshccl backend: {self._name}: the receive has not completed (wait() first)")
        return self._p2p.source

    def is_completed(self) -> bool:
        op = self._source()
        if not op.done and op.ready():
            self._complete(op)
        return self._fut.done()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self.is_completed():
            return None
        try:
            self._fut.value()
        except BaseException as e:  # the operation's error, handed to the caller
            return e
        return None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        value = self._fut.value()
        return value if isinstance(value, list) else []

    def __repr__(self) -> str:
        return f"<meshccl Work {self._name} {'done' if self._fut.done() else 'pending'}>"


class _Link:
    """The Communicator as the process group drives it: every call is queued on the
    communicator's own progress thread (async_op=True) and returns a meshccl.Work at once."""

    def __init__(self, comm: meshccl.Communicator) -> None:
        if not hasattr(comm, "exchange") or not hasattr(meshccl, "Work"):
            raise meshccl.BootstrapError(
                "meshccl backend: this meshccl has no async calls (meshccl.Work, exchange): the package is older "
                "than meshccl/torch.py; reinstall meshccl"
            )
        self.comm: Any = comm

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.comm, method)(*args, async_op=True, **kwargs)


# --- the process group --------------------------------------------------------------------------------


class ProcessGroupMeshccl(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on a meshccl Communicator."""

    def __init__(self, comm: meshccl.Communicator, rank: int, size: int, group_name: str = "") -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._comm: meshccl.Communicator | None = comm
        self._plan = comm.plan
        self._link = _Link(comm)
        self._lock = threading.RLock()
        self._completer = _Completer(group_name or "group", self._complete_through)
        self._unfinished: list[_Op] = []  # in submission order (meshccl's order)
        self._unfinished_lock = threading.Lock()
        self._p2p: list[_P2P] = []
        self._closed = False
        self._group_name = group_name
        self._group_desc = ""
        self.calls: Counter[str] = Counter()  # operation name -> times called (what DDP/FSDP use)
        _LIVE.add(self)

    # -- identity

    def getBackendName(self) -> str:
        return BACKEND

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # The group's name and description: torch sets them after creating the group and reads them
    # back (DeviceMesh, FSDP2); a ProcessGroup written in Python keeps them itself.

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    @property
    def communicator(self) -> meshccl.Communicator:
        return self._live("communicator")

    def _live(self, op: str) -> meshccl.Communicator:
        if self._comm is None:
            raise RuntimeError(f"meshccl backend: {op} on a process group that was shut down")
        return self._comm

    def __repr__(self) -> str:
        return f"<meshccl ProcessGroup rank {self._rank} of {self._size} ({self._plan.source})>"

    # -- running operations

    def _run(self, op: str, body: Callable[[Callable[..., Any]], Finish]) -> _Work:
        """Posts the meshccl calls `body` makes through its argument; the Work completes, with
        `body`'s finishing step's result, once they are done."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"meshccl backend: {op} on a process group that was shut down")
            self.calls[op] += 1
            self._flush_p2p_locked()
            handles: list[Any] = []

            def call(method: str, *args: Any, **kwargs: Any) -> Any:
                handles.append(self._link.call(method, *args, **kwargs))
                return handles[-1]

            posted = self._track(_Op(op, handles, body(call)))
            return _Work(op, posted.fut, lambda: posted, self)

    def _track(self, op: _Op) -> _Op:
        if not op.done:
            with self._unfinished_lock:
                self._unfinished.append(op)
        return op

    def _drain_locked(self) -> None:
        """(Under self._lock.) The held-back sends and receives posted and every operation posted so far
        completed: nothing of the group runs in meshccl, so a timeout set now is the next call's alone."""
        self._flush_p2p_locked()
        with self._unfinished_lock:
            last = self._unfinished[-1] if self._unfinished else None
        if last is not None:
            self._complete_through(last)

    def _complete_through(self, op: _Op) -> None:
        """Completes `op` and every operation posted before it (meshccl runs them in order, so
        they have ended too): an async operation nobody waited on still gets its finishing step
        (copy back, AVG's division) once a later one is waited on, as torch's backends do."""
        with self._unfinished_lock:
            if op in self._unfinished:
                k = self._unfinished.index(op) + 1
                earlier, self._unfinished = self._unfinished[:k], self._unfinished[k:]
            else:
                earlier = [op]
        for o in earlier:
            o.complete()

    # -- all_reduce

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self._allreduce("all_reduce", tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self._allreduce("all_reduce_coalesced", tensors, opts)

    def _allreduce(self, op: str, tensors: list[torch.Tensor], opts: Any) -> _Work:
        reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if any(isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo for t in tensors):
            if len(tensors) != 1:
                raise _unsupported(op, "sparse tensors are reduced one at a time (all_reduce of one tensor)")
            return self._sparse_allreduce(op, tensors[0], reduce_op)
        tensors = [_check_tensor(op, t) for t in tensors]
        plans = []
        for t in tensors:
            name, avg = _reduction(op, reduce_op, t.dtype)
            plans.append((t, name, avg))
        n = self._size

        def body(call: Callable[..., None]) -> Finish:
            bufs = []
            for t, name, avg in plans:
                buf, copied = _flat(t)
                call("all_reduce", buf, op=name)
                bufs.append((t, buf, copied, avg))

            def finish() -> list[torch.Tensor]:
                for t, buf, copied, avg in bufs:
                    if avg:
                        _divide(buf, n)
                    if copied:
                        _copy_back(t, buf)
                return list(tensors)

            return finish

        return self._run(op, body)

    def _sparse_allreduce(self, op: str, t: torch.Tensor, reduce_op: Any) -> _Work:
        """SUM of sparse COO tensors, as Gloo does it: every rank's indices and values are gathered (padded to the
        largest count, which an all-gather of the counts tells first), then summed and coalesced on every rank; the
        result replaces t's contents (its number of entries may change)."""
        kind = getattr(reduce_op, "op", reduce_op)
        if kind != _R.SUM:
            raise _unsupported(op, f"reduction {kind} of a sparse tensor is not supported: SUM only (as Gloo)")
        if t.device.type != "cpu":
            raise _unsupported(op, f"tensor on device {t.device}: meshccl moves CPU tensors only (use NCCL for GPUs)")
        if t.dtype not in DTYPES:
            raise _unsupported(op, f"dtype {t.dtype} is not supported; meshccl has {', '.join(str(d) for d in DTYPES)}")
        x = t.detach().coalesce()
        idx = x.indices().contiguous()  # sparse_dim x nnz, int64
        val = x.values().contiguous()  # nnz x dense shape
        sparse_dim, nnz = idx.shape
        dense = tuple(val.shape[1:])
        n = self._size

        def body(call: Callable[..., Any]) -> Finish:
            counts = torch.empty(n, dtype=torch.int64)
            call("all_gather", torch.tensor([nnz], dtype=torch.int64), counts).wait()
            most = int(counts.max())
            pidx = torch.zeros((sparse_dim, most), dtype=torch.int64)
            pidx[:, :nnz] = idx
            pval = torch.zeros((most, *dense), dtype=val.dtype)
            pval[:nnz] = val
            gidx = torch.empty(n * pidx.numel(), dtype=torch.int64)
            gval = torch.empty(n * pval.numel(), dtype=val.dtype)
            call("all_gather", pidx.reshape(-1), gidx)
            call("all_gather", pval.reshape(-1), gval)

            def finish() -> list[torch.Tensor]:
                ri = gidx.view(n, sparse_dim, most)
                rv = gval.view(n, most, *dense)
                got = [int(c) for c in counts]
                indices = torch.cat([ri[r, :, : got[r]] for r in range(n)], dim=1)
                values = torch.cat([rv[r, : got[r]] for r in range(n)], dim=0)
                total = torch.sparse_coo_tensor(indices, values, t.shape).coalesce()
                with torch.no_grad():
                    t.copy_(total)
                return [t]

            return finish

        return self._run(op, body)

    # -- broadcast

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        op = "broadcast"
        tensors = [_check_tensor(op, t) for t in tensors]
        root = opts.rootRank if opts is not None else 0
        self._check_rank(op, "root", root)

        def body(call: Callable[..., None]) -> Finish:
            bufs = []
            for t in tensors:
                buf, copied = _flat(t)
                call("broadcast", buf, root=root)
                bufs.append((t, buf, copied))

            def finish() -> list[torch.Tensor]:
                for t, buf, copied in bufs:
                    if copied:
                        _copy_back(t, buf)
                return list(tensors)

            return finish

        return self._run(op, body)

    # -- all_gather

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        return self._allgather("all_gather", output_tensors, input_tensors)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        # torch's layout, as Gloo reads it: one output list per rank, holding that rank's inputs in their order
        # (output_lists[q][i] is rank q's input i). all_gather's is the other way round (one list per input, a
        # block per rank), and reading one as the other gives a wrong answer whenever the counts line up.
        op = "all_gather_coalesced"
        n = self._size
        if len(output_lists) != n or any(len(outs) != len(input_list) for outs in output_lists):
            raise ValueError(
                f"meshccl backend: {op}: one output list per rank ({n}), each with one tensor per input "
                f"({len(input_list)}); got {len(output_lists)} lists of {[len(outs) for outs in output_lists]} tensors"
            )
        per_input = [[output_lists[q][i] for q in range(n)] for i in range(len(input_list))]
        return self._allgather(op, per_input, input_list, per_rank=True)

    def _allgather(
        self, op: str, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], per_rank: bool = False
    ) -> _Work:
        """One all-gather per input; ``outputs[i]`` holds input i's block from every rank. The result is in that
        layout, or with ``per_rank`` in all_gather_coalesced's (one list per rank)."""
        if len(outputs) != len(inputs):
            raise ValueError(f"meshccl backend: {op}: {len(outputs)} output lists for {len(inputs)} inputs")
        n = self._size
        jobs = []
        for outs, x in zip(outputs, inputs):
            _check_tensor(op, x)
            if len(outs) != n:
                raise ValueError(f"meshccl backend: {op}: {len(outs)} output tensors for a group of {n} ranks")
            for o in outs:
                _check_tensor(op, o)
                if o.dtype != x.dtype:
                    raise ValueError(
                        f"meshccl backend: {op}: output dtype {o.dtype} differs from input dtype {x.dtype}"
                    )
            sizes = [o.numel() for o in outs]
            if sizes[self._rank] != x.numel():
                raise ValueError(
                    f"meshccl backend: {op}: this rank's output tensor has {sizes[self._rank]} elements, "
                    f"its input {x.numel()}"
                )
            jobs.append((outs, x, sizes))

        def body(call: Callable[..., None]) -> Finish:
            posted = []
            for outs, x, sizes in jobs:
                # Blocks of any size: every rank knows every block's size from its output list,
                # so each pads its block to the largest and keeps what is real.
                block = max(sizes) if sizes else 0
                src, _copied = _flat(x)
                if block != src.numel():
                    padded = torch.zeros(block, dtype=x.dtype)
                    padded[: src.numel()] = src
                    src = padded
                gathered = torch.empty(n * block, dtype=x.dtype)
                call("all_gather", src, out=gathered)
                posted.append((outs, sizes, block, gathered, src))

            def finish() -> list[list[torch.Tensor]]:
                for outs, sizes, block, gathered, _src in posted:
                    for q, o in enumerate(outs):
                        _copy_back(o, gathered[q * block : q * block + sizes[q]])
                lists = [list(entry[0]) for entry in posted]
                return [list(blocks) for blocks in zip(*lists)] if per_rank else lists

            return finish

        return self._run(op, body)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._allgather_single("all_gather_into_tensor", [output], [input])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._allgather_single("all_gather_into_tensor", [output], [input])

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        return self._allgather_single("all_gather_into_tensor_coalesced", outputs, inputs)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        return self._allgather_single("all_gather_into_tensor_coalesced", outputs, inputs)

    def _allgather_single(self, op: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> _Work:
        if len(outputs) != len(inputs):
            raise ValueError(f"meshccl backend: {op}: {len(outputs)} outputs for {len(inputs)} inputs")
        for o, x in zip(outputs, inputs):
            _check_tensor(op, o)
            _check_tensor(op, x)
            if o.dtype != x.dtype:
                raise ValueError(f"meshccl backend: {op}: output dtype {o.dtype} differs from input dtype {x.dtype}")
            if o.numel() != self._size * x.numel():
                raise ValueError(
                    f"meshccl backend: {op}: the output has {o.numel()} elements; it must have group size "
                    f"({self._size}) x input ({x.numel()}) = {self._size * x.numel()}"
                )

        def body(call: Callable[..., None]) -> Finish:
            posted = []
            for o, x in zip(outputs, inputs):
                out, copied = _flat(o)
                src = _flat(x)[0]
                call("all_gather", src, out=out)
                posted.append((o, out, copied))

            def finish() -> list[torch.Tensor]:
                for o, out, copied in posted:
                    if copied:
                        _copy_back(o, out)
                return list(outputs)

            return finish

        return self._run(op, body)

    # -- reduce_scatter

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> _Work:
        op = "reduce_scatter"
        if len(output_tensors) != len(input_tensors):
            raise ValueError(f"meshccl backend: {op}: {len(output_tensors)} outputs for {len(input_tensors)} inputs")
        n = self._size
        reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        jobs = []
        for o, ins in zip(output_tensors, input_tensors):
            _check_tensor(op, o)
            if len(ins) != n:
                raise ValueError(f"meshccl backend: {op}: {len(ins)} input tensors for a group of {n} ranks")
            for x in ins:
                _check_tensor(op, x)
                if x.dtype != o.dtype:
                    raise ValueError(
                        f"meshccl backend: {op}: input dtype {x.dtype} differs from output dtype {o.dtype}"
                    )
            if any(x.numel() != o.numel() for x in ins):
                raise _unsupported(
                    op,
                    f"blocks of different sizes ({[x.numel() for x in ins]} elements; output {o.numel()}): "
                    "meshccl's reduce_scatter needs every block the size of the output",
                )
            name, avg = _reduction(op, reduce_op, o.dtype)
            jobs.append((o, ins, name, avg))

        def body(call: Callable[..., None]) -> Finish:
            posted = []
            for o, ins, name, avg in jobs:
                src = torch.cat([x.detach().reshape(-1) for x in ins]) if ins else torch.empty(0, dtype=o.dtype)
                out, copied = _flat(o)
                call("reduce_scatter", src, out=out, op=name)
                posted.append((o, out, copied, avg, src))

            def finish() -> list[torch.Tensor]:
                for o, out, copied, avg, _src in posted:
                    if avg:
                        _divide(out, n)
                    if copied:
                        _copy_back(o, out)
                return list(output_tensors)

            return finish

        return self._run(op, body)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._reduce_scatter_single("reduce_scatter_tensor", [output], [input], opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._reduce_scatter_single("reduce_scatter_tensor", [output], [input], opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        return self._reduce_scatter_single("reduce_scatter_tensor_coalesced", outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        return self._reduce_scatter_single("reduce_scatter_tensor_coalesced", outputs, inputs, opts)

    def _reduce_scatter_single(
        self, op: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> _Work:
        if len(outputs) != len(inputs):
            raise ValueError(f"meshccl backend: {op}: {len(outputs)} outputs for {len(inputs)} inputs")
        n = self._size
        reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        jobs = []
        for o, x in zip(outputs, inputs):
            _check_tensor(op, o)
            _check_tensor(op, x)
            if o.dtype != x.dtype:
                raise ValueError(f"meshccl backend: {op}: input dtype {x.dtype} differs from output dtype {o.dtype}")
            if x.numel() != n * o.numel():
                raise ValueError(
                    f"meshccl backend: {op}: the input has {x.numel()} elements; it must have group size "
                    f"({n}) x output ({o.numel()}) = {n * o.numel()}"
                )
            name, avg = _reduction(op, reduce_op, o.dtype)
            jobs.append((o, x, name, avg))

        def body(call: Callable[..., None]) -> Finish:
            posted = []
            for o, x, name, avg in jobs:
                src = _flat(x)[0]
                out, copied = _flat(o)
                call("reduce_scatter", src, out=out, op=name)
                posted.append((o, out, copied, avg))

            def finish() -> list[torch.Tensor]:
                for o, out, copied, avg in posted:
                    if avg:
                        _divide(out, n)
                    if copied:
                        _copy_back(o, out)
                return list(outputs)

            return finish

        return self._run(op, body)

    # -- reduce, gather, scatter: built from all_reduce, all_gather, broadcast

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        op = "reduce"
        tensors = [_check_tensor(op, t) for t in tensors]
        root = opts.rootRank if opts is not None else 0
        self._check_rank(op, "root", root)
        reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        plans = [(t, *_reduction(op, reduce_op, t.dtype)) for t in tensors]
        n, me = self._size, self._rank

        def body(call: Callable[..., None]) -> Finish:
            posted = []
            for t, name, avg in plans:
                src, copied = _flat(t)
                # The root reduces in place; the others into scratch, so their tensors keep their values.
                out = src if me == root else torch.empty_like(src)
                call("all_reduce", src, op=name, out=out)
                posted.append((t, out, copied, avg))

            def finish() -> list[torch.Tensor]:
                if me == root:
                    for t, out, copied, avg in posted:
                        if avg:
                            _divide(out, n)
                        if copied:
                            _copy_back(t, out)
                return list(tensors)

            return finish

        return self._run(op, body)

    def _rooted_blocks(
        self,
        op: str,
        root: int,
        one: list[torch.Tensor],
        blocks: list[list[torch.Tensor]],
        one_name: str,
        blocks_name: str,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """gather / scatter: every rank's one tensor, and the root's n blocks (each of that tensor's
        dtype and size; [] on the other ranks)."""
        self._check_rank(op, "root", root)
        n = self._size
        if len(one) != 1:
            raise ValueError(f"meshccl backend: {op}: one {one_name} tensor per rank, got {len(one)}")
        x = _check_tensor(op, one[0])
        if self._rank != root:
            return x, []
        if len(blocks) != 1 or len(blocks[0]) != n:
            raise ValueError(f"meshccl backend: {op}: the root needs a list of {n} {blocks_name} tensors")
        out = [_check_tensor(op, b) for b in blocks[0]]
        for b in out:
            if b.dtype != x.dtype or b.numel() != x.numel():
                raise _unsupported(
                    op,
                    f"{blocks_name} {b.dtype} x {b.numel()} for {one_name} {x.dtype} x {x.numel()}: "
                    f"every block must have the {one_name}'s dtype and size",
                )
        return x, out

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        op = "gather"
        root = opts.rootRank if opts is not None else 0
        n = self._size
        x, outs = self._rooted_blocks(op, root, input_tensors, output_tensors, "input", "output")

        def body(call: Callable[..., None]) -> Finish:
            src = _flat(x)[0]
            gathered = torch.empty(n * src.numel(), dtype=x.dtype)
            call("all_gather", src, out=gathered)

            def finish() -> list[list[torch.Tensor]]:
                k = src.numel()
                for q, o in enumerate(outs):
                    with torch.no_grad():
                        o.copy_(gathered[q * k : (q + 1) * k].view(o.shape))
                return [outs] if outs else []

            return finish

        return self._run(op, body)

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> _Work:
        op = "scatter"
        root = opts.rootRank if opts is not None else 0
        n, me = self._size, self._rank
        o, ins = self._rooted_blocks(op, root, output_tensors, input_tensors, "output", "input")

        def body(call: Callable[..., None]) -> Finish:
            k = o.numel()
            buf = torch.cat([x.detach().reshape(-1) for x in ins]) if me == root else torch.empty(n * k, dtype=o.dtype)
            call("broadcast", buf, root=root)

            def finish() -> list[torch.Tensor]:
                with torch.no_grad():
                    o.copy_(buf[me * k : (me + 1) * k].view(o.shape))
                return [o]

            return finish

        return self._run(op, body)

    # -- barrier

    def barrier(self, opts: Any = None) -> _Work:
        """`dist.barrier(timeout=...)` passes its timeout in `opts.timeout` (unset: -1 ms, the group's timeout
        applies). With one, the barrier runs at once with that timeout alone: the operations posted before it
        complete first under their own timeout, then the group's timeout is restored whatever happened. A rank that
        does not come within it makes the barrier's Work raise meshccl.TimeoutError, and the group is then unusable,
        as after any meshccl timeout."""

        def body(call: Callable[..., None]) -> Finish:
            call("barrier")
            return list

        seconds = _timeout_seconds(getattr(opts, "timeout", None))
        if seconds is None:
            return self._run("barrier", body)
        comm = self._live("barrier")
        with self._lock:
            self._drain_locked()  # the engine is idle: the timeout below is this barrier's alone
            before = comm.timeout
            comm.timeout = seconds
            try:
                work = self._run("barrier", body)
                self._complete_through(work._source())  # its error, if any, goes to whoever waits on the Work
            finally:
                with contextlib.suppress(meshccl.Error):  # closed meanwhile (abort)
                    comm.timeout = before
        return work

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """Gloo's monitored barrier, for callers of the group's method (torch.distributed.monitored_barrier itself
        refuses every backend but Gloo): rank 0 hears from every other rank, then answers each. When a rank does not
        come within `timeout` (default: the group's), rank 0 raises naming every rank that did not (whatever
        `wait_all_ranks`), and the others fail with its error; the group is then unusable, as after any meshccl
        timeout. Messages with tag 2**32 - 1 are this call's."""
        comm = self._live("monitored_barrier")
        if timeout is None:
            seconds = comm.timeout
        else:  # 0 is a timeout too: rank 0 fails unless every rank is already there
            seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        n = self._size
        with self._lock:
            self.calls["monitored_barrier"] += 1
            self._drain_locked()  # the engine is idle: the timeout below is this call's alone
            before = comm.timeout
            one = torch.ones(1, dtype=torch.uint8)
            got = torch.zeros(1, dtype=torch.uint8)
            start = time.monotonic()
            try:
                if self._rank != 0:
                    comm.timeout = seconds
                    comm.messages(sends=[(one, 0, _MONITOR_TAG)])
                    comm.messages(recvs=[(got, 0, _MONITOR_TAG)])
                    return
                came: list[int] = []
                try:
                    while len(came) < n - 1:
                        comm.timeout = max(seconds - (time.monotonic() - start), 1e-3)
                        came.append(int(comm.messages(recvs=[(got, None, _MONITOR_TAG)])[0]))
                except (meshccl.TimeoutError, meshccl.PeerError) as e:
                    missing = ", ".join(map(str, sorted(set(range(1, n)) - set(came))))
                    if isinstance(e, meshccl.PeerError):
                        gone = f"Rank 0 in monitoredBarrier: rank(s) {missing} of {n} left: {e}"
                        raise meshccl.PeerError(gone) from e
                    raise meshccl.TimeoutError(
                        f"Rank 0 timed out in monitoredBarrier after {seconds * 1000:.0f} ms: rank(s) {missing} "
                        f"of {n} did not reach it"
                    ) from e
                comm.timeout = seconds
                comm.messages(sends=[(one, q, _MONITOR_TAG) for q in range(1, n)])
            finally:
                with contextlib.suppress(meshccl.Error):  # closed meanwhile (abort)
                    comm.timeout = before

    # -- all_to_all

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        op = "all_to_all"
        n = self._size
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(f"meshccl backend: {op}: {n} input and {n} output tensors needed")
        for t in [*output_tensors, *input_tensors]:
            _check_tensor(op, t)
        _same_dtype(op, [*output_tensors, *input_tensors])
        return self._alltoall(op, list(output_tensors), list(input_tensors))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> _Work:
        op = "all_to_all_single"
        n = self._size
        _check_tensor(op, output)
        _check_tensor(op, input)
        _same_dtype(op, [output, input])
        outs = _split(op, "output", output, output_split_sizes, n)
        ins = _split(op, "input", input, input_split_sizes, n)
        return self._alltoall(op, outs, ins, whole=output)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> _Work:
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def _alltoall(
        self, op: str, outs: list[torch.Tensor], ins: list[torch.Tensor], whole: torch.Tensor | None = None
    ) -> _Work:
        n, me = self._size, self._rank
        comm = self._live(op)
        unlinked = [q for q in range(n) if q != me and not comm._native.linked(q)]
        if unlinked:
            raise _unsupported(
                op,
                f"rank {me} has no link to rank(s) {unlinked} in this job's cabling ({self._plan.source}: "
                f"{'a ring' if self._plan.ring else 'not a full mesh'}); all-to-all needs every pair of ranks "
                "linked (torchrun, one host, a full mesh): use a Gloo group for it",
            )
        p2p = []  # (kind, user tensor, buffer, copied, peer)
        for q in range(n):
            if q == me:
                continue
            if ins[q].numel():
                buf = _flat(ins[q])[0]
                p2p.append(("send", ins[q], buf, False, q))
            if outs[q].numel():
                buf, copied = _flat(outs[q])
                p2p.append(("recv", outs[q], buf, copied, q))
        result = outs if whole is None else [whole]

        def local() -> None:
            with torch.no_grad():
                outs[me].copy_(ins[me].view(outs[me].shape))

        return self._run(op, lambda call: self._post_p2p(call, p2p, local, result))

    # -- send / recv

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> _Work:
        return self._p2p_op("send", tensors, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> _Work:
        return self._p2p_op("recv", tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        return self._p2p_op("recv", tensors, None, tag)

    def _p2p_op(self, kind: str, tensors: list[torch.Tensor], peer: int | None, tag: int) -> _Work:
        if not 0 <= tag < 2**32:
            raise ValueError(f"meshccl backend: {kind}: tag {tag} is not in 0 .. 2**32 - 1")
        if len(tensors) != 1:
            raise ValueError(f"meshccl backend: {kind}: one tensor, got {len(tensors)}")
        t = _check_tensor(kind, tensors[0])
        if peer is not None:
            self._check_rank(kind, "peer", peer)
            if peer == self._rank:
                raise ValueError(f"meshccl backend: {kind}: rank {peer} is this rank")
        elif self._size < 2:
            raise ValueError(f"meshccl backend: {kind} from any rank: this rank is alone in its group")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"meshccl backend: {kind} on a process group that was shut down")
            self.calls[kind if peer is not None else "recv_anysource"] += 1
            buf, copied = _flat(t)
            # Held back until something waits on one of them or another operation comes: then the
            # sends and receives posted meanwhile go out together (batch_isend_irecv, a ring shift:
            # every rank sends first, and none waits for its send before its receive).
            item = _P2P(kind, t, buf, copied, peer, tag)
            self._p2p.append(item)

            def source() -> _Op:
                if item.op is None:
                    self._flush_p2p()
                assert item.op is not None
                return item.op

            return _Work(kind, item.fut, source, self, item)

    def _flush_p2p(self) -> None:
        with self._lock:
            self._flush_p2p_locked()

    def _flush_p2p_locked(self) -> None:
        if not self._p2p:
            return
        batch, self._p2p = self._p2p, []
        handles: list[Any] = []

        def call(method: str, *args: Any, **kwargs: Any) -> Any:
            handles.append(self._link.call(method, *args, **kwargs))
            return handles[-1]

        try:
            finish = self._post_messages(call, batch)
        except BaseException as e:  # every held-back operation fails with the batch's error
            error = e.with_traceback(None)

            def fail() -> None:
                raise error

            finish = fail
        op = self._track(_Op("send/recv", handles, finish))

        def settle(f: Future) -> None:
            try:
                f.value()
            except BaseException as e:  # the batch's error, for each operation in it
                for i in batch:
                    i.fut.set_exception(e)
                return
            for i in batch:
                i.fut.set_result([i.tensor])

        op.fut.add_done_callback(settle)  # at once if the batch already ran
        for i in batch:
            i.op = op

    def _post_messages(self, call: Callable[..., Any], batch: list[_P2P]) -> Finish:
        """Posts held-back sends and receives as one batch of meshccl's tagged messages (posted together,
        finished together: a ring shift cannot deadlock), matched as torch matches them: a receive takes the
        oldest message from its peer (or from any rank) with its tag, however each side grouped its calls."""
        sends = [(i.buf, i.peer, i.tag) for i in batch if i.kind == "send"]
        recvs = [i for i in batch if i.kind == "recv"]
        work = call("messages", sends=sends, recvs=[(i.buf, i.peer, i.tag) for i in recvs])

        def finish() -> None:
            for i, src in zip(recvs, work.result):  # the rank each receive came from (one per receive)
                i.source = int(src)
                if i.copied:
                    _copy_back(i.tensor, i.buf)

        return finish

    def _post_p2p(
        self,
        call: Callable[..., None],
        p2p: list[tuple[str, torch.Tensor, torch.Tensor, bool, int]],
        local: Callable[[], None] | None,
        result: Any,
    ) -> Finish:
        """all-to-all: one meshccl exchange, the same on every rank (posted together, finished together)."""
        sends = [(buf, peer) for kind, _t, buf, _c, peer in p2p if kind == "send"]
        recvs = [(buf, peer) for kind, _t, buf, _c, peer in p2p if kind == "recv"]
        if sends or recvs:
            call("exchange", sends=sends, recvs=recvs)

        def finish() -> Any:
            if local is not None:
                local()
            for kind, t, buf, copied, _peer in p2p:
                if kind == "recv" and copied:
                    _copy_back(t, buf)
            return result

        return finish

    # -- coalescing (torch's batch_isend_irecv and _coalescing_manager call these on some groups)

    def _start_coalescing(self, device: Any = None) -> None:
        return None

    def _end_coalescing(self, device: Any = None) -> _Work:
        self._flush_p2p()
        done = _Op("coalescing", [], list)
        return _Work("coalescing", done.fut, lambda: done, self)

    # -- unsupported and lifecycle

    def _check_rank(self, op: str, what: str, r: int) -> None:
        if not 0 <= r < self._size:
            raise ValueError(f"meshccl backend: {op}: {what} rank {r} is not in this group of {self._size} ranks")

    def abort(self) -> None:
        if self._comm is not None:
            self._comm.abort("torch.distributed abort()")
        self.shutdown()

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._flush_p2p_locked()
            finally:
                self._completer.stop()
                comm, self._comm = self._comm, None
                self._link.comm = None  # nothing keeps the closed communicator alive (torch keeps groups)
                if comm is not None:
                    _release(comm)
                    comm.close()  # aborts calls still running: their operations end with that error
                with self._unfinished_lock:
                    left, self._unfinished = self._unfinished, []
                for o in left:
                    o.complete()

    def split_group(self, *args: Any, **kwargs: Any) -> None:
        raise _unsupported("split_group", "not supported: create the group with new_group(ranks, backend='meshccl')")

    def merge_remote_group(self, *args: Any, **kwargs: Any) -> None:
        raise _unsupported("merge_remote_group", "not supported")


class _P2P:
    """A send or receive held back until its batch is posted."""

    __slots__ = ("buf", "copied", "fut", "kind", "op", "peer", "source", "tag", "tensor")

    def __init__(
        self, kind: str, tensor: torch.Tensor, buf: torch.Tensor, copied: bool, peer: int | None, tag: int
    ) -> None:
        self.kind = kind
        self.tensor = tensor
        self.buf = buf
        self.copied = copied
        self.peer = peer  # None: a receive from any rank
        self.tag = tag
        self.source = -1 if peer is None else peer  # the rank a receive came from, once it has
        self.fut: Future = Future()
        self.op: _Op | None = None


def _split(op: str, what: str, t: torch.Tensor, sizes: Sequence[int], n: int) -> list[torch.Tensor]:
    """t's dim-0 blocks for all_to_all_single (equal when `sizes` is empty)."""
    rows = t.shape[0] if t.dim() else 1
    if not sizes:
        if rows % n:
            raise ValueError(f"meshccl backend: {op}: {what} has {rows} rows, not a multiple of the group size {n}")
        sizes = [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows or any(s < 0 for s in sizes):
        raise ValueError(f"meshccl backend: {op}: {what} split sizes {list(sizes)} do not split {rows} rows {n} ways")
    return list(torch.split(t, list(sizes), dim=0)) if t.dim() else [t]


def _copy_back(t: torch.Tensor, buf: torch.Tensor) -> None:
    with torch.no_grad():
        t.copy_(buf.view(t.shape))


# --- connecting ------------------------------------------------------------------------------------------

_HOSTFILE_IN_USE: set[int] = set()  # ids of communicators holding the ports meshccl.json names


def _release(comm: meshccl.Communicator) -> None:
    _HOSTFILE_IN_USE.discard(id(comm))


def _agree(store: Any, key: str, rank: int, make: Callable[[], str]) -> str:
    """A value every rank of the group reads from the store, rank 0's."""
    if rank == 0:
        store.set(key, make())
    return bytes(store.get(key)).decode()


def _generation(store: Any, size: int) -> int:
    """How many times this group's store has seen meshccl connect before (a group created again
    with the same name after destroy_process_group reuses its keys: the generation keeps them apart)."""
    return (int(store.add("meshccl/arrivals", 1)) - 1) // size


def _connect(
    store: Any, rank: int, size: int, timeout: Any, group_id: str, global_ranks: list[int]
) -> meshccl.Communicator:
    env = dict(os.environ)
    token = env.get("MESHCCL_TOKEN", "")
    allow_no_token = bootstrap.allow_no_token_from_env(env)
    bootstrap.check_token(rank, size, token, allow_no_token)  # AuthError before anything is sent
    options = meshccl._env_options(env)
    if "timeout" not in options and _timeout_seconds(timeout) is not None:
        options["timeout"] = _timeout_seconds(timeout)  # torch's timeout for the group
    world_size = dist.get_world_size() if dist.is_initialized() else size
    members = list(global_ranks) if global_ranks else list(range(size))
    whole_world = members == list(range(world_size)) and size == world_size
    gen = _generation(store, size)
    job_id = bootstrap.job_id_from_env(env) or _agree(store, f"meshccl/{gen}/job", rank, lambda: secrets.token_hex(8))
    if group_id and not whole_world:
        job_id = f"{job_id}/group-{group_id}"
    env["MESHCCL_JOB_ID"] = job_id
    if "MESHCCL_HOSTFILE" in env and "MESHCCL_RANK" not in env and whole_world:
        env["MESHCCL_RANK"] = str(rank)  # torchrun hands every worker the same environment: torch's rank is ours
    hostfile = "MESHCCL_RANK" in env or "MESHCCL_HOSTFILE" in env
    mlx = "MLX_RANK" in env and "MLX_HOSTFILE" in env
    torchrun = all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))

    if whole_world and hostfile and "MESHCCL_RANK" in env and bootstrap._int_env(env, "MESHCCL_RANK") != rank:
        raise meshccl.BootstrapError(
            f"meshccl backend: MESHCCL_RANK={env['MESHCCL_RANK']} but torch says this process is rank {rank} of "
            f"{size}: the two must name the same rank (meshkit launch -r torch sets both; do not start torchrun "
            "inside it)"
        )
    if whole_world and (hostfile or mlx) and not _HOSTFILE_IN_USE:
        comm = meshccl.init(env, **options)  # meshccl.json: every cable
        _HOSTFILE_IN_USE.add(id(comm))
    elif whole_world and not hostfile and not mlx and torchrun and env["RANK"] == str(members[rank]):
        if "MESHCCL_MASTER_PORT" not in env:
            master = bootstrap._resolve(env["MASTER_ADDR"])
            env["MESHCCL_MASTER_PORT"] = _agree(
                store, f"meshccl/{gen}/master_port", rank, lambda: str(bootstrap._free_port(master))
            )
        comm = meshccl.init(env, **options)  # meshccl's own rendezvous, the token proved at both ends
    elif hostfile:
        plan = torch_store.plan_from_sub_hostfile(store, rank, members, gen, env)
        comm = meshccl.Communicator(plan, token=token, job_id=job_id, allow_no_token=allow_no_token, **options)
    else:
        plan = torch_store.plan_from_store(store, rank, size, gen, env, token, job_id)
        comm = meshccl.Communicator(plan, token=token, job_id=job_id, allow_no_token=allow_no_token, **options)
    if comm.rank != rank or comm.size != size:
        comm.close()
        _release(comm)
        raise meshccl.BootstrapError(
            f"meshccl backend: torch says this process is rank {rank} of {size}, but meshccl's environment "
            f"({comm.plan.source}) says rank {comm.rank} of {comm.size}"
        )
    return comm


def _create(dist_opts: Any, backend_options: Any = None) -> ProcessGroupMeshccl:
    """torch's creator for "meshccl" (extended API: store, rank, size, timeout, group id, ranks)."""
    comm = _connect(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        dist_opts.timeout,
        str(dist_opts.group_id),
        list(dist_opts.global_ranks_in_group),
    )
    return ProcessGroupMeshccl(comm, dist_opts.group_rank, dist_opts.group_size, str(dist_opts.group_id))


# Groups not shut down yet: closed at exit, so a program that never calls
# destroy_process_group() leaves no running calls, threads or native objects behind.
_LIVE: weakref.WeakSet[ProcessGroupMeshccl] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for group in list(_LIVE):
        group.shutdown()


def register() -> None:
    """Registers the backend "meshccl" with torch.distributed (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


register()
