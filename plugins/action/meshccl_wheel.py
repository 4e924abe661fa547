# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: group the hosts for meshccl and build what the controller builds, here on the controller
(meshkit/meshccl_wheel.py does the work; plugins/modules/meshccl_wheel.py documents it)."""

from __future__ import annotations

from ansible_collections.meshkit.cluster.plugins.plugin_utils.controller import ControllerStep


class ActionModule(ControllerStep):
    STEP = "meshkit.meshccl_wheel"
