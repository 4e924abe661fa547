"""A rank for the launch tests that leaves a family behind: a child and a grandchild in its process
group, a daemon (double fork + setsid), and a daemon that also drops its environment (so no job
marker finds it). Every one of them sleeps SECONDS, a number unique to the test, so a process
listing finds them all."""

import os
import subprocess
import sys
import time

seconds = sys.argv[1]
subprocess.Popen(["sh", "-c", f"sleep {seconds} & wait"])
for env in (dict(os.environ), {}):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execve("/bin/sleep", ["sleep", seconds], env)
        os._exit(0)
print(f"rank {os.environ['MESHKIT_RANK']} up, family sleeping {seconds} s", flush=True)
time.sleep(float(seconds))
