"""A rank that leaves a family behind, for the launch agent's portable-mode tests.

Usage: family.py DIR. Each member writes its pid to DIR/<role>-<rank>.pid (rank: $MESHKIT_RANK),
then the rank prints "up" and sleeps. Members (all sleep 600; "bare" ones have an empty environment,
so no MESHKIT_JOB_MARK):

- child, grandchild: in the rank's process group (child is the rank's child, grandchild its child);
- group-orphan: bare, in the rank's process group, its parent gone (a re-parented orphan);
- daemon: double fork + setsid, environment kept: out of the group and the tree, found by its mark;
- leader, leader-kid: a session of their own (setsid), both bare; the leader stays the rank's child;
- pgid-leaver: bare, a process group of its own (setpgid), the rank's child.

With a second argument "ignore-term" the rank ignores SIGTERM (its stop takes the SIGKILL).
"""

from __future__ import annotations

import os
import signal
import sys
import time

where = sys.argv[1]
rank = os.environ["MESHKIT_RANK"]
SLEEP = "/bin/sleep" if os.path.exists("/bin/sleep") else "/usr/bin/sleep"
ROLES = ("child", "grandchild", "group-orphan", "daemon", "leader", "leader-kid", "pgid-leaver")


def note(role: str) -> None:
    with open(os.path.join(where, f".{role}-{rank}.tmp"), "w") as handle:
        handle.write(str(os.getpid()))
    os.replace(os.path.join(where, f".{role}-{rank}.tmp"), os.path.join(where, f"{role}-{rank}.pid"))


def sleep_as(role: str, env: dict[str, str]) -> None:
    note(role)
    os.execve(SLEEP, [SLEEP, "600"], env)


if len(sys.argv) > 2 and sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

if os.fork() == 0:  # child, and its grandchild, in the rank's group
    if os.fork() == 0:
        sleep_as("grandchild", dict(os.environ))
    sleep_as("child", dict(os.environ))

if os.fork() == 0:  # its child is orphaned at once, and stays in the rank's group with no environment
    if os.fork() == 0:
        sleep_as("group-orphan", {})
    os._exit(0)

if os.fork() == 0:  # a daemon: double fork, setsid; keeps its environment
    os.setsid()
    if os.fork() == 0:
        sleep_as("daemon", dict(os.environ))
    os._exit(0)

if os.fork() == 0:  # a session leader that stays the rank's child, and its child; both bare
    os.setsid()
    if os.fork() == 0:
        sleep_as("leader-kid", {})
    sleep_as("leader", {})

if os.fork() == 0:  # out of the rank's group (not its session), bare
    os.setpgid(0, 0)
    sleep_as("pgid-leaver", {})

while not all(os.path.exists(os.path.join(where, f"{role}-{rank}.pid")) for role in ROLES):
    time.sleep(0.01)
print("up", flush=True)
while True:
    time.sleep(600)
