# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: tell the host module ``management`` the controller's address as the host sees it."""

from __future__ import annotations

import ipaddress
import socket

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


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        target = args.get("address") or self._play_context.remote_addr
        if target and not args.get("controller_addresses"):
            port = self._play_context.port or 22
            args["controller_addresses"] = source_addresses(str(target), int(port))
        result.update(
            self._execute_module(module_name="meshkit.cluster.management", module_args=args, task_vars=task_vars)
        )
        result["controller_addresses"] = args.get("controller_addresses", [])
        return result
