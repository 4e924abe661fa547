"""meshccl: collectives over every cable of a small cluster.

    import meshccl
    comm = meshccl.init()          # from MESHCCL_*, MLX_* or torchrun's environment
    comm.all_reduce(x)             # in place; x: NumPy array, PyTorch CPU tensor, any buffer
    comm.all_reduce(x, out=y, op="max")

Every job of more than one rank needs a secret job token in MESHCCL_TOKEN, the same on every
rank (`meshkit launch` sets it; the ranks prove it to each other and never send it); without
one, init() raises AuthError unless MESHCCL_ALLOW_NO_TOKEN=1.

Every rank must make the same calls in the same order. A rank that dies, stalls or calls
something else makes every rank raise (PeerError, TimeoutError, MismatchError) instead of
hanging; after such an error the communicator is unusable.

Every call takes async_op=True: it is queued on the communicator's engine and returns a
:class:`Work` at once (``work.wait()``). Calls run one at a time in the order they were made,
from any number of threads; a blocking call with nothing queued runs on the caller's thread.
``comm.abort(reason)`` (any thread) ends the running call on every rank with AbortedError;
Ctrl-C during a call on the main thread does the same and raises KeyboardInterrupt.
"""

from __future__ import annotations

import array
import os
from typing import Any

from meshccl._meshccl import (
    AbortedError,
    AuthError,
    BootstrapError,
    Error,
    InvalidArgumentError,
    MismatchError,
    PeerError,
    TimeoutError,
)
from meshccl._meshccl import Communicator as _Native
from meshccl._meshccl import build_info as _build_info
from meshccl._meshccl import make_config as _make_config
from meshccl.bootstrap import (
    Plan,
    allow_no_token_from_env,
    job_id_from_env,
    plan_from_env,
    plan_from_meshccl_hostfile,
    plan_from_mlx_hostfile,
)

__all__ = [
    "DTYPES",
    "OPS",
    "AbortedError",
    "AuthError",
    "BootstrapError",
    "Communicator",
    "Error",
    "InvalidArgumentError",
    "MismatchError",
    "PeerError",
    "Plan",
    "TimeoutError",
    "Work",
    "build_info",
    "init",
    "plan_from_env",
    "plan_from_meshccl_hostfile",
    "plan_from_mlx_hostfile",
]

OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3}
DTYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3, "int8": 4, "int32": 5, "int64": 6, "uint8": 7}

# Defaults; each can be set in the environment (MESHCCL_<NAME>) or passed to init().
DEFAULTS: dict[str, Any] = {
    "timeout": 300.0,  # seconds per operation
    "connect_timeout": 60.0,  # seconds to connect the job
    "handshake_timeout": 5.0,  # seconds each incoming connection has to prove the token (capped by connect_timeout)
    "conns_per_link": 2,
    "algorithm": "auto",  # auto | ring | direct
    "segment_bytes": 256 << 10,
    "small_bytes": 64 << 10,
    "pipeline_depth": 4,
    "socket_buffer": 0,  # 0: kernel autotuning
    "transport": "auto",  # auto: shared memory between ranks of one host | tcp
    "shm_ring_bytes": 256 << 10,  # per direction and connection (power of two)
    "shm_segment_bytes": 64 << 10,  # segment when all ranks share one host (0: segment_bytes)
    "single_copy_bytes": 256 << 10,  # all ranks on one host: read peers' buffers directly from here (0: never)
    "log_level": 1,
}


def build_info() -> dict[str, Any]:
    """What this build of meshccl selected when it was compiled (its platform layer):

    system ("linux", "macos", ...); portable (True: a Linux build forced onto the code paths
    macOS takes, MESHCCL_PORTABLE, for testing them); single_copy (True: ranks of one host can
    read each other's buffers, process_vm_readv; else they copy through shared memory);
    sockets ("accept4": SOCK_CLOEXEC|SOCK_NONBLOCK at creation, "fcntl": set afterwards);
    sigpipe ("MSG_NOSIGNAL", "SO_NOSIGPIPE+MSG_NOSIGNAL", "SO_NOSIGPIPE" or "sigmask");
    shm_reserve ("posix_fallocate" or "ftruncate"); shm_name_max (30); crypto (the library);
    protocol_version; abi_version (the C ABI).
    """
    return dict(_build_info())


def _op(op: str | int) -> int:
    if isinstance(op, int):
        return op
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduction op {op!r}; one of {', '.join(OPS)}") from None


def _dtype(dtype: str | None) -> int:
    if dtype is None:
        return -1
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; one of {', '.join(DTYPES)}") from None


def _empty_like(x: Any, count: int) -> Any:
    """A new 1-D buffer of `count` elements of x's type, from x's own library."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        import torch

        return torch.empty(count, dtype=x.dtype)
    if mod == "mlx":
        import mlx.core as mx

        out = mx.zeros((count,), dtype=x.dtype)  # MLX has no uninitialised allocation
        mx.eval(out)
        return out
    import numpy as np

    return np.empty(count, dtype=np.asarray(x).dtype)


def _numel(x: Any) -> int:
    n = getattr(x, "size", None)
    if callable(n):  # torch: size() is a method
        return int(x.numel())
    if n is not None:
        return int(n)
    return len(memoryview(x).cast("B")) // memoryview(x).itemsize


class Work:
    """A call queued with async_op=True. It holds the call's arrays until the call has ended
    (the engine reads and writes them meanwhile: do not touch them before wait())."""

    __slots__ = ("_arrays", "_native", "result")

    def __init__(self, native: Any, result: Any, arrays: tuple[Any, ...]) -> None:
        self._native = native
        self.result = result  # what the blocking call would have returned
        self._arrays = arrays

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the call (timeout None: without limit). True once it has ended, False if
        `timeout` seconds passed first. Raises the call's error (meshccl.Error)."""
        done = bool(self._native.wait(timeout))
        if done:
            self._arrays = ()
        return done

    def is_completed(self) -> bool:
        return bool(self._native.is_completed())

    def exception(self) -> Error | None:
        """The call's error once it has ended with one, else None (never waits)."""
        if not self._native.is_completed():
            return None
        try:
            self._native.wait(0)
        except Error as e:
            return e
        return None

    def __repr__(self) -> str:
        state = "done" if self._native.is_completed() else "pending"
        return f"<meshccl.Work {state}>"


class Communicator:
    """A connected group of ranks. Build with :func:`init` (or from a :class:`Plan`).

    Safe to use from several threads: calls are queued and run one at a time, in the order they
    were made (every rank must still make the same calls in the same order)."""

    def __init__(
        self, plan: Plan, token: str = "", job_id: str = "", allow_no_token: bool = False, **options: Any
    ) -> None:
        opts = {**DEFAULTS, **options}
        unknown = set(opts) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
        config = _make_config(
            plan.rank,
            plan.size,
            token,
            plan.listen,
            [(r, links, initiate, r in plan.same_host) for r, (links, initiate) in sorted(plan.peers.items())],
            int(opts["conns_per_link"]),
            float(opts["timeout"]),
            float(opts["connect_timeout"]),
            plan.complete,
            plan.ring,
            plan.ring_links * int(opts["conns_per_link"]),
            int(opts["segment_bytes"]),
            int(opts["small_bytes"]),
            int(opts["pipeline_depth"]),
            str(opts["algorithm"]),
            int(opts["socket_buffer"]),
            int(opts["log_level"]),
            str(opts["transport"]),
            int(opts["shm_ring_bytes"]),
            int(opts["shm_segment_bytes"]),
            int(opts["single_copy_bytes"]),
            job_id,
            allow_no_token,
            float(opts["handshake_timeout"]),
        )
        self.plan = plan
        self._inflight: list[Work] = []
        self._native = _Native(config)

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def size(self) -> int:
        return self._native.size

    @property
    def timeout(self) -> float:
        return self._native.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._native.timeout = seconds

    def transport(self, peer: int) -> str:
        """How this rank reaches `peer`: "shm", "tcp", "shm+tcp" (partly fell back), "" if not linked."""
        return str(self._native.transport(peer))

    @property
    def transports(self) -> dict[int, str]:
        """Every linked peer and how this rank reaches it ("shm", "tcp" or "shm+tcp")."""
        return {peer: self.transport(peer) for peer in range(self.size) if self._native.linked(peer)}

    @property
    def single_copy(self) -> bool:
        """Every peer shares this host and this rank can read its memory: calls from
        ``single_copy_bytes`` up copy each byte once, straight out of the peer's buffer (when
        every rank can). Never in a build without single copy (build_info()["single_copy"])."""
        return bool(self._native.single_copy)

    def info(self) -> dict[str, Any]:
        """What this rank runs on: transport over all its peers ("shm", "tcp", "shm+tcp"; ""
        alone), transports per peer, single_copy on or off, and the build (build_info())."""
        return {
            "transport": str(self._native.transport_summary),
            "transports": self.transports,
            "single_copy": self.single_copy,
            "build": build_info(),
        }

    def _done(self, work: Any, result: Any, *arrays: Any) -> Any:
        """A blocking call's result, or a queued call's Work (kept until it ends)."""
        if work is None:
            return result
        w = Work(work, result, arrays)
        self._inflight = [x for x in self._inflight if not x.is_completed()]
        self._inflight.append(w)
        return w

    def all_reduce(
        self, x: Any, op: str = "sum", out: Any = None, dtype: str | None = None, async_op: bool = False
    ) -> Any:
        """Reduces x over all ranks into out (default: x itself, in place); returns the result
        (async_op: a Work whose .result it is)."""
        target = x if out is None else out
        return self._done(self._native.all_reduce(x, target, _op(op), _dtype(dtype), async_op), target, x, target)

    def all_gather(self, x: Any, out: Any = None, dtype: str | None = None, async_op: bool = False) -> Any:
        """Every rank's x, in rank order, into out (size * len(x) elements; allocated if None)."""
        if out is None:
            out = _empty_like(x, self.size * _numel(x))
        return self._done(self._native.all_gather(x, out, _dtype(dtype), async_op), out, x, out)

    def reduce_scatter(
        self, x: Any, out: Any = None, op: str = "sum", dtype: str | None = None, async_op: bool = False
    ) -> Any:
        """Block `rank` of the reduction of x (size * n elements) over all ranks, into out (n)."""
        if out is None:
            out = _empty_like(x, _numel(x) // self.size)
        return self._done(self._native.reduce_scatter(x, out, _op(op), _dtype(dtype), async_op), out, x, out)

    def broadcast(self, x: Any, root: int = 0, dtype: str | None = None, async_op: bool = False) -> Any:
        """x on every rank becomes root's x; returns x."""
        return self._done(self._native.broadcast(x, root, _dtype(dtype), async_op), x, x)

    def send(self, x: Any, dst: int, dtype: str | None = None, async_op: bool = False) -> Any:
        return self._done(self._native.send(x, dst, _dtype(dtype), async_op), None, x)

    def recv(self, x: Any, src: int, dtype: str | None = None, async_op: bool = False) -> Any:
        return self._done(self._native.recv(x, src, _dtype(dtype), async_op), x, x)

    def exchange(
        self,
        sends: list[tuple[Any, int]] | tuple[()] = (),
        recvs: list[tuple[Any, int]] | tuple[()] = (),
        async_op: bool = False,
    ) -> Any:
        """Sends and receives posted together and finished together: [(array, peer), ...] each,
        raw bytes (any dtype). A ring shift (send right, receive left) in one exchange cannot
        deadlock. The other end must take part in an exchange too, naming this rank in the same
        order with the same sizes; peers must be linked to this rank. Returns the receive
        buffers (async_op: a Work whose .result they are)."""
        sends = list(sends)
        recvs = list(recvs)
        native = self._native.exchange([(a, int(p)) for a, p in sends], [(a, int(p)) for a, p in recvs], async_op)
        bufs = [pair[0] for pair in recvs]
        return self._done(native, bufs, *(pair[0] for pair in sends), *bufs)

    def messages(
        self,
        sends: list[tuple[Any, int, int]] | tuple[()] = (),
        recvs: list[tuple[Any, int | None, int]] | tuple[()] = (),
        async_op: bool = False,
    ) -> Any:
        """Tagged messages, as MPI and torch.distributed pass them: [(array, peer, tag), ...] each, raw bytes. A
        receive takes the oldest message from its peer (None: from any linked rank) with its tag, whatever that
        peer sent before it; messages that come before their receive wait in the communicator (sent in one call,
        received in a later one). A rank's messages must all be received before the pair's next collective, and
        sizes must agree (MismatchError). Sends, then receives from named ranks, are posted together (a ring shift
        cannot deadlock). Returns the rank each receive came from, an array of ints (async_op: a Work whose .result
        it is, filled once the Work completes)."""
        sends = list(sends)
        recvs = list(recvs)
        sources = array.array("i", [-1] * len(recvs))
        native = self._native.messages(
            [(a, int(p), int(t)) for a, p, t in sends],
            [(a, -1 if p is None else int(p), int(t)) for a, p, t in recvs],
            sources,
            async_op,
        )
        return self._done(native, sources, *(s[0] for s in sends), *(r[0] for r in recvs), sources)

    def barrier(self, async_op: bool = False) -> Any:
        return self._done(self._native.barrier(async_op), None)

    def abort(self, reason: str = "abort() was called") -> None:
        """From any thread: the running call (or the next) fails with AbortedError on this rank
        and, through ABORT frames, on every rank it reaches; the communicator is then unusable.
        With nothing running the peers learn at once (their calls with this rank fail)."""
        self._native.abort(reason)

    @property
    def pending(self) -> int:
        """Calls queued or running right now."""
        return int(self._native.pending)

    def close(self) -> None:
        """Closes the connections. From another thread during a call, the call is aborted first
        (AbortedError on every rank), then the communicator closes."""
        self._native.close()
        self._inflight = []

    def __del__(self) -> None:
        native = getattr(self, "_native", None)
        if native is not None and not native.closed:
            native.close()  # queued calls hold arrays that are about to go: end them first

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<meshccl.Communicator rank {self.rank} of {self.size} ({self.plan.source})>"


def _env_options(env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, default in DEFAULTS.items():
        key = "MESHCCL_" + name.upper()
        if key in env:
            try:
                out[name] = type(default)(env[key])
            except ValueError:
                raise BootstrapError(f"{key}={env[key]!r} is not a valid {type(default).__name__}") from None
    return out


def init(env: dict[str, str] | None = None, **options: Any) -> Communicator:
    """Connects this rank to the job described by the environment (see meshccl.bootstrap).

    Options (keyword or MESHCCL_<NAME> in the environment): timeout, connect_timeout,
    conns_per_link, algorithm, segment_bytes, small_bytes, pipeline_depth, socket_buffer, handshake_timeout,
    transport, shm_ring_bytes, shm_segment_bytes, single_copy_bytes, log_level.

    The job token comes from MESHCCL_TOKEN (never logged, never sent: ranks prove they hold
    it), the job id from MESHCCL_JOB_ID (else torchrun's TORCHELASTIC_RUN_ID). A job of more
    than one rank without a token raises AuthError before anything is sent, unless
    MESHCCL_ALLOW_NO_TOKEN=1 (then a warning is printed once).
    """
    env = dict(os.environ if env is None else env)
    opts = {**_env_options(env), **options}
    token = env.get("MESHCCL_TOKEN", "")
    job_id = job_id_from_env(env)
    allow_no_token = allow_no_token_from_env(env)
    plan = plan_from_env(
        env,
        token=token,
        timeout=float(opts.get("connect_timeout", DEFAULTS["connect_timeout"])),
        job_id=job_id,
        allow_no_token=allow_no_token,
    )
    return Communicator(plan, token=token, job_id=job_id, allow_no_token=allow_no_token, **opts)
