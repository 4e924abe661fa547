#!/usr/bin/env python3
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""PID 1 of one lab host.

Started by the lab module as
``ip netns exec <netns> unshare --mount --uts --ipc --pid --fork --mount-proc
--kill-child python3 lab_init.py ...``, so it already sits in the host's own
network, mount, UTS, IPC and PID namespaces. It gives the host its hostname
and private mounts (its own meshkit state directory, /etc/ssh and /dev/shm),
runs the host's sshd in the foreground and restarts it if it dies, and reaps
orphans as an init must. Killing this process (SIGKILL from outside) ends
every process of the host: that is how the lab removes a host.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

STATE_MOUNT = "/var/lib/meshkit"
SSH_MOUNT = "/etc/ssh"


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} lab_init[{os.uname().nodename}]: {message}", flush=True)


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def setup(args: argparse.Namespace) -> None:
    subprocess.run(["hostname", args.hostname], check=True)
    # unshare made every mount private; still say so, so nothing we mount
    # here can propagate back to the machine.
    mount("--make-rprivate", "/")
    os.makedirs(STATE_MOUNT, exist_ok=True)
    mount("--bind", args.state_dir, STATE_MOUNT)
    mount("--bind", args.ssh_dir, SSH_MOUNT)
    # Shared memory is per host (ranks on one host share it, hosts do not).
    # /tmp stays the machine's: the checkout may live there, and every host
    # must see programs at the same paths, as on a cluster with shared storage.
    mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)


def start_sshd(args: argparse.Namespace) -> subprocess.Popen[bytes]:
    return subprocess.Popen([args.sshd, "-D", "-e", "-f", f"{SSH_MOUNT}/sshd_config"], stdin=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hostname", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--sshd", default="/usr/sbin/sshd")
    parser.add_argument("--ssh-dir", required=True, help="bind-mounted on /etc/ssh")
    args = parser.parse_args()

    setup(args)
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        log(f"signal {signum}: stopping")
        sshd.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sshd = start_sshd(args)
    log(f"sshd started (pid {sshd.pid})")
    restarts: list[float] = []
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if pid != sshd.pid:
            continue  # an orphan reparented to us: reaped, nothing more
        if stopping:
            return 0
        log(f"sshd exited with status {status}")
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < 60] + [now]
        if len(restarts) > 5:
            log("sshd keeps exiting; giving up")
            return 1
        time.sleep(1)
        sshd = start_sshd(args)
        log(f"sshd restarted (pid {sshd.pid})")


if __name__ == "__main__":
    sys.exit(main())
