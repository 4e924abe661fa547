# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""How the launcher reaches a host: the inventory's connection settings, as plain commands.

The launcher keeps one long-lived, streaming session per host, which Ansible's connection
plugins do not offer, so it runs ``ssh`` itself with the inventory's settings (address, port,
user, key, ``ansible_ssh_common_args`` / ``ansible_ssh_extra_args``: host key checking stays as
the inventory has it) and its own persistent master in ``ansible_control_path_dir``. The lab's
``meshkit.cluster.netns`` connection becomes ``nsenter`` into the host's holder process, and
``local`` runs on the controller.

Run as a program, this file is the remote shell agent of MPI jobs (mpirun's ``plm_rsh_agent``):
``python3 launch_connection.py CONNECTIONS.json HOST WORD...`` runs the words (the remote daemon's
command line, already quoted by mpirun for a shell) on HOST over that host's own connection.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import stat
import sys
import tempfile
from typing import Any

SSH = ("ssh", "ansible.builtin.ssh", "smart", "ansible.legacy.ssh")
# Seconds without a word from a host before the launcher declares it lost (and its agent, not
# hearing from the launcher for as long, stops its ranks). ssh's keepalives and connect timeout
# are set within it. The default of launch_settings' host_timeout (written here, as this file also
# runs as a program of its own that imports nothing of meshkit).
DEFAULT_HOST_TIMEOUT = 20.0
LOCAL = ("local", "ansible.builtin.local", "ansible.legacy.local")
NETNS = ("meshkit.cluster.netns",)


class ConnectionError_(Exception):
    """A host's connection settings cannot be turned into a launch connection."""


def _value(hv: Any, templar: Any, name: str, default: Any = None) -> Any:
    value = hv.get(name, default)
    if templar is not None and isinstance(value, str) and "{{" in value:
        value = templar.template(value)
    return value


def lab_holder(lab_dir: str, netns: str) -> tuple[str, int]:
    """(host name, pid) of the process that holds a lab host's namespaces, checked against the
    named network namespace. The lab's netns connection plugin uses it too."""
    try:
        with open(os.path.join(lab_dir, "state.json")) as handle:
            holders = json.load(handle)["holders"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConnectionError_(f"no lab record in {lab_dir} ({exc}); build the lab first") from exc
    # The namespace is "<lab>-<host>", the record is keyed by host.
    name = next((n for n in holders if netns.endswith("-" + n)), None)
    if name is None:
        raise ConnectionError_(f"namespace {netns} is not a host of this lab ({sorted(holders)})")
    pid = holders[name]
    try:
        alive = os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{netns}").st_ino
    except OSError:
        alive = False
    if not alive:
        raise ConnectionError_(
            f"lab host {name}: holder process {pid} is not in namespace {netns}; rebuild the lab with playbooks/lab.yml"
        )
    return name, int(pid)


def connection_for(
    host: str,
    hv: Any,
    templar: Any = None,
    ssh: dict[str, Any] | None = None,
    become: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """How to reach ``host``. ``ssh``: Ansible's own ssh connection options for it, as Ansible
    resolves them (ansible.cfg, environment, host variables: remote_user, port, private_key_file,
    ssh_args, ssh_common_args, ssh_extra_args, host_key_checking, control_path_dir); without it the
    host variables alone. ``become``: {"method", "user"} when the task runs with become, so the
    ranks run as that user, as Ansible would run the task."""
    kind = _value(hv, templar, "ansible_connection", "ssh")
    python = _value(hv, templar, "ansible_python_interpreter", None)
    if not python or str(python).startswith("auto"):
        python = "python3"
    extra: dict[str, Any] = {}
    if become:
        if become.get("method") != "sudo":
            raise ConnectionError_(
                f"{host}: become_method {become.get('method')} is not one meshkit launch can run ranks with; "
                "use sudo (passwordless: the ranks cannot be asked for a password), or launch without become"
            )
        extra["become"] = {"method": "sudo", "user": str(become.get("user") or "root")}
    if kind in LOCAL:
        return {"kind": "local", "python": python, **extra}
    if kind in NETNS:
        lab_dir = _value(hv, templar, "meshkit_lab_dir")
        netns = _value(hv, templar, "meshkit_lab_netns")
        if not lab_dir or not netns:
            raise ConnectionError_(f"{host}: connection {kind} needs meshkit_lab_dir and meshkit_lab_netns")
        # lab_dir and netns let `meshkit launch` check a remembered connection (the holder changes
        # when the lab is rebuilt).
        pid = lab_holder(lab_dir, netns)[1]
        return {"kind": "nsenter", "pid": pid, "python": python, "lab_dir": lab_dir, "netns": netns, **extra}
    if kind not in SSH:
        raise ConnectionError_(
            f"{host}: ansible_connection={kind} is not one meshkit launch can stream over; use ssh "
            "(or meshkit.cluster.netns / local)"
        )
    if ssh is None:  # the host variables alone (no Ansible configuration to ask)
        ssh = {
            "host": _value(hv, templar, "ansible_host", host) or host,
            "port": _value(hv, templar, "ansible_port", None),
            "remote_user": _value(hv, templar, "ansible_user", None),
            "private_key_file": _value(hv, templar, "ansible_ssh_private_key_file", None),
            "ssh_common_args": _value(hv, templar, "ansible_ssh_common_args", ""),
            "ssh_extra_args": _value(hv, templar, "ansible_ssh_extra_args", ""),
            "control_path_dir": _value(hv, templar, "ansible_control_path_dir", None),
        }
    args: list[str] = []
    for name in ("ssh_args", "ssh_common_args", "ssh_extra_args"):
        args += shlex.split(str(ssh.get(name) or ""))
    if ssh.get("host_key_checking") is False:
        # The user's own configuration turned it off (never meshkit's default): as Ansible does.
        args += ["-o", "StrictHostKeyChecking=no"]
    control_dir = private_control_dir(os.path.expanduser(str(ssh.get("control_path_dir") or "~/.ansible/cp")))
    # Our own master per host (not Ansible's, whose socket name is its own hash): a second launch
    # within a minute skips the SSH handshake.
    args += ["-o", "ControlMaster=auto", "-o", "ControlPersist=60s", "-o", f"ControlPath={control_dir}/mk-%C"]
    return {
        "kind": "ssh",
        "host": str(ssh.get("host") or host),
        "port": ssh.get("port"),
        "user": ssh.get("remote_user"),
        "key": ssh.get("private_key_file"),
        "args": args,
        "python": python,
        **extra,
    }


# A Unix socket's path must fit sun_path (108 bytes with its NUL); ours is <dir>/mk-<40 hex digits>.
SOCKET_PATH_MAX = 107
CONTROL_NAME_LENGTH = len("/mk-") + 40


def private_control_dir(wanted: str) -> str:
    """The directory of meshkit's ssh control sockets: ``wanted`` (Ansible's control_path_dir), or,
    when a socket there would not fit a Unix socket path, a short one of this user's in the temporary
    directory. Either must be this user's and writable by no one else, or no master is made there:
    refused."""
    path = wanted
    if len(wanted) + CONTROL_NAME_LENGTH > SOCKET_PATH_MAX:
        path = os.path.join(tempfile.gettempdir(), f"meshkit-cp-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        # Another user who may write there could plant a socket meshkit's ssh would then use.
        raise ConnectionError_(
            f"{path} (for ssh control sockets) is not this user's, or others may write to it; "
            "remove it or set ansible_control_path_dir to a directory of your own (mode 0700 or 0755)"
        )
    return path


def become_argv(connection: dict[str, Any]) -> list[str]:
    """The words that run a command as the become user (empty without become). Never prompts:
    a password-protected sudo fails at once instead of hanging the launch."""
    become = connection.get("become")
    if not become:
        return []
    return ["sudo", "-n", "-H", "-u", str(become["user"]), "--"]


def still_valid(connection: dict[str, Any]) -> str | None:
    """Why a remembered connection can no longer be used as it is (None: it can)."""
    if connection.get("kind") != "nsenter":
        return None
    try:
        pid = lab_holder(str(connection.get("lab_dir")), str(connection.get("netns")))[1]
    except ConnectionError_ as exc:
        return str(exc)
    return None if pid == connection.get("pid") else f"lab host {connection.get('netns')} was rebuilt"


def keepalive_options(host_timeout: float) -> list[str]:
    """ssh options that end a connection whose server went silent within ``host_timeout``
    seconds (keepalives through the encrypted channel, answered by sshd itself), and a
    connection that cannot be set up within it."""
    interval = max(1, int(host_timeout // 4))
    count = max(1, int(host_timeout // interval) - 1)
    return [
        "-o", f"ServerAliveInterval={interval}",
        "-o", f"ServerAliveCountMax={count}",
        "-o", f"ConnectTimeout={max(1, math.ceil(host_timeout))}",
    ]  # fmt: skip


def ssh_argv(connection: dict[str, Any]) -> list[str]:
    """ssh and its options for an ssh connection, up to (and with) the host name. meshkit's
    keepalives come first (ssh takes an option's first value): the launch's host timeout holds
    whatever ServerAlive settings Ansible's ssh_args carry for its own tasks; every other option
    is Ansible's (ansible.cfg, the inventory) as it would use it."""
    argv = ["ssh", "-T", "-o", "BatchMode=yes"]
    if connection.get("port"):
        argv += ["-p", str(connection["port"])]
    if connection.get("user"):
        argv += ["-l", str(connection["user"])]
    if connection.get("key"):
        argv += ["-i", str(connection["key"])]
    keepalive = keepalive_options(float(connection.get("host_timeout") or DEFAULT_HOST_TIMEOUT))
    return [*argv, *keepalive, *(connection.get("args") or []), str(connection["host"])]


def nsenter_argv(connection: dict[str, Any]) -> list[str]:
    return ["nsenter", "-t", str(connection["pid"]), "-n", "-m", "-u", "-i", "-p", "--"]


def shell_argv(connection: dict[str, Any], command: str) -> list[str]:
    """Run a shell command line on the connection's host."""
    kind = connection.get("kind")
    become = become_argv(connection)
    if kind == "ssh":
        return [*ssh_argv(connection), shlex.join([*become, "sh", "-c", command]) if become else command]
    if kind == "nsenter":
        return [*nsenter_argv(connection), *become, "sh", "-c", command]
    if kind == "local":
        return [*become, "sh", "-c", command]
    raise ValueError(f"unknown connection kind {kind!r}")


def rsh_main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: launch_connection.py CONNECTIONS.json HOST WORD...", file=sys.stderr)
        return 2
    path, host, words = argv[0], argv[1], argv[2:]
    try:
        with open(path) as handle:
            connection = json.load(handle)[host]
    except (OSError, ValueError, KeyError) as exc:
        print(f"meshkit rsh: no connection for host {host!r} in {path} ({exc!r})", file=sys.stderr)
        return 255
    command = shell_argv(connection, " ".join(w.strip() for w in words))
    os.execvp(command[0], command)
    return 255  # not reached


if __name__ == "__main__":
    sys.exit(rsh_main(sys.argv[1:]))
