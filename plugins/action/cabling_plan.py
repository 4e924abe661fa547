# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: plan the cluster from every host's discovery and record plan.json, here on the controller
(meshkit/cabling_plan.py does the work; plugins/modules/cabling_plan.py documents it)."""

from __future__ import annotations

from ansible_collections.meshkit.cluster.plugins.plugin_utils.controller import ControllerStep


class ActionModule(ControllerStep):
    STEP = "meshkit.cabling_plan"
