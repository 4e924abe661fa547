# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Options of the modules that must never touch the management interface."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  management_interface:
    description:
      - The interface that carries the management connection, as C(meshkit.cluster.management) established it
        (C(setup.yml) passes it). Never touched, nor anything it rests on.
      - When not given, the module establishes it itself the same way from O(management_address),
        O(controller_addresses) and C(SSH_CONNECTION), and fails when it cannot (fail closed).
    type: str
  management_address:
    description: How the controller reaches this host (the inventory's C(ansible_host)), resolved on the host.
    type: str
  controller_addresses:
    description: The controller's addresses as the host sees them; the route back to them names an interface.
    type: list
    elements: str
    default: []
"""
