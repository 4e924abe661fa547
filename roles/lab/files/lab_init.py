# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""PID 1 of one lab host: its boot and its init.

Started by the lab module as
``ip netns exec <netns> unshare --mount --uts --ipc --pid --fork --mount-proc
--kill-child python3 lab_init.py --config <host dir>/init.json``, so it already sits in the
host's own network, mount, UTS, IPC and PID namespaces. What it does is what a booting Linux
host does, in order:

1. ``lo`` up and the hostname set (systemd does both before anything else);
2. its own file systems: every mount made private (nothing propagates back to the machine),
   a fresh ``/run`` (tmpfs: empty at every boot), the host's own files bind-mounted from the
   lab's directory (``/var/lib/meshkit``, ``/etc/ssh``, ``/etc/hosts``, ``/etc/machine-id``,
   and as the config asks ``/etc/passwd``, ``/etc/shadow``, ``/etc/group``, ``/etc/gshadow``,
   ``/etc/sudoers``, ``/etc/systemd/network``), the login user's own home under ``/home``,
   root's own dotfiles and caches in ``/root``, a private ``/dev/shm``;
3. with ``network_daemon: networkd``: a read-only sysfs of the host's own network namespace
   (networkd then treats the host as a container and does not wait for udev), the system
   D-Bus (``dbus-daemon --system``, for ``networkctl``) and ``systemd-networkd``, which
   configures the network from ``/etc/systemd/network`` alone;
4. sshd, once the management address is there (``network-online``), in the foreground.

Then it supervises the daemons (restarting one that dies) and reaps orphans, as an init must.
Killing this process (SIGKILL from outside) ends every process of the host at once: that is
how the lab removes a host, and how it reboots one.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from typing import Any

NETWORKD = ("/lib/systemd/systemd-networkd", "/usr/lib/systemd/systemd-networkd")
STAGE = "/run/lab-init/machine"


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} lab_init[{os.uname().nodename}]: {message}", flush=True)


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def bind(source: str, target: str) -> None:
    """Bind-mount a file or directory of the lab over a path of the host."""
    if not os.path.lexists(target):
        # Only mount points the machine lacks are created (empty), e.g. /var/lib/meshkit.
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
    mount("--bind", source, target)


def rebind(directory: str, mode: int, skip: str | None = None, own: str | None = None) -> None:
    """``directory`` becomes this host's own: a tmpfs of ``mode`` that holds the machine's entries
    again (bind-mounted, so what they hold stays the shared one), except ``skip``; each entry of the
    directory ``own`` (the lab's files of this host) is bound there instead of the machine's."""
    stage = os.path.join(STAGE, directory.strip("/").replace("/", "-"))
    os.makedirs(stage, exist_ok=True)
    if os.path.isdir(directory):
        mount("--rbind", directory, stage)
    else:
        os.makedirs(directory)
    mount("-t", "tmpfs", "-o", f"mode={mode:04o}", "tmpfs", directory)
    mine = {entry: os.path.join(own, entry) for entry in os.listdir(own)} if own else {}
    machine = {entry: os.path.join(stage, entry) for entry in os.listdir(stage) if entry != skip}
    for entry, source in sorted({**machine, **mine}.items()):
        path = os.path.join(directory, entry)
        if os.path.islink(source):
            os.symlink(os.readlink(source), path)
            continue
        if os.path.isdir(source):
            os.mkdir(path)
        else:
            open(path, "a").close()
        mount("--rbind", source, path)
    if os.path.ismount(stage):
        subprocess.run(["umount", "--lazy", "--recursive", stage], check=True)


def own_home(user: str, source: str) -> None:
    """/home becomes the host's own (a checkout under /home stays the shared one), with this host's
    own home for ``user``."""
    rebind("/home", 0o755, skip=user)
    os.mkdir(os.path.join("/home", user))
    mount("--bind", source, os.path.join("/home", user))


def boot_filesystems(cfg: dict[str, Any]) -> None:
    # unshare made every mount private; still say so, so nothing mounted here can propagate
    # back to the machine.
    mount("--make-rprivate", "/")
    mount("-t", "tmpfs", "-o", "mode=0755,nosuid,nodev", "tmpfs", "/run")
    os.makedirs("/run/sshd", mode=0o755)
    os.makedirs("/run/lock", mode=0o1777)
    os.chmod("/run/lock", 0o1777)
    for source, target in cfg["binds"]:
        bind(source, target)
    if cfg.get("home"):
        own_home(cfg["home"]["user"], cfg["home"]["source"])
    if cfg.get("root_home"):
        # root's home is the host's own, as on any machine: its own dotfiles (the distribution's, so a
        # shell on the host starts as a fresh host's does: nothing of this machine's ~/.bashrc, such
        # as a Python version manager's shims and its lock shared by every host) and its own caches.
        # The machine's other entries stay visible (this machine's Python, under /root/.pyenv on the
        # development machine, as on a cluster's shared storage). With a login user other than root,
        # 0711: the user may pass through; what each entry lets it read is still that entry's business.
        home = cfg["root_home"]
        rebind("/root", home["mode"], own=home["source"])
    if cfg.get("cgroups"):
        # "ip netns exec" mounted a fresh sysfs on /sys, which hides the machine's cgroup file
        # systems: mount them again where a host has them (slurmd, systemd and container tools read
        # them). The same hierarchies as the machine's, so what a host's processes are in is real.
        mount("-t", "tmpfs", "-o", "mode=0755,nosuid,nodev,noexec", "cgroup", "/sys/fs/cgroup")
        for fstype, target, options in cfg["cgroups"]:
            os.makedirs(target, exist_ok=True)
            mount("-t", fstype, "-o", options, fstype, target)
    # Shared memory is per host (ranks on one host share it, hosts do not). /tmp stays the
    # machine's: the checkout may live there, and every host must see programs at the same
    # paths, as on a cluster with shared storage.
    mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm")


def networkd_binary() -> str:
    for path in NETWORKD:
        if os.access(path, os.X_OK):
            return path
    raise SystemExit("systemd-networkd is not installed (apt-get install systemd)")


class Services:
    """The host's daemons, each restarted when it dies (at most 5 times a minute)."""

    def __init__(self) -> None:
        self.argv: dict[str, list[str]] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.restarts: dict[str, list[float]] = {}

    def start(self, name: str, argv: list[str]) -> None:
        self.argv[name] = argv
        self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        log(f"{name} started (pid {self.procs[name].pid})")

    def name_of(self, pid: int) -> str | None:
        return next((n for n, p in self.procs.items() if p.pid == pid), None)

    def restart(self, name: str, status: int) -> bool:
        log(f"{name} exited with status {status}")
        now = time.monotonic()
        self.restarts[name] = [t for t in self.restarts.get(name, []) if now - t < 60] + [now]
        if len(self.restarts[name]) > 5:
            log(f"{name} keeps exiting; giving up on it")
            del self.procs[name]
            return False
        time.sleep(1)
        self.start(name, self.argv[name])
        return True

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()


def wait_for_address(address: str, timeout: float) -> bool:
    """network-online for sshd: the management address is on an interface (networkd may still be
    configuring it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, check=False).stdout
        try:
            links = json.loads(out or "[]")
        except ValueError:
            links = []
        if any(a.get("local") == address for link in links for a in link.get("addr_info", [])):
            return True
        time.sleep(0.1)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the host's init.json, written by the lab module")
    args = parser.parse_args()
    with open(args.config) as handle:
        cfg = json.load(handle)

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["hostname", cfg["hostname"]], check=True)
    boot_filesystems(cfg)
    services = Services()
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        log(f"signal {signum}: stopping")
        services.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    if cfg.get("network_daemon") == "networkd":
        # "ip netns exec" mounted the namespace's own sysfs on /sys already: make it read-only.
        mount("-o", "remount,bind,ro", "/sys")
        os.makedirs("/run/dbus", mode=0o755)
        # What systemd's RuntimeDirectory= would make for systemd-networkd.
        net_user = pwd.getpwnam("systemd-network")
        for sub in (
            "/run/systemd/netif",
            "/run/systemd/netif/links",
            "/run/systemd/netif/leases",
            "/run/systemd/netif/lldp",
        ):
            os.makedirs(sub, mode=0o755, exist_ok=True)
            os.chown(sub, net_user.pw_uid, net_user.pw_gid)
        services.start("dbus-daemon", ["dbus-daemon", "--system", "--nofork", "--nopidfile", "--nosyslog"])
        services.start("systemd-networkd", [networkd_binary()])
    address = str(ipaddress.ip_address(cfg["mgmt_ip"]))
    if not wait_for_address(address, float(cfg.get("online_timeout", 30))):
        log(f"{address} is not on any interface after {cfg.get('online_timeout', 30)} s; starting sshd anyway")
    services.start("sshd", [cfg["sshd"], "-D", "-e", "-f", "/etc/ssh/sshd_config"])

    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        name = services.name_of(pid)
        if name is None:
            continue  # an orphan reparented to us: reaped, nothing more
        if stopping:
            del services.procs[name]
            if not services.procs:
                return 0
            continue
        if not services.restart(name, status) and name == "sshd":
            return 1


if __name__ == "__main__":
    sys.exit(main())
