"""Run an Ansible module's main() in-process: exit_json / fail_json raise instead of exiting."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from ansible.module_utils import basic
from ansible.module_utils.testing import patch_module_args


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
