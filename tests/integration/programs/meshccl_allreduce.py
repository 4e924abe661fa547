"""A meshccl job for the launch tests: all_reduce across every rank, checked exactly."""

import os
import socket

import meshccl
import numpy as np

comm = meshccl.init()
rank, size = comm.rank, comm.size
assert size == int(os.environ["MESHKIT_WORLD_SIZE"]), (size, os.environ["MESHKIT_WORLD_SIZE"])
for count in (1000, 1 << 18):
    x = np.full(count, rank + 1, dtype=np.float32)
    comm.all_reduce(x)
    expected = size * (size + 1) / 2
    assert np.all(x == expected), (count, x[:4], expected)
comm.barrier()
print(f"meshccl rank {rank}/{size} on {socket.gethostname()}: all_reduce exact", flush=True)
# Which install the rank ran (the host's own virtual environment, put on PATH by the launch).
stat = os.stat(meshccl.__file__)
print(f"meshccl from {meshccl.__file__} inode {stat.st_dev}:{stat.st_ino}", flush=True)
