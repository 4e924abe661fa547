#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: check that this host can run its share of a launch, changing nothing."""

from __future__ import annotations

DOCUMENTATION = r"""
module: launch_preflight
short_description: Check a host before a launch - program, interpreter, working directory, free ports
description:
  - Resolves the program (through C(PATH), the job's own C(PATH) when it sets one) to the real path it runs,
    and its interpreter - a script's C(#!) line (C(/usr/bin/env NAME) resolved too), or the script or C(-m) module
    a Python interpreter is given. The launch compares the results across hosts, so a program that exists at
    different paths (or not at all) on some host stops the launch before any rank starts.
  - Tries to bind every planned listening address and port, and reports one that is taken (with the process that
    holds it, where C(ss) can tell) or an address the host does not have.
  - Read-only; runs in check mode too.
version_added: 0.1.0
author: meshkit contributors
extends_documentation_fragment:
  - meshkit.cluster.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
options:
  argv:
    description: The command every rank runs.
    type: list
    elements: str
    required: true
  path:
    description: The C(PATH) the ranks get, when the job sets one; else the host's own.
    type: str
  path_prepend:
    description: Directories put in front of that C(PATH) for the ranks (meshccl's virtual environment).
    type: list
    elements: str
    default: []
  cwd:
    description: The ranks' working directory.
    type: str
  require:
    description: Further commands that must be on the ranks' C(PATH) (C(orted) for an MPI job).
    type: list
    elements: str
    default: []
  ports:
    description: "C([address, port, what]) entries this host's ranks will listen on."
    type: list
    elements: raw
    default: []
"""

EXAMPLES = r"""
- name: Preflight
  meshkit.cluster.launch_preflight:
    argv: [python3, /shared/train.py]
    ports: [[198.18.128.1, 29600, meshccl rank 0]]
"""

RETURN = r"""
program:
  description: The real path of the program (symbolic links resolved), null when it is missing.
  returned: always
  type: str
interpreter:
  description: The real path of its interpreter (a script's C(#!), or the Python it is), null when there is none.
  returned: always
  type: str
script:
  description: The real path of the script or the module file a Python interpreter runs, when there is one.
  returned: always
  type: str
problems:
  description: One line per problem found; empty when the host is ready.
  returned: always
  type: list
  elements: str
"""

import errno
import os
import re
import shutil
import socket
import subprocess

from ansible.module_utils.basic import AnsibleModule

PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


REQUIRED_HINTS = {
    "orted": "install Open MPI (the same version as the controller's mpirun; Debian: openmpi-bin)",
}


def resolve(name: str, path: str | None, cwd: str | None) -> str | None:
    if "/" in name:
        full = name if os.path.isabs(name) else os.path.join(cwd or os.getcwd(), name)
        return os.path.realpath(full) if os.path.isfile(full) and os.access(full, os.X_OK) else None
    found = shutil.which(name, path=path)
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


def holder(port: int) -> str:
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
                return f"port {port} on {address} is in use{holder(port)}"
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"address {address} is not on this host (run setup.yml: the cabling or addresses changed)"
            return f"cannot listen on {address}:{port}: {exc.strerror}"
    return None


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "argv": {"type": "list", "elements": "str", "required": True},
            "path": {"type": "str"},
            "path_prepend": {"type": "list", "elements": "str", "default": []},
            "cwd": {"type": "str"},
            "require": {"type": "list", "elements": "str", "default": []},
            "ports": {"type": "list", "elements": "raw", "default": []},
        },
        supports_check_mode=True,
    )
    p = module.params
    argv, path, cwd = p["argv"], p["path"] or os.environ.get("PATH", os.defpath), p["cwd"]
    path = os.pathsep.join([*p["path_prepend"], path])
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
                probe = subprocess.run(
                    [program, "-c", "import importlib.util, sys; s = importlib.util.find_spec(sys.argv[1]); "
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
    for name in p["require"]:
        if resolve(name, path, cwd) is None:
            hint = REQUIRED_HINTS.get(name, "install it on every host")
            problems.append(f"{name} not found on PATH ({path}); {hint}")
    for entry in p["ports"]:
        address, port = str(entry[0]), int(entry[1])
        what = entry[2] if len(entry) > 2 else ""
        problem = check_port(address, port)
        if problem:
            problems.append(f"{problem}{f' (planned for {what})' if what else ''}")
    module.exit_json(changed=False, program=program, interpreter=interpreter, script=script, problems=problems)


if __name__ == "__main__":
    main()
