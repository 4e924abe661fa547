"""A PyTorch gloo job for the launch tests: all_reduce across every rank, with the environment it got."""

import os
import socket

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(4) * (dist.get_rank() + 1)
dist.all_reduce(t)
env = " ".join(f"{k}={os.environ[k]}" for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))
print(f"torch rank {dist.get_rank()}/{dist.get_world_size()} on {socket.gethostname()} {env} sum={t[0].item():g}")
dist.destroy_process_group()
