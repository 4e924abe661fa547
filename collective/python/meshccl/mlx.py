"""meshccl for MLX: ``mx.array`` in, ``mx.array`` out.

    import meshccl
    import meshccl.mlx as mccl

    comm = meshccl.init()
    y = mccl.all_reduce(comm, x)                    # a new array: x summed over every rank
    mccl.all_reduce(comm, x, out=x)                 # in place
    grads = mccl.average_gradients(comm, grads)     # a tree of gradients, averaged over the ranks

Every rank must make the same calls in the same order, with arrays of the same shapes and dtypes
(meshccl raises MismatchError on every rank otherwise).

How arrays reach meshccl, and what is copied:

- meshccl reads and writes an array's own memory, through MLX's buffer protocol (the documented
  way to share an MLX array's memory: MLX evaluates a lazy array first, then exports its data,
  writable). Nothing is converted on the way.
- Inputs: no copy when the array is row-contiguous (anything MLX computed, sliced along the
  first axis or reshaped). A transposed, broadcast or strided input is made contiguous first by
  ``mx.contiguous`` (one copy, of that input only).
- Outputs: written where they lie. An ``out=`` must be row-contiguous (else ValueError: meshccl
  would otherwise write into a copy and the result would be lost). A new output is allocated by
  MLX, which has no uninitialised allocation: it is filled with zeros once, then overwritten.
- Trees (``all_reduce_tree``, ``average_gradients``, ``broadcast_tree``): the arrays of one dtype
  are packed into one buffer per bucket of about ``all_reduce_size`` bytes (one copy: a call
  moves one buffer, and one call per bucket instead of one per array cuts the per-call latency),
  the bucket is reduced in place, and the results come back as slices of it (views, no copy). A
  bucket holding one array is not packed (no copy).
- ``average_gradients`` divides each bucket by the world size with an MLX division (one pass,
  a new buffer: MLX arrays have no in-place arithmetic).

Writing in place (``out=x``) is outside MLX's model of immutable arrays: every array that shares
the memory of ``out`` (its views and reshapes, ``copy.copy(out)``, ``out.astype(out.dtype)``)
sees the result, and a lazy computation that reads ``out`` and is evaluated later sees the new
values; gradients do not flow through meshccl calls. The functions that return new arrays have
none of these effects.

dtypes: float32, float64, float16, bfloat16, int8, int32, int64, uint8. Others (bool, int16,
uint16, uint32, uint64, complex64) raise TypeError naming the dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

# MLX dtype -> meshccl's dtype name (meshccl.DTYPES).
DTYPES: dict[Any, str] = {
    mx.float32: "float32",
    mx.float64: "float64",
    mx.float16: "float16",
    mx.bfloat16: "bfloat16",
    mx.int8: "int8",
    mx.int32: "int32",
    mx.int64: "int64",
    mx.uint8: "uint8",
}

# Same default as mlx.nn.utils.average_gradients.
ALL_REDUCE_SIZE = 32 * 1024**2

__all__ = [
    "ALL_REDUCE_SIZE",
    "DTYPES",
    "all_gather",
    "all_reduce",
    "all_reduce_tree",
    "average_gradients",
    "broadcast",
    "broadcast_tree",
    "buffer",
    "recv",
    "recv_like",
    "reduce_scatter",
    "send",
]


def dtype_name(dtype: Any, what: str = "array") -> str:
    """meshccl's name for an MLX dtype; TypeError naming it if meshccl has none."""
    name = DTYPES.get(dtype)
    if name is None:
        supported = ", ".join(DTYPES.values())
        raise TypeError(
            f"{what}: meshccl has no {dtype} (it supports {supported}); cast first, e.g. x.astype(mx.float32)"
        )
    return name


def _array(x: Any, what: str) -> mx.array:
    if not isinstance(x, mx.array):
        raise TypeError(f"{what}: expected an mx.array, got {type(x).__name__}")
    return x


def buffer(x: mx.array, what: str = "array", writable: bool = False) -> memoryview:
    """The bytes of x as meshccl takes them: x's own memory (evaluated first if lazy), as a flat
    byte view. Read-only use (``writable=False``) of an array that is not row-contiguous gets the
    memory of a contiguous copy (``mx.contiguous``); a writable one must be row-contiguous."""
    x = _array(x, what)
    dtype_name(x.dtype, what)
    if x.size == 0:
        # Nothing is read or written; the call is still made (every rank makes the same calls).
        # memoryview.cast refuses zero-sized shapes, so hand meshccl an empty buffer of its own.
        return memoryview(bytearray(0))
    view = memoryview(x)  # MLX's buffer protocol: evaluates x, exports its own data, writable
    if not view.c_contiguous:
        if writable:
            raise ValueError(
                f"{what}: not row-contiguous (a transposed, broadcast or strided view of shape {tuple(x.shape)}); "
                "meshccl writes into an array's own memory, so the result would be lost. Pass a contiguous array "
                "(mx.contiguous(x) makes one) or leave out= unset to get a new array"
            )
        view = memoryview(mx.contiguous(x))  # the one copy an input can need; the view keeps it alive
    if writable and view.readonly:
        raise ValueError(f"{what}: its memory is read-only; meshccl cannot write the result into it")
    return view.cast("B")


def _new(shape: Sequence[int], dtype: Any) -> mx.array:
    out = mx.zeros(tuple(shape), dtype=dtype)
    mx.eval(out)
    return out


def _check_out(out: Any, dtype: Any, size: int, what: str) -> mx.array:
    out = _array(out, what)
    if out.dtype != dtype:
        raise TypeError(f"{what}: dtype {out.dtype}, the input's is {dtype}")
    if out.size != size:
        raise ValueError(f"{what}: holds {out.size} elements, it must hold {size}")
    return out


def all_reduce(comm: Any, x: mx.array, op: str = "sum", *, out: mx.array | None = None) -> mx.array:
    """x reduced over every rank (op: sum, prod, min, max): a new array, or written into ``out``
    (``out=x``: in place) and returned."""
    x = _array(x, "all_reduce input")
    name = dtype_name(x.dtype, "all_reduce input")
    out = _new(x.shape, x.dtype) if out is None else _check_out(out, x.dtype, x.size, "all_reduce out")
    dst = buffer(out, "all_reduce out", writable=True)
    src = dst if out is x else buffer(x, "all_reduce input")
    comm.all_reduce(src, op=op, out=dst, dtype=name)
    return out


def all_gather(comm: Any, x: mx.array, *, out: mx.array | None = None) -> mx.array:
    """Every rank's x, in rank order, concatenated along the first axis (a 0-d x gives shape
    (size,)); a new array, or written into ``out``."""
    x = _array(x, "all_gather input")
    name = dtype_name(x.dtype, "all_gather input")
    n = comm.size
    shape = (n * x.shape[0], *x.shape[1:]) if x.ndim else (n,)
    out = _new(shape, x.dtype) if out is None else _check_out(out, x.dtype, n * x.size, "all_gather out")
    comm.all_gather(buffer(x, "all_gather input"), out=buffer(out, "all_gather out", writable=True), dtype=name)
    return out


def reduce_scatter(comm: Any, x: mx.array, op: str = "sum", *, out: mx.array | None = None) -> mx.array:
    """Block ``rank`` of x reduced over every rank: x's first axis is cut into ``size`` equal
    blocks, this rank gets the reduction of block ``rank`` (shape (x.shape[0] // size, ...))."""
    x = _array(x, "reduce_scatter input")
    name = dtype_name(x.dtype, "reduce_scatter input")
    n = comm.size
    if x.ndim == 0 or x.shape[0] % n:
        raise ValueError(
            f"reduce_scatter: the input's first axis must be a multiple of the world size {n}; its shape is "
            f"{tuple(x.shape)}"
        )
    shape = (x.shape[0] // n, *x.shape[1:])
    out = _new(shape, x.dtype) if out is None else _check_out(out, x.dtype, x.size // n, "reduce_scatter out")
    comm.reduce_scatter(
        buffer(x, "reduce_scatter input"), out=buffer(out, "reduce_scatter out", writable=True), op=op, dtype=name
    )
    return out


def broadcast(comm: Any, x: mx.array, root: int = 0, *, out: mx.array | None = None) -> mx.array:
    """root's x on every rank. Without ``out``: root gets x itself back (nothing copied), every
    other rank a new array (x gives only the shape and dtype). With ``out`` (``out=x``: in
    place): the result is written into out on every rank (on root, x is copied into out unless
    out is x)."""
    x = _array(x, "broadcast input")
    name = dtype_name(x.dtype, "broadcast input")
    is_root = comm.rank == root
    if out is None:
        out = x if is_root else _new(x.shape, x.dtype)
        # Root's buffer is only read; one that is not contiguous is sent from a contiguous copy.
        buf = buffer(out, "broadcast input") if is_root else buffer(out, "broadcast out", writable=True)
    else:
        out = _check_out(out, x.dtype, x.size, "broadcast out")
        buf = buffer(out, "broadcast out", writable=True)
        if is_root and out is not x:
            buf[:] = buffer(x, "broadcast input")  # the copy the caller asked for
    comm.broadcast(buf, root=root, dtype=name)
    return out


def send(comm: Any, x: mx.array, dst: int) -> None:
    """Sends x to rank dst (which calls recv with the same shape and dtype)."""
    x = _array(x, "send input")
    comm.send(buffer(x, "send input"), dst, dtype=dtype_name(x.dtype, "send input"))


def recv(comm: Any, shape: Sequence[int], dtype: Any, src: int, *, out: mx.array | None = None) -> mx.array:
    """An array of ``shape`` and ``dtype`` received from rank src (new, or written into ``out``)."""
    name = dtype_name(dtype, "recv")
    size = 1
    for d in shape:
        size *= int(d)
    out = _new(shape, dtype) if out is None else _check_out(out, dtype, size, "recv out")
    comm.recv(buffer(out, "recv out", writable=True), src, dtype=name)
    return out


def recv_like(comm: Any, x: mx.array, src: int) -> mx.array:
    """recv with x's shape and dtype (x is not written)."""
    x = _array(x, "recv_like template")
    return recv(comm, x.shape, x.dtype, src)


# --- trees ---------------------------------------------------------------------------------------


def _leaves(tree: Any, what: str) -> list[tuple[str, mx.array]]:
    flat = tree_flatten(tree)
    for key, leaf in flat:
        if not isinstance(leaf, mx.array):
            raise TypeError(f"{what}: leaf {key!r} is a {type(leaf).__name__}, not an mx.array")
        dtype_name(leaf.dtype, f"{what}: leaf {key!r}")
    return flat


def _buckets(arrays: Sequence[mx.array], all_reduce_size: int) -> list[list[int]]:
    """Indices of arrays grouped by dtype (first appearance first, tree order within), each group
    cut into buckets that close once they reach all_reduce_size bytes (<= 0: one array each).
    Depends only on shapes and dtypes, so every rank cuts the same buckets."""
    by_dtype: dict[Any, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(i)
    buckets: list[list[int]] = []
    for indices in by_dtype.values():
        current: list[int] = []
        nbytes = 0
        for i in indices:
            current.append(i)
            nbytes += arrays[i].nbytes
            if all_reduce_size <= 0 or nbytes >= all_reduce_size:
                buckets.append(current)
                current, nbytes = [], 0
        if current:
            buckets.append(current)
    return buckets


def _pack(arrays: Sequence[mx.array]) -> mx.array:
    packed = mx.concatenate([a.reshape(-1) for a in arrays])
    mx.eval(packed)
    return packed


def _unpack(packed: mx.array, arrays: Sequence[mx.array]) -> list[mx.array]:
    parts = []
    offset = 0
    for a in arrays:
        parts.append(packed[offset : offset + a.size].reshape(a.shape))
        offset += a.size
    return parts


def _tree_collective(
    comm: Any, tree: Any, what: str, all_reduce_size: int, run: Any, scale: int = 1, receive_only: bool = False
) -> Any:
    """run(array) -> result for a bucket of one array; run(packed, in_place=True) for a packed
    bucket. receive_only: this rank's values are not sent (a broadcast's non-root ranks), so a
    packed bucket is allocated instead of packed."""
    flat = _leaves(tree, what)
    if not flat:
        return tree
    keys = [key for key, _leaf in flat]
    arrays = [leaf for _key, leaf in flat]
    results: list[Any] = [None] * len(arrays)
    for bucket in _buckets(arrays, all_reduce_size):
        members = [arrays[i] for i in bucket]
        if len(members) == 1:
            parts = [run(members[0])]
            if scale != 1:
                parts = [parts[0] / scale]
        else:
            # A broadcast's non-root ranks send nothing: allocate, don't pack.
            packed = _new((sum(a.size for a in members),), members[0].dtype) if receive_only else _pack(members)
            packed = run(packed, in_place=True)
            if scale != 1:
                packed = packed / scale
            parts = _unpack(packed, members)
        for i, part in zip(bucket, parts):
            results[i] = part
    return tree_unflatten(list(zip(keys, results)))


def all_reduce_tree(comm: Any, tree: Any, op: str = "sum", *, all_reduce_size: int = ALL_REDUCE_SIZE) -> Any:
    """Every array of a tree (dicts, lists, tuples of mx.array: a model's parameters or
    gradients) reduced over every rank; a new tree of the same structure. Arrays of one dtype
    travel in buckets of about all_reduce_size bytes (one call each; <= 0: one call per array)."""

    def run(a: mx.array, in_place: bool = False) -> mx.array:
        return all_reduce(comm, a, op, out=a if in_place else None)

    return _tree_collective(comm, tree, "all_reduce_tree", all_reduce_size, run)


def average_gradients(comm: Any, gradients: Any, all_reduce_size: int = ALL_REDUCE_SIZE) -> Any:
    """The gradient tree averaged over every rank: summed by meshccl, divided by the world size
    (like mlx.nn.utils.average_gradients, over meshccl). A world of one returns it unchanged."""
    if comm.size == 1:
        return gradients

    def run(a: mx.array, in_place: bool = False) -> mx.array:
        return all_reduce(comm, a, "sum", out=a if in_place else None)

    return _tree_collective(comm, gradients, "average_gradients", all_reduce_size, run, scale=comm.size)


def broadcast_tree(comm: Any, tree: Any, root: int = 0, *, all_reduce_size: int = ALL_REDUCE_SIZE) -> Any:
    """root's tree on every rank (e.g. a model's initial parameters, so that every rank starts
    from the same ones); every rank passes a tree of the same structure, shapes and dtypes. Root
    gets its own arrays back where a bucket holds one array."""

    def run(a: mx.array, in_place: bool = False) -> mx.array:
        return broadcast(comm, a, root, out=a if in_place else None)

    return _tree_collective(comm, tree, "broadcast_tree", all_reduce_size, run, receive_only=comm.rank != root)
