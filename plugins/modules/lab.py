#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: the local emulated cluster (namespaces, veth cables, bridges, sshd)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: lab
short_description: Build or remove meshkit's local emulated cluster
description:
  - Builds a cluster of O(size) hosts on this Linux machine. Each host is a network namespace with
    its own hostname, mounts and PID namespace, a management address and its own OpenSSH server.
  - Cables are veth pairs named like peer ports (C(tb0), C(tb1), ...) inside each host, all enslaved to a
    C(bridge0) with STP on, as macOS ships its Thunderbolt Bridge.
  - Validates every input before anything is built and refuses a management subnet that overlaps a
    route of this machine.
  - Idempotent. A lab that already matches the plan is left alone; one that differs (other shape,
    a dead host) is removed and built again. Host and client keys are kept across rebuilds.
  - Driven by the C(meshkit.cluster.lab) role (C(playbooks/lab.yml)); option names in error messages
    are the role's C(lab_*) variables.
version_added: 0.1.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
requirements:
  - Linux with network namespaces, veth and bridges; root.
  - iproute2, util-linux (unshare), openssh-server and openssh-client.
options:
  name:
    description: Lab name; prefixes every namespace (V(<name>-node<i>)) and link the lab makes.
    type: str
    default: lab
  state:
    description: V(present) builds or keeps the lab; V(absent) removes everything it made.
    type: str
    choices: [present, absent]
    default: present
  size:
    description:
      - Number of cabled hosts (2-64), C(node1) to C(node<size>). Defaults to 4, or to the highest host in O(cables).
      - The head node of O(head) is one more, not counted here.
    type: raw
  shape:
    description: Cabling when O(cables) is empty.
    type: str
    default: mesh
  cables:
    description: Explicit cables as pairs of 1-based host numbers; a pair given twice is two parallel cables.
    type: raw
  link_rate:
    description: Rate limit of every cable end (tc tbf), for example V(2gbit). Empty means unlimited.
    type: raw
  mgmt_subnet:
    description: IPv4 network of the management bridge; the controller takes the first address.
    type: str
    default: 198.18.0.0/24
  dir:
    description: Directory for the lab's keys, daemon configs, host state directories and record.
    type: path
    required: true
  init_script:
    description: Path of C(lab_init.py), run as PID 1 of every host.
    type: path
    required: true
  ssh_timeout:
    description: Seconds to wait for every host's sshd to answer after a build.
    type: int
    default: 30
  access:
    description:
      - How the inventory logs in. V(root) - as root. V(sudo) - as the non-root user C(meshadmin), which has
        passwordless sudo; root cannot log in over SSH (C(PermitRootLogin no)); plays use C(become).
      - Each host has its own C(/etc/passwd), C(/etc/shadow), C(/etc/group), C(/etc/gshadow) and C(/etc/sudoers)
        (copies of the machine's plus the user, bind-mounted in the host's own mount namespace) and its own
        C(/home/meshadmin). The machine's own files are never edited.
    type: str
    choices: [root, sudo]
    default: root
  names:
    description:
      - V(true) - the inventory's C(ansible_host) is a name, C(node<i>.<lab>.meshkit.test), that resolves on
        the controller (a marked block in O(hosts_file), added on build and removed on teardown) and on every
        host (its own C(/etc/hosts)). Host keys are collected and checked by name.
    type: bool
    default: false
  head:
    description:
      - V(true) - the lab has one more host after the cabled ones, C(head) (C(head.<lab>.meshkit.test)), standing
        in for a cluster's head (login, Slurm controller) node. It has no cables, no cable ports and no C(bridge0),
        only its management port, with the next management address after the last node's; namespace
        V(<name>-head). Otherwise it is a lab host as every other (own namespaces, hostname, sshd, users, own
        directories, names). The role's inventory puts it in its own group C(heads), outside the group C(cluster).
    type: bool
    default: false
  network_daemon:
    description:
      - V(none) - the lab sets up every host's factory network itself (bridge0 with the ports, the management
        address) at build and at every reboot.
      - V(networkd) - every host runs its own C(systemd-networkd) (and a system D-Bus, for C(networkctl)),
        which configures the network from the host's own C(/etc/systemd/network) alone; the lab writes the
        factory files there (C(10-mgmt0.network), C(20-bridge0.netdev), C(20-bridge0.network), C(30-tb.network)).
    type: str
    choices: [none, networkd]
    default: none
  reboot:
    description:
      - Hosts to reboot (names such as V(node2), or V(head)). Their processes end, their runtime network state is gone,
        and only their own boot brings anything back; the module returns once the lab is settled again.
        The lab must be built as asked.
    type: list
    elements: str
    default: []
  hosts_file:
    description: This machine's hosts file, where O(names=true) adds the lab's names.
    type: path
    default: /etc/hosts
  shared_paths:
    description:
      - Paths the hosts use from this machine's filesystem (the checkout, the hosts' Python). With O(access=sudo)
        the module checks the login user can read and enter each, and fails naming the directory in the way.
    type: list
    elements: path
    default: []
  settle_timeout:
    description:
      - Seconds to wait, after a build and on every run, until every host is settled - its management
        address present, an IPv6 link-local address on every interface that will get one (bridge0
        included), no address still in duplicate-address detection, sshd answering. On the deadline the
        module fails naming each host, interface and what it lacks.
    type: int
    default: 60
"""

EXAMPLES = r"""
- name: Build a 6-host ring
  meshkit.cluster.lab:
    size: 6
    shape: ring
    dir: /srv/meshkit/.lab/lab
    init_script: "{{ role_path }}/files/lab_init.py"

- name: Remove it
  meshkit.cluster.lab:
    state: absent
    dir: /srv/meshkit/.lab/lab
    init_script: "{{ role_path }}/files/lab_init.py"
"""

RETURN = r"""
lab:
  description: The lab as planned and, when present, as built.
  returned: always
  type: dict
  contains:
    hosts:
      description:
        - Per host its name, namespace, management address, ports, state directory, holder PID and whether it is
          the head node (C(head)); the head, when there is one, comes last.
      type: list
      elements: dict
    head:
      description: The head node's name (C(head)) when O(head=true), else null.
      type: str
    cables:
      description: Per cable its two ends (host, port and, when built, the port's MAC address).
      type: list
      elements: dict
    known_hosts:
      description: Host keys collected with ssh-keyscan, in known_hosts format.
      type: list
      elements: str
removed:
  description: What O(state=absent), or a rebuild, removed.
  returned: always
  type: list
  elements: str
rebooted:
  description: With O(reboot), per host the seconds from power-off to booted, and the seconds until settled.
  returned: when O(reboot) is given
  type: dict
reasons:
  description: Why the lab was (or in check mode would be) built again.
  returned: always
  type: list
  elements: str
elapsed:
  description: Seconds spent building or removing.
  returned: always
  type: float
settled_in:
  description: Seconds spent waiting until every host was settled (present only).
  returned: when state is present and not in check mode
  type: float
"""

import sys
import time

from ansible.module_utils.basic import AnsibleModule

try:
    from meshkit.lab_netns import Lab, LabError
    from meshkit.lab_spec import LabSpecError, plan, validate
except ImportError as exc:  # the meshkit package (or its cerberus) is missing from this interpreter
    IMPORT_ERROR: Exception | None = exc
else:
    IMPORT_ERROR = None


def summary(plan_dict: dict) -> str:
    head = next((h for h in plan_dict["hosts"] if h.get("head")), None)
    lines = [
        f"lab {plan_dict['name']}: {plan_dict['size']} hosts"
        + (f" and a head node ({head['name']}, {head['mgmt_ip']}, no cables)" if head else "")
        + f", {plan_dict['shape']}, "
        f"{len(plan_dict['cables'])} cables, link rate {plan_dict['link_rate'] or 'unlimited'}, "
        f"management {plan_dict['mgmt_subnet']}"
    ]
    for c in plan_dict["cables"]:
        a, b = c["ends"]
        lines.append(f"  cable {c['index']}: {a['host']}:{a['port']} <-> {b['host']}:{b['port']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "name": {"type": "str", "default": "lab"},
            "state": {"type": "str", "default": "present", "choices": ["present", "absent"]},
            "size": {"type": "raw"},
            "shape": {"type": "str", "default": "mesh"},
            "cables": {"type": "raw"},
            "link_rate": {"type": "raw"},
            "mgmt_subnet": {"type": "str", "default": "198.18.0.0/24"},
            "dir": {"type": "path", "required": True},
            "init_script": {"type": "path", "required": True},
            "ssh_timeout": {"type": "int", "default": 30},
            "settle_timeout": {"type": "int", "default": 60},
            "access": {"type": "str", "default": "root", "choices": ["root", "sudo"]},
            "names": {"type": "bool", "default": False},
            "head": {"type": "bool", "default": False},
            "network_daemon": {"type": "str", "default": "none", "choices": ["none", "networkd"]},
            "reboot": {"type": "list", "elements": "str", "default": []},
            "hosts_file": {"type": "path", "default": "/etc/hosts"},
            "shared_paths": {"type": "list", "elements": "path", "default": []},
        },
        supports_check_mode=True,
    )
    if IMPORT_ERROR is not None:
        module.fail_json(
            msg=f"meshkit.cluster.lab runs with the meshkit Python package on the controller ({IMPORT_ERROR}): "
            "pip install meshkit"
        )
    p = module.params
    try:
        doc = validate(
            {
                "lab_name": p["name"],
                "lab_state": p["state"],
                "lab_size": p["size"],
                "lab_shape": p["shape"],
                "lab_cables": p["cables"],
                "lab_link_rate": p["link_rate"],
                "lab_mgmt_subnet": p["mgmt_subnet"],
                "lab_access": p["access"],
                "lab_names": p["names"],
                "lab_head": p["head"],
                "lab_network_daemon": p["network_daemon"],
            }
        )
    except LabSpecError as exc:
        module.fail_json(msg=str(exc), problems=exc.problems)

    lab = Lab(
        plan(doc),
        p["dir"],
        p["init_script"],
        sys.executable,
        ssh_timeout=p["ssh_timeout"],
        settle_timeout=p["settle_timeout"],
        hosts_file=p["hosts_file"],
    )
    result: dict = {"changed": False, "removed": [], "reasons": [], "elapsed": 0.0}
    start = time.monotonic()
    try:
        if p["state"] == "absent":
            if lab.exists():
                result["changed"] = True
                result["reasons"] = ["state=absent"]
                result["diff"] = {"before": summary(lab.plan.as_dict()), "after": ""}
                if not module.check_mode:
                    result["removed"] = lab.teardown(keep_files=False)
            result["lab"] = lab.plan.as_dict()
        else:
            missing = lab.missing_tools()
            if missing:
                module.fail_json(msg="this machine cannot run the lab: " + "; ".join(missing), missing=missing)
            conflicts = lab.route_conflicts()
            if conflicts:
                module.fail_json(
                    msg=f"lab_mgmt_subnet = {doc['lab_mgmt_subnet']!r} overlaps routes this machine "
                    f"already has: {'; '.join(conflicts)}. Pick another subnet (-e lab_mgmt_subnet=...) "
                    "so lab traffic can never leave the machine.",
                    conflicts=conflicts,
                )
            reasons = lab.problems()
            reboot = [name for name in p["reboot"] if name]
            if reasons and reboot:
                module.fail_json(
                    msg=f"lab_reboot: lab {doc['lab_name']} is not up as asked ({'; '.join(reasons)}); "
                    "run playbooks/lab.yml without lab_reboot first",
                    reasons=reasons,
                )
            if reasons:
                result["changed"] = True
                result["reasons"] = reasons
                before = lab.recorded()
                result["diff"] = {
                    "before": summary(before["plan"]) if before else "",
                    "after": summary(lab.plan.as_dict()),
                }
                if not module.check_mode:
                    if lab.exists():
                        result["removed"] = lab.teardown(keep_files=True)
                    try:
                        lab.build()
                        lab.check_shared_paths(p["shared_paths"])
                    except LabError:
                        lab.teardown(keep_files=True)  # leave nothing half-built behind
                        raise
            elif lab.plan.names and lab.names_problem():
                # Built as asked, but this machine's hosts file lost the lab's names.
                result["changed"] = True
                result["reasons"] = [str(lab.names_problem())]
                if not module.check_mode:
                    lab.write_names_block()
            if reboot:
                result["changed"] = True
                if not module.check_mode:
                    result["rebooted"] = lab.reboot(reboot)
            if not module.check_mode:
                # Built now or earlier: return only once every host is settled.
                result["settled_in"] = lab.settle()
            result["lab"] = lab.report()
    except LabError as exc:
        module.fail_json(msg=str(exc), **result)
    result["elapsed"] = round(time.monotonic() - start, 2)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
