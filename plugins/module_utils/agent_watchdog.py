# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The launch agent's watchdog: nothing of a job outlives a killed agent.

The process the connection started becomes the watchdog once the job is read: it forks, the child
is the agent, and the watchdog waits for it; when the agent ends any way but in order (even
SIGKILL) the watchdog kills what is left of the job (agent_procs). Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time

from ansible_collections.meshkit.cluster.plugins.module_utils.agent_jobdir import log_line
from ansible_collections.meshkit.cluster.plugins.module_utils.agent_procs import PortableJob, platform_mode, sweep_job

PARENT_POLL = 0.5  # seconds between the portable watchdog's looks at its own parent (the connection)


def _say(fd: int, text: str) -> None:
    """Write a short line to ``fd`` only if it takes it now (a stalled connection must not hold
    the watchdog)."""
    data = text.encode(errors="replace")[:4000]  # below PIPE_BUF: a writable pipe takes it whole
    with contextlib.suppress(OSError, ValueError):
        if select.select([], [fd], [], 0)[1]:
            os.write(fd, data)


def watchdog(agent: int, read_fd: int, mark: str, log_fd: int | None, portable: bool | None = None) -> int:
    """The original process of the agent, once the agent runs as its child: waits for the agent to
    end (end of file on the pipe the agent holds), then, unless the agent ended in order, kills
    whatever of the job is left (sweep_job(); PortableJob.sweep() in the portable mode). On that
    pipe the agent writes "+PID" when a rank's process group starts, "-PID" once it has seen that
    group empty, and "=" last, when it ends in order: every rank reported, what they left swept,
    every group confirmed empty. An agent that exits 0 after "=" leaves nothing to do: the watchdog
    signals nothing. Signals that would stop the agent are passed on to it. In the portable mode
    the agent also writes "~PID START" for each process of the job it has seen and "!PID" for each
    gone, and the watchdog stops the agent (SIGTERM: it stops the job) when its own parent, the
    process the connection started it from, is gone."""
    if portable is None:
        portable = platform_mode() == "portable"
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda s, _f: _forward(agent, s))
    parent = os.getppid()
    job = PortableJob(os.getpid(), mark, {agent, parent}) if portable else None
    groups: set[int] = set()
    in_order = False
    parent_gone = False
    look_at = time.monotonic() + PARENT_POLL
    pending = b""
    while True:
        if job is not None:
            # Its parent looked at every PARENT_POLL seconds, whatever comes through the pipe.
            ready = select.select([read_fd], [], [], max(0.0, look_at - time.monotonic()))[0]
            if time.monotonic() >= look_at:
                look_at = time.monotonic() + PARENT_POLL
                if not parent_gone and os.getppid() != parent:
                    parent_gone = True
                    log_line(log_fd, f"the connection's process (pid {parent}) is gone: stopping the job")
                    _forward(agent, signal.SIGTERM)
            if not ready:
                continue
        try:
            chunk = os.read(read_fd, 4096)
        except OSError:
            chunk = b""
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            kind, rest = line[:1], line[1:]
            if line == b"=":
                in_order = True
            elif kind == b"~" and job is not None:
                pid, _sep, start = rest.partition(b" ")
                if pid.isdigit():
                    job.known[int(pid)] = start.decode(errors="replace")
            elif kind == b"!" and job is not None and rest.isdigit():
                job.known.pop(int(rest), None)
            elif kind == b"+" and rest.isdigit():
                groups.add(int(rest))
                in_order = False
            elif kind == b"-" and rest.isdigit():
                groups.discard(int(rest))
    while True:
        try:
            _pid, status = os.waitpid(agent, 0)
            break
        except ChildProcessError:
            status = 0
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"
        how = f"killed by {name}"
        code = 128 + number
    else:
        how = f"exited {os.WEXITSTATUS(status)}"
        code = os.WEXITSTATUS(status)
    if in_order and code == 0:
        return 0
    if job is None:
        killed = sweep_job(os.getpid(), mark, groups)
    else:
        swept = job.sweep(groups)
        if swept is None:
            log_line(log_fd, "ps cannot be run: the job's processes cannot be found (the portable mode needs ps)")
        killed = swept or []
    text = f"meshkit agent (pid {agent}) {how}; its watchdog killed {len(killed)} processes of the job: {killed}\n"
    log_line(log_fd, text.rstrip("\n"))
    if killed or os.WIFSIGNALED(status):
        _say(2, text)
    return code


def _forward(agent: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(agent, sig)
