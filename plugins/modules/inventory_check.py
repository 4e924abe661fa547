#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the inventory_check action (it runs entirely on the controller)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: inventory_check
short_description: Validate meshkit's inventory variables for every host in the play
description:
  - Runs on the controller (action plugin) and touches no host.
  - Validates every C(meshkit_*) variable of every host in the play against meshkit's Cerberus schema
    (fabric, backend, address pool, peer-port patterns, MTU, ...), flags unknown C(meshkit_*) names with the
    closest known one, and checks that cluster-wide variables agree between hosts.
  - Fails listing every problem with the hosts it concerns and what to do.
version_added: 0.1.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
options:
  hosts:
    description: Hosts to check; defaults to every host of the play.
    type: list
    elements: str
"""

EXAMPLES = r"""
- name: Validate the inventory before touching any host
  meshkit.cluster.inventory_check:
  run_once: true
"""

RETURN = r"""
config:
  description: Per host, its meshkit variables with defaults filled in.
  returned: success
  type: dict
problems:
  description: One line per problem, naming hosts, field, value and what to do.
  returned: always
  type: list
  elements: str
"""
