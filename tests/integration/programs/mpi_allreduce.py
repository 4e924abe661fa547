"""An MPI job for the launch tests (mpi4py): an all-reduce of rank + 1 over every rank."""

import os
import socket

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
total = comm.allreduce(rank + 1)
print(
    f"mpi rank {rank}/{size} on {socket.gethostname()} sum={total} "
    f"local={os.environ.get('OMPI_COMM_WORLD_LOCAL_RANK')} job={os.environ.get('MESHKIT_JOB_ID')} "
    f"greeting={os.environ.get('GREETING')}",
    flush=True,
)
