# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Options of the modules that change the peer network and undo it from the host's record."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  state:
    description:
      - V(present) makes the change. Before its first change on a host, the module records what the host has
        (each peer port's bridge, MTU, up/down, IPv6 link-local addresses; the bridges' state; the network
        manager) in C(<state_dir>/record.json), where O(state_dir) is given; later runs keep the first record.
      - V(absent) undoes it - restores what the record says and removes meshkit's own configuration. With no
        record, or one taken while meshkit's configuration was already there, it refuses and names what it would
        remove, unless O(own_only).
    type: str
    choices: [present, absent]
    default: present
  state_dir:
    description: meshkit's state directory on the host, which holds C(record.json). Required with V(absent).
    type: path
  own_only:
    description:
      - With O(state=absent) and no usable record - remove meshkit's own configuration only (its addresses,
        routes, files, profiles) and restore nothing.
    type: bool
    default: false
"""
