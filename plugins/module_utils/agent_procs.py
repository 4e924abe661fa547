# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The processes of a launch job on a host: found, and killed, so that nothing of it is left.

Every rank's environment carries the job's random ``MESHKIT_JOB_MARK``. How the rest of the job is
found depends on the platform (platform_mode()):

- Linux ("linux"): the agent and its watchdog are child subreapers (prctl()), so every orphan of
  the job is re-parented to them; ranks get PR_SET_PDEATHSIG (die_with_agent()); /proc gives the
  tree, the groups and every process's environment (job_processes(), sweep_job()).
- macOS, and Linux with MESHKIT_AGENT_PORTABLE=1 ("portable"): ``ps`` alone (PortableJob; see
  launch_agent's docstring for what a portable host cannot catch).

Used by the launch agent and its watchdog (agent_watchdog). Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import NamedTuple

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> bool:
    """prctl(2) on Linux (False elsewhere, or when it fails)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_agent() -> None:
    # Runs in the child between fork and exec.
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def reap_children() -> None:
    """Collect every exited child (ranks' orphans re-parented here die as zombies of the agent)."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def child_pids(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (Linux /proc; empty elsewhere)."""
    return [child for child, (parent, state, _group) in proc_table().items() if parent == pid and state != b"Z"]


# --- Linux: the job's processes through /proc -------------------------------------------------------


def proc_table() -> dict[int, tuple[int, bytes, int]]:
    """pid -> (parent pid, state, process group) of every process (Linux /proc; empty elsewhere)."""
    out: dict[int, tuple[int, bytes, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat_line = handle.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        fields = stat_line[stat_line.rfind(b")") + 2 :].split()
        if len(fields) > 2:
            out[int(name)] = (int(fields[1]), fields[0], int(fields[2]))
    return out


def job_processes(root: int, mark: str, table: dict[int, tuple[int, bytes, int]] | None = None) -> set[int]:
    """Live processes of the job (Linux): every descendant of ``root`` (the watchdog, a child
    subreaper: a killed agent's orphans come to it), and any process whose environment carries
    ``MESHKIT_JOB_MARK=mark`` (one that left the tree, e.g. started through another daemon)."""
    table = proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _state, _group) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    needle = f"MESHKIT_JOB_MARK={mark}".encode()
    for pid in table:
        if pid in found or pid == root:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.add(pid)
        except OSError:
            continue
    return {pid for pid in found if table.get(pid, (0, b"Z", 0))[1] != b"Z"}


def marked_groups(groups: set[int], mark: str, ps_output: str | None = None) -> set[int]:
    """Of ``groups``, those that still hold a process carrying the job's mark, from ``ps -E``
    (the environment after the command; macOS and BSDs, where there is no /proc): a group number
    reused by something else since is left alone. (The portable sweep, PortableJob, asks the same
    of a group and more: see PortableJob.members().)"""
    if ps_output is None:
        try:
            ps_output = subprocess.run(
                ["ps", "-E", "-ww", "-A", "-o", "pgid=,command="], capture_output=True, text=True, timeout=10,
                check=False, errors="replace",
            ).stdout  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return set()
    needle = f"MESHKIT_JOB_MARK={mark}"
    found = set()
    for line in ps_output.splitlines():
        head, _sep, rest = line.strip().partition(" ")
        if head.isdigit() and int(head) in groups and needle in rest.split():
            found.add(int(head))
    return found


# --- the job's processes through ps alone (macOS; Linux with MESHKIT_AGENT_PORTABLE=1) -------------

PORTABLE_ENV = "MESHKIT_AGENT_PORTABLE"
TRACK_EVERY = 0.5  # seconds between the portable agent's looks at its job's processes


def platform_mode() -> str:
    """How this host finds and stops a job's processes: "linux" (PR_SET_PDEATHSIG, child subreapers,
    /proc) on Linux; "portable" (ps only: PortableJob) elsewhere, and on Linux too when the agent's
    environment has MESHKIT_AGENT_PORTABLE=1: the code path macOS takes, run where it can be tested."""
    if sys.platform.startswith("linux") and os.environ.get(PORTABLE_ENV, "") in ("", "0"):
        return "linux"
    return "portable"


class Proc(NamedTuple):
    """One line of ps."""

    pid: int
    ppid: int
    pgid: int
    stat: str  # starts with "Z" for a zombie
    start: str  # when it started, to the second, as lstart writes it ("" when not shown): with pid, who it is
    command: str  # its command line, and its environment after it when ps was asked for that


# One keyword per -o: BSD ps lets only the last keyword of a list rename its header.
PS_COLUMNS = (("pid", "PID"), ("ppid", "PPID"), ("pgid", "PGID"), ("stat", "STAT"), ("lstart", "LSTART"),
              ("command", "COMMAND"))  # fmt: skip
WEEKDAYS = frozenset(("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"))


def ps_argv(environment: bool = False) -> list[str]:
    """ps listing every process with PS_COLUMNS, and (``environment``) the environment each started
    with after its command: procps's BSD-style ``e``; macOS's ``-E`` (its ``-e`` means -A)."""
    program = "/bin/ps" if os.access("/bin/ps", os.X_OK) else shutil.which("ps") or "ps"
    argv = [program, "-A", "-ww"]
    for keyword, header in PS_COLUMNS:
        argv += ["-o", f"{keyword}={header}"]
    if environment:
        argv.append("-E" if sys.platform == "darwin" else "e")
    return argv


def parse_ps(text: str) -> dict[int, Proc]:
    """pid -> Proc from ps output with its header line: ps_argv()'s columns, or any others that hold
    PID, PPID and PGID with the command last (macOS's ``ps -j``: USER PID PPID PGID SESS JOBC STAT TT
    TIME COMMAND). A start time in lstart's form ("%c" in the C locale: "Tue Nov 24 18:44:06 2026")
    takes five words and is the process's start; any other (``-``, a short STARTED) is one word and
    no start. Lines that do not fit the header are left out."""
    lines = text.splitlines()
    header = lines[0].split() if lines else []
    if not {"PID", "PPID", "PGID"} <= set(header[:-1]) or header[-1] not in ("COMMAND", "CMD", "ARGS"):
        return {}
    out: dict[int, Proc] = {}
    for line in lines[1:]:
        words = list(re.finditer(r"\S+", line))
        values: dict[str, str] = {}
        at = 0
        for name in header[:-1]:
            wide = name in ("LSTART", "STARTED") and at < len(words) and words[at].group() in WEEKDAYS
            width = 5 if wide else 1
            if at + width > len(words):
                break
            values[name] = " ".join(word.group() for word in words[at : at + width])
            at += width
        else:
            try:
                pid, ppid, pgid = int(values["PID"]), int(values["PPID"]), int(values["PGID"])
            except ValueError:
                continue
            start = values.get("LSTART", values.get("STARTED", ""))
            command = line[words[at].start() :] if at < len(words) else ""
            out[pid] = Proc(pid, ppid, pgid, values.get("STAT", ""), start if len(start.split()) == 5 else "", command)
    return out


def ps_table(environment: bool = False) -> dict[int, Proc] | None:
    """Every process now (ps itself left out), or None when ps cannot be run or says nothing."""
    env = dict(os.environ, LC_ALL="C", LANG="C")  # lstart's form; the agent and the watchdog share TZ
    try:
        proc = subprocess.Popen(
            ps_argv(environment), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=env,
        )  # fmt: skip
    except OSError:
        return None
    try:
        out = proc.communicate(timeout=10)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
    table = parse_ps(out.decode("utf-8", "replace"))
    table.pop(proc.pid, None)
    return table or None


class PortableJob:
    """The processes of one job, found and stopped through ps alone (no /proc, no prctl).

    A process is the job's when, in one table of ps: it descends (by parent pid) from ``root``; it
    was seen as the job's before and has the same start time still (an orphan re-parented to
    init/launchd keeps its pid and start time; a pid used again has another start time); its
    environment carries MESHKIT_JOB_MARK=``mark`` (where ps shows it); it descends from one of
    those; or it is in one of ``groups`` (the ranks' process groups) that holds one of those. With
    ``trust_groups`` (the agent, which looks at its ranks' groups every TAIL_POLL from the moment it
    reaps each rank, so a number it still calls a rank's cannot have been taken since) every member
    of ``groups`` is. ``spare`` (root, its parent, the agent) and pids 0 and 1 never are."""

    def __init__(self, root: int, mark: str, spare: set[int] | None = None) -> None:
        self.root = root
        self.mark = mark
        self.spare = {0, 1, root, *(spare or set())}
        self.known: dict[int, str] = {}  # pid -> start time of every process seen as the job's

    def members(
        self, table: dict[int, Proc], groups: set[int], trust_groups: bool = False
    ) -> tuple[set[int], set[int]]:
        """(the job's live processes, the groups of ``groups`` that hold one) in ``table``."""
        children: dict[int, list[int]] = {}
        in_group: dict[int, list[int]] = {}
        for proc in table.values():
            children.setdefault(proc.ppid, []).append(proc.pid)
            in_group.setdefault(proc.pgid, []).append(proc.pid)
        needle = f"MESHKIT_JOB_MARK={self.mark}" if self.mark else None
        todo = list(children.get(self.root, []))
        for proc in table.values():
            if (proc.start and self.known.get(proc.pid) == proc.start) or (needle and needle in proc.command.split()):
                todo.append(proc.pid)
        if trust_groups:
            for group in groups:
                todo += in_group.get(group, [])
        found: set[int] = set()
        entered: set[int] = set()
        while todo:
            pid = todo.pop()
            if pid in found or pid in self.spare or pid not in table:
                continue
            found.add(pid)
            todo += children.get(pid, [])
            group = table[pid].pgid
            if group in groups and group not in entered:
                entered.add(group)
                todo += in_group.get(group, [])
        pids = {pid for pid in found if not table[pid].stat.startswith("Z")}
        return pids, {table[pid].pgid for pid in pids} & groups

    def track(self, groups: set[int], trust_groups: bool = False) -> tuple[dict[int, str], list[int]] | None:
        """Look at the job now: remember each of its processes by pid and start time, forget what is
        gone. (new {pid: start}, pids forgotten); None when ps cannot be run."""
        table = ps_table()
        if table is None:
            return None
        pids, _groups = self.members(table, groups, trust_groups)
        new = {}
        for pid in pids:
            start = table[pid].start
            if start and self.known.get(pid) != start:
                self.known[pid] = new[pid] = start
        gone = [pid for pid, start in self.known.items() if pid not in table or table[pid].start != start]
        for pid in gone:
            del self.known[pid]
        return new, gone

    def sweep(self, groups: set[int], trust_groups: bool = False, within: float = 5.0) -> list[int] | None:
        """SIGKILL the job's processes and the groups of ``groups`` that hold one, until none is left
        (or ``within`` seconds). The pids killed; None when ps cannot be run (then, with
        ``trust_groups``, the groups alone are killed)."""
        killed: set[int] = set()
        deadline = time.monotonic() + within
        while True:
            table = ps_table(environment=True)
            if table is None:
                if trust_groups:
                    for group in groups:
                        with contextlib.suppress(OSError):
                            os.killpg(group, signal.SIGKILL)
                return None
            pids, live = self.members(table, groups, trust_groups)
            for group in live:
                with contextlib.suppress(OSError):
                    os.killpg(group, signal.SIGKILL)
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            killed |= pids
            if not pids or time.monotonic() > deadline:
                return sorted(killed)
            time.sleep(0.02)


def sweep_job(root: int, mark: str, groups: set[int], within: float = 5.0) -> list[int]:
    """SIGKILL every process of the job until none is left (or ``within`` seconds): on Linux every
    process of job_processes(), and the ranks' process groups that still hold one of them; in the
    portable mode what PortableJob finds. A group number alone is never enough: once a group is
    empty, its number may be another's. The pids killed."""
    if platform_mode() == "portable":
        return PortableJob(root, mark).sweep(set(groups), within=within) or []
    killed: set[int] = set()
    deadline = time.monotonic() + within
    groups = set(groups)
    while True:
        table = proc_table()
        pids = job_processes(root, mark, table)
        pids.discard(root)
        live = {table[pid][2] for pid in pids if pid in table} & groups
        for group in live:
            try:
                os.killpg(group, signal.SIGKILL)
            except OSError:  # gone (or not ours): nothing more to do for it
                groups.discard(group)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        reap_children()
        if not live and not pids:
            return sorted(killed)
        if time.monotonic() > deadline:
            return sorted(killed)
        time.sleep(0.02)


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still holds a process (one not ours to signal counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # there, but not ours to signal
    return True
