# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: draw the cabling (DOT, SVG, PNG) from the plan, here on the controller
(meshkit/cabling_picture.py does the work; plugins/modules/cabling_picture.py documents it)."""

from __future__ import annotations

from ansible_collections.meshkit.cluster.plugins.plugin_utils.controller import ControllerStep


class ActionModule(ControllerStep):
    STEP = "meshkit.cabling_picture"
