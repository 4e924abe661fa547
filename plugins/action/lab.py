# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: build, keep, reboot or remove the local emulated cluster, here on the controller
(meshkit/lab.py does the work; plugins/modules/lab.py documents it)."""

from __future__ import annotations

from ansible_collections.meshkit.cluster.plugins.plugin_utils.controller import ControllerStep


class ActionModule(ControllerStep):
    STEP = "meshkit.lab"
