# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the collection's action plugins share on the controller (as community.docker's
plugin_utils: controller-only, never shipped to a host, unlike module_utils).

The controller's work (the plan, the picture, meshccl's wheelhouses, the lab, the inventory check,
the launch) is the meshkit Python package's, done inside ansible-playbook's own Python: no Python
is started for the task. The collection itself must import without that package (ansible-test's
import sanity test, ansible-doc, a controller with only the collection installed), so an action
plugin imports meshkit under ``MeshkitImports`` and asks for it when it runs:

    MESHKIT = MeshkitImports()
    with MESHKIT:
        from meshkit import check_report

    class ActionModule(ActionBase):
        def run(self, tmp=None, task_vars=None):
            MESHKIT.require("check_report")
            ...

An action that is one step of the package (its module file documentation only) is a
``ControllerStep``: the step module's ``ARGUMENT_SPEC`` validates the task's arguments, and its
``run_task(params, check_mode)`` gives the result, as the module's main() gave it.
"""

from __future__ import annotations

import importlib
import json
from types import ModuleType, TracebackType
from typing import Any

from ansible.errors import AnsibleError
from ansible.plugins.action import ActionBase


def missing_controller_package(step: str, error: BaseException) -> AnsibleError:
    """The error of a step run without the meshkit package (or one of its requirements)."""
    return AnsibleError(
        f"meshkit.cluster's {step} runs on the controller with the meshkit Python package, which this "
        f"Python cannot import ({error}); install it where ansible-playbook runs: pip install meshkit"
    )


class MeshkitImports:
    """``with`` it around an action plugin's imports from the meshkit package: an ImportError is kept
    (``error``), not raised, and ``require(step)`` raises it, saying what to install, when the
    action runs."""

    def __init__(self) -> None:
        self.error: ImportError | None = None

    def __enter__(self) -> MeshkitImports:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> bool:
        if isinstance(error, ImportError):
            self.error = error
            return True
        return False

    def require(self, step: str) -> None:
        if self.error is not None:
            raise missing_controller_package(step, self.error)


def step_module(name: str, step: str) -> ModuleType | None:
    """The meshkit package's module ``name`` (``meshkit.cabling_plan``), imported for ``step``
    (AnsibleError saying what to install when it cannot be)."""
    guard = MeshkitImports()
    module = None
    with guard:
        module = importlib.import_module(name)
    guard.require(step)
    return module


class ControllerStep(ActionBase):
    """An action plugin that is one step of the meshkit package, done here on the controller.

    ``STEP`` names the package's module: ``ARGUMENT_SPEC`` (AnsibleModule's form, the one the
    module file's DOCUMENTATION states) and ``run_task(params, check_mode) -> result``. The result is
    what the module's main() returned, through JSON as a module's is."""

    TRANSFERS_FILES = False
    _requires_connection = False
    STEP = ""

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        name = self.STEP.rpartition(".")[2]
        step = step_module(self.STEP, name)
        result = super().run(tmp, task_vars or {})
        _validation, params = self.validate_argument_spec(step.ARGUMENT_SPEC)
        done = step.run_task(params, check_mode=bool(self._play_context.check_mode))
        result.update(json.loads(json.dumps(done)))
        return result
