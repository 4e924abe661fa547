"""The launch agent's watchdog (module_utils/agent_watchdog.py), alone: after an agent that ended in order it
signals nothing; after a killed agent it kills what still carries the job's mark, never a process that
only took the number of one of the job's process groups. (The watchdog under a real agent: test_launcher.py
and test_launch_agent_portable.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import agent_watchdog

# The directory that holds ansible_collections/ (this checkout's), first on the watchdog's sys.path.
COLLECTIONS = Path(agent_watchdog.__file__).parents[5]


WATCHDOG = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from ansible_collections.meshkit.cluster.plugins.module_utils import agent_procs, agent_watchdog
decoy, marked, how, mark = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
read_fd, write_fd = os.pipe()
agent = os.fork()
if agent == 0:  # the agent: its ranks' groups were these two; then it ends in order, or is killed
    os.close(read_fd)
    os.write(write_fd, f"+{decoy}\n+{marked}\n".encode())
    if how == "in-order":
        os.write(write_fd, b"=\n")
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)
os.close(write_fd)
agent_procs.prctl(agent_procs.PR_SET_CHILD_SUBREAPER, 1)
sys.exit(agent_watchdog.watchdog(agent, read_fd, mark, None))
"""


@pytest.mark.parametrize("how", ["in-order", "killed"])
def test_the_watchdog_signals_only_after_an_abnormal_end_and_only_what_carries_the_job(how: str) -> None:
    """Two process groups the agent had announced: one whose number now belongs to another process
    (no mark, not below the watchdog), one still the job's (its mark). An agent that ended in order
    leaves both alone; a killed agent's watchdog kills the job's only."""
    mark = f"m-{uuid.uuid4().hex}"
    env = {"MESHKIT_JOB_ID": f"test-{uuid.uuid4().hex}"}
    decoy = subprocess.Popen(["sleep", "60"], start_new_session=True, env=env)
    marked = subprocess.Popen(["sleep", "60"], start_new_session=True, env={**env, "MESHKIT_JOB_MARK": mark})
    try:
        here = str(COLLECTIONS)
        watch = subprocess.run(
            [sys.executable, "-c", WATCHDOG, here, str(decoy.pid), str(marked.pid), how, mark],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert decoy.poll() is None, "a group number that is no longer the job's was signalled"
        if how == "in-order":
            assert watch.returncode == 0 and watch.stderr == "", watch
            assert marked.poll() is None
        else:
            assert watch.returncode == 128 + signal.SIGKILL, watch
            assert f"killed by SIGKILL; its watchdog killed 1 processes of the job: [{marked.pid}]" in watch.stderr
            # SIGKILL sent; on a loaded machine the process may take a while to be scheduled and die
            # (CI once took over 5 s). Less than its own 60 s: a sleep nobody killed still fails here.
            assert marked.wait(timeout=45) == -signal.SIGKILL, watch.stderr
    finally:
        for proc in (decoy, marked):
            proc.kill()
            proc.wait()
