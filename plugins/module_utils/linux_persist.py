# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Make the peer-port configuration survive a reboot on Linux, through whichever network
manager the host runs: systemd-networkd (files) or NetworkManager (connection profiles).

Runtime changes are made with ``ip`` by the modules; this file only writes what a reboot
needs. Where neither manager runs (as in the lab), the configuration is runtime only and the
modules say so. Plain Python: commands go through ``run(argv)``, files through ``FileSet``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Run = Callable[[list[str]], tuple[int, str, str]]
NETWORKD_DIR = "/etc/systemd/network"
# "00-" so the file sorts before a distribution's or user's own match for the port:
# networkd applies the first .network file that matches.
PREFIX = "00-meshkit-"
HEADER = "# Managed by meshkit ({role}); changes here are overwritten by setup.yml.\n"


def detect(run: Run, have: Callable[[str], bool]) -> str | None:
    """'networkd', 'networkmanager' or None (runtime only)."""
    if have("networkctl") and have("systemctl"):
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
        HEADER.format(role="thunderbolt_bridge") + f"[Match]\nName={port}\n\n[Link]\nRequiredForOnline=no\n\n"
        "[Network]\nConfigureWithoutCarrier=yes\nLinkLocalAddressing=ipv6\nIPv6AcceptRA=no\n",
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
    return dict(zip(keys, values + [""] * (len(keys) - len(values)), strict=False))


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
    """Write changed persistence files (not in check mode) and let networkd reload them."""
    if not changes or module.check_mode:
        return
    files.apply()
    rc, _out, err = run(["networkctl", "reload"])
    if rc != 0:
        module.fail_json(msg=f"networkctl reload failed (rc={rc}): {err.strip()}", files=[c["path"] for c in changes])
