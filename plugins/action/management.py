# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: tell the host module ``management`` the controller's address as the host sees it."""

from __future__ import annotations

import ipaddress
import shlex
import socket
import subprocess

from ansible.errors import AnsibleError
from ansible.plugins.action import ActionBase


def source_addresses(target: str, port: int = 22) -> list[str]:
    """The controller's own addresses that packets to ``target`` leave from, one per address the
    name resolves to here (a connected UDP socket sends nothing; the kernel only picks a route).
    Empty when ``target`` does not resolve or has no route from here."""
    out: list[str] = []
    try:
        infos = socket.getaddrinfo(target, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return out
    for family, kind, proto, _canon, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(sockaddr)
                address = sock.getsockname()[0].partition("%")[0]
        except OSError:
            continue
        if address not in out and not ipaddress.ip_address(address).is_unspecified:
            out.append(address)
    return out


def ssh_proxy(target: str, options: list[str]) -> str | None:
    """The jump host or proxy command ssh would use to reach ``target`` (``ssh -G`` prints the
    effective configuration, ~/.ssh/config included, without connecting), or None."""
    try:
        proc = subprocess.run(["ssh", "-G", *options, target], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in proc.stdout.splitlines():
        key, _sep, value = line.partition(" ")
        if key in ("proxyjump", "proxycommand") and value.strip() and value.strip() != "none":
            return f"{key} {value.strip()}"
    return None


def ssh_options(connection) -> list[str]:
    """The ssh options Ansible's connection to the host uses (ssh_args, ssh_common_args, ssh_extra_args)."""
    options: list[str] = []
    for name in ("ssh_args", "ssh_common_args", "ssh_extra_args"):
        try:
            value = connection.get_option(name)
        except (KeyError, AttributeError, AnsibleError):
            continue
        options += shlex.split(value or "")
    return options


def with_controller_addresses(action: ActionBase, args: dict) -> tuple[dict, str | None]:
    """The management options ``args`` with ``controller_addresses`` filled in (unless given), and
    the jump host or proxy ssh reaches the host through (then none is filled in: the host sees the
    jump host, not this machine, and the controller's own address would only mislead)."""
    args = dict(args)
    target = args.get("address") or action._play_context.remote_addr
    proxy = None
    if target and action._connection.transport in ("ssh", "ansible.builtin.ssh", "ansible.legacy.ssh"):
        proxy = ssh_proxy(str(target), ssh_options(action._connection))
    if target and not args.get("controller_addresses") and proxy is None:
        port = action._play_context.port or 22
        args["controller_addresses"] = source_addresses(str(target), int(port))
    return args, proxy


def controller_facts(args: dict, proxy: str | None) -> dict:
    """What the action adds to the module's result: the controller addresses it gave, or why none."""
    out = {"controller_addresses": args.get("controller_addresses", [])}
    if proxy:
        out["controller_addresses_skipped"] = f"ssh reaches the host through {proxy}"
    return out


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args, proxy = with_controller_addresses(self, dict(self._task.args))
        result.update(
            self._execute_module(module_name="meshkit.cluster.management", module_args=args, task_vars=task_vars)
        )
        result.update(controller_facts(args, proxy))
        return result
