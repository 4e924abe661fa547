# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What every meshkit module on a host shares: running commands the same way."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ansible_collections.meshkit.cluster.plugins.module_utils import management


def runner(module: Any):
    """run(argv) through AnsibleModule.run_command, in the C locale so parsers see stable output."""

    def run(argv: list[str]) -> tuple[int, str, str]:
        rc, out, err = module.run_command(argv, environ_update={"LC_ALL": "C", "LANG": "C"})
        return rc, out, err

    return run


Key = TypeVar("Key")


def run_parallel(
    module: Any, argvs: dict[Key, list[str]], timeout: float | None = None
) -> dict[Key, tuple[int, str, str]]:
    """Run every command at once, each through ``AnsibleModule.run_command`` in a thread of its own;
    ``(rc, out, err)`` by key, in the order given. The arguments are passed as they are (no ``~`` or
    ``$VAR`` expansion). A command still running after ``timeout`` seconds is killed (its rc is then
    negative: -9). A command that cannot be started raises (OSError), as ``subprocess`` does, instead
    of ``run_command`` failing the module from inside a thread."""

    def one(argv: list[str]) -> tuple[int, str, str]:
        timers: list[threading.Timer] = []

        def arm(proc: Any) -> None:
            if timeout is not None:
                timer = threading.Timer(timeout, proc.kill)
                timer.daemon = True
                timer.start()
                timers.append(timer)

        try:
            return module.run_command(
                argv, expand_user_and_vars=False, handle_exceptions=False, before_communicate_callback=arm
            )
        finally:
            for timer in timers:
                timer.cancel()

    if not argvs:
        return {}
    with ThreadPoolExecutor(max_workers=len(argvs)) as pool:
        futures = {key: pool.submit(one, argv) for key, argv in argvs.items()}
        return {key: future.result() for key, future in futures.items()}


def apply(module: Any, run, commands: list[list[str]]) -> list[dict[str, Any]]:
    """Run mutating commands unless in check mode; fail naming the first command that fails."""
    done = []
    for argv in commands:
        if module.check_mode:
            continue
        rc, _out, err = run(argv)
        done.append({"cmd": argv, "rc": rc})
        # macOS route(8) exits 0 when the routing socket refuses ("File exists", "not in table"):
        # only its stderr tells (recorded: tests/fixtures/macos/route_*_stdout_macos26vm.txt).
        if rc == 0 and argv[0] == "route" and err.strip():
            rc = 1
        if rc != 0:
            module.fail_json(msg=f"{' '.join(argv)} failed (rc={rc}): {err.strip()}", commands=commands, done=done)
    return done


# Options every module that must keep off the management interface takes.
MANAGEMENT_ARGS: dict[str, dict[str, Any]] = {
    "management_address": {"type": "str"},
    "management_interface": {"type": "str"},
    "controller_addresses": {"type": "list", "elements": "str", "default": []},
}


def find_management_interface(module: Any, run, darwin: bool) -> str:
    """The interface carrying the connection this play runs over: the module's
    ``management_interface`` when given (setup.yml passes what ``meshkit.cluster.management``
    established), else established here the same way. Fails the module when it cannot be (fail
    closed: an unknown management interface never lets a change through)."""
    p = module.params
    if darwin:
        net = management.darwin_hostnet(run)
        route = functools.partial(management.darwin_route_interface, run)
    else:
        net = management.linux_hostnet(run)
        route = functools.partial(management.linux_route_interface, run)
    found = []
    if not p.get("management_interface"):
        found = management.findings(
            p.get("management_address"),
            p.get("controller_addresses") or [],
            net,
            route,
            management.system_resolve,
            peer_ports=p.get("peer_ports") or [],
        )
    try:
        return management.decide(p.get("management_address") or "this host", p.get("management_interface"), found, net)
    except management.ManagementError as exc:
        module.fail_json(msg=str(exc), findings=[f.as_dict() for f in found])
        raise  # not reached: fail_json exits
