# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: validate the meshkit variables of every host in the play, on the controller."""

from __future__ import annotations

from ansible.plugins.action import ActionBase
from ansible_collections.meshkit.cluster.plugins.plugin_utils.controller import MeshkitImports

MESHKIT = MeshkitImports()
with MESHKIT:
    from meshkit.inventory_schema import slurm_controller_problems, validate_hosts


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        MESHKIT.require("inventory_check")
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        hosts = self._task.args.get("hosts") or task_vars.get("ansible_play_hosts_all", [])
        hostvars = task_vars["hostvars"]
        # A meshkit_* variable of the play itself (its vars:, import_playbook's vars:, a role's) holds for
        # every host, over the inventory's (Ansible's precedence); hostvars do not carry play variables.
        me = task_vars.get("inventory_hostname")
        own = hostvars.get(me, {})
        play = {}
        for key in task_vars:
            if key.startswith("meshkit_"):
                value = self._templar.template(task_vars[key])
                if key not in own or own[key] != value:
                    play[key] = value
        given = {}
        for host in hosts:
            hv = hostvars[host]
            given[host] = {**{key: hv[key] for key in hv if key.startswith("meshkit_")}, **play}
        normalised, problems = validate_hosts(given)
        inventory_hosts = set(task_vars.get("groups", {}).get("all", []))
        controllers = {cfg.get("meshkit_slurm_controller") for cfg in normalised.values() if cfg.get("meshkit_slurm")}
        addresses = {
            c: str(self._templar.template(hostvars[c].get("ansible_host", c)))
            for c in controllers
            if c and c in inventory_hosts
        }
        problems += slurm_controller_problems(normalised, inventory_hosts, addresses)
        result["changed"] = False
        result["problems"] = problems
        if problems:
            result["failed"] = True
            result["msg"] = "the inventory has problems; nothing was changed on any host:\n  - " + "\n  - ".join(
                problems
            )
            return result
        result["config"] = normalised
        result["msg"] = f"inventory valid for {len(normalised)} hosts"
        return result
