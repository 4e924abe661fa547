# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What every meshkit module on a host shares: running commands the same way."""

from __future__ import annotations

import os
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils import linux_net, macos


def runner(module: Any):
    """run(argv) through AnsibleModule.run_command, in the C locale so parsers see stable output."""

    def run(argv: list[str]) -> tuple[int, str, str]:
        rc, out, err = module.run_command(argv, environ_update={"LC_ALL": "C", "LANG": "C"})
        return rc, out, err

    return run


def connection_addresses(extra: str | None, controller: bool = False) -> list[str]:
    """Addresses that identify the management connection: sshd's side of SSH_CONNECTION first
    (the controller's side too, first, when ``controller``: macOS finds the interface by the
    route to the controller), then ``extra`` (the inventory's ansible_host)."""
    out = []
    ssh = os.environ.get("SSH_CONNECTION", "").split()
    if len(ssh) == 4:
        if controller:
            out.append(ssh[0])
        out.append(ssh[2])
    if extra:
        out.append(extra)
    return out


def apply(module: Any, run, commands: list[list[str]]) -> list[dict[str, Any]]:
    """Run mutating commands unless in check mode; fail naming the first command that fails."""
    done = []
    for argv in commands:
        if module.check_mode:
            continue
        rc, _out, err = run(argv)
        done.append({"cmd": argv, "rc": rc})
        if rc != 0:
            module.fail_json(msg=f"{' '.join(argv)} failed (rc={rc}): {err.strip()}", commands=commands, done=done)
    return done


# Options every module that must keep off the management interface takes.
MANAGEMENT_ARGS: dict[str, dict[str, Any]] = {
    "management_address": {"type": "str"},
    "management_interface": {"type": "str"},
}


def find_management_interface(module: Any, run, darwin: bool, addrs: list[dict[str, Any]] | None = None) -> str | None:
    """The interface carrying the connection this play runs over (the override wins)."""

    p = module.params
    if p.get("management_interface"):
        return p["management_interface"]
    if darwin:
        return macos.management_interface(run, connection_addresses(p.get("management_address"), controller=True))
    addrs = linux_net.addresses(run) if addrs is None else addrs
    return linux_net.management_interface(addrs, connection_addresses(p.get("management_address")), None)
