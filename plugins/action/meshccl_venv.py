# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: copy meshccl's archive (one file) from the controller, then install it on the host.

One task, three round trips where the archive is needed: the task's temporary directory made, the
archive put there (one transfer, over the connection's own multiplexed channel), the module run
(it removes the archive and that directory itself). Nothing is copied in check mode, or without
``src`` (the module then reads, or installs from ``wheelhouse``)."""

from __future__ import annotations

import os

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        src = args.pop("src", None)
        if src and not self._task.check_mode and args.get("state", "present") == "present":
            if not os.path.isfile(src):
                raise AnsibleActionFail(f"src={src}: no such archive on the controller (meshccl_wheel makes it)")
            if self._connection._shell.tmpdir is None:
                self._make_tmp_path()
            tmpdir = self._connection._shell.tmpdir
            remote = self._connection._shell.join_path(tmpdir, os.path.basename(src))
            self._transfer_file(src, remote)
            self._fixup_perms2((tmpdir, remote))
            args["archive"] = remote
        try:
            result.update(
                self._execute_module(module_name="meshkit.cluster.meshccl_venv", module_args=args, task_vars=task_vars)
            )
        finally:
            self._remove_tmp_path(self._connection._shell.tmpdir)
        return result
