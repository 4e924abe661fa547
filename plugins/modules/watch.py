#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the watch action (it runs entirely on the controller, in ansible-playbook's Python:
plugins/action/watch.py, meshkit/watch.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: watch
short_description: Schedule meshkit check on the controller (meshkit watch enable / disable)
description:
  - Runs on the controller (an action plugin, in ansible-playbook's own Python), as C(meshkit watch enable) and
    C(meshkit watch disable) do. O(state=present) installs a scheduled check of the inventory's cluster - a systemd
    timer where systemd runs, a launchd agent on a Mac, else a line of the user's crontab (O(scheduler)).
  - Each run is C(meshkit check --quick), or a full check once O(full_every) has passed; it is skipped while a job
    holds the cluster's hosts. It writes node_exporter's textfile C(<textfile_dir>/meshkit-<cluster>.prom), a
    history and a status page under C(<artifacts>/watch) (docs/check.md, Watching a cluster).
  - Idempotent - changed only when the configuration or the installed schedule differs from what this task would
    make. O(state=absent) removes the schedule and nothing else (the history and the textfile stay).
  - The inventory is validated, and the scheduler asked whether it works here, before anything is written.
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
  inventory:
    description: The inventory setup.yml converged (its C(cluster) group), as each scheduled run reads it.
    type: path
    required: true
  state:
    description: Whether the scheduled check is installed.
    type: str
    choices: [present, absent]
    default: present
  every:
    description: Time between two runs (C(90s), C(15m), C(6h), C(1d)); cron takes whole minutes dividing an hour or
      whole hours dividing a day.
    type: str
    default: 15m
  full_every:
    description: Time between two full checks (every cable's bandwidth); at least O(every). Equal to O(every), every
      run is full.
    type: str
    default: 6h
  textfile_dir:
    description: node_exporter's C(--collector.textfile.directory); it must exist.
    type: path
    default: /var/lib/prometheus/node-exporter
  scheduler:
    description: Which scheduler; C(auto) takes the first that runs here (systemd, launchd, cron).
    type: str
    choices: [auto, systemd, launchd, cron]
    default: auto
  check_args:
    description: More arguments for each C(meshkit check) (C(--threshold=0.7)).
    type: list
    elements: str
    default: []
"""

EXAMPLES = r"""
- name: Check the cluster every 15 minutes, every cable's bandwidth every 6 hours
  meshkit.cluster.watch:
    inventory: "{{ ansible_inventory_sources[0] }}"
    every: 15m
    full_every: 6h

- name: Stop watching
  meshkit.cluster.watch:
    inventory: "{{ ansible_inventory_sources[0] }}"
    state: absent
"""

RETURN = r"""
config:
  description: The watch's configuration file (C(<artifacts>/watch/watch.json)).
  returned: O(state=present)
  type: str
scheduler:
  description: The scheduler used (systemd, launchd or cron).
  returned: O(state=present)
  type: str
textfile:
  description: The node_exporter textfile each run writes.
  returned: O(state=present)
  type: str
installed:
  description: What was installed, and how to see it (C(crontab -l), C(systemctl list-timers)).
  returned: changed and not in check mode
  type: str
removed:
  description: What O(state=absent) removed (or, in check mode, the schedulers it would remove from).
  returned: O(state=absent)
  type: list
  elements: str
"""
