#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the meshccl_wheel action (it runs entirely on the controller, in ansible-playbook's
Python: plugins/action/meshccl_wheel.py, meshkit/meshccl_wheel.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: meshccl_wheel
short_description: Group the hosts by platform and prepare one meshccl wheelhouse per group (controller side)
description:
  - Hashes meshccl's sources (the C(collective) directory, its build directories left out) and the extra
    requirements into a build id. The id does not depend on any platform - every host records the same one.
  - With O(phase=plan) and O(hosts) (each host's M(meshkit.cluster.meshccl_host_facts) result), groups the hosts by
    OS, architecture, Python X.Y and libc (glibc's version; macOS's version on a Mac). A group is built once. On
    the controller when the controller's platform serves it (same OS, architecture and Python X.Y, and a libc no
    newer than the hosts'), unless its hosts say otherwise (C(build_on) - C(group) builds on the group's first
    host, C(host) on every host itself). Otherwise on the group's first host that can build - from meshccl's source
    distribution, which this module makes once (scikit-build-core's C(build_sdist), no network).
  - Only groups with a host whose installed build is not the current one are built, and only when the group's
    wheelhouse (C(dest/<build id>/<group>)) is not already complete.
  - Before anything is built anywhere, a host with a Python older than 3.9, or a group whose builder lacks a C++
    compiler, CMake, or Python's or OpenSSL's headers, fails the task naming the host and the command that installs
    what is missing (C(xcode-select --install) on a Mac).
  - For the controller's groups it builds the wheel here (C(pip wheel), build requirements from a local directory of
    wheels, C(--no-index)) and adds binary wheels of the extra requirements and of pip. For the other groups it
    prepares a kit (the source distribution, the build requirements' wheels and pip's, for that group's Python)
    to copy to the builder, and stages the group's wheelhouse (binary wheels of the extra requirements for that
    platform, from C(pip download --platform ... --python-version X.Y); a requirement with no such wheel is left
    for the host to install from its own package index).
  - For every host to install, one archive to copy (C(hosts.<host>.archive)). Where the host's Python is at a path
    where the controller has a Python of the same X.Y (not itself a virtual environment's), and the group is built
    on the controller, a ready C(environment) - made here once with that interpreter from the group's wheelhouse,
    packed for the host's environment path (C(environment-<hash>.tar.gz) in the group's wheelhouse). Elsewhere the
    group's C(wheelhouse.tar), which the host installs with pip. See M(meshkit.cluster.meshccl_venv).
  - With O(phase=finish), after the builders' wheels were fetched into the staged wheelhouses, checks each holds a
    meshccl wheel, packs its C(wheelhouse.tar) and marks it complete.
  - Without O(hosts), builds (or with check mode reports) the controller's own wheelhouse only.
  - Older builds' wheelhouses in O(dest) are removed, the previous one kept.
  - "Run it on the controller (C(delegate_to: localhost), C(run_once))."
  - An action plugin - its work is done in ansible-playbook's own Python on the controller (the meshkit package,
    which must be installed there), with no Python started for the task.
  - The controller's Python is ansible-playbook's - it builds the controller's wheelhouse and serves the hosts
    of its platform.
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
  source:
    description: meshccl's source directory (the one holding its C(pyproject.toml)).
    type: path
    required: true
  dest:
    description: Where wheelhouses are kept, one directory per build id, one per group in it.
    type: path
    required: true
  requirements:
    description:
      - Further packages hosts get, as binary wheels. A bare name is pinned to the version installed here, if any
        (for another platform or Python, the newest that has a wheel there when the pinned one has none).
    type: list
    elements: str
    default: [numpy]
  hosts:
    description:
      - Each host's M(meshkit.cluster.meshccl_host_facts) result (its C(build_on) included), in play order.
    type: dict
    default: {}
  phase:
    description: C(plan) groups and builds what the controller builds; C(finish) completes the groups built on hosts.
    type: str
    choices: [plan, finish]
    default: plan
  groups:
    description: For O(phase=finish), the C(groups) that O(phase=plan) returned.
    type: list
    elements: dict
    default: []
"""

EXAMPLES = r"""
- name: Group the hosts and build what the controller builds
  meshkit.cluster.meshccl_wheel:
    source: "{{ role_path }}/../../collective"
    dest: "{{ lookup('ansible.builtin.env', 'HOME') }}/.cache/meshkit/meshccl-wheels"
    hosts: "{{ dict(ansible_play_hosts | zip(ansible_play_hosts | map('extract', hostvars, 'meshccl_host'))) }}"
  run_once: true
  delegate_to: localhost
  register: meshccl_wheelhouse
"""

RETURN = r"""
build:
  description: The build id (16 hex digits), a hash of the sources and the pinned requirements.
  returned: always
  type: str
version:
  description: meshccl's version.
  returned: always
  type: str
path:
  description: The controller's own wheelhouse (empty when no host uses it).
  returned: always
  type: str
wheels:
  description: The wheel file names in it; empty when it is not built (check mode, or no host needs it).
  returned: always
  type: list
  elements: str
python_tag:
  description: The controller's CPython tag, e.g. C(cp311).
  returned: always
  type: str
groups:
  description:
    - One per group - name, platform, where (controller, group, host), builder (C(controller) or a host), hosts,
      needs (hosts not current), build_now, ready (its wheelhouse is complete), path, staging, kit, wheels,
      built_on, unresolved (requirements its hosts install from their own index).
  returned: always
  type: list
  elements: dict
hosts:
  description:
    - Per host - group, builder, built_on, wheelhouse (on the controller), ready, install (not current),
      build_here (this host builds its group's wheel now), kit, fetch_to, index (the build fetches its build
      requirements from the host's index), unresolved, archive (the one file to copy to it, on the controller),
      ship (C(environment) or C(wheels)), why_wheels (why no ready environment is shipped), bin (its environment's
      C(bin) directory).
  returned: always
  type: dict
summary:
  description: One line per group - who builds for whom, and what this run does.
  returned: always
  type: list
  elements: str
"""
