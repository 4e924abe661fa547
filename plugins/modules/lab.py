#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the lab action (it runs entirely on the controller, in ansible-playbook's
Python: plugins/action/lab.py, meshkit/lab.py)."""

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
  - Idempotent. A lab that already matches the plan is left alone. A running lab whose hosts and cables alone
    differ from the plan (same name, subnet, link rate, access, names, network daemon, head) is changed in place -
    hosts and cables added and removed, every other host and cable left as it is (see RV(reshaped)). One that
    differs otherwise (another subnet, a dead host) is removed and built again, saying why in RV(reasons). Host
    and client keys are kept across rebuilds.
  - An action plugin - its work is done in ansible-playbook's own Python on the controller (the meshkit package,
    which must be installed there), with no Python started for the task.
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
    description: Seconds to wait for every host's sshd to answer after a build (a bound; it returns once all answer).
    type: int
    default: 120
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
  factory_network:
    description:
      - Hosts (names such as V(node2)) whose cable ports go back as the factory network has them, without a
        reboot - C(bridge0) (STP on) up, every cable port in it, up, at MTU 1500, with no address but its
        link-local ones and no route of its own. Changed only where something had to be done. The lab must be
        built as asked. Only with O(network_daemon=none) (with V(networkd) reboot the host, O(reboot)).
    type: list
    elements: str
    default: []
  replace:
    description:
      - Hosts (names such as V(node3)) swapped for new machines under the same names, cabled into the same ports
        (docs/runbooks/replace-node.md) - each gets a new host key, machine id, MACs and an empty
        C(/var/lib/meshkit), and comes up with the factory network; its peers keep their configuration.
        The lab's known_hosts keeps the OLD keys, as an operator's does, so SSH to those hosts fails until the old
        key is removed and the new one collected (docs/runbooks/ssh-host-keys.md); the next run without
        O(replace) puts the new keys in known_hosts itself. The lab must be built as asked.
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
  description: What O(state=absent), a rebuild or a change in place removed.
  returned: always
  type: list
  elements: str
rebooted:
  description: With O(reboot), per host the seconds from power-off to booted, and the seconds until settled.
  returned: when O(reboot) is given
  type: dict
reshaped:
  description:
    - The hosts and cables added and removed in place (in check mode, that would be), cables by their ends
      (C(node4:tb1-node5:tb0)); C(cables_moved) pairs a removed cable with the added one that took one of its ends;
      C(summary) says it all in one line.
  returned: when the lab was changed in place
  type: dict
  contains:
    hosts_added:
      description: Hosts added.
      type: list
      elements: str
    hosts_removed:
      description: Hosts removed.
      type: list
      elements: str
    cables_added:
      description: Cables added.
      type: list
      elements: str
    cables_removed:
      description: Cables removed.
      type: list
      elements: str
    cables_moved:
      description: "[removed, added] pairs."
      type: list
      elements: list
    cables_kept:
      description: How many cables were left as they were.
      type: int
    summary:
      description: One line naming every host and cable added and removed.
      type: str
replaced:
  description: >-
    With O(replace): the hosts replaced, their cables (plugged in again), per host the SHA256 fingerprint of
    the C(old) key (still in known_hosts) and of the C(new) one, and the seconds it took.
  returned: when O(replace) is given
  type: dict
trusted:
  description: The replaced hosts whose new keys this run put in known_hosts.
  returned: when a replaced host's new key was not yet trusted
  type: list
  elements: str
factory_network:
  description: >-
    With O(factory_network), per host the C(ip) commands that put its ports back (empty when none were needed).
  returned: when O(factory_network) is given
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
