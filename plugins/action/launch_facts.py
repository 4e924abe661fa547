# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: the host module ``launch_facts`` with its management step told the controller's
address as the host sees it (as the ``management`` action does for its module)."""

from __future__ import annotations

from ansible.plugins.action import ActionBase
from ansible_collections.meshkit.cluster.plugins.action.management import controller_facts, with_controller_addresses


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        args["management"], proxy = with_controller_addresses(self, dict(args.get("management") or {}))
        result.update(
            self._execute_module(module_name="meshkit.cluster.launch_facts", module_args=args, task_vars=task_vars)
        )
        if isinstance(result.get("management"), dict):
            result["management"].update(controller_facts(args["management"], proxy))
        else:
            result.update(controller_facts(args["management"], proxy))
        return result
