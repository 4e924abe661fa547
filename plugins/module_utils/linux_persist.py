# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Make the peer-port configuration survive a reboot on Linux, through whichever network
manager the host runs: systemd-networkd (files) or NetworkManager (connection profiles).

Runtime changes are made with ``ip`` by the modules; this file only writes what a reboot
needs. Where neither manager runs (as in the lab), the configuration is runtime only and the
modules say so. Plain Python: commands go through ``run(argv)``, files through ``FileSet``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: modules run on the hosts' Pythons (3.8 and later)
    from collections.abc import Callable

    Run = Callable[[list[str]], tuple[int, str, str]]

NETWORKD_DIR = "/etc/systemd/network"
# "00-" so the file sorts before a distribution's or user's own match for the port:
# networkd applies the first .network file that matches.
PREFIX = "00-meshkit-"
HEADER = "# Managed by meshkit ({role}); changes here are overwritten by setup.yml.\n"


def networkd_running(proc_root: str = "/proc") -> bool:
    """True when a systemd-networkd process manages this host's network.

    Read from the process table, so it holds wherever networkd runs: under systemd as PID 1 (a
    normal host), in a container or a lab host without systemd, or started by hand - where
    ``systemctl is-active`` needs systemd as PID 1. Only a networkd in this process's network
    namespace counts (a container's own networkd, visible in the host's process table, manages
    the container's network, not the host's). The kernel truncates a process name to 15
    characters, ``systemd-network``; the command line says which program it is.
    """
    try:
        own_net = os.stat(os.path.join(proc_root, "self", "ns", "net")).st_ino
        pids = [p for p in os.listdir(proc_root) if p.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            with open(os.path.join(proc_root, pid, "comm")) as handle:
                if handle.read().strip() != "systemd-network":
                    continue
            with open(os.path.join(proc_root, pid, "cmdline"), "rb") as handle:
                argv0 = handle.read().split(b"\0", 1)[0].decode(errors="replace")
            if os.path.basename(argv0) != "systemd-networkd":
                continue
            if os.stat(os.path.join(proc_root, pid, "ns", "net")).st_ino == own_net:
                return True
        except OSError:
            continue  # the process ended meanwhile, or its namespace is not ours to see
    return False


def detect(run: Run, have: Callable[[str], bool], proc_root: str = "/proc") -> str | None:
    """'networkd', 'networkmanager' or None (runtime only).

    networkd when a systemd-networkd process runs in this host's network namespace, or systemd
    (where it is PID 1) says the service is active, and networkctl is there to reload it; else
    NetworkManager when ``nmcli`` says it runs; else None.
    """
    if have("networkctl"):
        if networkd_running(proc_root):
            return "networkd"
        if have("systemctl"):
            rc, out, _err = run(["systemctl", "is-active", "systemd-networkd"])
            if rc == 0 and out.strip() == "active":
                return "networkd"
    if have("nmcli"):
        rc, out, _err = run(["nmcli", "-t", "-g", "RUNNING", "general"])
        if rc == 0 and out.strip() == "running":
            return "networkmanager"
    return None


def describe(manager: str | None) -> str:
    return {
        "networkd": "systemd-networkd files in /etc/systemd/network",
        "networkmanager": "NetworkManager connection profiles (meshkit-<port>)",
    }.get(manager or "", "runtime only: neither systemd-networkd nor NetworkManager runs on this host")


@dataclass
class FileSet:
    """Files to converge: path -> wanted content (None: remove)."""

    wanted: dict[str, str | None] = field(default_factory=dict)

    def changes(self) -> list[dict[str, Any]]:
        out = []
        for path, content in sorted(self.wanted.items()):
            try:
                with open(path) as handle:
                    current: str | None = handle.read()
            except FileNotFoundError:
                current = None
            if current != content:
                out.append({"path": path, "before": current or "", "after": content or ""})
        return out

    def apply(self) -> None:
        for path, content in self.wanted.items():
            if content is None:
                if os.path.exists(path):
                    os.unlink(path)
                    parent = os.path.dirname(path)
                    if parent.endswith(".network.d") and not os.listdir(parent):
                        os.rmdir(parent)
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".meshkit-tmp"
            with open(tmp, "w") as handle:
                handle.write(content)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)


def networkd_port(directory: str, port: str) -> tuple[str, str]:
    """The port's own .network file: a standalone peer port, not a bridge member."""
    return (
        os.path.join(directory, f"{PREFIX}{port}.network"),
        HEADER.format(role="discovery") + f"[Match]\nName={port}\n\n[Link]\nRequiredForOnline=no\n\n"
        "[Network]\nConfigureWithoutCarrier=yes\nLinkLocalAddressing=ipv6\nIPv6AcceptRA=no\n",
    )


def networkd_bridge_down(directory: str, bridge: str) -> tuple[str, str]:
    """The bridge's own .network file: it stays down at boot (its peer ports left it for good),
    as setup.yml leaves it at runtime; it sorts before any factory file that would bring it up."""
    return (
        os.path.join(directory, f"{PREFIX}{bridge}.network"),
        HEADER.format(role="discovery") + f"[Match]\nName={bridge}\n\n[Link]\nActivationPolicy=down\n"
        "RequiredForOnline=no\n\n[Network]\nLinkLocalAddressing=no\nIPv6AcceptRA=no\n",
    )


def networkd_address(directory: str, port: dict[str, Any], mtu: int | None) -> tuple[str, str]:
    """Drop-in with the cable's address, the host route to the peer and the MTU."""
    body = HEADER.format(role="peer_network") + f"[Network]\nAddress={port['address']}/{port['prefix']}\n\n"
    body += f"[Route]\nDestination={port['peer_address']}/32\nPreferredSource={port['address']}\n"
    if mtu:
        body += f"\n[Link]\nMTUBytes={mtu}\n"
    return os.path.join(directory, f"{PREFIX}{port['port']}.network.d", "50-address.conf"), body


def networkd_stale_dropins(directory: str, keep: set[str]) -> list[str]:
    """meshkit's address drop-ins for ports that no longer have a cable."""
    stale = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return stale
    for name in names:
        if name.startswith(PREFIX) and name.endswith(".network.d"):
            port = name[len(PREFIX) : -len(".network.d")]
            path = os.path.join(directory, name, "50-address.conf")
            if port not in keep and os.path.exists(path):
                stale.append(path)
    return sorted(stale)


def nm_profiles(run: Run) -> dict[str, dict[str, str]]:
    """NetworkManager profiles: name -> {device, type, master}."""
    rc, out, err = run(["nmcli", "-t", "-f", "NAME,TYPE,DEVICE", "connection", "show"])
    if rc != 0:
        raise RuntimeError(f"nmcli connection show failed: {err.strip()}")
    profiles = {}
    for line in out.splitlines():
        parts = line.replace("\\:", "\0").split(":")
        if len(parts) >= 3:
            name, kind, device = (p.replace("\0", ":") for p in parts[:3])
            profiles[name] = {"type": kind, "device": device}
    return profiles


def nm_settings(run: Run, name: str, keys: list[str]) -> dict[str, str]:
    rc, out, _err = run(["nmcli", "-t", "-g", ",".join(keys), "connection", "show", name])
    if rc != 0:
        return {}
    values = out.rstrip("\n").split("\n")
    # One line per key; keys nmcli printed nothing for read as "".
    return {key: values[i] if i < len(values) else "" for i, key in enumerate(keys)}


def nm_add(port: str, *settings: str) -> list[str]:
    """The command creating a port's meshkit-<port> Ethernet profile with the given settings."""
    return ["nmcli", "connection", "add", "type", "ethernet", "con-name", f"meshkit-{port}", "ifname", port, *settings]


def nm_bridge_commands(run: Run, ports: list[str], bridge: str) -> list[list[str]]:
    """Bridge-slave profiles of the ports stop autoconnecting; each port gets a meshkit profile."""
    profiles = nm_profiles(run)
    commands: list[list[str]] = []
    for name in sorted(profiles):
        s = nm_settings(run, name, ["connection.master", "connection.interface-name", "connection.autoconnect"])
        slave = s.get("connection.master") == bridge and s.get("connection.interface-name") in ports
        if slave and s.get("connection.autoconnect") != "no":
            commands.append(["nmcli", "connection", "modify", name, "connection.autoconnect", "no"])
    for port in ports:
        name = f"meshkit-{port}"
        if name not in profiles:
            commands.append(
                nm_add(port, "ipv4.method", "disabled", "ipv6.method", "link-local", "connection.autoconnect", "yes")
            )
    return commands


def nm_address_commands(run: Run, ports: list[dict[str, Any]], mtu: int | None) -> list[list[str]]:
    commands: list[list[str]] = []
    keys = ["ipv4.method", "ipv4.addresses", "ipv4.routes", "802-3-ethernet.mtu"]
    for p in ports:
        name = f"meshkit-{p['port']}"
        want = {
            "ipv4.method": "manual",
            "ipv4.addresses": f"{p['address']}/{p['prefix']}",
            "ipv4.routes": f"{p['peer_address']}/32",
        }
        if mtu:
            want["802-3-ethernet.mtu"] = str(mtu)
        have = nm_settings(run, name, keys)
        if not have:
            commands.append(nm_add(p["port"], "ipv6.method", "link-local"))
        diff = [arg for key, value in want.items() if have.get(key, "").split(" ")[0] != value for arg in (key, value)]
        if diff:
            commands.append(["nmcli", "connection", "modify", name, *diff])
    return commands


# ---- used by the modules that persist (bridge_detach, peer_link) ---------------------------------
# Options of the modules that persist Linux configuration.
PERSIST_ARGS: dict[str, dict[str, Any]] = {
    "persist": {"type": "str", "default": "auto", "choices": ["auto", "networkd", "networkmanager", "runtime"]},
    "networkd_dir": {"type": "path", "default": NETWORKD_DIR},
}


def module_manager(module: Any, run: Run) -> str | None:
    """networkd, networkmanager or None (runtime only), from the module's persist option."""
    choice = module.params["persist"]
    if choice == "auto":
        return detect(run, lambda b: module.get_bin_path(b) is not None)
    return None if choice == "runtime" else choice


def module_write(module: Any, run: Run, files: FileSet, changes: list[dict[str, Any]]) -> None:
    """Write changed persistence files (not in check mode) and have networkd apply them now.

    ``networkctl reload`` (systemd-networkd re-reads its files and reconfigures the links whose
    file changed) goes over D-Bus; if it fails, or networkd then still configures a port from
    another file than meshkit's, the module fails saying so: the files are written but the host
    would not boot into what they say.
    """
    if module.check_mode:
        return
    if not changes:
        # Nothing to write, but still true? Another file that sorts first may have appeared since
        # the run that wrote these: say so on every run, not only the one that changed something.
        ours = [{"path": path, "after": content} for path, content in files.wanted.items() if content]
        stale = networkd_not_applied(run, ours, timeout=0)
        if stale:
            module.fail_json(
                msg="systemd-networkd does not configure these ports from meshkit's files: "
                + "; ".join(stale)
                + ". Another .network file that sorts first matches them (networkd uses the first that matches)",
                files=sorted(files.wanted),
            )
        return
    files.apply()
    if not any(c["path"].endswith((".network", ".conf")) for c in changes):
        return
    rc, out, err = run(["networkctl", "reload"])
    if rc != 0:
        module.fail_json(
            msg=f"networkctl reload failed (rc={rc}): {(err or out).strip()}. The files are written but "
            "systemd-networkd did not re-read them: it must run and be reachable over the system D-Bus "
            "(networkctl talks to it there); fix that and run again",
            files=[c["path"] for c in changes],
        )
    stale = networkd_not_applied(run, changes)
    if stale:
        module.fail_json(
            msg="systemd-networkd reloaded but does not configure these ports from meshkit's files: "
            + "; ".join(stale)
            + ". Another .network file that sorts first matches them (networkd uses the first that matches)",
            files=[c["path"] for c in changes],
        )


def networkd_port_of(path: str) -> tuple[str, str] | None:
    """(port, the port's meshkit .network file) for a meshkit networkd file or drop-in, else None."""
    name = os.path.basename(path)
    parent = os.path.dirname(path)
    if name.startswith(PREFIX) and name.endswith(".network"):
        return name[len(PREFIX) : -len(".network")], path
    base = os.path.basename(parent)
    if base.startswith(PREFIX) and base.endswith(".network.d"):
        return base[len(PREFIX) : -len(".network.d")], parent[: -len(".d")]
    return None


def networkd_not_applied(
    run: Run,
    changes: list[dict[str, Any]],
    sys_root: str = "/sys",
    timeout: float = 10.0,
    interval: float = 0.2,
) -> list[str]:
    """Ports that systemd-networkd does not configure from meshkit's .network file (empty: all).

    ``networkctl status --json=short PORT`` names the file networkd applied (``NetworkFile``); a
    drop-in (``00-meshkit-<port>.network.d/``) is read only with the .network file of that name,
    so that file must be the one. A reload reconfigures links as it goes: this waits up to
    ``timeout`` seconds. Ports that do not exist now, and files being removed, are not checked.
    """
    wanted: dict[str, str] = {}
    for c in changes:
        found = networkd_port_of(c["path"]) if c["after"] else None
        if found and os.path.exists(os.path.join(sys_root, "class", "net", found[0])):
            wanted[found[0]] = found[1]
    deadline = time.monotonic() + timeout
    while True:
        problems = []
        for port, network_file in sorted(wanted.items()):
            rc, out, err = run(["networkctl", "status", "--json=short", port])
            if rc != 0 and "json" in err.lower() and ("unrecognized" in err or "unknown" in err.lower()):
                return []  # systemd before 250 has no --json: nothing to check with; the files stand
            try:
                applied = json.loads(out).get("NetworkFile") if rc == 0 else None
            except ValueError:
                applied = None
            if applied != network_file:
                seen = applied or (f"no file ({err.strip()})" if err.strip() else "no file")
                problems.append(f"{port}: configured from {seen}, not {network_file}")
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(interval)
