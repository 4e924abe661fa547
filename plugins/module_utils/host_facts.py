# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a host says about what setup.yml left there, read in one go without changing anything.

`meshkit launch` (meshkit/launch_fast.py) and `meshkit check` (meshkit/check_drift.py) compare it with
the plan instead of discovering again: the hostfiles' fingerprint, torch.env, the meshccl build, and
(Linux) per planned cable its port's state, addresses, MTU, speed, routes and the MAC that answers
for the peer, RDMA as sysfs shows it, and cable candidates (port_rules) that are up but not planned.
The launch agent reads it in its check (agent_preflight.check_host); the check_facts module through
Ansible. Standard library only: the agent sends it to hosts that have no copy of the collection.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import ipaddress
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time

from ansible_collections.meshkit.cluster.plugins.module_utils.port_rules import candidate_ports, has_carrier


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
    does not ship (rdma.py is not one of its parts: see agent_sources.AGENT_PARTS)."""
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


def slurm_jobs(proc_root: str = "/proc") -> list[str]:
    """The Slurm jobs with a step on this host now (Linux): slurmd starts one ``slurmstepd`` per step, whose
    command line it sets to ``slurmstepd: [<job>.<step>]`` (``[123.batch]``, ``[123.0]``, ``[123.extern]``).
    Sorted job ids; [] without /proc."""
    jobs = set()
    try:
        pids = [name for name in os.listdir(proc_root) if name.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            with open(os.path.join(proc_root, pid, "cmdline"), "rb") as handle:
                line = handle.read(200).replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        found = re.match(r"slurmstepd: \[(\d+)[._]", line)
        if found:
            jobs.add(found.group(1))
    return sorted(jobs, key=int)


def host_facts(spec: dict) -> dict:
    """What `meshkit launch` compares with what setup.yml left, instead of discovering again
    (Linux): the hostfiles' fingerprint, torch.env, the meshccl build, and per planned cable
    the port's state, MAC and addresses, the route to the peer's address, and the MAC that
    answers for that address on that port; plus candidate ports that are up but not planned.

    For `meshkit check` (meshkit/check_drift.py) also, per planned port: its MTU, its negotiated
    speed in Mb/s (sysfs; None where the driver does not say), and the IPv4 routes of the main
    table leaving through it other than its planned network and the planned host route to the
    peer; with ``spec["slurm_jobs"]``, ``facts["slurm_jobs"]`` (slurm_jobs()); with ``spec["rdma"]``,
    ``facts["rdma"]`` (rdma_state(): sysfs under
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
    if spec.get("slurm_jobs"):
        facts["slurm_jobs"] = slurm_jobs(spec.get("proc_root") or "/proc")
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
