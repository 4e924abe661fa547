# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Build, inspect and remove the local lab: namespaces, cables, bridges, SSH daemons.

Each lab host is a named network namespace (``<lab>-node<i>``; the head node of a lab
with ``lab_head``, which has no cables, ``<lab>-head``) plus a holder
process started inside it with its own mount, UTS, IPC and PID namespaces
(``lab_init.py`` is PID 1 there and runs the host's sshd). Cables are veth
pairs created straight into the two hosts' namespaces, so the machine's own
namespace only ever holds the management bridge ``<lab>-mgmt`` and one veth
end per host (``<lab>-m<i>``). Nothing here touches a name outside those
patterns, so labs with different names and subnets coexist.

Plain Python: the module ``meshkit.cluster.lab`` drives it; tests may too.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

from meshkit.lab_spec import (
    HEAD_NAME,
    HOST_BRIDGE,
    HOST_MGMT_PORT,
    HOST_PORT_PREFIX,
    LAB_USER,
    Host,
    LabPlan,
    PlanDiff,
    cable_name,
    plan_diff,
    plan_from_dict,
)

STATE_VERSION = 1
SSH_PORT = 22
NETWORKD = ("/lib/systemd/systemd-networkd", "/usr/lib/systemd/systemd-networkd")
# STP timers of every host's bridge0: the smallest the protocol allows (hello 1 s, max age 6 s,
# forward delay 4 s; 2 x (forward delay - 1) >= max age >= 2 x (hello + 1)), so a bridge
# forwards, and gets its carrier and IPv6 link-local address, ~8 s after its ports come up
# rather than the 30 s of the kernel's defaults.
STP_TIMERS = {"hello_time": 1, "max_age": 6, "forward_delay": 4}
# Directories a service keeps its configuration, keys, state and logs in, which on a cluster every
# host has its own of (the lab hosts otherwise share the machine's filesystem): Slurm's and munge's.
# Each host gets an empty one of the machine's owner and mode, as after the package's install but
# without its key or configuration, so the slurm role must bring them (as on a real cluster). Only
# those the machine has (scripts/system-deps installs the packages) are made the host's own.
HOST_OWN_DIRS = (
    "/etc/munge",
    "/var/lib/munge",
    "/var/log/munge",
    "/etc/slurm",
    "/var/lib/slurm",
    "/var/log/slurm",
)


# root's home on a host is its own (lab_init binds these over /root; the machine's other entries stay
# visible): the distribution's dotfiles, as a freshly installed host has them (never this machine's
# ~/.bashrc, which may start a Python version manager whose shims and lock every host would share),
# and its own caches. name -> the file its content comes from (the first that exists), or None for an
# empty directory.
ROOT_HOME = {
    ".bashrc": ("/usr/share/base-files/dot.bashrc", "/etc/skel/.bashrc"),
    ".profile": ("/usr/share/base-files/dot.profile", "/etc/skel/.profile"),
    ".cache": None,
    ".ansible": None,
}


# The boot links of the machine's init scripts (sysvinit's runlevels, which `update-rc.d` and Ansible's
# service module change when a service is enabled or disabled at boot): each host gets a copy of the
# machine's, so enabling or disabling a service on one host (the slurm role does) leaves the machine and
# every other host as they are.
HOST_COPIED_DIRS = tuple(f"/etc/rc{level}.d" for level in (*"0123456", "S"))


class LabError(RuntimeError):
    """A lab operation failed; the message names the command or host."""


def run(cmd: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command in the C locale; on failure raise LabError quoting it and its stderr."""
    env = dict(os.environ, LC_ALL="C", LANG="C")
    try:
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, check=False)
    except FileNotFoundError as exc:
        raise LabError(f"{cmd[0]} is not installed ({exc}); run 'make deps' as root") from exc
    if check and proc.returncode != 0:
        shown = " ".join(cmd)
        if stdin:
            shown += " <<EOF\n" + stdin + "EOF"
        raise LabError(f"command failed (rc={proc.returncode}): {shown}\n{proc.stderr.strip()}")
    return proc


def ip_json(*args: str) -> Any:
    out = run(["ip", "-j", *args]).stdout
    return json.loads(out) if out.strip() else []


def tbf_burst(rate: str) -> int:
    """Bytes of burst for a tc rate: 10 ms at that rate, at least 32 KiB (a GSO packet and more)."""
    match = re.fullmatch(r"([0-9.]+)([kmgt]?)(bit|bps)", rate)
    if not match:
        raise LabError(f"lab_link_rate {rate!r} is not a tc rate")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2)]
    bits = float(match.group(1)) * scale * (8 if match.group(3) == "bps" else 1)
    return max(int(bits / 8 / 100), 32 * 1024)


class Lab:
    """One named lab on this machine, as planned in a LabPlan."""

    def __init__(
        self,
        plan: LabPlan,
        lab_dir: str,
        init_script: str,
        python: str,
        *,
        sshd: str = "/usr/sbin/sshd",
        ssh_timeout: float = 120.0,
        settle_timeout: float = 60.0,
        hosts_file: str = "/etc/hosts",
    ) -> None:
        self.plan = plan
        self.dir = Path(lab_dir)
        self.init_script = init_script
        self.python = python
        self.sshd = sshd
        self.ssh_timeout = ssh_timeout
        self.settle_timeout = settle_timeout
        self.hosts_file = hosts_file
        # <lab>-boot<i>: a host's next network namespace while it reboots (the head's i is N+1).
        self.netns_re = re.compile(rf"^{re.escape(plan.name)}-((node|boot)[0-9]+|{HEAD_NAME})$")
        self.root_port_re = re.compile(rf"^{re.escape(plan.name)}-m[0-9]+$")

    # ---- paths -------------------------------------------------------------
    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    @property
    def client_key(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def control_dir(self) -> Path:
        return self.dir / "cp"

    def host_dir(self, name: str) -> Path:
        return self.dir / "hosts" / name

    def state_dir(self, name: str) -> Path:
        return self.host_dir(name) / "state"

    def ssh_dir(self, name: str) -> Path:
        return self.host_dir(name) / "ssh"

    def missing_tools(self) -> list[str]:
        """What this machine lacks to build the lab (root, commands), as hints to act on."""
        missing = []
        if os.geteuid() != 0:
            missing.append("root: the lab creates network namespaces; run the playbook as root")
        tools = {
            "ip": "iproute2",
            "tc": "iproute2",
            "unshare": "util-linux",
            "nsenter": "util-linux",
            "ssh-keygen": "openssh-client",
            "ssh-keyscan": "openssh-client",
            "ssh": "openssh-client",
        }
        for tool, package in tools.items():
            if shutil.which(tool) is None:
                missing.append(f"{tool}: install {package} (make deps)")
        if not os.access(self.sshd, os.X_OK):
            missing.append(f"{self.sshd}: install openssh-server (make deps)")
        if self.plan.access == "sudo":
            for tool, package in {"sudo": "sudo", "setpriv": "util-linux"}.items():
                if shutil.which(tool) is None:
                    missing.append(f"{tool}: install {package} (make deps); lab_access=sudo needs it")
        if self.plan.network_daemon == "networkd":
            if not any(os.access(p, os.X_OK) for p in NETWORKD):
                missing.append("systemd-networkd: install systemd (make deps); lab_network_daemon=networkd needs it")
            for tool, package in {"networkctl": "systemd", "dbus-daemon": "dbus"}.items():
                if shutil.which(tool) is None:
                    missing.append(f"{tool}: install {package} (make deps); lab_network_daemon=networkd needs it")
        return missing

    # ---- what exists -------------------------------------------------------
    def recorded(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None
        return data if data.get("version") == STATE_VERSION else None

    def existing_netns(self) -> list[str]:
        names = []
        for entry in ip_json("netns", "list"):
            if self.netns_re.match(entry.get("name", "")):
                names.append(entry["name"])
        return sorted(names)

    def existing_root_links(self) -> list[str]:
        names = []
        for link in ip_json("link", "show"):
            name = link.get("ifname", "")
            if name == self.plan.mgmt_bridge or self.root_port_re.match(name):
                names.append(name)
        return names

    def exists(self) -> bool:
        return bool(self.existing_netns() or self.existing_root_links() or self.dir.exists())

    def route_conflicts(self) -> list[str]:
        """Routes of this machine that the management subnet would overlap (other than our own)."""
        subnet = ipaddress.IPv4Network(self.plan.mgmt_subnet)
        conflicts = []
        for route in ip_json("-4", "route", "show", "table", "all"):
            dst = route.get("dst", "")
            if dst in ("", "default") or route.get("dev") == self.plan.mgmt_bridge:
                continue
            try:
                net = ipaddress.IPv4Network(dst if "/" in dst else dst + "/32", strict=False)
            except ValueError:
                continue
            if net.overlaps(subnet):
                where = f" dev {route['dev']}" if route.get("dev") else ""
                conflicts.append(f"{route.get('type', 'unicast')} {dst}{where}")
        return sorted(set(conflicts))

    def observed_cables(self) -> list[tuple[tuple[str, str], tuple[str, str]]]:
        """The cables the kernel has, read from each veth's peer namespace and index."""
        by_ns = {h.netns: h.name for h in self.plan.hosts}
        index: dict[tuple[str, int], str] = {}
        peers: list[tuple[str, str, str, int]] = []
        for host in self.plan.hosts:
            ids = {}
            for entry in ip_json("-n", host.netns, "netns", "list-id"):
                if "name" in entry:
                    ids[entry["nsid"]] = entry["name"]
            for link in ip_json("-n", host.netns, "-d", "link", "show"):
                index[(host.name, link["ifindex"])] = link["ifname"]
                peer_ns = ids.get(link.get("link_netnsid"))
                if link["ifname"].startswith("tb") and peer_ns in by_ns:
                    peers.append((host.name, link["ifname"], by_ns[peer_ns], link["link_index"]))
        cables = set()
        for host, port, peer_host, peer_index in peers:
            peer_port = index.get((peer_host, peer_index))
            if peer_port:
                cables.add(tuple(sorted([(host, port), (peer_host, peer_port)])))
        return sorted(cables)  # type: ignore[arg-type]

    def live_macs(self) -> dict[str, dict[str, str]]:
        macs: dict[str, dict[str, str]] = {}
        for host in self.plan.hosts:
            links = ip_json("-n", host.netns, "link", "show")
            macs[host.name] = {link["ifname"]: link.get("address", "") for link in links}
        return macs

    def problems(self) -> list[str]:
        """Why the running lab is not the planned one; empty when it is."""
        state = self.recorded()
        if state is None:
            return ["the lab is not built"]
        if state["plan"] != self.plan.as_dict():
            change = describe_change(state["plan"], self.plan.as_dict())
            diff = plan_diff(plan_from_dict(state["plan"]), self.plan)
            if diff.blockers:
                return [f"{change} (not changeable in place: {', '.join(diff.blockers)})"]
            broken = self.like(plan_from_dict(state["plan"])).problems()
            if not broken:
                return [f"{change} ({diff.summary()})"]
            return [f"{change} (not changeable in place, the running lab is not as recorded: {'; '.join(broken)})"]
        problems = []
        netns = set(self.existing_netns())
        for host in self.plan.hosts:
            if host.netns not in netns:
                problems.append(f"{host.name}: namespace {host.netns} is missing")
                continue
            pid = state["holders"].get(host.name)
            if not pid or not self._holder_alive(host.netns, pid):
                problems.append(f"{host.name}: its holder process is gone")
                continue
            names = {link["ifname"] for link in ip_json("-n", host.netns, "link", "show")}
            wanted = host_links(host)
            if names != wanted:
                problems.append(f"{host.name}: has ports {sorted(names)}, expected {sorted(wanted)}")
        if problems:
            return problems
        want = sorted(tuple(sorted([(c.a.host, c.a.port), (c.b.host, c.b.port)])) for c in self.plan.cables)
        if self.observed_cables() != want:
            problems.append("the cables in the kernel differ from the plan")
        for host in self.plan.hosts:
            if not _port_open(host.mgmt_ip, SSH_PORT, 1.0):
                problems.append(f"{host.name}: sshd does not answer on {host.mgmt_ip}:{SSH_PORT}")
        return problems

    def like(self, plan: LabPlan) -> Lab:
        """This lab's directory and settings with another plan (e.g. the recorded one)."""
        return Lab(
            plan,
            str(self.dir),
            self.init_script,
            self.python,
            sshd=self.sshd,
            ssh_timeout=self.ssh_timeout,
            settle_timeout=self.settle_timeout,
            hosts_file=self.hosts_file,
        )

    def in_place_changes(self) -> tuple[LabPlan, PlanDiff] | None:
        """The recorded plan and the hosts and cables to add and remove to make the running lab the
        planned one, when only hosts and cables differ and the lab runs as recorded; None when the lab
        is as planned or must be built again (problems() then says why)."""
        state = self.recorded()
        if state is None or state["plan"] == self.plan.as_dict():
            return None
        before = plan_from_dict(state["plan"])
        diff = plan_diff(before, self.plan)
        if not diff.in_place or self.like(before).problems():
            return None
        return before, diff

    @staticmethod
    def _holder_alive(netns: str, pid: int) -> bool:
        try:
            return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{netns}").st_ino
        except OSError:
            return False

    # ---- build -------------------------------------------------------------
    def build(self) -> None:
        self._write_files()
        plan = self.plan
        prefix = ipaddress.IPv4Network(plan.mgmt_subnet).prefixlen

        # The machine's side: namespaces, management bridge and one veth per host,
        # then every cable straight into its two namespaces.
        root = [f"netns add {h.netns}" for h in plan.hosts]
        root += [
            f"link add {plan.mgmt_bridge} type bridge",
            f"addr add {plan.controller_ip}/{prefix} dev {plan.mgmt_bridge}",
            f"link set {plan.mgmt_bridge} up",
        ]
        for h in plan.hosts:
            root += [
                f"link add {h.mgmt_root_port} type veth peer name {HOST_MGMT_PORT} netns {h.netns}",
                f"link set {h.mgmt_root_port} master {plan.mgmt_bridge}",
                f"link set {h.mgmt_root_port} up",
            ]
        ns_of = {h.name: h.netns for h in plan.hosts}
        for c in plan.cables:
            root.append(
                f"link add {c.a.port} netns {ns_of[c.a.host]} type veth peer name {c.b.port} netns {ns_of[c.b.host]}"
            )
        run(["ip", "-batch", "-"], stdin="\n".join(root) + "\n")
        for h in plan.hosts:
            self._hardware(h)
            self._factory_network(h)
        if plan.names:
            self.write_names_block()

        holders = {h.name: self._start_holder(h) for h in plan.hosts}
        self._wait_for_sshd()
        known_hosts = self._scan_host_keys()
        state = {
            "version": STATE_VERSION,
            "plan": plan.as_dict(),
            "holders": holders,
            "known_hosts": known_hosts,
            "user": self._user_record(),
        }
        self._save_state(state)

    def _save_state(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_file)

    # ---- change in place --------------------------------------------------------
    def reshape(self, before: LabPlan, diff: PlanDiff, *, replaced: bool = False) -> list[str]:
        """Make the running lab, built as ``before``, the planned one by adding and removing only the
        hosts and cables ``diff`` names: every host and cable in both plans is left as it is (its
        links keep their index, MAC, addresses; its processes run on). Returns what was removed.
        The caller waits for the lab to settle (settle()), as after build().

        A cable that goes is its veth pair (both ends at once); one that comes is a new pair, so a
        recabled port gets a new far end, as a real cable gives. A host that goes loses its
        processes, namespace (with its cables' ends), machine-side port, files, known_hosts line and
        name; one that comes is built as build() builds a host. ``replaced`` (see replace()): the hosts
        that go and come have the same names, and known_hosts keeps the old machines' keys."""
        state = self.recorded()
        if state is None:
            raise LabError(f"lab {self.plan.name} is not built; build it first")
        old_hosts = {h.name: h for h in before.hosts}
        new_hosts = {h.name: h for h in self.plan.hosts}
        added = tuple(new_hosts[n] for n in diff.hosts_added)
        gone = [old_hosts[n] for n in diff.hosts_removed]
        removed: list[str] = []

        # 1. Cables that go, from one end: both ends go at once and their names are free again.
        by_ns: dict[str, list[str]] = {}
        for c in diff.cables_removed:
            by_ns.setdefault(old_hosts[c.a.host].netns, []).append(f"link del {c.a.port}")
        for netns, cmds in by_ns.items():
            run(["ip", "-n", netns, "-batch", "-"], stdin="\n".join(cmds) + "\n")
        removed += [f"cable {cable_name(c)}" for c in diff.cables_removed]

        # 2. Hosts that go: processes, namespace, machine-side port (deleted here, not left to the
        # namespace's asynchronous end), files.
        for h in gone:
            self._remove_host(h)
            removed += [f"host {h.name}", f"namespace {h.netns}", f"link {h.mgmt_root_port}"]
        if gone:
            self._close_ssh_masters()  # connections to the hosts that went (the others reconnect)

        # 3. Hosts that come, as build() makes them (after what a failed earlier run left of them).
        for h in added:
            self._remove_host(h)
        self._write_files(added)
        cmds: list[str] = []
        for h in added:
            cmds += [
                f"netns add {h.netns}",
                f"link add {h.mgmt_root_port} type veth peer name {HOST_MGMT_PORT} netns {h.netns}",
                f"link set {h.mgmt_root_port} master {self.plan.mgmt_bridge}",
                f"link set {h.mgmt_root_port} up",
            ]
        # 4. Cables that come: new veth pairs straight into their two hosts.
        for c in diff.cables_added:
            cmds.append(
                f"link add {c.a.port} netns {new_hosts[c.a.host].netns} "
                f"type veth peer name {c.b.port} netns {new_hosts[c.b.host].netns}"
            )
        if cmds:
            run(["ip", "-batch", "-"], stdin="\n".join(cmds) + "\n")
        new_ports: dict[str, list[str]] = {}
        for c in diff.cables_added:
            for end in (c.a, c.b):
                new_ports.setdefault(end.host, []).append(end.port)
        for h in added:
            self._hardware(h)
            self._factory_network(h)
        for name, ports in new_ports.items():
            if name not in diff.hosts_added:
                self._hardware(new_hosts[name], tuple(ports))
                self._factory_ports(new_hosts[name], tuple(ports))

        # 5. Names: this machine's block, and every running host's own /etc/hosts (in place: it is
        # bind-mounted there).
        if self.plan.names:
            self.write_names_block()
            for h in self.plan.hosts:
                if h.name not in diff.hosts_added:
                    path = self.etc_dir(h.name) / "hosts"
                    text = self._host_hosts_file(h)
                    if path.read_text() != text:
                        path.write_text(text)

        # 6. The new hosts boot; their keys join known_hosts, the old hosts' keys leave it.
        for h in gone:
            state["holders"].pop(h.name, None)
        for h in added:
            state["holders"][h.name] = self._start_holder(h)
        self._wait_for_sshd(added)
        scanned = self._scan_host_keys(added) if added else []
        if replaced:
            # The new machines' keys (checked against those the lab made) wait for trust_replaced().
            state["untrusted"] = sorted({*state.get("untrusted", []), *scanned})
        else:
            leaving = {before.ssh_name(h) for h in gone} | {self.plan.ssh_name(h) for h in added}
            known = [line for line in state.get("known_hosts", []) if line.split()[0] not in leaving]
            state["known_hosts"] = sorted(known + scanned)
        state["plan"] = self.plan.as_dict()
        self._save_state(state)
        return removed

    # ---- a host replaced by another machine --------------------------------------------
    def replace(self, names: list[str]) -> dict[str, Any]:
        """Hosts swapped for other machines under the same names and cabled into the same ports, as
        docs/runbooks/replace-node.md has it. Each old machine goes (processes, namespace, its cables,
        files); a new one comes as build() makes a host: a new host key, machine id and MACs, an empty
        /var/lib/meshkit, the factory network. Its peers keep their configuration; their end of each of
        its cables is a new veth end, as a cable plugged in again gives.

        The lab's known_hosts keeps each OLD machine's key, as an operator's controller does: SSH to the
        host fails ("Host key verification failed") until the old key is removed and the new one
        collected and verified (docs/runbooks/ssh-host-keys.md, step 4). The next playbooks/lab.yml run
        trusts the new keys itself (trust_replaced(): the lab made them)."""
        hosts = self._named("lab_replace", names)
        if self.recorded() is None:
            raise LabError(f"lab_replace: lab {self.plan.name} is not built; build it first")
        start = time.monotonic()
        gone = {h.name for h in hosts}
        cables = tuple(c for c in self.plan.cables if {c.a.host, c.b.host} & gone)
        names_ = tuple(h.name for h in hosts)
        diff = PlanDiff(
            hosts_added=names_, hosts_removed=names_, cables_added=cables, cables_removed=cables,
            cables_kept=(), moved=(), blockers=(),
        )  # fmt: skip
        old = {h.name: self._fingerprint(self.plan.ssh_name(h)) for h in hosts}
        self.reshape(self.plan, diff, replaced=True)
        keys = {
            h.name: {"old": old[h.name], "new": self._fingerprint(self.plan.ssh_name(h), untrusted=True)} for h in hosts
        }
        return {
            "replaced": list(names_),
            "cables": [cable_name(c) for c in cables],
            "host_keys": keys,
            "elapsed": round(time.monotonic() - start, 2),
        }

    def untrusted(self) -> list[str]:
        """known_hosts lines of replaced hosts' new keys that the lab has not trusted yet."""
        return list((self.recorded() or {}).get("untrusted", []))

    def trust_replaced(self) -> list[str]:
        """Put the new keys of replaced hosts in known_hosts (after checking each still is the key the
        lab made): the names whose key changed."""
        state = self.recorded()
        if not state or not state.get("untrusted"):
            return []
        by_ssh = {self.plan.ssh_name(h): h for h in self.plan.hosts}
        names = {line.split()[0] for line in state["untrusted"]}
        fresh = self._scan_host_keys(tuple(by_ssh[n] for n in sorted(names) if n in by_ssh))
        known = [line for line in state.get("known_hosts", []) if line.split()[0] not in names]
        state["known_hosts"] = sorted(known + fresh)
        state.pop("untrusted")
        self._save_state(state)
        return sorted(by_ssh[n].name for n in names if n in by_ssh)

    def _fingerprint(self, ssh_name: str, untrusted: bool = False) -> str:
        """The SHA256 fingerprint of a host's key as the lab's known_hosts has it (or, ``untrusted``,
        of its new key not trusted yet); "" when there is none."""
        state = self.recorded() or {}
        lines = state.get("untrusted" if untrusted else "known_hosts", [])
        line = next((x for x in lines if x.split()[0] == ssh_name), None)
        if line is None:
            return ""
        blob = base64.b64decode(line.split()[2])
        return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")

    def _named(self, option: str, names: list[str]) -> list[Host]:
        """The hosts an option names, or an error naming the unknown ones and the lab's hosts."""
        by_name = {h.name: h for h in self.plan.hosts}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise LabError(
                f"{option} names {', '.join(unknown)}, not a host of lab {self.plan.name} "
                f"({', '.join(by_name)}); name hosts as the inventory does, e.g. -e {option}=node2"
            )
        return [by_name[n] for n in names]

    def _remove_host(self, h: Host) -> None:
        """A host gone: its processes, namespace, machine-side port and files (nothing if none)."""
        if h.netns in self.existing_netns():
            self._kill_netns_processes(h.netns)
            run(["ip", "netns", "del", h.netns])
        if any(link.get("ifname") == h.mgmt_root_port for link in ip_json("link", "show")):
            run(["ip", "link", "del", h.mgmt_root_port])
        if self.host_dir(h.name).exists():
            shutil.rmtree(self.host_dir(h.name))

    def _factory_ports(self, h: Host, ports: tuple[str, ...]) -> None:
        """New cable ports of a running host, as its OS takes a port plugged in: with
        lab_network_daemon=none the lab's factory network puts them in bridge0 (as at build; only
        brought up when the host has no bridge0 any more) and up; with networkd the host's own
        systemd-networkd configures them from its files, untouched here."""
        if self.plan.network_daemon != "none" or not ports:
            return
        bridge = any(link.get("ifname") == HOST_BRIDGE for link in ip_json("-n", h.netns, "link", "show"))
        cmds = []
        for port in ports:
            if bridge:
                cmds.append(f"link set {port} master {HOST_BRIDGE}")
            cmds.append(f"link set {port} up")
        run(["ip", "-n", h.netns, "-batch", "-"], stdin="\n".join(cmds) + "\n")

    def _hardware(self, h: Host, ports: tuple[str, ...] | None = None) -> None:
        """What a host's network hardware is, whatever its OS does: the cable ports' rate (tc tbf,
        standing in for the link's speed) and their factory MTU (of every port, or of ``ports``)."""
        ports = h.ports if ports is None else ports
        cmds = [f"link set {port} mtu 1500" for port in ports]
        if cmds:
            run(["ip", "-n", h.netns, "-batch", "-"], stdin="\n".join(cmds) + "\n")
        if self.plan.link_rate and ports:
            burst = tbf_burst(self.plan.link_rate)
            tc = [
                f"qdisc replace dev {port} root tbf rate {self.plan.link_rate} burst {burst} latency 20ms"
                for port in ports
            ]
            run(["tc", "-n", h.netns, "-batch", "-"], stdin="\n".join(tc) + "\n")

    def _bridge_add(self, h: Host) -> str:
        """The ``ip`` command making a host's factory bridge0: STP on with the timers above, and a MAC
        of its own (locally administered, from the lab's and host's names), as a Mac's Thunderbolt
        Bridge and networkd's bridge (from the machine id) have: a bridge without one takes its
        ports' lowest MAC, so plugging or unplugging a cable would change it and its STP bridge id."""
        digest = hashlib.sha256(f"{self.plan.name}/{h.name}/{HOST_BRIDGE}".encode()).digest()
        mac = ":".join(f"{b:02x}" for b in (0x02, *digest[:5]))
        return f"link add {HOST_BRIDGE} address {mac} type bridge stp_state 1 " + " ".join(
            f"{k} {v * 100}" for k, v in STP_TIMERS.items()
        )

    def _factory_network(self, h: Host) -> None:
        """The network a host has after boot before any of its own configuration, as the factory
        ships it: every cable port in bridge0 with STP on (a Mac's Thunderbolt Bridge across a
        loop), the management address. With lab_network_daemon=none the lab sets it up, as the
        OS of such a host would; with networkd the host's own systemd-networkd does, from the
        factory files in its /etc/systemd/network."""
        if self.plan.network_daemon != "none":
            return
        prefix = ipaddress.IPv4Network(self.plan.mgmt_subnet).prefixlen
        cmds = ["link set lo up"]
        if HOST_BRIDGE in host_links(h):
            cmds.append(self._bridge_add(h))
            for port in h.ports:
                cmds += [f"link set {port} master {HOST_BRIDGE}", f"link set {port} up"]
            cmds.append(f"link set {HOST_BRIDGE} up")
        cmds += [
            f"addr add {h.mgmt_ip}/{prefix} dev {HOST_MGMT_PORT}",
            f"link set {HOST_MGMT_PORT} up",
        ]
        run(["ip", "-n", h.netns, "-batch", "-"], stdin="\n".join(cmds) + "\n")

    # ---- per-host files ----------------------------------------------------
    def etc_dir(self, name: str) -> Path:
        return self.host_dir(name) / "etc"

    def own_dirs_root(self, name: str) -> Path:
        return self.host_dir(name) / "own"

    def _own_dirs(self, h: Host) -> list[list[str]]:
        """Fresh per-host copies of HOST_OWN_DIRS (empty, the machine's owner and mode) and of HOST_COPIED_DIRS
        (with what the machine has in them): binds."""
        root = self.own_dirs_root(h.name)
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        root.chmod(0o755)
        binds = []
        for path in HOST_OWN_DIRS:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                continue
            own = root / path.strip("/").replace("/", "-")
            own.mkdir()
            os.chown(own, st.st_uid, st.st_gid)
            own.chmod(stat.S_IMODE(st.st_mode))
            binds.append([str(own), path])
        for path in HOST_COPIED_DIRS:
            if not os.path.isdir(path) or os.path.islink(path):
                continue
            own = root / path.strip("/").replace("/", "-")
            shutil.copytree(path, own, symlinks=True)
            binds.append([str(own), path])
        return binds

    def network_dir(self, name: str) -> Path:
        return self.host_dir(name) / "network"

    def home_dir(self, name: str) -> Path:
        return self.host_dir(name) / "home"

    def root_home_dir(self, name: str) -> Path:
        return self.host_dir(name) / "root"

    def _root_home(self, name: str) -> Path:
        """The host's own entries of /root (ROOT_HOME): the dotfiles as a fresh host has them, written at
        every build; the caches kept (a reboot keeps them too)."""
        home = self.root_home_dir(name)
        home.mkdir(parents=True, exist_ok=True)
        home.chmod(0o700)
        for entry, sources in ROOT_HOME.items():
            path = home / entry
            if sources is None:
                path.mkdir(exist_ok=True)
                path.chmod(0o700)
                continue
            source = next((Path(s) for s in sources if Path(s).is_file()), None)
            path.write_text(source.read_text() if source else "")
            path.chmod(0o644)
        return home

    def _user_ids(self) -> tuple[int, int]:
        """uid and gid of the login user: the first number from 2000 that the machine uses for
        no user and no group, so files it writes on the shared filesystem are nobody else's."""
        used: set[int] = set()
        for path in ("/etc/passwd", "/etc/group"):
            for line in Path(path).read_text().splitlines():
                fields = line.split(":")
                if len(fields) > 2 and fields[2].isdigit():
                    used.add(int(fields[2]))
        n = 2000
        while n in used:
            n += 1
        return n, n

    def _user_record(self) -> dict[str, Any]:
        if self.plan.access != "sudo":
            return {"name": "root", "uid": 0, "gid": 0, "home": "/root"}
        uid, gid = self._user_ids()
        return {"name": LAB_USER, "uid": uid, "gid": gid, "home": f"/home/{LAB_USER}"}

    def _etc_files(self, h: Host) -> dict[str, tuple[str, int]]:
        """The host's own copies of files under /etc: name -> (content, mode)."""
        files = {"hosts": (self._host_hosts_file(h), 0o644)}
        if self.plan.access == "sudo":
            uid, gid = self._user_ids()

            def without_user(path: str) -> str:
                lines = Path(path).read_text().splitlines()
                return "".join(line + "\n" for line in lines if line.split(":", 1)[0] != LAB_USER)

            entry = f"{LAB_USER}:x:{uid}:{gid}:meshkit lab admin:/home/{LAB_USER}:/bin/bash\n"
            files["passwd"] = (without_user("/etc/passwd") + entry, 0o644)
            # "*": no password, but not locked ("!" would refuse key logins too with UsePAM no).
            files["shadow"] = (without_user("/etc/shadow") + f"{LAB_USER}:*:19000:0:99999:7:::\n", 0o640)
            files["group"] = (without_user("/etc/group") + f"{LAB_USER}:x:{gid}:\n", 0o644)
            if Path("/etc/gshadow").exists():
                files["gshadow"] = (without_user("/etc/gshadow") + f"{LAB_USER}:!::\n", 0o640)
            files["sudoers"] = (
                "# meshkit lab host: written by playbooks/lab.yml (the machine's own /etc/sudoers is untouched)\n"
                "Defaults env_reset\n"
                "Defaults secure_path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
                "root ALL=(ALL:ALL) ALL\n"
                f"{LAB_USER} ALL=(ALL:ALL) NOPASSWD: ALL\n",
                0o440,
            )
        return files

    def _host_hosts_file(self, h: Host) -> str:
        """The host's /etc/hosts, as Debian writes it: localhost, its own name on 127.0.1.1 (so
        sudo and others resolve the hostname; note the short name then resolves to loopback on
        the host itself), and with lab_names the lab's names."""
        text = (
            f"# meshkit lab {self.plan.name}, host {h.name}: written by playbooks/lab.yml\n"
            "127.0.0.1\tlocalhost\n"
            f"127.0.1.1\t{h.name}\n"
            "\n"
            "::1\tlocalhost ip6-localhost ip6-loopback\n"
            "ff02::1\tip6-allnodes\n"
            "ff02::2\tip6-allrouters\n"
        )
        if self.plan.names:
            text += "\n" + names_block(self.plan.name, self.names_lines())
        return text

    def names_lines(self) -> list[str]:
        return [f"{h.mgmt_ip}\t{h.fqdn}" for h in self.plan.hosts]

    def _network_files(self, h: Host) -> dict[str, str]:
        """The factory systemd-networkd configuration of a host: what the lab builds."""
        prefix = ipaddress.IPv4Network(self.plan.mgmt_subnet).prefixlen
        head = f"# Factory configuration of lab host {h.name} (meshkit lab {self.plan.name}).\n"
        mgmt = {
            "10-mgmt0.network": head + f"[Match]\nName={HOST_MGMT_PORT}\n\n[Network]\nAddress={h.mgmt_ip}/{prefix}\n"
            "LinkLocalAddressing=ipv6\nIPv6AcceptRA=no\n",
        }
        if HOST_BRIDGE not in host_links(h):
            return mgmt  # the head node: its management port alone
        return {
            **mgmt,
            f"20-{HOST_BRIDGE}.netdev": head + f"[NetDev]\nName={HOST_BRIDGE}\nKind=bridge\n\n[Bridge]\nSTP=yes\n"
            f"HelloTimeSec={STP_TIMERS['hello_time']}\nMaxAgeSec={STP_TIMERS['max_age']}\n"
            f"ForwardDelaySec={STP_TIMERS['forward_delay']}\n",
            f"20-{HOST_BRIDGE}.network": head
            + f"[Match]\nName={HOST_BRIDGE}\n\n[Network]\nLinkLocalAddressing=ipv6\nIPv6AcceptRA=no\n",
            "30-tb.network": head + f"[Match]\nName={HOST_PORT_PREFIX}*\n\n[Network]\nBridge={HOST_BRIDGE}\n",
        }

    def _write_files(self, hosts: tuple[Host, ...] | None = None) -> None:
        """The lab's own files and every host's (or only ``hosts``')."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o700)
        self.control_dir.mkdir(exist_ok=True)
        if not self.client_key.exists():
            run(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    f"meshkit-lab-{self.plan.name}",
                    "-f",
                    str(self.client_key),
                ]
            )
        pubkey = Path(str(self.client_key) + ".pub").read_text()
        sudo = self.plan.access == "sudo"
        user = self._user_record()
        for h in self.plan.hosts if hosts is None else hosts:
            # Each host's /etc/ssh: the holder bind-mounts this directory there, so
            # sshd reads its own config and host key at the usual paths (which also
            # pass sshd's StrictModes wherever the checkout is).
            ssh_dir = self.ssh_dir(h.name)
            ssh_dir.mkdir(parents=True, exist_ok=True)
            ssh_dir.chmod(0o755)
            state_dir = self.state_dir(h.name)
            state_dir.mkdir(parents=True, exist_ok=True)
            state_dir.chmod(0o755)
            key = ssh_dir / "ssh_host_ed25519_key"
            if not key.exists():
                run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f", str(key)])
            auth = ssh_dir / "authorized_keys"
            if sudo:
                auth.unlink(missing_ok=True)
                home = self.home_dir(h.name)
                dot_ssh = home / ".ssh"
                dot_ssh.mkdir(parents=True, exist_ok=True)
                (dot_ssh / "authorized_keys").write_text(pubkey)
                for path, mode in ((home, 0o755), (dot_ssh, 0o700), (dot_ssh / "authorized_keys", 0o600)):
                    os.chown(path, user["uid"], user["gid"])
                    path.chmod(mode)
            else:
                auth.write_text(pubkey)
                auth.chmod(0o600)
            (ssh_dir / "sshd_config").write_text(
                "\n".join(
                    [
                        f"# meshkit lab {self.plan.name}, host {h.name}: written by playbooks/lab.yml",
                        f"ListenAddress {h.mgmt_ip}:{SSH_PORT}",
                        "HostKey /etc/ssh/ssh_host_ed25519_key",
                        # lab_access=sudo: the login user's own ~/.ssh/authorized_keys; root
                        # cannot log in at all. root: the key for root is in /etc/ssh.
                        "AuthorizedKeysFile " + (".ssh/authorized_keys" if sudo else "/etc/ssh/authorized_keys"),
                        "PidFile none",
                        "PermitRootLogin " + ("no" if sudo else "prohibit-password"),
                        "PubkeyAuthentication yes",
                        "PasswordAuthentication no",
                        "KbdInteractiveAuthentication no",
                        # PAM's session modules (loginuid, systemd) fail inside a
                        # namespace host; keys are the only way in.
                        "UsePAM no",
                        "UseDNS no",
                        "PrintMotd no",
                        "MaxStartups 64:30:128",
                        "MaxSessions 64",
                        "AcceptEnv LANG LC_*",
                        "Subsystem sftp internal-sftp",
                        "",
                    ]
                )
            )
            etc = self.etc_dir(h.name)
            if etc.exists():
                shutil.rmtree(etc)
            etc.mkdir(parents=True)
            etc.chmod(0o755)
            binds = [
                [str(state_dir), "/var/lib/meshkit"],
                [str(ssh_dir), "/etc/ssh"],
                *self._own_dirs(h),
            ]
            for name, (content, mode) in self._etc_files(h).items():
                path = etc / name
                path.write_text(content)
                path.chmod(mode)
                binds.append([str(path), f"/etc/{name}"])
            # The host's own machine id (systemd-networkd derives bridge0's MAC from it: a shared
            # one would give every host's bridge the same STP bridge id). Kept across rebuilds.
            machine_id = self.host_dir(h.name) / "machine-id"
            if not machine_id.exists():
                machine_id.write_text(os.urandom(16).hex() + "\n")
                machine_id.chmod(0o444)
            binds.append([str(machine_id), "/etc/machine-id"])
            if Path("/var/lib/dbus/machine-id").exists() and not Path("/var/lib/dbus/machine-id").is_symlink():
                binds.append([str(machine_id), "/var/lib/dbus/machine-id"])
            if self.plan.network_daemon == "networkd":
                # A (re)built host has its factory configuration only.
                net = self.network_dir(h.name)
                if net.exists():
                    shutil.rmtree(net)
                net.mkdir(parents=True)
                net.chmod(0o755)
                for name, content in self._network_files(h).items():
                    (net / name).write_text(content)
                    (net / name).chmod(0o644)
                binds.append([str(net), "/etc/systemd/network"])
            config = {
                "cgroups": machine_cgroups(),
                "hostname": h.name,
                "mgmt_ip": h.mgmt_ip,
                "sshd": self.sshd,
                "network_daemon": self.plan.network_daemon,
                "binds": binds,
                "home": {"user": LAB_USER, "source": str(self.home_dir(h.name))} if sudo else None,
                "root_home": {"source": str(self._root_home(h.name)), "mode": 0o711 if sudo else 0o700},
            }
            (self.host_dir(h.name) / "init.json").write_text(json.dumps(config, indent=2) + "\n")

    def _start_holder(self, h: Host) -> int:
        """Boot a host: its PID 1 (lab_init.py) in its network namespace and its own mount, UTS,
        IPC and PID namespaces."""
        log = open(self.host_dir(h.name) / "init.log", "ab")  # noqa: SIM115 - handed to the child
        cmd = [
            "ip",
            "netns",
            "exec",
            h.netns,
            "unshare",
            "--mount",
            "--uts",
            "--ipc",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            self.python,
            self.init_script,
            "--config",
            str(self.host_dir(h.name) / "init.json"),
        ]
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            log.close()
        # "ip netns exec" execs unshare, which forks the namespace's PID 1: our init.
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise LabError(f"{h.name}: the host's holder exited at once; see {self.host_dir(h.name)}/init.log")
            try:
                kids = children.read_text().split()
            except OSError:
                kids = []
            if kids:
                return int(kids[0])
            time.sleep(0.01)
        raise LabError(f"{h.name}: the host's holder did not start within 10 s")

    def _wait_for_sshd(self, hosts: tuple[Host, ...] | None = None) -> None:
        deadline = time.monotonic() + self.ssh_timeout
        waiting = list(self.plan.hosts if hosts is None else hosts)
        while waiting and time.monotonic() < deadline:
            waiting = [h for h in waiting if not _port_open(h.mgmt_ip, SSH_PORT, 0.5)]
            if waiting:
                time.sleep(0.05)
        if waiting:
            names = ", ".join(f"{h.name} ({h.mgmt_ip})" for h in waiting)
            raise LabError(
                f"sshd did not answer within {self.ssh_timeout:.0f} s on: {names}; see {self.dir}/hosts/<host>/init.log"
            )

    # ---- reboot --------------------------------------------------------------
    def reboot(self, names: list[str]) -> dict[str, Any]:
        """Reboot hosts as a machine reboots, then wait until the whole lab is settled.

        1. Power off: every process of the host ends at once (its PID namespace dies with its init).
        2. A new kernel: the host gets a fresh network namespace and its hardware - the cable ports
           and mgmt0, veths whose other ends stay where they are - is moved into it. Everything
           the old kernel held at runtime is gone with the old namespace: addresses, routes,
           neighbours, sysctls, bridge memberships, bridge0 itself (a software device). The ports
           come back down, with their MAC and factory MTU, as a NIC does at power-on.
        3. Boot: lab_init starts again from the host's files on disk (its /etc, /var/lib/meshkit),
           and only the host's own boot configures the network: with lab_network_daemon=networkd,
           systemd-networkd from /etc/systemd/network (the factory files and whatever was
           persisted there); with none, the factory network as the lab's OS sets it up.
        Returns per host the seconds from power-off to booted, and the seconds until settled.
        """
        state = self.recorded()
        by_name = {h.name: h for h in self._named("lab_reboot", names)}
        if state is None:
            raise LabError(f"lab_reboot: lab {self.plan.name} is not built; build it first")
        start = time.monotonic()
        booted: dict[str, float] = {}
        for name in names:
            h = by_name[name]
            t0 = time.monotonic()
            self._kill_netns_processes(h.netns)
            self._fresh_netns(h)
            self._hardware(h)
            self._factory_network(h)
            state["holders"][h.name] = self._start_holder(h)
            self._save_state(state)
            booted[name] = round(time.monotonic() - t0, 2)
        # Connections to the old sshd are dead; the next task opens new ones.
        self._close_ssh_masters()
        settled = self.settle()
        return {"rebooted": names, "boot": booted, "settled_in": settled, "elapsed": round(time.monotonic() - start, 2)}

    def _fresh_netns(self, h: Host) -> None:
        """Give the host a new network namespace holding only its hardware (see reboot)."""
        spare = f"{self.plan.name}-boot{h.index}"
        if spare in self.existing_netns():
            run(["ip", "netns", "del", spare])
        run(["ip", "netns", "add", spare])
        hardware = [HOST_MGMT_PORT, *h.ports]
        present = {link["ifname"] for link in ip_json("-n", h.netns, "link", "show")}
        lost = [name for name in hardware if name not in present]
        if lost:
            run(["ip", "netns", "del", spare])
            raise LabError(f"{h.name}: cannot reboot, its ports {', '.join(lost)} are gone; rebuild the lab")
        moves = "".join(f"link set dev {name} netns {spare}\n" for name in hardware)
        run(["ip", "-n", h.netns, "-batch", "-"], stdin=moves)
        # The old namespace (and bridge0, lo and all state in it) goes; the new one takes its name.
        run(["ip", "netns", "del", h.netns])
        path = f"/run/netns/{h.netns}"
        Path(path).touch()
        run(["mount", "--bind", f"/run/netns/{spare}", path])
        run(["ip", "netns", "del", spare])

    # ---- the factory network, again ---------------------------------------------
    def factory_network(self, names: list[str], check_mode: bool = False) -> dict[str, list[str]]:
        """Put hosts' cable ports back as the factory network has them, without a reboot: bridge0
        (STP on, made again if it is gone) up, every cable port in it, up, at the factory MTU, with
        no address but its link-local ones and no route of its own. Per host the ``ip`` commands
        that did it (none: it already was so); ``check_mode`` only says them.

        With lab_network_daemon=networkd the host's own networkd owns its network: its bridge comes
        back from its own files at its next boot (lab_reboot), which this refuses to second-guess."""
        by_name = {h.name: h for h in self._named("lab_factory_network", names)}
        if self.plan.network_daemon != "none":
            raise LabError(
                "lab_factory_network: with lab_network_daemon=networkd each host's own systemd-networkd "
                "configures its ports from its own files; reboot the host to have it apply them "
                f"(-e lab_reboot={','.join(names)})"
            )
        heads = [n for n in names if by_name[n].head]
        if heads:
            raise LabError(f"lab_factory_network: {', '.join(heads)} is the head node, which has no cables")
        done: dict[str, list[str]] = {}
        for name in names:
            h = by_name[name]
            cmds = self._factory_fixes(h)
            if cmds and not check_mode:
                run(["ip", "-n", h.netns, "-batch", "-"], stdin="\n".join(cmds) + "\n")
            done[name] = cmds
        return done

    def _factory_fixes(self, h: Host) -> list[str]:
        """The ``ip`` commands that give a host's cable ports their factory network again."""
        links = {link["ifname"]: link for link in ip_json("-n", h.netns, "-d", "link", "show")}
        addrs = {a["ifname"]: a.get("addr_info", []) for a in ip_json("-n", h.netns, "addr", "show")}
        routes = ip_json("-n", h.netns, "-4", "route", "show", "table", "main")
        lost = [port for port in h.ports if port not in links]
        if lost:
            raise LabError(f"{h.name}: its ports {', '.join(lost)} are gone; build the lab again")
        cmds = []
        bridge = links.get(HOST_BRIDGE)
        stp = " ".join(f"{k} {v * 100}" for k, v in STP_TIMERS.items())
        if bridge is None:
            cmds.append(self._bridge_add(h))
        elif bridge.get("linkinfo", {}).get("info_data", {}).get("stp_state") != 1:
            cmds.append(f"link set dev {HOST_BRIDGE} type bridge stp_state 1 {stp}")
        for port in h.ports:
            link = links[port]
            for r in routes:
                if r.get("dev") == port and r.get("protocol") != "kernel":
                    cmds.append(f"route del {r['dst']} dev {port}" + (f" via {r['gateway']}" if "gateway" in r else ""))
            for a in addrs.get(port, []):
                if a.get("scope") != "link":
                    cmds.append(f"addr del {a['local']}/{a['prefixlen']} dev {port}")
            if link.get("mtu") != 1500:
                cmds.append(f"link set {port} mtu 1500")
            if link.get("master") != HOST_BRIDGE:
                cmds.append(f"link set {port} master {HOST_BRIDGE}")
            if "UP" not in link.get("flags", []):
                cmds.append(f"link set {port} up")
        if bridge is None or "UP" not in bridge.get("flags", []):
            cmds.append(f"link set {HOST_BRIDGE} up")
        return cmds

    # ---- settled -----------------------------------------------------------
    def unsettled(self, host: Host) -> list[str]:
        """What one host still lacks to be settled; empty when it is.

        Settled: the management address is on mgmt0; every interface that is up and will get an
        IPv6 link-local address has one (a port with carrier; a bridge once one of its members
        has carrier, as STP then lets it forward); no address is still in duplicate-address
        detection (``tentative``) and none failed it; sshd answers with its banner.
        """
        links = ip_json("-n", host.netns, "-d", "link", "show")
        by_name = {link["ifname"]: link for link in links}
        addrs = {a["ifname"]: a.get("addr_info", []) for a in ip_json("-n", host.netns, "addr", "show")}
        for name, link in by_name.items():
            link["addr_info"] = addrs.get(name, [])
        missing: list[str] = []
        prefix = ipaddress.IPv4Network(self.plan.mgmt_subnet).prefixlen
        mgmt = by_name.get(HOST_MGMT_PORT)
        if mgmt is None:
            missing.append(f"{HOST_MGMT_PORT}: the interface is missing")
        elif not any(a.get("local") == host.mgmt_ip and a.get("prefixlen") == prefix for a in mgmt["addr_info"]):
            missing.append(f"{HOST_MGMT_PORT}: no management address {host.mgmt_ip}/{prefix}")
        carrier = {name for name, link in by_name.items() if "LOWER_UP" in link.get("flags", [])}
        disabled: set[str] | None = None
        for name, link in sorted(by_name.items()):
            if name == "lo":
                continue
            for a in link.get("addr_info", []):
                flags = [f for f in ("tentative", "dadfailed") if a.get(f)]
                if "dadfailed" in flags:
                    missing.append(f"{name}: {a['local']} failed duplicate-address detection")
                elif flags:
                    missing.append(f"{name}: {a['local']} is still tentative (duplicate-address detection)")
            if "UP" not in link.get("flags", []) or link.get("inet6_addr_gen_mode") == "none":
                continue
            kind = link.get("linkinfo", {}).get("info_kind")
            members = [n for n, m in by_name.items() if m.get("master") == name]
            expected = any(m in carrier for m in members) if kind == "bridge" else name in carrier
            has_ll = any(a.get("family") == "inet6" and a.get("scope") == "link" for a in link.get("addr_info", []))
            if expected and not has_ll:
                if disabled is None:
                    disabled = self._ipv6_disabled(host)
                if name not in disabled:
                    why = "carrier" if name in carrier else f"a member with carrier ({', '.join(sorted(members))})"
                    missing.append(f"{name}: no IPv6 link-local address yet (it is up, with {why})")
        if self.plan.network_daemon == "networkd":
            missing += self._networkd_unsettled(host, links)
        if not missing and not _ssh_banner(host.mgmt_ip, SSH_PORT, 1.0):
            missing.append(f"sshd does not answer on {host.mgmt_ip}:{SSH_PORT}")
        return missing

    def _networkd_unsettled(self, host: Host, links: list[dict[str, Any]]) -> list[str]:
        """systemd-networkd has processed every link: its state file for each says configured or
        unmanaged (read through the host's holder, in the host's own /run)."""
        state = self.recorded() or {}
        pid = state.get("holders", {}).get(host.name)
        root = Path(f"/proc/{pid}/root/run/systemd/netif")
        if not pid or not (root / "state").exists():
            return ["systemd-networkd has not started (no /run/systemd/netif/state)"]
        missing = []
        if HOST_BRIDGE in host_links(host) and not any(link["ifname"] == HOST_BRIDGE for link in links):
            missing.append(f"{HOST_BRIDGE}: not created yet (20-{HOST_BRIDGE}.netdev)")
        for link in links:
            try:
                text = (root / "links" / str(link["ifindex"])).read_text()
            except OSError:
                missing.append(f"{link['ifname']}: systemd-networkd has not seen it yet")
                continue
            fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
            admin = fields.get("ADMIN_STATE", "?")
            if admin in ("configured", "unmanaged"):
                continue
            if admin == "configuring" and "LOWER_UP" not in link.get("flags", []):
                continue  # waits for a carrier that nothing here will bring (a bridge without ports)
            missing.append(f"{link['ifname']}: systemd-networkd state {admin}")
        return missing

    @staticmethod
    def _ipv6_disabled(host: Host) -> set[str]:
        """Interfaces of the host with IPv6 switched off (they never get a link-local address)."""
        proc = run(
            ["nsenter", f"--net=/run/netns/{host.netns}", "grep", "-l", "^1$", "-r", "/proc/sys/net/ipv6/conf"],
            check=False,
        )
        return {line.split("/")[-2] for line in proc.stdout.splitlines() if line.endswith("/disable_ipv6")}

    def settle(self, hosts: list[Host] | None = None) -> float:
        """Wait until every host (or the given ones) is settled; seconds waited. On the deadline,
        LabError naming each host, interface and what it lacks."""
        start = time.monotonic()
        deadline = start + self.settle_timeout
        waiting = list(hosts if hosts is not None else self.plan.hosts)
        lacking: dict[str, list[str]] = {}
        while waiting:
            lacking = {}
            for h in waiting:
                missing = self.unsettled(h)
                if missing:
                    lacking[h.name] = missing
            waiting = [h for h in waiting if h.name in lacking]
            if not waiting:
                break
            if time.monotonic() > deadline:
                detail = "; ".join(f"{name}: {', '.join(what)}" for name, what in lacking.items())
                raise LabError(
                    f"the lab did not settle within {self.settle_timeout:.0f} s (lab_settle_timeout): {detail}"
                )
            time.sleep(0.2)
        return round(time.monotonic() - start, 2)

    def _scan_host_keys(self, hosts: tuple[Host, ...] | None = None) -> list[str]:
        """Collect every host's (or only ``hosts``') key with ssh-keyscan, by the name the inventory
        uses for it (its address, or with lab_names its name), and check it is the key we gave that host."""
        hosts = self.plan.hosts if hosts is None else hosts
        names = [self.plan.ssh_name(h) for h in hosts]
        out = run(["ssh-keyscan", "-T", "5", "-t", "ed25519", *names]).stdout
        lines = sorted(line for line in out.splitlines() if line and not line.startswith("#"))
        scanned = {line.split()[0]: line.split()[2] for line in lines}
        for h, name in zip(hosts, names, strict=True):
            expected = (self.ssh_dir(h.name) / "ssh_host_ed25519_key.pub").read_text().split()[1]
            if scanned.get(name) != expected:
                raise LabError(
                    f"{h.name}: ssh-keyscan of {name} did not return the host key the lab "
                    "generated; another sshd may be answering on that address"
                    + (f", or {name} does not resolve to {h.mgmt_ip}" if name != h.mgmt_ip else "")
                )
        return lines

    # ---- names -------------------------------------------------------------
    def write_names_block(self) -> bool:
        """Add (or replace) the lab's block in this machine's hosts file; True when it changed."""
        try:
            return update_hosts_block(self.hosts_file, self.plan.name, self.names_lines())
        except OSError as exc:
            raise LabError(
                f"lab_names: cannot write the lab's names into {self.hosts_file} ({exc}); make it writable "
                "or point lab_hosts_file at this machine's hosts file"
            ) from exc

    def remove_names_block(self) -> bool:
        try:
            return update_hosts_block(self.hosts_file, self.plan.name, None)
        except OSError as exc:
            raise LabError(f"cannot remove lab {self.plan.name}'s names from {self.hosts_file}: {exc}") from exc

    def names_problem(self) -> str | None:
        """Why this machine's hosts file does not map the lab's names as built (None: it does)."""
        try:
            text = Path(self.hosts_file).read_text()
        except OSError as exc:
            return f"cannot read {self.hosts_file}: {exc}"
        want = names_block(self.plan.name, self.names_lines())
        return None if want in text else f"{self.hosts_file} lacks the lab's names block"

    # ---- login user ----------------------------------------------------------
    def check_shared_paths(self, paths: list[str]) -> None:
        """With lab_access=sudo, the hosts' login user must be able to use what the hosts share
        with this machine (the checkout, the hosts' Python): try it as that user on node1."""
        if self.plan.access != "sudo" or not paths:
            return
        state = self.recorded() or {}
        host = self.plan.hosts[0]
        pid = state.get("holders", {}).get(host.name)
        user = self._user_record()
        for path in paths:
            proc = run(
                [
                    "nsenter", "-t", str(pid), "-m", "-u", "-i", "-n", "-p", "--",
                    "setpriv", f"--reuid={user['uid']}", f"--regid={user['gid']}", "--clear-groups", "--",
                    "test", "-r", path, "-a", "-x", path,
                ],
                check=False,
            )  # fmt: skip
            if proc.returncode != 0:
                raise LabError(
                    f"lab_access=sudo: the hosts' login user {LAB_USER} cannot read and enter {path}"
                    f"{_blocked_by(path)}. The hosts share this machine's files: put the checkout where "
                    "other users can read it, or use lab_access=root."
                )

    # ---- teardown ----------------------------------------------------------
    def teardown(self, keep_files: bool) -> list[str]:
        """Remove the lab's namespaces, processes and links (and its files unless keep_files)."""
        removed = []
        for netns in self.existing_netns():
            self._kill_netns_processes(netns)
        netns = self.existing_netns()
        if netns:
            run(["ip", "-batch", "-"], stdin="".join(f"netns del {n}\n" for n in netns))
            removed += [f"namespace {n}" for n in netns]
        # Deleting a namespace frees its veths asynchronously; delete the
        # machine-side ends ourselves so a rebuild cannot race them.
        links = self.existing_root_links()
        for link in sorted(links, key=lambda n: n == self.plan.mgmt_bridge):
            run(["ip", "link", "del", link], check=False)
        removed += [f"link {n}" for n in links]
        self._close_ssh_masters()
        if self.remove_names_block():
            removed.append(f"names block of lab {self.plan.name} in {self.hosts_file}")
        if self.state_file.exists():
            self.state_file.unlink()
        if not keep_files and self.dir.exists():
            shutil.rmtree(self.dir)
            removed.append(f"directory {self.dir}")
        return removed

    def _kill_netns_processes(self, netns: str) -> None:
        # Every process in a lab namespace belongs to the lab: the holder, its
        # PID namespace (sshd, sessions, jobs) and the unshare parent. Killing
        # the PID namespace's init takes all of that namespace with it.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pids = [int(p) for p in run(["ip", "netns", "pids", netns], check=False).stdout.split()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        raise LabError(f"processes in namespace {netns} did not exit after SIGKILL")

    def _close_ssh_masters(self) -> None:
        # Ansible's persistent SSH connections to a removed host would
        # otherwise linger, and hang the next lab that reuses the address.
        if not self.control_dir.is_dir():
            return
        for sock in self.control_dir.iterdir():
            subprocess.run(
                ["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "lab-host"],
                capture_output=True,
                timeout=10,
                check=False,
            )
            sock.unlink(missing_ok=True)

    # ---- results -----------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """The lab as built: the plan plus live MACs and the collected host keys."""
        data = self.plan.as_dict()
        state = self.recorded() or {}
        if state.get("plan") != data:
            state = {}  # check mode: the lab is not (yet) what the plan says
        macs = self.live_macs() if state else {}
        for cable in data["cables"]:
            for end in cable["ends"]:
                end["mac"] = macs.get(end["host"], {}).get(end["port"], "")
        # The templates ask every host whether it is the head node, and the lab for its head's name.
        data.setdefault("head", None)
        for host in data["hosts"]:
            host.setdefault("head", False)
            host["state_dir"] = str(self.state_dir(host["name"]))
            host["holder_pid"] = state.get("holders", {}).get(host["name"])
        data["known_hosts"] = state.get("known_hosts", [])
        data["client_key"] = str(self.client_key)
        data["control_dir"] = str(self.control_dir)
        data["dir"] = str(self.dir)
        return data


def machine_cgroups(mounts: str = "/proc/self/mounts") -> list[list[str]]:
    """The machine's cgroup file systems under /sys/fs/cgroup: [fstype, target, options] each, for
    the hosts to mount again (cgroup v2 alone, or v1 controllers with a v2 "unified" beside them)."""
    out = []
    for line in Path(mounts).read_text().splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[2] not in ("cgroup", "cgroup2"):
            continue
        target = fields[1]
        if target != "/sys/fs/cgroup" and not target.startswith("/sys/fs/cgroup/"):
            continue
        keep = [o for o in fields[3].split(",") if o not in ("rw", "ro", "relatime", "seclabel")]
        out.append([fields[2], target, ",".join(keep) or "defaults"])
    return out


def host_links(host: Host) -> set[str]:
    """The interfaces a host has once built: lo, its management port and, unless it is the head
    node (a login node, without cables or a Thunderbolt Bridge), bridge0 and its cable ports."""
    if host.head:
        return {"lo", HOST_MGMT_PORT}
    return {"lo", HOST_MGMT_PORT, HOST_BRIDGE, *host.ports}


def describe_change(before: dict[str, Any], after: dict[str, Any]) -> str:
    parts = []
    for key in ("size", "shape", "link_rate", "mgmt_subnet", "access", "names", "network_daemon"):
        if before.get(key) != after.get(key):
            parts.append(f"{key} {before.get(key)} -> {after.get(key)}")
    if before.get("head") != after.get("head"):
        # Absent from the record of a lab without a head (and of one built before lab_head existed).
        parts.append("head node " + ("added" if after.get("head") else "removed"))
    if before.get("cables") != after.get("cables"):
        parts.append(
            f"cables {len(before.get('cables', []))} -> {len(after.get('cables', []))}"
            if len(before.get("cables", [])) != len(after.get("cables", []))
            else "cables rewired"
        )
    return "the lab was built differently: " + (", ".join(parts) or "plan changed")


def _port_open(ip: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False


def _ssh_banner(ip: str, port: int, timeout: float) -> bool:
    """True when an SSH server answers on ip:port with its identification line."""
    try:
        with socket.create_connection((ip, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


BEGIN = "# BEGIN meshkit lab {name}"
END = "# END meshkit lab {name}"


def names_block(name: str, lines: list[str]) -> str:
    return "\n".join([BEGIN.format(name=name), *lines, END.format(name=name)]) + "\n"


def replace_block(text: str, name: str, lines: list[str] | None) -> str:
    """``text`` (a hosts file) with lab ``name``'s block replaced by ``lines`` (None: removed).
    Every stale copy of that lab's block goes; other labs' blocks and other lines stay."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.strip() == begin:
            inside = True
            continue
        if inside:
            if line.strip() == end:
                inside = False
            continue
        out.append(line)
    body = "\n".join(out).rstrip("\n")
    body = body + "\n" if body else ""
    if lines is not None:
        body += names_block(name, lines)
    return body


def update_hosts_block(path: str, name: str, lines: list[str] | None) -> bool:
    """Write lab ``name``'s block into the hosts file at ``path`` (None: remove it); True when the
    file changed. In place (the file may be a bind mount, which a rename would break) and under an
    exclusive lock on the file, so labs built at the same time do not lose each other's names."""
    if lines is None:
        # Removing: touch (and lock) the file only when it holds the lab's block, so a lab without
        # names never needs the hosts file writable.
        try:
            if BEGIN.format(name=name) not in Path(path).read_text():
                return False
        except FileNotFoundError:
            return False
    try:
        handle = open(path, "r+")  # noqa: SIM115 - closed below, after the lock is released
    except FileNotFoundError:
        handle = open(path, "w+")  # noqa: SIM115
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            text = handle.read()
            new = replace_block(text, name, lines)
            if new == text:
                return False
            handle.seek(0)
            handle.write(new)
            handle.truncate()
            handle.flush()
            os.fsync(handle.fileno())
            return True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _blocked_by(path: str) -> str:
    """Which directory on the way to ``path`` others cannot enter (or read, for the last)."""
    parts = Path(os.path.abspath(path)).parts
    for i in range(1, len(parts) + 1):
        p = Path(*parts[:i])
        try:
            mode = p.stat().st_mode
        except OSError:
            return f" ({p} does not exist)"
        last = i == len(parts)
        need = stat.S_IXOTH | (stat.S_IROTH if last else 0)
        if p.is_dir() and mode & need != need:
            return f" ({p} is mode {stat.S_IMODE(mode):04o}: others cannot {'read and ' if last else ''}enter it)"
    return ""
