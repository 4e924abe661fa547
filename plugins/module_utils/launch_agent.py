# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The per-host supervisor of a launch: starts this host's ranks and stops them all on command.

The controller (the meshkit package's launcher.py) runs it on every host over the host's connection
(ssh, or nsenter on the lab) and talks to it through the connection's stdin and stdout, one
JSON object per line. Standard library only: it runs under whatever Python the host has; the
controller sends its source over the connection, so hosts need no copy of meshkit.

Controller -> agent (stdin):
  0. before the job, a preflight: {"preflight": {...}} (check_host()'s spec); the agent answers
     {"t": "preflight", "result": check_host()'s "preflight"} and waits for the job (1.); the end
     of input instead (the launch was refused) ends it, starting nothing.
     Or instead of a job, a check: {"check": {...}} (see check_host()); the agent answers
     {"t": "checked", "preflight": {...}, "facts": {...}} and exits, starting nothing. A check may
     carry collection module_utils' sources ("modules", see SentSources) for checks that need them.
  1. the job: {"job", "dir", "files": {name: text}, "grace", "stdin": bool, "host_timeout",
     "heartbeat", "ranks": [{"rank", "argv", "env", "cwd"}]}
  2. then any number of {"t": "stdin", "d": text}, {"t": "stdin_eof"}, {"t": "stop", "why": text},
     {"t": "hb"} (a heartbeat).
  End of input (the controller or its connection is gone) stops the job like "stop"; so does no
  word from the controller for ``host_timeout`` seconds (a partition closes nothing).

Agent -> controller (stdout, written without ever blocking: a controller that does not take its
output holds the ranks' output up, never the agent):
  {"t": "started", "r", "pid"}; {"t": "out", "r", "d"}; {"t": "exit", "r", "code", "sig", "err",
  "stopped"}; {"t": "error", "msg"}; {"t": "hb"} every ``heartbeat`` seconds; {"t": "bye", "left":
  [pids killed after the ranks ended]}.

The job's directory (``<state_dir>/jobs/<job id>``) is made 0700 and the login user's own, inside
a parent every user may write to (sticky, like /tmp): see job_directory(). The ranks run as the
user the connection logged in as.

Stopping is SIGTERM to each rank's process group, SIGKILL to what is left after ``grace``
seconds, then SIGKILL to whatever else of the job is left. The process the connection started
becomes a watchdog once the job is read: it forks, the child is the agent, and the watchdog
waits for it; when the agent ends any way but in order (even SIGKILL) the watchdog kills what is
left of the job. Every rank's environment carries the job's random ``MESHKIT_JOB_MARK``. How the
rest of the job is found depends on the platform (_platform_mode()):

- Linux ("linux"): the agent and the watchdog are child subreapers, so every orphan of the job
  (a daemon: double fork, setsid) is re-parented to them and cannot leave the tree; ranks get
  PR_SET_PDEATHSIG, so a killed agent takes its ranks with it; /proc gives the tree, the groups
  and every process's environment (job_processes(), sweep_job()).
- macOS, and Linux with MESHKIT_AGENT_PORTABLE=1 in the agent's environment (or "portable": true
  in the job) ("portable"): no subreaper, no PR_SET_PDEATHSIG, no /proc; ``ps`` alone
  (PortableJob). The agent looks at its job every TRACK_EVERY seconds (and before it stops it)
  and remembers each process of it by pid and start time, telling the watchdog; an orphan
  re-parented to init/launchd is still known by both. A process is the job's when it descends
  from the agent (or watchdog), was seen as the job's with the same start time, carries the
  mark (where ps shows environments: procps ``e``; macOS ``-E``, which shows nothing for
  Apple's restricted platform binaries), descends from one of those, or shares a rank's process
  group with one of those. Ranks die with a killed agent through the watchdog's sweep. The
  watchdog also stops the job when its own parent (the connection's process) is gone. What a
  portable host cannot catch: a process that left the ranks' groups and the tree (double fork,
  setsid) before any look at the job, and carries no visible mark (it cleared its environment,
  or on macOS it is a restricted binary); a pid reused within the same second is taken for
  the process it replaced (start times have one-second resolution).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import glob
import hashlib
import ipaddress
import json
import os
import re
import secrets
import select
import selectors
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from typing import IO, Any, NamedTuple

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TAIL_POLL = 0.02


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die_with_agent() -> None:
    # Runs in the child between fork and exec.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _reap() -> None:
    """Collect every exited child (ranks' orphans re-parented here die as zombies of the agent)."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (Linux /proc; empty elsewhere)."""
    return [child for child, (parent, state, _group) in _proc_table().items() if parent == pid and state != b"Z"]


# --- checks before a launch (the launch_preflight module and `meshkit launch` share them) ------

PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
REQUIRED_HINTS = {
    "orted": "install Open MPI (the same version as the controller's mpirun; Debian: openmpi-bin)",
}


def locate(name: str, path: str | None, cwd: str | None) -> str | None:
    """Where a command name is found (through ``path``), links not resolved, or None."""
    if "/" in name:
        full = name if os.path.isabs(name) else os.path.join(cwd or os.getcwd(), name)
        return full if os.path.isfile(full) and os.access(full, os.X_OK) else None
    return shutil.which(name, path=path)


def resolve(name: str, path: str | None, cwd: str | None) -> str | None:
    """The real path a command name runs (through ``path``), or None."""
    found = locate(name, path, cwd)
    return os.path.realpath(found) if found else None


def shebang(program: str) -> list[str] | None:
    try:
        with open(program, "rb") as handle:
            head = handle.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    return head[2:].split(b"\n", 1)[0].decode(errors="replace").split()


def port_holder(port: int) -> str:
    """Who listens on a TCP port, from ss (empty when ss cannot tell)."""
    try:
        out = subprocess.run(
            ["ss", "-H", "-ltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    found = re.search(r'users:\(\("([^"]+)",pid=(\d+)', out)
    return f" by {found.group(1)} (pid {found.group(2)})" if found else ""


def check_port(address: str, port: int) -> str | None:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {address} is in use{port_holder(port)}"
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"address {address} is not on this host (run setup.yml: the cabling or addresses changed)"
            return f"cannot listen on {address}:{port}: {exc.strerror}"
    return None


def preflight(
    argv: list[str],
    path: str | None = None,
    path_prepend: list[str] | None = None,
    cwd: str | None = None,
    require: list[str] | None = None,
    ports: list[list] | None = None,
) -> dict:
    """Can this host run its share of a job? The program (through the ranks' PATH) and its
    interpreter resolved to real paths, the script or module a Python runs, further commands,
    the working directory, and every planned listening address and port. Changes nothing."""
    path = os.pathsep.join([*(path_prepend or []), path or os.environ.get("PATH", os.defpath)])
    problems: list[str] = []
    if cwd and not os.path.isdir(cwd):
        problems.append(f"working directory {cwd} does not exist")
        cwd = None
    program = resolve(argv[0], path, cwd)
    interpreter = script = None
    if program is None:
        where = "" if "/" in argv[0] else f" on PATH ({path})"
        problems.append(f"program {argv[0]} not found{where}, or not executable")
    else:
        line = shebang(program)
        if line:
            name = line[1] if os.path.basename(line[0]) == "env" and len(line) > 1 else line[0]
            interpreter = resolve(name, path, cwd)
            if interpreter is None:
                problems.append(f"{program}: its interpreter {name} (#! line) is missing")
        elif PYTHON.match(os.path.basename(argv[0])):
            interpreter = program
            rest = argv[1:]
            if rest and rest[0] == "-m" and len(rest) > 1:
                # Asked of the Python as the ranks start it: a virtual environment's python is a link
                # to the system's, whose real path would not see the environment's packages.
                started_as = locate(argv[0], path, cwd) or program
                probe = subprocess.run(
                    [started_as, "-c", "import importlib.util, sys; s = importlib.util.find_spec(sys.argv[1]); "
                     "print(s.origin if s else '')", rest[1]],
                    capture_output=True, text=True, cwd=cwd, timeout=60, check=False,
                )  # fmt: skip
                origin = probe.stdout.strip()
                if probe.returncode != 0 or not origin:
                    problems.append(f"{program} cannot import module {rest[1]} (python -m)")
                else:
                    script = os.path.realpath(origin)
            elif rest and not rest[0].startswith("-"):
                full = rest[0] if os.path.isabs(rest[0]) else os.path.join(cwd or os.getcwd(), rest[0])
                if os.path.isfile(full):
                    script = os.path.realpath(full)
                else:
                    problems.append(f"script {rest[0]} not found (run by {program})")
    for name in require or []:
        if resolve(name, path, cwd) is None:
            hint = REQUIRED_HINTS.get(name, "install it on every host")
            problems.append(f"{name} not found on PATH ({path}); {hint}")
    for entry in ports or []:
        address, port = str(entry[0]), int(entry[1])
        what = entry[2] if len(entry) > 2 else ""
        problem = check_port(address, port)
        if problem:
            problems.append(f"{problem}{f' (planned for {what})' if what else ''}")
    return {"program": program, "interpreter": interpreter, "script": script, "problems": problems}


# --- link state: which interfaces may be cables (linux_net uses these; one definition) ---------


def matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def protected(all_links: list[dict[str, Any]], mgmt: str | None) -> set[str]:
    """The management interface and every interface it depends on: the device a VLAN or macvlan
    rests on (``link``), recursively, and the ports of a bond or bridge it is (``master``). None of
    them is ever a peer port: a change to one cuts the management connection too."""
    if not mgmt:
        return set()
    lower = {link["ifname"]: link.get("link") for link in all_links}
    members: dict[str, list[str]] = {}
    for link in all_links:
        if link.get("master"):
            members.setdefault(link["master"], []).append(link["ifname"])
    out: set[str] = set()
    todo = [mgmt]
    while todo:
        name = todo.pop()
        if not name or name in out:
            continue
        out.add(name)
        if lower.get(name) in lower:  # a lower device in this namespace (a veth's peer elsewhere is not)
            todo.append(lower[name])
        todo.extend(members.get(name, []))
    return out


def has_carrier(link: dict[str, Any]) -> bool:
    """Up, and with carrier (a cable plugged in and its far end up)."""
    flags = link.get("flags") or []
    return "UP" in flags and "LOWER_UP" in flags


def candidate_ports(all_links: list[dict[str, Any]], patterns: list[str], mgmt: str | None) -> list[dict[str, Any]]:
    """Interfaces that may be peer ports: matching ``patterns``, never a bridge, ``lo``, the
    management interface or anything it depends on (see ``protected``)."""
    keep_off = protected(all_links, mgmt) | {"lo"}
    out = []
    for link in all_links:
        name = link["ifname"]
        kind = link.get("linkinfo", {}).get("info_kind")
        if name in keep_off or kind == "bridge" or not matches(name, patterns):
            continue
        out.append(link)
    return sorted(out, key=lambda link: link["ifname"])


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None


def _ip(commands: list[str]) -> tuple[dict[str, dict], dict[str, str]]:
    """One ``ip -json -batch`` run: the interfaces ("address show") by name, and for each
    "route get ADDRESS" the device the route leaves through."""
    try:
        out = subprocess.run(
            ["ip", "-j", "-d", "-force", "-batch", "-"],  # -d: each link's kind (a bridge is never a cable)
            input="\n".join(commands) + "\n",
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}, {}
    interfaces: dict[str, dict] = {}
    routes: dict[str, str] = {}
    for line in out.splitlines():
        try:
            entries = json.loads(line)
        except ValueError:
            continue
        for entry in entries if isinstance(entries, list) else []:
            if "ifname" in entry:
                interfaces[entry["ifname"]] = entry
            elif "dst" in entry and "dev" in entry:
                routes[entry["dst"]] = entry["dev"]
    return interfaces, routes


def _arp() -> dict[tuple[str, str], str]:
    """(device, address) -> MAC of every complete IPv4 neighbour entry."""
    out = {}
    for line in (_read("/proc/net/arp") or b"").decode().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 6 and int(fields[2], 16) & 0x2 and fields[3] != "00:00:00:00:00:00":
            out[(fields[5], fields[0])] = fields[3].lower()
    return out


def _routes() -> dict[str, list[str]]:
    """Device -> destinations of the IPv4 routes of the main table that leave through it (a
    multipath route counts for each of its devices)."""
    try:
        out = subprocess.run(
            ["ip", "-j", "-4", "route", "show", "table", "main"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout
        entries = json.loads(out) if out.strip() else []
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return {}
    by_dev: dict[str, list[str]] = {}
    for entry in entries if isinstance(entries, list) else []:
        devs = [entry.get("dev")] + [hop.get("dev") for hop in entry.get("nexthops") or []]
        for dev in dict.fromkeys(d for d in devs if d):
            by_dev.setdefault(dev, []).append(str(entry.get("dst")))
    return by_dev


def _net_value(port: str, name: str, ifindex: object) -> int | None:
    """An integer of /sys/class/net/<port>/<name>, only where that sysfs is this network namespace's
    (the port's ifindex there is the one ``ip`` reports); None when unreadable (a down port's
    ``speed`` is EINVAL) or not positive (-1: unknown speed)."""
    base = os.path.join("/sys/class/net", port)
    try:
        if ifindex is not None and int((_read(os.path.join(base, "ifindex")) or b"").strip() or -1) != ifindex:
            return None
        value = int((_read(os.path.join(base, name)) or b"").strip() or 0)
    except ValueError:
        return None
    return value if value > 0 else None


def env_file(text: str) -> dict[str, str]:
    """KEY=value lines of an environment file (hostfiles.torch_env writes them shell-quoted)."""
    out = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _sep, value = line.partition("=")
        try:
            words = shlex.split(value)
        except ValueError:
            continue
        out[key.strip()] = words[0] if words else ""
    return out


ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def _text(path: str) -> str | None:
    data = _read(path)
    return data.decode(errors="replace").strip() if data is not None else None


def _mapped_ipv4(gid: str) -> str | None:
    try:
        mapped = ipaddress.IPv6Address(gid).ipv4_mapped
    except ValueError:
        return None
    return str(mapped) if mapped else None


def rdma_sysfs(root: str = "/sys") -> list[dict]:
    """Every port under <root>/class/infiniband: device, port, state (ACTIVE, DOWN, ...), link
    layer, netdev, and the GID an IPv4 connection uses (RoCE: the RoCE v2 IPv4-mapped one; NCCL's
    NCCL_IB_GID_INDEX). The same reading as module_utils/rdma.py read_sysfs(), which the agent
    cannot import (it is shipped as one file)."""
    base = os.path.join(root, "class", "infiniband")
    try:
        devices = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for dev in devices:
        net_dir = os.path.join(base, dev, "device", "net")
        netdevs = sorted(n for n in os.listdir(net_dir) if not n.startswith(".")) if os.path.isdir(net_dir) else []
        ports_dir = os.path.join(base, dev, "ports")
        numbers = sorted(int(p) for p in os.listdir(ports_dir) if p.isdigit()) if os.path.isdir(ports_dir) else []
        for number in numbers:
            pdir = os.path.join(ports_dir, str(number))
            gids = []  # (index, value, type, ndev)
            gid_dir = os.path.join(pdir, "gids")
            names = sorted((n for n in os.listdir(gid_dir) if n.isdigit()), key=int) if os.path.isdir(gid_dir) else []
            for name in names:
                value = _text(os.path.join(gid_dir, name))
                if not value or value == ZERO_GID:
                    continue  # an unused slot: its type and ndev cannot be read
                kind = _text(os.path.join(pdir, "gid_attrs", "types", name))
                ndev = _text(os.path.join(pdir, "gid_attrs", "ndevs", name))
                gids.append((int(name), value, kind, ndev))
            state = _text(os.path.join(pdir, "state")) or "UNKNOWN"  # "4: ACTIVE"
            state = state.split(":", 1)[1].strip() if ":" in state else state
            link_layer = _text(os.path.join(pdir, "link_layer"))
            if link_layer is None:
                roce = any((k or "").lower().replace(" ", "") == "rocev2" or n for _i, _v, k, n in gids)
                link_layer = "Ethernet" if roce else "Unknown"
            ndevs = [n for _i, _v, _k, n in gids if n]
            if ndevs:
                netdev = ndevs[0]
            elif len(netdevs) == 1:
                netdev = netdevs[0]
            else:
                netdev = netdevs[number - 1] if number - 1 < len(netdevs) else None
            mapped = [(i, _mapped_ipv4(v), k) for i, v, k, _n in gids if _mapped_ipv4(v)]
            if link_layer.lower() == "ethernet":
                mapped = [m for m in mapped if (m[2] or "").lower().replace(" ", "") == "rocev2"]
            out.append(
                {
                    "device": dev,
                    "port": number,
                    "state": state,
                    "link_layer": link_layer,
                    "netdev": netdev,
                    "gid_index": mapped[0][0] if mapped else None,
                    "gid_ipv4": mapped[0][1] if mapped else None,
                }
            )
    return out


def rdma_state(sysfs_root: str, torch_env: bytes | None) -> dict:
    """What sysfs says about RDMA next to what this host's torch.env (written by setup.yml from the
    same sysfs) says: {"ports": rdma_sysfs(), "env": its NCCL_IB_* variables, or None without a
    torch.env}. drift() on the controller compares them."""
    env = None
    if torch_env is not None:
        env = {k: v for k, v in env_file(torch_env.decode(errors="replace")).items() if k.startswith("NCCL_IB_")}
    return {"sysfs_root": sysfs_root, "ports": rdma_sysfs(sysfs_root), "env": env}


def host_facts(spec: dict) -> dict:
    """What `meshkit launch` compares with what setup.yml left, instead of discovering again
    (Linux): the hostfiles' fingerprint, torch.env, the meshccl build, and per planned cable
    the port's state, MAC and addresses, the route to the peer's address, and the MAC that
    answers for that address on that port; plus candidate ports that are up but not planned.

    For `meshkit check` (meshkit/check_drift.py) also, per planned port: its MTU, its negotiated
    speed in Mb/s (sysfs; None where the driver does not say), and the IPv4 routes of the main
    table leaving through it other than its planned network and the planned host route to the
    peer; with ``spec["rdma"]``, ``facts["rdma"]`` (rdma_state(): sysfs under
    ``spec["sysfs_root"]`` next to torch.env's NCCL_IB_* variables)."""
    state_dir = spec.get("state_dir") or "/var/lib/meshkit"
    facts: dict = {"platform": sys.platform}
    manifest = _read(os.path.join(state_dir, "hostfiles", "manifest.json"))
    try:
        facts["fingerprint"] = json.loads(manifest).get("fingerprint") if manifest else None
    except (ValueError, AttributeError):
        facts["fingerprint"] = None
    torch_env = _read(os.path.join(state_dir, "hostfiles", "torch.env"))
    facts["torch_env"] = hashlib.sha256(torch_env).hexdigest() if torch_env is not None else None
    if spec.get("meshccl_venv"):
        venv = spec["meshccl_venv"]
        record = _read(os.path.join(venv, "meshkit-meshccl.json"))
        try:
            build = json.loads(record).get("build") if record else None
        except (ValueError, AttributeError):
            build = None
        # The record, the venv's python and meshccl's package (its native module) all there; the
        # import itself is launch.yml's to try (about 0.2 s a host).
        native = glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "meshccl", "_meshccl*"))
        present = os.path.exists(os.path.join(venv, "bin", "python")) and bool(native)
        facts["meshccl_build"] = build if present else None
    if not sys.platform.startswith("linux"):
        return facts
    if spec.get("rdma"):
        facts["rdma"] = rdma_state(spec.get("sysfs_root") or "/sys", torch_env)
    links = spec.get("links") or []
    interfaces, routes = _ip(["address show", *(f"route get {link['peer_address']}" for link in links)])
    by_port = _routes() if links else {}
    neighbours = _arp()
    wanted = [(link["port"], link["peer_address"]) for link in links]
    missing = [w for w in wanted if w not in neighbours and w[0] in interfaces]
    if missing:
        # Ask: a datagram to the discard port makes the kernel resolve the peer's address on
        # the port its route uses. Entries of a port are flushed when its carrier goes, so an
        # entry that is there is the cable's current peer.
        for _port, address in missing:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
                sock.sendto(b"meshkit", (address, 9))
        deadline = time.monotonic() + float(spec.get("arp_wait", 1.0))
        while time.monotonic() < deadline:
            time.sleep(0.005)
            neighbours = _arp()
            if all(w in neighbours for w in missing):
                break
    ports = {}
    for link in links:
        port = link["port"]
        info = interfaces.get(port)
        if info is None:
            ports[port] = {"exists": False}
            continue
        ports[port] = {
            "exists": True,
            "up": has_carrier(info),
            "mac": (info.get("address") or "").lower(),
            "addresses": [
                f"{a.get('local')}/{a.get('prefixlen')}"
                for a in info.get("addr_info") or []
                if a.get("family") == "inet"
            ],
            "route": routes.get(link["peer_address"]),
            "neighbour": neighbours.get((port, link["peer_address"])),
            # ip's MTU is the kernel's (netlink, this namespace); sysfs where ip gave none.
            "mtu": info["mtu"] if isinstance(info.get("mtu"), int) else _net_value(port, "mtu", info.get("ifindex")),
            "speed_mbps": _net_value(port, "speed", info.get("ifindex")),
            "routes": [
                dst
                for dst in by_port.get(port, [])
                if dst not in (link.get("network"), link["peer_address"], f"{link['peer_address']}/32")
            ],
        }
    facts["ports"] = ports
    planned = {link["port"] for link in links}
    management = spec.get("management_interface") or ""
    if management:
        info = interfaces.get(management)
        facts["management_up"] = bool(info) and "UP" in (info.get("flags") or [])
    # Cables the plan does not have: what discovery would probe (candidate_ports, as linux_net
    # uses it), outside any bridge, with carrier.
    unplanned = [
        info["ifname"]
        for info in candidate_ports(list(interfaces.values()), spec.get("peer_ports") or [], management or None)
        if info["ifname"] not in planned and not info.get("master") and has_carrier(info)
    ]
    facts["unplanned"] = sorted(unplanned)
    return facts


MODULE_UTILS = "ansible_collections.meshkit.cluster.plugins.module_utils"


class SentSources:
    """An import finder for the collection's module_utils whose sources the controller sent with a
    check ({short name: source}): the host has no copy of the collection. The packages on the way
    are empty; ``launch_agent`` is this agent itself (the same source)."""

    def __init__(self, sources: dict, me: Any) -> None:
        self.sources = sources
        self.me = me

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        # importlib.machinery was imported before this finder was put in place (module_util()):
        # an import from here would come back here.
        spec = sys.modules["importlib.machinery"].ModuleSpec
        if name == MODULE_UTILS or MODULE_UTILS.startswith(name + "."):
            return spec(name, self, is_package=True)
        short = name[len(MODULE_UTILS) + 1 :] if name.startswith(MODULE_UTILS + ".") else None
        if short in self.sources or short == "launch_agent":
            return spec(name, self)
        return None

    def create_module(self, spec: Any) -> Any:
        if spec.name == MODULE_UTILS + ".launch_agent":
            return self.me
        return None

    def exec_module(self, module: Any) -> None:
        name = module.__name__
        if module is self.me:
            return
        if name == MODULE_UTILS or MODULE_UTILS.startswith(name + "."):
            module.__path__ = []
            return
        short = name[len(MODULE_UTILS) + 1 :]
        exec(compile(self.sources[short], f"<meshkit {short}.py>", "exec"), module.__dict__)


def module_util(name: str, sources: dict | None) -> Any:
    """The collection's module_utils ``name``: from the sources the controller sent (this host has
    no collection), else imported as usual (the agent imported as a module, in tests)."""
    import importlib
    import importlib.machinery  # SentSources uses it

    if sources and not any(isinstance(f, SentSources) for f in sys.meta_path):
        sys.meta_path.insert(0, SentSources(sources, sys.modules[__name__]))
    return importlib.import_module(f"{MODULE_UTILS}.{name}")


def run_command(argv: list[str]) -> tuple[int, str, str]:
    """run(argv) -> (rc, out, err) in the C locale, as the host modules run commands; a command that
    cannot start gives rc 127 and why."""
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            env=dict(os.environ, LC_ALL="C", LANG="C"),
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, "", str(exc)
    return done.returncode, done.stdout, done.stderr


def cable_checks(links: list[dict], interpreter: str | None, sources: dict | None) -> dict:
    """The launch preflight's checks of this host's cables (macos.launch_checks, as the
    launch_preflight module runs them): no cable port in a bridge, every peer reachable from the
    ranks' interpreter."""
    import platform

    macos = module_util("macos", sources)
    return macos.launch_checks(links, run_command, platform.system(), interpreter=interpreter)


def check_host(spec: dict) -> dict:
    """The whole check of one host: {"preflight": ..., "facts": ...}. With ``spec["cables"]`` (the
    plan's cables of this host) the preflight also checks them as launch.yml's preflight does
    (cable_checks()); with ``spec["facts"]`` false, no facts are read."""
    job = spec.get("preflight") or {}
    result: dict = {"t": "checked"}
    found = preflight(
        job.get("argv") or ["true"],
        path=job.get("path"),
        path_prepend=job.get("path_prepend"),
        cwd=job.get("cwd"),
        require=job.get("require"),
        ports=job.get("ports"),
    )
    if spec.get("cables"):
        checks = cable_checks(spec["cables"], found["interpreter"], spec.get("modules"))
        found = {
            **found,
            **{k: v for k, v in checks.items() if k != "problems"},
            "problems": list(found["problems"]) + list(checks["problems"]),
        }
    result["preflight"] = found
    if spec.get("facts", True):
        result["facts"] = host_facts(spec)
    return result


# --- the job directory ---------------------------------------------------------------------------


class JobDirError(Exception):
    """The job's directory cannot be made safely; says why and what to do."""


def _user() -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()})"
    except (ImportError, KeyError):
        return f"uid {os.geteuid()}"


def _unsafe_parent(st: os.stat_result) -> str | None:
    """Why a directory is no place to make a job's directory in (None: it is): another user could
    rename, remove or replace what is made there. Safe: owned by root or this user, and sticky (like
    /tmp: no one removes or renames another's entry) or writable by nobody else."""
    if st.st_uid not in (0, os.geteuid()):
        return f"it belongs to uid {st.st_uid}, neither root nor {_user()}"
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_ISVTX:
        return None
    if mode & stat.S_IWOTH:
        return "every user may write to it and it is not sticky"
    if mode & stat.S_IWGRP and st.st_gid not in (0, os.getegid()):
        return f"group {st.st_gid} may write to it and it is not sticky"
    return None


def job_directory(path: str) -> int:
    """Make this job's directory and return an open descriptor of it: mode 0700, this user's own.
    Its parent, ``<state_dir>/jobs``, is shared by every user who launches (setup.yml makes it
    root's, sticky and world-writable, like /tmp); a parent another user could change under the
    job (not root's or this user's, or writable by others without the sticky bit) is refused. The
    directory is made exclusively and opened with O_NOFOLLOW relative to the parent's descriptor;
    one already there (the same job id again) is used only when it is a real directory of this
    user's that no one else can enter. Everything the agent writes there is made relative to the
    returned descriptor (dir_fd), so no later path lookup can be redirected."""
    path = path.rstrip("/") or "/"
    parent, name = os.path.split(path)
    if not os.path.isdir(parent):
        try:
            os.makedirs(os.path.dirname(parent) or "/", exist_ok=True)
            os.mkdir(parent)
        except FileExistsError:
            pass
        except OSError as exc:
            raise JobDirError(
                f"cannot create {parent} as {_user()}: {exc.strerror}; setup.yml creates it (mode 1777, like "
                f"/tmp); run setup.yml, or as root: install -d -m 1777 {parent}"
            ) from None
        else:
            if os.geteuid() == 0:
                # The layout setup.yml makes, whoever is first: every login user can launch.
                os.chmod(parent, 0o1777)
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise JobDirError(f"cannot open {parent} as {_user()}: {exc.strerror}; run setup.yml") from None
    try:
        st = os.fstat(parent_fd)
        why = _unsafe_parent(st)
        if why:
            raise JobDirError(
                f"{parent} is not a safe place for job directories: {why} (owner uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}), so another user could replace a job's directory; nothing was "
                f"started: run setup.yml, or as root: chown root {parent} && chmod 1777 {parent}"
            )
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass  # checked below, through the descriptor
        except PermissionError:
            raise JobDirError(
                f"cannot create {path}: {parent} is not writable by {_user()}; setup.yml makes it sticky and "
                f"world-writable (mode 1777, like /tmp) so that every login user can launch: run setup.yml, or "
                f"as root: chmod 1777 {parent}"
            ) from None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        except OSError:
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except OSError as exc:
                raise JobDirError(f"cannot open {path} as {_user()}: {exc.strerror}") from None
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise JobDirError(
                f"{path} exists and is not a private directory of {_user()} ({kind}, owner uid {st.st_uid}, "
                f"mode {stat.S_IMODE(st.st_mode):04o}); nothing was started: remove it, or launch with another job id"
            ) from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.close(fd)
            raise JobDirError(
                f"{path} exists and is not a private directory of {_user()} (a directory, owner uid {st.st_uid}, "
                f"mode {stat.S_IMODE(st.st_mode):04o}); nothing was started: remove it, or launch with another job id"
            )
        os.fchmod(fd, 0o700)
        return fd
    finally:
        os.close(parent_fd)


def _plain(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"a file of the job must have a plain name, not {name!r}")
    return name


def job_file(dir_fd: int, name: str, mode: str = "w") -> IO[Any]:
    """Open ``name`` in the job's directory for writing ("w", "wb": from empty; "a", "ab": appended),
    relative to its descriptor and never through a symbolic link."""
    _plain(name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_APPEND if "a" in mode else os.O_TRUNC
    fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    return os.fdopen(fd, mode)


def write_job_file(dir_fd: int, name: str, text: str) -> None:
    """A file of the job, written whole under a temporary name and renamed into place (several
    agents may share a directory on one machine), all relative to the directory's descriptor."""
    tmp = f".{_plain(name)}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


# --- the watchdog: nothing of the job outlives a killed agent --------------------------------------


def _proc_table() -> dict[int, tuple[int, bytes, int]]:
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
    table = _proc_table() if table is None else table
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
PARENT_POLL = 0.5  # seconds between the portable watchdog's looks at its own parent (the connection)


def _platform_mode() -> str:
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
    if _platform_mode() == "portable":
        return PortableJob(root, mark).sweep(set(groups), within=within) or []
    killed: set[int] = set()
    deadline = time.monotonic() + within
    groups = set(groups)
    while True:
        table = _proc_table()
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
        _reap()
        if not live and not pids:
            return sorted(killed)
        if time.monotonic() > deadline:
            return sorted(killed)
        time.sleep(0.02)


def _say(fd: int, text: str) -> None:
    """Write a short line to ``fd`` only if it takes it now (a stalled connection must not hold
    the watchdog)."""
    data = text.encode(errors="replace")[:4000]  # below PIPE_BUF: a writable pipe takes it whole
    with contextlib.suppress(OSError, ValueError):
        if select.select([], [fd], [], 0)[1]:
            os.write(fd, data)


def _log(fd: int | None, text: str) -> None:
    """A line in the job's agent.log, through its descriptor (opened once, O_APPEND)."""
    if fd is not None:
        with contextlib.suppress(OSError):
            os.write(fd, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {text}\n".encode(errors="replace"))


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
        portable = _platform_mode() == "portable"
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
                    _log(log_fd, f"the connection's process (pid {parent}) is gone: stopping the job")
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
            _log(log_fd, "ps cannot be run: the job's processes cannot be found (the portable mode needs ps)")
        killed = swept or []
    text = f"meshkit agent (pid {agent}) {how}; its watchdog killed {len(killed)} processes of the job: {killed}\n"
    _log(log_fd, text.rstrip("\n"))
    if killed or os.WIFSIGNALED(status):
        _say(2, text)
    return code


def _forward(agent: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(agent, sig)


# --- the agent ----------------------------------------------------------------------------------

# While this much output waits for the controller, the ranks' output is not read (their pipes
# then fill and they wait): the agent's memory stays bounded and it never blocks.
HIGH_WATER = 1 << 20
# Broadcast input a rank has not read yet, at most (about): beyond it the agent asks the controller
# to pause the ranks' input ("stdin_pause") until every rank is below it again ("stdin_resume").
# What was already on its way still arrives, so a rank's backlog stays within this plus what the
# controller had sent (its own high-water mark, 1 MiB) plus the connection's buffers.
STDIN_CAP = 1 << 20
DRAIN_AT_EXIT = 5.0  # seconds the agent waits for its last messages to be taken before it exits
JOB_WAIT = 120.0  # seconds the agent waits for its job after its source


class Rank:
    def __init__(self, spec: dict, dir_fd: int) -> None:
        self.rank: int = spec["rank"]
        self.proc: subprocess.Popen | None = None
        self.log = job_file(dir_fd, f"rank-{self.rank}.log", "ab")
        self.eof = False
        self.reading = False  # its output registered with the selector
        self.reported = False
        self.stopped = False
        self.group_gone = False  # its process group is empty (the watchdog was told)
        self.exited_at: float | None = None
        self.stdin_pending = bytearray()  # broadcast input this rank has not read yet (see STDIN_CAP)
        self.stdin_eof = False  # close its stdin once the pending input is written


class Agent:
    def __init__(self, out_fd: int = 1, in_fd: int = 0) -> None:
        self.out_fd = out_fd
        self.in_fd = in_fd
        self.inbuf = bytearray()
        self.outbuf = bytearray()  # messages the controller has not taken yet
        self.out_blocking = True  # until the job runs: the check answers with one blocking write
        self.writing = False
        self.silenced = False  # the controller is unreachable: messages are dropped, not kept
        self.ranks: list[Rank] = []
        self.sel = selectors.DefaultSelector()
        self.stopping_since: float | None = None
        self.killed = False
        self.host_timeout: float | None = None
        self.heartbeat = 5.0
        self.heard_at = self.beat_at = time.monotonic()
        self.watch_fd: int | None = None  # the pipe to the watchdog
        self.mark = ""
        self.dir_fd: int | None = None  # the job's directory: every file of the job is made relative to it
        self.log_fd: int | None = None  # its agent.log (O_APPEND), shared with the watchdog
        self.job: dict | None = None
        self.stdin_paused = False  # the controller was asked to pause the ranks' input
        self.ps_failed = False
        self.portable = False  # ps only: no prctl, no /proc (see _platform_mode()); set once the job is read
        self.job_procs: PortableJob | None = None  # the portable mode's view of the job's processes
        self.tracked_at = 0.0  # when the portable mode last looked at the job's processes
        self.tracking = False
        self.stop_requested = False  # the portable mode: a signal asked to stop (the main loop stops)

    # --- talking to the controller ------------------------------------------------------------

    def send(self, **msg: object) -> None:
        if self.silenced:
            return
        self.outbuf += (json.dumps(msg) + "\n").encode()
        self.flush()

    def flush(self) -> None:
        """Write what the controller's pipe takes now, never waiting (once the job runs)."""
        while self.outbuf:
            try:
                n = os.write(self.out_fd, self.outbuf)
            except BlockingIOError:
                break
            except OSError:
                # The controller is gone: nobody to tell; stopping follows from the closed stdin.
                self.outbuf.clear()
                self.silenced = True
                break
            del self.outbuf[:n]
        if self.out_blocking:
            return
        want = bool(self.outbuf)
        if want != self.writing:
            if want:
                self.sel.register(self.out_fd, selectors.EVENT_WRITE, "out")
            else:
                self.sel.unregister(self.out_fd)
            self.writing = want

    def drain(self, within: float) -> None:
        """At the end: give the last messages ``within`` seconds to be taken."""
        deadline = time.monotonic() + within
        while self.outbuf and not self.silenced and time.monotonic() < deadline:
            self.sel.select(0.05)
            self.flush()

    def read_line(self, within: float = JOB_WAIT) -> dict | None:
        """One whole line of input (used before the job starts); None at end of input or after
        ``within`` seconds without it."""
        deadline = time.monotonic() + within
        while b"\n" not in self.inbuf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.in_fd], [], [], left)[0]:
                return None
            chunk = os.read(self.in_fd, 65536)
            if not chunk:
                return None
            self.inbuf += chunk
        end = self.inbuf.index(b"\n")
        line = bytes(self.inbuf[:end])
        del self.inbuf[: end + 1]
        return json.loads(line)

    def note(self, text: str) -> None:
        """A line in the host's own agent.log (the controller may not be there to hear it)."""
        _log(self.log_fd, text)

    def tell_watchdog(self, text: str) -> None:
        if self.watch_fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(self.watch_fd, text.encode())  # a few bytes into a pipe it always reads

    # --- the job --------------------------------------------------------------------------------

    def open_job_directory(self, job: dict) -> int:
        """The job's directory (see job_directory()) and its agent.log, both held open: nothing
        the agent or its watchdog writes there later goes by path. Returns the directory's fd."""
        dir_fd = job_directory(job["dir"])
        try:
            self.log_fd = os.open(
                "agent.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                dir_fd=dir_fd,
            )  # fmt: skip
        except OSError:
            os.close(dir_fd)
            raise
        self.dir_fd = dir_fd
        return dir_fd

    def start(self, job: dict) -> None:
        dir_fd = self.dir_fd if self.dir_fd is not None else self.open_job_directory(job)
        for name, text in job.get("files", {}).items():
            write_job_file(dir_fd, name, text)
        self.grace = float(job.get("grace", 3.0))
        interactive = bool(job.get("stdin"))
        how = "ps only (no /proc, no subreaper, no PR_SET_PDEATHSIG)" if self.portable else "/proc, subreapers"
        self.note(
            f"job {job.get('job')}: starting {len(job['ranks'])} ranks as {_user()}; processes found through {how}"
        )
        for spec in job["ranks"]:
            rank = Rank(spec, dir_fd)
            self.ranks.append(rank)
            env = dict(os.environ)
            env.update(spec.get("env", {}))
            env["MESHKIT_JOB_MARK"] = self.mark
            if spec.get("path_prepend"):
                env["PATH"] = os.pathsep.join([*spec["path_prepend"], env.get("PATH", os.defpath)])
            try:
                rank.proc = subprocess.Popen(
                    spec["argv"],
                    env=env,
                    cwd=spec.get("cwd") or None,
                    stdin=subprocess.PIPE if interactive else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=None if self.portable else _die_with_agent,  # noqa: PLW1509
                )
            except (OSError, ValueError, TypeError) as exc:
                # OSError: no such program or working directory (filename says which); ValueError /
                # TypeError: an argument or variable Popen refuses (a NUL byte, not a string).
                rank.proc = None
                rank.eof = True
                rank.reported = True
                if isinstance(exc, OSError):
                    why = f"{exc.filename or spec['argv'][0]}: {exc.strerror}"
                else:
                    why = f"cannot start {spec['argv'][0]}: {exc}"
                self.send(t="exit", r=rank.rank, code=127, sig=None, err=why)
                continue
            self.tell_watchdog(f"+{rank.proc.pid}\n")
            if rank.proc.stdin:
                os.set_blocking(rank.proc.stdin.fileno(), False)
            os.set_blocking(rank.proc.stdout.fileno(), False)
            self.read_from(rank, True)
            self.send(t="started", r=rank.rank, pid=rank.proc.pid)
        self.track()  # the ranks (and what they started already) known by their start times at once

    def read_from(self, rank: Rank, on: bool) -> None:
        """Read a rank's output (or not, while the controller does not take it)."""
        on = on and not rank.eof
        if on != rank.reading:
            if on:
                self.sel.register(rank.proc.stdout, selectors.EVENT_READ, rank)
            else:
                self.sel.unregister(rank.proc.stdout)
            rank.reading = on

    def pace(self) -> None:
        full = len(self.outbuf) > HIGH_WATER
        for rank in self.ranks:
            if rank.proc is not None:
                self.read_from(rank, not full)

    def on_input(self) -> None:
        try:
            chunk = os.read(self.in_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.sel.unregister(self.in_fd)
            self.note("end of input from the controller: stopping every rank")
            self.stop()
            return
        self.heard_at = time.monotonic()
        self.inbuf += chunk
        self.handle_lines()

    def handle_lines(self) -> None:
        start = 0
        while True:
            end = self.inbuf.find(b"\n", start)
            if end < 0:
                break
            line, start = bytes(self.inbuf[start:end]), end + 1
            msg = json.loads(line)
            kind = msg.get("t")
            if kind == "stop":
                self.note(f"stop from the controller: {msg.get('why')}")
                self.stop()
            elif kind == "stdin":
                self.to_ranks(msg["d"].encode("utf-8", "surrogateescape"))
            elif kind == "stdin_eof":
                for rank in self.ranks:
                    rank.stdin_eof = True
                    self.feed(rank)
            # "hb": the controller's heartbeat; hearing it is all it is for.
        del self.inbuf[:start]

    def to_ranks(self, data: bytes) -> None:
        for rank in self.ranks:
            if rank.proc and rank.proc.stdin and not rank.proc.stdin.closed:
                rank.stdin_pending += data
                self.feed(rank)
        self.pace_stdin()

    def pace_stdin(self) -> None:
        """Ask the controller to pause the ranks' input while a rank has more than STDIN_CAP of it
        unread, and to go on once every rank is below it: the agent itself keeps reading its
        connection (stop and heartbeats must get through), so its memory stays bounded only if
        the controller stops sending."""
        over = any(len(rank.stdin_pending) > STDIN_CAP for rank in self.ranks)
        if over != self.stdin_paused:
            self.stdin_paused = over
            self.send(t="stdin_pause" if over else "stdin_resume")

    def feed(self, rank: Rank) -> None:
        """Write what a rank's stdin can take now, never blocking: a rank that does not read
        its input must not stop the agent from forwarding output or stopping the job."""
        stdin = rank.proc.stdin if rank.proc else None
        if stdin is None or stdin.closed:
            rank.stdin_pending.clear()
            return
        while rank.stdin_pending:
            try:
                n = os.write(stdin.fileno(), rank.stdin_pending)
            except BlockingIOError:
                return
            except OSError:
                rank.stdin_pending.clear()  # it closed its stdin or is gone; its exit is reported as usual
                break
            del rank.stdin_pending[:n]
        if rank.stdin_eof:
            with contextlib.suppress(OSError):
                stdin.close()

    def on_output(self, rank: Rank) -> None:
        try:
            chunk = os.read(rank.proc.stdout.fileno(), 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.read_from(rank, False)
            rank.eof = True
            rank.proc.stdout.close()
            return
        rank.log.write(chunk)
        rank.log.flush()
        self.send(t="out", r=rank.rank, d=chunk.decode("utf-8", "surrogateescape"))

    def stop(self) -> None:
        self.stop_requested = False
        if self.stopping_since is not None:
            return
        # The portable mode: everything of the job there now is known before the ranks' groups are
        # signalled (a rank's child in a session of its own is an orphan once the rank is gone).
        self.track()
        self.stopping_since = time.monotonic()
        for rank in self.ranks:
            if rank.proc and rank.proc.returncode is None and rank.proc.poll() is None:
                rank.stopped = True
                self._signal_group(rank, signal.SIGTERM)

    def _signal_group(self, rank: Rank, sig: int) -> None:
        try:
            os.killpg(rank.proc.pid, sig)
        except OSError:
            with contextlib.suppress(OSError):
                rank.proc.send_signal(sig)

    def check_controller(self) -> None:
        """Heartbeats: say we are here; stop the ranks when the controller has not been heard
        from for host_timeout seconds (a partition drops traffic without closing anything)."""
        now = time.monotonic()
        if now - self.beat_at >= self.heartbeat:
            self.beat_at = now
            if len(self.outbuf) <= HIGH_WATER:
                self.send(t="hb")
        if self.host_timeout and not self.silenced and now - self.heard_at > self.host_timeout:
            self.silenced = True
            self.outbuf.clear()
            self.flush()
            self.pace()
            self.note(f"no word from the controller for {self.host_timeout:g} s: stopping every rank of this host")
            self.stop()

    def reap(self) -> None:
        for rank in self.ranks:
            if rank.proc is None:
                continue
            if rank.reported:
                self.group_check(rank)
                continue
            code = rank.proc.poll()
            if code is None:
                continue
            if rank.exited_at is None:
                # Reaped just now: its group number is free from here on. Look at the group at
                # once, before anything else can take that number. Its pid too: forgotten at once
                # (a pid taken again within the same second would otherwise look the same).
                self.group_check(rank)
                self.forget(rank.proc.pid)
            # A rank that exited may leave output in its pipe (or a child holding it open):
            # report the exit once the pipe is drained, or after 0.5 s of reading it (time while
            # the controller holds its output up does not count).
            if rank.exited_at is None or (not rank.reading and not rank.eof):
                rank.exited_at = time.monotonic()
            if not rank.eof and (not rank.reading or time.monotonic() - rank.exited_at < 0.5):
                continue
            if not rank.eof:
                self.read_from(rank, False)
                rank.proc.stdout.close()
                rank.eof = True
            rank.reported = True
            rank.log.close()
            self.send(
                t="exit",
                r=rank.rank,
                code=code if code >= 0 else None,
                sig=-code if code < 0 else None,
                err=None,
                stopped=rank.stopped,
            )

    def group_check(self, rank: Rank) -> bool:
        """Whether a reported rank's process group is known to be empty; the first time it is seen
        empty the watchdog is told ("-PID"): its number may be used again, so it must not be
        signalled any more."""
        if rank.proc is None or rank.group_gone:
            return True
        if _group_alive(rank.proc.pid):
            return False
        rank.group_gone = True
        self.tell_watchdog(f"-{rank.proc.pid}\n")
        self.note(f"rank {rank.rank} (pid {rank.proc.pid}): its process group is empty")
        return True

    def confirm_groups(self, within: float = 2.0) -> bool:
        """At the end, once sweep() has run: every rank's process group seen empty and the watchdog
        told so. Nothing is signalled by group number here (the number of an empty group may be
        another's): what the ranks left is the agent's own children, swept again while waiting.
        False if a group is still not empty after ``within`` seconds (the watchdog then sweeps)."""
        deadline = time.monotonic() + within
        while True:
            alive = [rank for rank in self.ranks if not self.group_check(rank)]
            if not alive:
                return True
            if time.monotonic() > deadline:
                self.note(f"process groups still not empty at the end: {[r.proc.pid for r in alive if r.proc]}")
                return False
            self.sweep()
            time.sleep(0.01)

    def escalate(self) -> None:
        if self.stopping_since is None or self.killed:
            return
        if time.monotonic() - self.stopping_since >= self.grace:
            self.killed = True
            for rank in self.ranks:
                if rank.proc and rank.proc.poll() is None:
                    self._signal_group(rank, signal.SIGKILL)

    def live_groups(self) -> set[int]:
        """The ranks' process groups not yet seen empty (each looked at now)."""
        return {rank.proc.pid for rank in self.ranks if rank.proc is not None and not self.group_check(rank)}

    def track(self) -> None:
        """The portable mode: look at the job's processes, remember each by pid and start time and
        tell the watchdog ("~PID START", "!PID" for each gone), so that an orphan of the job
        re-parented to init/launchd is still known as the job's (PortableJob)."""
        if self.job_procs is None or self.tracking:
            return
        self.tracking = True
        try:
            self.tracked_at = time.monotonic()
            seen = self.job_procs.track(self.live_groups(), trust_groups=True)
            if seen is None:
                if not self.ps_failed:
                    self.ps_failed = True
                    self.note("ps cannot be run: only the ranks' process groups can be stopped")
                return
            new, gone = seen
            for pid, start in new.items():
                self.tell_watchdog(f"~{pid} {start}\n")
            for pid in gone:
                self.tell_watchdog(f"!{pid}\n")
        finally:
            self.tracking = False

    def forget(self, pid: int) -> None:
        """The portable mode: ``pid`` is known to be gone (a rank reaped): never the job's again."""
        if self.job_procs is not None and self.job_procs.known.pop(pid, None) is not None:
            self.tell_watchdog(f"!{pid}\n")

    def sweep(self) -> list[int]:
        """Kill whatever the ranks left running (re-parented to this subreaper; in the portable mode
        what PortableJob finds); their pids."""
        if self.job_procs is not None:
            _reap()
            return self.job_procs.sweep(self.live_groups(), trust_groups=True, within=2.0) or []
        left: set[int] = set()
        for _attempt in range(50):
            _reap()
            pids = _children(os.getpid())
            if not pids:
                break
            left.update(pids)
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        return sorted(left)

    def fork_watchdog(self) -> None:
        """From here on this process is the watchdog (it never returns from here) and its child
        the agent: the agent may be killed, the watchdog then kills what is left of the job."""
        self.mark = f"{os.getpid()}-{secrets.token_hex(8)}"
        try:
            read_fd, write_fd = os.pipe()
            pid = os.fork()
        except OSError as exc:
            self.note(f"no watchdog ({exc}): a killed agent may leave ranks' children behind")
            return
        if pid == 0:
            os.close(read_fd)
            self.watch_fd = write_fd
            os.set_blocking(write_fd, False)
            return
        os.close(write_fd)
        self.sel.close()
        # The controller's connection belongs to the agent: its end of input and end of output
        # follow the agent's, not this process's.
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, self.in_fd)
        os.dup2(devnull, self.out_fd)
        os.close(devnull)
        if not self.portable:
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
        code = watchdog(pid, read_fd, self.mark, self.log_fd, portable=self.portable)
        os._exit(code)

    def run(self) -> int:
        job = self.read_line()
        if job is None:
            return 1
        if "check" in job:
            try:
                self.send(**check_host(job["check"]))
            except Exception as exc:
                self.send(t="error", msg=f"cannot check the host: {exc!r}")
            return 0
        if "preflight" in job:
            # The launch's preflight, on the connection the job then comes over: the answer, then the
            # job, or the end of input when any host's preflight refused it (nothing starts).
            try:
                self.send(t="preflight", result=check_host(job["preflight"])["preflight"])
            except Exception as exc:
                self.send(t="error", msg=f"cannot check the host: {exc!r}")
                return 1
            job = self.read_line()
            if job is None:
                return 0
        self.job = job
        self.portable = _platform_mode() == "portable" or job.get("portable") is True
        # Before the watchdog exists, so that it writes to the same agent.log descriptor; on a
        # failure start() tries again and reports it.
        with contextlib.suppress(OSError, KeyError, TypeError, ValueError, JobDirError):
            self.open_job_directory(job)
        self.fork_watchdog()
        if self.portable:
            # Its parent is the watchdog (or, without one, the connection's process): never the job's.
            self.job_procs = PortableJob(os.getpid(), self.mark, {os.getppid()})
        else:
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.host_timeout = float(job["host_timeout"]) if job.get("host_timeout") else None
        self.heartbeat = float(job.get("heartbeat") or 5.0)
        self.heard_at = self.beat_at = time.monotonic()
        os.set_blocking(self.out_fd, False)
        self.out_blocking = False
        try:
            self.start(job)
        except (OSError, KeyError, TypeError, ValueError, JobDirError) as exc:
            self.send(t="error", msg=f"cannot start the job: {exc}")
            self.stop()
        os.set_blocking(self.in_fd, False)
        self.sel.register(self.in_fd, selectors.EVENT_READ, None)
        self.flush()
        self.handle_lines()  # lines that came in with the job line
        while not all(r.reported for r in self.ranks):
            if self.stop_requested:
                self.stop()
            for key, _events in self.sel.select(TAIL_POLL):
                if key.data is None:
                    self.on_input()
                elif key.data == "out":
                    self.flush()
                else:
                    self.on_output(key.data)
            for rank in self.ranks:
                if rank.stdin_pending:
                    self.feed(rank)
            self.pace_stdin()
            self.check_controller()
            self.pace()
            self.reap()
            self.escalate()
            if self.job_procs is not None and time.monotonic() - self.tracked_at >= TRACK_EVERY:
                self.track()
        left = self.sweep()
        in_order = self.confirm_groups()
        self.send(t="bye", left=left)
        self.drain(DRAIN_AT_EXIT)
        if in_order:
            # Every rank reported, what they left killed, every group seen empty: nothing for the
            # watchdog to do (it signals nothing after this and an exit 0).
            self.tell_watchdog("=\n")
        return 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # there, but not ours to signal
    return True


def main() -> int:
    # A rank that closed its stdin must not kill the agent when input is broadcast (EPIPE is
    # handled where it happens); the ranks themselves get the default back from Popen.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # SIGTERM/SIGHUP to the agent (sshd closing the session) stop the job like end of input.
    agent = Agent()

    def _stop(_sig: int, _frame: object) -> None:
        if agent.portable:
            # Stopped from the main loop: it looks at the job first (ps), which a handler must not do
            # while the main loop may be in the middle of a look.
            agent.stop_requested = True
        else:
            agent.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    return agent.run()


if __name__ == "__main__":  # the launcher runs this file's source as the host's launch supervisor
    raise SystemExit(main())
