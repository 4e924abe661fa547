# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""RDMA facts: what a host's RDMA devices are, whether each cabled port can carry RDMA, and the
NCCL environment that follows.

Linux reads sysfs (``<root>/class/infiniband/<dev>/ports/<p>/...``); macOS reads ``rdma_ctl
status``, ``ibv_devices`` and ``ibv_devinfo -v``. The sysfs root and the command paths are
parameters, so recorded trees and outputs (tests/fixtures/rdma, tests/fixtures/macos) test the
same code that runs on a host. Plain Python, no AnsibleModule.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils.naming import natural_key

RUNBOOK_MACOS = "docs/runbooks/rdma-macos.md"
RUNBOOK_TB = "docs/runbooks/tb4-vs-tb5.md"
RUNBOOK_ROCE = "docs/runbooks/roce-nccl.md"
RUNBOOK_GID = "docs/runbooks/rdma-link-local-gid.md"
RUNBOOK_BRIDGE = "docs/runbooks/thunderbolt-bridge.md"
# What JACCL (MLX) prints when a queue pair is given no usable GID: ml-explore/mlx#3467, #4191.
JACCL_ERRNO_22 = "[jaccl] Changing queue pair to RTR failed with errno 22"
# Never NCCL's socket interface: loopback and container bridges.
NOT_FABRIC = re.compile(r"^(lo|docker\d*|virbr\d*|veth[0-9a-f]+|br-[0-9a-f]+|cni\d*|flannel.*)$")
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


@dataclass
class Gid:
    index: int
    gid: str
    type: str | None = None  # "RoCE v2", "IB/RoCE v1"; None where the kernel gives no type (InfiniBand)
    ndev: str | None = None

    @property
    def ipv4(self) -> str | None:
        """a.b.c.d when the GID is an IPv4-mapped address (::ffff:a.b.c.d)."""
        try:
            mapped = ipaddress.IPv6Address(self.gid).ipv4_mapped
        except ValueError:
            return None
        return str(mapped) if mapped else None

    @property
    def link_local(self) -> bool:
        try:
            return ipaddress.IPv6Address(self.gid).is_link_local
        except ValueError:
            return False


@dataclass
class RdmaPort:
    device: str
    port: int
    state: str  # ACTIVE, DOWN, INIT, ARMED, ... (the name without the number)
    link_layer: str  # Ethernet, InfiniBand, Thunderbolt
    netdev: str | None = None
    phys_state: str | None = None
    rate: str | None = None
    gids: list[Gid] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def roce(self) -> bool:
        return self.link_layer.lower() == "ethernet"

    def ipv4_gid(self) -> Gid | None:
        """The GID an IPv4 RDMA connection uses: RoCE v2 with an IPv4-mapped value on RoCE; any
        IPv4-mapped GID elsewhere (Thunderbolt RDMA publishes one once its interface has IPv4)."""
        mapped = [g for g in self.gids if g.ipv4]
        if self.roce:
            v2 = [g for g in mapped if (g.type or "").lower().replace(" ", "") == "rocev2"]
            return v2[0] if v2 else None
        return mapped[0] if mapped else None

    def problem(self) -> str | None:
        """Why this port cannot carry RDMA now; None when it can."""
        if not self.active:
            return f"{self.device} port {self.port} is {self.state}" + (
                f" ({self.phys_state})" if self.phys_state else ""
            )
        if self.link_layer.lower() == "infiniband":
            return None
        if self.ipv4_gid() is None:
            kind = "RoCE v2 " if self.roce else ""
            why = f"{self.device} port {self.port} has no {kind}IPv4 GID yet (its interface needs an IPv4 address)"
            if self.thunderbolt and self.link_local_only():
                shown = ", ".join(f"GID[{g.index}] {ipaddress.IPv6Address(g.gid).compressed}" for g in self.gids)
                why += (
                    f": only link-local GIDs ({shown}). JACCL needs an IPv4-mapped GID (::ffff:a.b.c.d) on every "
                    f"port it uses and fails without one with '{JACCL_ERRNO_22}'; it appears once "
                    f"{self.netdev or 'the port'} has an IPv4 address of its own"
                )
            return why
        return None

    @property
    def thunderbolt(self) -> bool:
        return self.link_layer.lower() == "thunderbolt"

    def link_local_only(self) -> bool:
        """Every GID is link-local (fe80::): what a Thunderbolt port publishes before its interface has IPv4."""
        return bool(self.gids) and all(g.link_local for g in self.gids)

    def gid_note(self) -> str | None:
        """A Thunderbolt port whose IPv4-mapped GID is not at index 1, the index Apple's TN3205 example and
        MLX releases before ml-explore/mlx#3412 use."""
        gid = self.ipv4_gid()
        if not self.thunderbolt or gid is None or gid.index == 1:
            return None
        return (
            f"{self.device}: its IPv4-mapped GID is at index {gid.index}, not 1; MLX releases that took GID index "
            f"1 (before ml-explore/mlx#3412) fail on it with '{JACCL_ERRNO_22}', current JACCL finds it itself"
        )

    def as_dict(self) -> dict[str, Any]:
        gid = self.ipv4_gid()
        data = asdict(self)
        data["gids"] = [asdict(g) | {"ipv4": g.ipv4} for g in self.gids]
        data["gid_index"] = gid.index if gid else None
        data["gid_ipv4"] = gid.ipv4 if gid else None
        data["usable"] = self.problem() is None
        data["problem"] = self.problem()
        return data


# ---------------------------------------------------------------- Linux: sysfs


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:  # absent, or EINVAL (types/ndevs of an unused GID slot)
        return None


def _drop_prefix(text: str, prefix: str) -> str:
    """``str.removeprefix`` (Python 3.9+) for the hosts' Pythons (3.8 and later)."""
    return text[len(prefix) :] if text.startswith(prefix) else text


def _state_name(text: str | None) -> str:
    """'4: ACTIVE' -> 'ACTIVE'; 'PORT_ACTIVE (4)' -> 'ACTIVE'."""
    if not text:
        return "UNKNOWN"
    text = text.strip()
    if ":" in text:
        text = text.split(":", 1)[1].strip()
    text = re.sub(r"\s*\(\d+\)$", "", text)
    return _drop_prefix(text, "PORT_")


def _guess_link_layer(gids: list[Gid]) -> str:
    """Without a link_layer file: RoCE GIDs (typed RoCE v2, or bound to a netdev) mean Ethernet."""
    if any((g.type or "").lower().replace(" ", "") == "rocev2" or g.ndev for g in gids):
        return "Ethernet"
    return "Unknown"


def read_sysfs(root: str = "/sys") -> list[RdmaPort]:
    """Every port of every device under <root>/class/infiniband; [] when there is none."""
    base = os.path.join(root, "class", "infiniband")
    if not os.path.isdir(base):
        return []
    ports = []
    for dev in sorted(os.listdir(base), key=natural_key):
        dev_dir = os.path.join(base, dev)
        net_dir = os.path.join(dev_dir, "device", "net")
        netdevs = sorted(os.listdir(net_dir), key=natural_key) if os.path.isdir(net_dir) else []
        ports_dir = os.path.join(dev_dir, "ports")
        if not os.path.isdir(ports_dir):
            continue
        numbers = sorted(int(p) for p in os.listdir(ports_dir) if p.isdigit())
        for number in numbers:
            pdir = os.path.join(ports_dir, str(number))
            gids = []
            gid_dir = os.path.join(pdir, "gids")
            for name in sorted(os.listdir(gid_dir), key=int) if os.path.isdir(gid_dir) else []:
                value = _read(os.path.join(gid_dir, name))
                if not value or value == ZERO_GID:
                    continue
                gids.append(
                    Gid(
                        int(name),
                        value,
                        _read(os.path.join(pdir, "gid_attrs", "types", name)),
                        _read(os.path.join(pdir, "gid_attrs", "ndevs", name)),
                    )
                )
            # The port's netdev: the one its GIDs are bound to; else the device's only netdev,
            # or the one in port order for a multi-port device.
            gid_ndevs = [g.ndev for g in gids if g.ndev]
            if gid_ndevs:
                netdev: str | None = gid_ndevs[0]
            elif len(netdevs) == 1:
                netdev = netdevs[0]
            elif number - 1 < len(netdevs):
                netdev = netdevs[number - 1]
            else:
                netdev = None
            ports.append(
                RdmaPort(
                    device=dev,
                    port=number,
                    state=_state_name(_read(os.path.join(pdir, "state"))),
                    link_layer=_read(os.path.join(pdir, "link_layer")) or _guess_link_layer(gids),
                    netdev=netdev,
                    phys_state=_state_name(phys) if (phys := _read(os.path.join(pdir, "phys_state"))) else None,
                    rate=_read(os.path.join(pdir, "rate")),
                    gids=gids,
                )
            )
    return ports


# ---------------------------------------------------------------- macOS: rdma_ctl, ibv_*


def parse_rdma_ctl(text: str) -> bool | None:
    """`rdma_ctl status` -> True (enabled), False (disabled), None (unrecognised)."""
    words = set(re.findall(r"[a-z]+", text.lower()))
    if "disabled" in words or "disable" in words:
        return False
    if "enabled" in words:
        return True
    return None


def parse_ibv_devices(text: str) -> list[str]:
    """`ibv_devices` -> device names (the header and its dashes skipped)."""
    names = []
    for line in text.splitlines():
        cols = line.split()
        if not cols or cols[0] in ("device", "%", "$", "ibv_devices") or set(cols[0]) == {"-"}:
            continue
        names.append(cols[0])
    return names


# One token per field, found anywhere (not per line): published copies expand tabs, wrap long
# lines after "GID[  0]:", or run several fields together on one line.
DEVINFO_TOKEN = re.compile(
    r"(?<![\w])(?:"
    r"hca_id:\s*(?P<hca>\S+)"
    r"|port:\s*(?P<port>\d+)"
    r"|phys_state:\s*(?P<phys>[A-Za-z_]+)(?:\s*\(\d+\))?"
    r"|state:\s*(?P<state>[A-Za-z_]+)(?:\s*\(\d+\))?"
    r"|link_layer:\s*(?P<ll>\S+)"
    r"|active_width:\s*(?P<width>\S+)"
    r"|active_speed:\s*(?P<speed>[\d.]+\s*\S+)"
    r"|GID\[\s*(?P<gidx>\d+)\]:\s*(?P<gid>[0-9A-Fa-f:.]+)(?:,[ \t]*(?P<gtype>[^\n]+?))?[ \t]*$"
    r")",
    re.M,
)


def parse_ibv_devinfo(text: str) -> list[RdmaPort]:
    """`ibv_devinfo [-v]` -> ports with state, link layer, speed and (with -v) the GID table."""
    ports: list[RdmaPort] = []
    device = None
    current: RdmaPort | None = None
    width = speed = None
    for m in DEVINFO_TOKEN.finditer(text):
        if m.group("hca"):
            device, current = m.group("hca"), None
        elif m.group("port") and device:
            current = RdmaPort(device=device, port=int(m.group("port")), state="UNKNOWN", link_layer="")
            width = speed = None
            ports.append(current)
        elif current is None and device and m.group("gidx") is not None:
            # A copy that elided the "port:" line: GIDs belong to the first port.
            current = RdmaPort(device=device, port=1, state="UNKNOWN", link_layer="")
            ports.append(current)
        if current is None or m.group("hca") or m.group("port"):
            continue
        if m.group("phys"):
            current.phys_state = _state_name(m.group("phys"))
        elif m.group("state"):
            current.state = _state_name(m.group("state"))
        elif m.group("ll"):
            current.link_layer = m.group("ll")
        elif m.group("width"):
            width = m.group("width")
        elif m.group("speed"):
            speed = m.group("speed")
        elif m.group("gidx") is not None:
            try:
                value = ipaddress.IPv6Address(m.group("gid")).exploded
            except ValueError:
                continue
            if value != ZERO_GID:
                kind = (m.group("gtype") or "").strip() or None
                # rdma-core prints "RoCE v1" where the kernel's sysfs says "IB/RoCE v1".
                kind = "IB/RoCE v1" if kind == "RoCE v1" else kind
                current.gids.append(Gid(int(m.group("gidx")), value, kind))
        if current is not None and speed:
            current.rate = f"{speed} ({width})" if width else speed
    for port in ports:
        if port.device.startswith("rdma_"):
            port.netdev = _drop_prefix(port.device, "rdma_")
        if not port.link_layer:
            port.link_layer = "Thunderbolt" if port.device.startswith("rdma_en") else _guess_link_layer(port.gids)
    return ports


# ---------------------------------------------------------------- facts


def slow_link(name: str, link: dict[str, Any] | None, device: str | None = None) -> str | None:
    """Why RDMA cannot run over the cable on port ``name``: its link was negotiated at Thunderbolt 4/3
    speed (40 Gb/s or less), whatever devices macOS lists. ``link``: macos.thunderbolt_links' entry, or
    only a ``generation`` from discovery."""
    if not link or link.get("generation") not in ("tb4", "tb3-or-older"):
        return None
    if link.get("linked") is False:
        return None
    label = f"{name} ({link['name']})" if link.get("name") else name
    speed = link.get("speed") or "Thunderbolt 4 speed"
    to = f" to {link['far_end']}" if link.get("far_end") else ""
    listed = f", although macOS lists {device} for it" if device else ""
    return (
        f"{label} is linked at {speed}{to}: a Thunderbolt 4/3 link, and RDMA does not run over it{listed} "
        "(Thunderbolt 5 needed at both ends and in the cable; JACCL over it crashes or never connects)"
    )


def bridged(name: str, bridge: str, device: str | None) -> str:
    """A cabled port that is a member of a bridge (the Thunderbolt Bridge active again)."""
    gid = f"{device} gets no IPv4-mapped GID" if device else "the port has no address of its own"
    return (
        f"{name} is a member of {bridge} (the Thunderbolt Bridge is active): the IPv4 address sits on {bridge}, "
        f"{gid}, and JACCL fails with '{JACCL_ERRNO_22}'. Run setup.yml (its discovery step takes the "
        f"ports out of {bridge} and keeps them out)"
    )


def host_facts(
    system: str,
    ports: list[RdmaPort],
    fabric: list[str],
    enabled: bool | None = None,
    devices: list[str] | None = None,
    tool_missing: str | None = None,
    generations: dict[str, str | None] | None = None,
    links: dict[str, dict[str, Any]] | None = None,
    bridges: dict[str, dict[str, Any]] | None = None,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """One host's RDMA facts for the cabled ports ``fabric`` (the plan's ports of this host).

    ``status`` is one of: ``none`` (no RDMA on this host), ``disabled`` (macOS: RDMA not
    enabled), ``not_capable`` (enabled, but no device: Thunderbolt 4 or older), ``enabled``
    (devices present; per port ``usable`` tells which can carry RDMA now).

    macOS only: ``links`` (macos.thunderbolt_links: each port's negotiated speed) or ``generations`` (from
    discovery) rule out a port linked at Thunderbolt 4/3 speed even where macOS lists a device for it (its
    ``device`` is then null, ``listed_device`` names it); ``bridges`` (macos.parse_ifconfig_bridges) rule
    out a port that is a member of a bridge.
    """
    generations = generations or {}
    links = dict(links or {})
    for name, generation in generations.items():
        if name not in links and generation:
            links[name] = {"generation": generation}
    in_bridge = {m: b for b, info in (bridges or {}).items() for m in info.get("members") or []}
    by_netdev = {p.netdev: p for p in ports if p.netdev}
    notes = list(notes or [])
    status, message, runbook = "enabled", "", None
    if system == "Darwin":
        if tool_missing:
            status, runbook = "none", RUNBOOK_MACOS
            message = f"{tool_missing} not found: Thunderbolt RDMA needs macOS 26.2 or later"
        elif enabled is False:
            status, runbook = "disabled", RUNBOOK_MACOS
            message = "RDMA is not enabled (rdma_ctl status: disabled); it can only be enabled from macOS Recovery"
        elif not (devices or ports):
            status, runbook = "not_capable", RUNBOOK_TB
            message = (
                "RDMA is enabled but there is no RDMA device: Thunderbolt RDMA needs Thunderbolt 5 "
                "ports on both Macs (Thunderbolt 4 and older have none)"
            )
    elif not ports:
        status, runbook = "none", RUNBOOK_ROCE
        message = "no RDMA devices (/sys/class/infiniband is empty or absent)"
    runbooks = [runbook] if runbook else []
    port_facts = {}
    problems = []
    for name in fabric:
        rport = by_netdev.get(name)
        listed = rport.device if rport else f"rdma_{name}" if devices and f"rdma_{name}" in devices else None
        why: list[str] = []
        slow = slow_link(name, links.get(name), listed) if system == "Darwin" and not tool_missing else None
        if slow:
            why.append(slow)
            runbooks.append(RUNBOOK_TB)
        bridge = in_bridge.get(name) if system == "Darwin" else None
        if bridge:
            why.append(bridged(name, bridge, rport.device if rport else None))
            runbooks.append(RUNBOOK_BRIDGE)
        platform_runbook = RUNBOOK_MACOS if system == "Darwin" else RUNBOOK_ROCE
        if rport is None:
            if not why:
                why.append(message or f"no RDMA device on {name}")
                runbooks.append(runbook or platform_runbook)
            entry: dict[str, Any] = {"netdev": name, "device": None}
        else:
            entry = rport.as_dict()
            problem = rport.problem()
            gid_only = problem is not None and rport.active and rport.ipv4_gid() is None
            if problem and not slow and not (bridge and gid_only):
                why.append(problem)
                runbooks.append(RUNBOOK_GID if gid_only and rport.thunderbolt else platform_runbook)
            note = rport.gid_note()
            if note:
                notes.append(note)
        if slow and entry.get("device"):
            entry["device"] = None  # the planner counts a port with a device as able to carry RDMA
        entry["listed_device"] = listed
        entry["link"] = links.get(name)
        entry["bridge"] = bridge
        entry["usable"] = not why
        entry["problem"] = "; ".join(why) or None
        port_facts[name] = entry
        if why:
            problems.append(f"{name}: {entry['problem']}")
    if status == "enabled" and not message:
        usable = sum(1 for p in port_facts.values() if p["usable"])
        message = f"{len(ports)} RDMA port(s); {usable} of {len(fabric)} cabled port(s) usable"
    runbooks = list(dict.fromkeys(runbooks))
    return {
        "system": system,
        "status": status,
        "message": message,
        "runbook": runbooks[0] if runbooks else None,
        "runbooks": runbooks,
        "devices": [p.as_dict() for p in ports],
        "ports": port_facts,
        "usable": bool(fabric) and not problems,
        "problems": problems,
        "notes": notes,
        "bridges": bridges or {},
        "nccl_env": nccl_env(ports, fabric) if system != "Darwin" else {},
    }


def nccl_env(ports: list[RdmaPort], fabric: list[str]) -> dict[str, str]:
    """NCCL's variables from the RDMA facts: ACTIVE HCAs, the RoCE v2 IPv4 GID index, and the
    fabric interface named exactly (never lo or docker0)."""
    env: dict[str, str] = {}
    active = [p for p in ports if p.active]
    if active:
        env["NCCL_IB_HCA"] = "=" + ",".join(f"{p.device}:{p.port}" for p in active)
        roce = [p for p in active if p.roce]
        indices = {g.index for g in (p.ipv4_gid() for p in roce) if g is not None}
        if len(indices) == 1:
            env["NCCL_IB_GID_INDEX"] = str(indices.pop())
        elif len(indices) > 1:
            # Devices disagree on the index: let NCCL (2.21+) pick the RoCE v2 IPv4 GID per device.
            env["NCCL_IB_ROCE_VERSION_NUM"] = "2"
            env["NCCL_IB_ADDR_FAMILY"] = "AF_INET"
    else:
        env["NCCL_IB_DISABLE"] = "1"
    # The cabled ports when the plan has them; else the netdevs of the ACTIVE RDMA ports.
    ifaces = list(fabric) or [p.netdev for p in active if p.netdev]
    ifaces = [i for i in dict.fromkeys(ifaces) if i and not NOT_FABRIC.match(i)]
    if ifaces:
        env["NCCL_SOCKET_IFNAME"] = "=" + ",".join(ifaces)
    return env
