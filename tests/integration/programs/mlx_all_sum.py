"""An MLX ring job for the launch tests: all_sum across every rank, with the environment it got."""

import os
import socket

import mlx.core as mx

group = mx.distributed.init(backend="ring", strict=True)
x = mx.distributed.all_sum(mx.ones(4) * (group.rank() + 1))
mx.eval(x)
print(
    f"mlx rank {group.rank()}/{group.size()} on {socket.gethostname()} MLX_RANK={os.environ['MLX_RANK']} "
    f"sum={x.tolist()[0]:g}",
    flush=True,
)
