# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The launch agent's check of its host before a launch: can this host run its share of the job?

The program and its interpreter resolved to real paths, the script or module a Python runs, further
commands, the working directory, every planned listening address and port (preflight()); the
host's cables (cable_checks(): the collection's macos.launch_checks, from sources the controller
sends with the check); and with check_host() also the host's facts (host_facts). launch.yml (the
launch action's ``check_hosts``) and `meshkit launch` run it on every host through the agent, over
the connection the ranks then use. Read-only. Standard library only.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import subprocess

from ansible_collections.meshkit.cluster.plugins.module_utils.agent_sources import module_util
from ansible_collections.meshkit.cluster.plugins.module_utils.host_facts import host_facts

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
    """The launch preflight's checks of this host's cables (macos.launch_checks; from ``sources``, the
    module_utils the controller sent, where it sent them): no cable port in a bridge, every peer
    reachable from the ranks' interpreter."""
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
