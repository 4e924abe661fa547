"""Run an Ansible module's main() in-process (exit_json / fail_json raise instead of exiting), or an
action plugin's run() as the task executor runs it on the controller."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from ansible.errors import AnsibleAction
from ansible.module_utils import basic
from ansible.module_utils.testing import patch_module_args
from ansible.playbook.play_context import PlayContext
from ansible.playbook.task import Task


class Exit(Exception):
    """exit_json was called; args[0] holds its keyword arguments."""


class Fail(Exception):
    """fail_json was called; args[0] holds its keyword arguments."""


def patch_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", lambda _m, **kw: (_ for _ in ()).throw(Exit(kw)))
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", lambda _m, **kw: (_ for _ in ()).throw(Fail(kw)))


def run_module(module: ModuleType, args: dict[str, Any], check: bool = False) -> tuple[bool, dict[str, Any]]:
    """(exited normally, the result) of ``module.main()`` with ``args``; call patch_exits first."""
    if check:
        args = {**args, "_ansible_check_mode": True}
    with patch_module_args(args), pytest.raises((Exit, Fail)) as info:
        module.main()
    return info.type is Exit, info.value.args[0]


def run_action(plugin: ModuleType, args: dict[str, Any], check: bool = False) -> tuple[bool, dict[str, Any]]:
    """(succeeded, the result) of action plugin ``plugin``'s ActionModule run in-process as Ansible
    runs it for a task with ``args`` (in check mode if ``check``): what it raises as an
    AnsibleAction (a bad argument) is the task's result, as the task executor makes it."""
    task = Task()
    task.action = f"meshkit.cluster.{plugin.__name__.rpartition('.')[2]}"
    task.args = dict(args)
    task.check_mode = check
    context = PlayContext()
    context.check_mode = check
    # A controller-side action needs no connection: the executor gives it a local one it never uses.
    connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir=None))
    action = plugin.ActionModule(task, connection, context, loader=None, templar=None, shared_loader_obj=None)
    action._load_name = task.action  # as the plugin loader names it
    try:
        result = action.run(task_vars={})
    except AnsibleAction as exc:
        result = exc.result
    return not result.get("failed"), result
