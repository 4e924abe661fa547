# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: meshkit check on a schedule on the controller, as `meshkit watch enable`/`disable`
(meshkit/watch.py does the work; plugins/modules/watch.py documents it)."""

from __future__ import annotations

from ansible_collections.meshkit.cluster.plugins.plugin_utils.controller import ControllerStep


class ActionModule(ControllerStep):
    STEP = "meshkit.watch"
