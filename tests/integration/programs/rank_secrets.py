"""A rank of the secrets tests (torch/plain: MESHKIT_RANK; MPI: OMPI_COMM_WORLD_RANK).

Prints one line: the sha256 and length of each secret it got (never a value), its job id, and
which processes of the machine have one of the values on their command line while it runs. With
an argument, it then waits (up to 240 s) until that file exists, so the test can look at every
process while the ranks are alive.
"""

import hashlib
import os
import sys
import time

names = ["MESHCCL_TOKEN", "API_TOKEN", "MY_PASS"]
values = [os.environ.get(n, "") for n in names]
leaks = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read()
    except OSError:
        continue
    leaks += [pid for v in values if v and v.encode() in argv]
rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ["MESHKIT_RANK"]
said = " ".join(f"{n}={hashlib.sha256(v.encode()).hexdigest()}/{len(v)}" for n, v in zip(names, values, strict=True))
print(f"secrets rank {rank} {said} job={os.environ.get('MESHCCL_JOB_ID')} argv-leaks={leaks or 'none'}", flush=True)
if len(sys.argv) > 1:
    deadline = time.monotonic() + 240
    while not os.path.exists(sys.argv[1]):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
