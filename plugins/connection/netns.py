# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Connection plugin: run tasks inside a meshkit lab host by entering its namespaces."""

from __future__ import annotations

DOCUMENTATION = r"""
name: netns
short_description: Run tasks inside a meshkit lab host by entering its namespaces
description:
  - A faster alternative to SSH for the local lab built by C(playbooks/lab.yml), for tests.
    Each command runs through C(nsenter) in the host's network, mount, UTS, IPC and PID
    namespaces, so it sees exactly what an SSH session on that host sees (hostname, ports,
    state directory, processes) without the SSH handshake.
  - The host's holder process is read from the lab's record (C(<lab_dir>/state.json)) and
    checked against the host's named network namespace before every use.
  - Logs in as the inventory's C(ansible_user), as SSH would - for a non-root user (a lab built with
    C(lab_access=sudo)) commands run with that user's ids, groups, environment and home directory, read
    from the host's own C(/etc/passwd); C(become) then goes through the host's sudo exactly as over SSH.
    As root (the default) commands run with the controller's environment.
  - Use it with the lab's inventory, e.g. C(-e ansible_connection=meshkit.cluster.netns).
author: meshkit contributors (@meshkit)
version_added: 0.1.0
options:
  lab_dir:
    description: The lab's directory (the inventory sets C(meshkit_lab_dir)).
    type: path
    required: true
    vars:
      - name: meshkit_lab_dir
  netns:
    description: The host's network namespace (the inventory sets C(meshkit_lab_netns)).
    type: str
    required: true
    vars:
      - name: meshkit_lab_netns
  remote_user:
    description: The user to log in as (the inventory's C(ansible_user)); root when unset.
    type: str
    vars:
      - name: ansible_user
      - name: ansible_ssh_user
extends_documentation_fragment:
  - connection_pipelining
"""

import os
import shlex
import subprocess

from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound
from ansible.module_utils.common.text.converters import to_bytes, to_text
from ansible.plugins.connection import ConnectionBase
from ansible.utils.display import Display

try:  # the controller package (pip install meshkit), which builds the lab
    from meshkit.launch_connection import ConnectionError_, lab_holder
except ImportError as exc:
    MESHKIT_IMPORT_ERROR: ImportError | None = exc

    class ConnectionError_(Exception):
        pass

else:
    MESHKIT_IMPORT_ERROR = None

display = Display()


class Connection(ConnectionBase):
    """Commands and files through nsenter into one lab host."""

    transport = "meshkit.cluster.netns"
    has_pipelining = True
    has_tty = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pid: int | None = None
        self._login: list[str] = []  # setpriv ... for a non-root login user
        self._home: str | None = None

    def _connect(self) -> Connection:
        if self._connected:
            return self
        netns = self.get_option("netns")
        try:
            if MESHKIT_IMPORT_ERROR is not None:
                raise AnsibleError(
                    "the lab's connection needs the meshkit Python package "
                    f"({MESHKIT_IMPORT_ERROR}): pip install meshkit"
                )
            _name, self._pid = lab_holder(self.get_option("lab_dir"), netns)
        except ConnectionError_ as exc:
            raise AnsibleConnectionFailure(f"{self._play_context.remote_addr}: {exc}") from exc
        user = self.get_option("remote_user") or "root"
        if user != "root":
            entry = self._passwd_entry(user)
            if entry is None:
                raise AnsibleConnectionFailure(
                    f"{self._play_context.remote_addr}: no user {user!r} in the host's /etc/passwd "
                    "(ansible_user names the login user of a lab built with lab_access=sudo)"
                )
            uid, gid, self._home = entry
            self._login = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "--reset-env", "--"]
        self._connected = True
        display.vvv(f"NETNS: entering {netns} through pid {self._pid} as {user}", host=self._play_context.remote_addr)
        return self

    def _passwd_entry(self, user: str) -> tuple[int, int, str] | None:
        """(uid, gid, home) of a user in the host's own /etc/passwd (seen through its holder)."""
        try:
            with open(f"/proc/{self._pid}/root/etc/passwd") as handle:
                for line in handle:
                    fields = line.rstrip("\n").split(":")
                    if len(fields) >= 6 and fields[0] == user:
                        return int(fields[2]), int(fields[3]), fields[5]
        except (OSError, ValueError):
            return None
        return None

    def _nsenter(self, argv: list[str]) -> list[str]:
        wd = [f"--wdns={self._home}"] if self._home else []
        return ["nsenter", "-t", str(self._pid), "-n", "-m", "-u", "-i", "-p", *wd, "--", *self._login, *argv]

    def exec_command(self, cmd: str, in_data: bytes | None = None, sudoable: bool = True):
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        shell = "/bin/sh" if self._login else os.environ.get("SHELL") or "/bin/sh"
        argv = self._nsenter([shell, "-c", cmd])
        display.vvv(f"NETNS EXEC {shlex.join(argv)}", host=self._play_context.remote_addr)
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if in_data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        stdout, stderr = proc.communicate(in_data)
        return proc.returncode, stdout, stderr

    def put_file(self, in_path: str, out_path: str) -> None:
        super().put_file(in_path, out_path)
        if not os.path.exists(to_bytes(in_path)):
            raise AnsibleFileNotFound(f"file or module does not exist: {in_path}")
        with open(to_bytes(in_path), "rb") as src:
            proc = subprocess.run(
                self._nsenter(["/bin/sh", "-c", f"cat > {shlex.quote(out_path)}"]),
                stdin=src,
                capture_output=True,
                check=False,
            )
        if proc.returncode != 0:
            raise AnsibleError(f"failed to put {in_path} to {out_path}: {to_text(proc.stderr)}")

    def fetch_file(self, in_path: str, out_path: str) -> None:
        super().fetch_file(in_path, out_path)
        with open(to_bytes(out_path), "wb") as dst:
            proc = subprocess.run(self._nsenter(["cat", in_path]), stdout=dst, stderr=subprocess.PIPE, check=False)
        if proc.returncode != 0:
            raise AnsibleError(f"failed to fetch {in_path} to {out_path}: {to_text(proc.stderr)}")

    def close(self) -> None:
        self._connected = False
