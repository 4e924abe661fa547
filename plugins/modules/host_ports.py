#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: a host's ports in one call - out of the bridge, discovered, RDMA read."""

from __future__ import annotations

DOCUMENTATION = r"""
module: host_ports
short_description: Take the peer ports out of the bridge, discover the cabling and read RDMA, in one call
description:
  - setup.yml's per-host work before the plan, as one round trip to the host instead of three; each step is
    the work of the module it is named after, with that module's options, in this order.
  - 1. O(bridge) (M(meshkit.cluster.bridge_detach)) takes the peer ports out of the Thunderbolt bridge and
    disables it; left out, the bridge is not touched (a discovery-only run).
  - 2. O(discover) (M(meshkit.cluster.discover)) finds which port is cabled to which host; changes nothing;
    sets the fact C(meshkit_discovery). Not where step 1 changed something (also in check mode; RV(rediscover)) -
    a peer whose ports are still in its bridge answers nothing, so discovery waits until every host's ports
    have left theirs - the caller runs this module again, without O(bridge), on every host.
  - 3. O(rdma) (M(meshkit.cluster.rdma_facts)) reads RDMA on the ports discovery saw a peer on, with the
    Thunderbolt generations discovery read; sets the fact C(meshkit_rdma). Only where step 2 ran.
  - With C(state=absent) in O(bridge) (undo), only step 1 runs - it puts the ports back into the bridge as the
    host's record says - and O(discover) is left out.
  - A step that fails fails the module, naming the step (RV(step)); the steps after it do not run.
version_added: 0.9.0
author: meshkit contributors (@meshkit)
extends_documentation_fragment:
  - meshkit.cluster.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
options:
  bridge:
    description:
      - The options of M(meshkit.cluster.bridge_detach). Left out or null, the bridge is not touched.
    type: dict
  discover:
    description: The options of M(meshkit.cluster.discover). Required unless O(bridge) has C(state=absent).
    type: dict
  rdma:
    description:
      - The options of M(meshkit.cluster.rdma_facts) but O(meshkit.cluster.rdma_facts#module:ports) and
        O(meshkit.cluster.rdma_facts#module:generations), which come from discovery.
    type: dict
    default: {}
"""

EXAMPLES = r"""
- name: Take the peer ports out of the bridge, discover the cabling, read RDMA
  meshkit.cluster.host_ports:
    bridge:
      bridge: bridge0
      peer_ports: [thunderbolt*]
      management_interface: "{{ meshkit_management.interface }}"
    discover:
      peer_ports: [thunderbolt*]
      management_interface: "{{ meshkit_management.interface }}"
  register: meshkit_ports
"""

RETURN = r"""
bridge:
  description: What M(meshkit.cluster.bridge_detach) returns; absent when the bridge was not touched.
  returned: when O(bridge) is given
  type: dict
discovery:
  description: What M(meshkit.cluster.discover) returns (C(ports), C(platform), C(management_interface)).
  returned: unless RV(rediscover)
  type: dict
rdma:
  description: This host's RDMA facts, as M(meshkit.cluster.rdma_facts) returns them in its C(rdma).
  returned: unless RV(rediscover)
  type: dict
rediscover:
  description: The bridge step changed something, so discovery did not run (see above); false on undo.
  returned: success
  type: bool
step:
  description: The step that failed (bridge, discover or rdma).
  returned: failure
  type: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.meshkit.cluster.plugins.module_utils import host_steps as steps


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "bridge": {"type": "dict"},
            "discover": {"type": "dict"},
            "rdma": {"type": "dict", "default": {}},
        },
        supports_check_mode=True,
    )
    p = module.params

    def body(run: steps.Run) -> None:
        out = run.out
        undo = (p["bridge"] or {}).get("state") == "absent"
        if p["discover"] is None and not undo:
            module.fail_json(msg="discover is required unless bridge has state absent (undo)")
        if p["bridge"] is not None:
            out["bridge"] = run.step("bridge", steps.BRIDGE_ARGS, p["bridge"], steps.bridge_detach)
        if undo:
            out["rediscover"] = False
            return
        # A port that leaves a bridge now is discovered once every host's ports have left theirs (a peer
        # still bridged answers nothing): the caller runs discovery again, without the bridge step.
        out["rediscover"] = bool(out.get("bridge", {}).get("changed"))
        if out["rediscover"]:
            return
        out["discovery"] = run.step("discover", steps.DISCOVER_ARGS, p["discover"], steps.discover, changes=False)
        found = out["discovery"]["ports"]
        rdma = {
            **p["rdma"],
            "ports": [x["port"] for x in found if x["seen"] and x["port"]],
            "generations": {x["port"]: x["generation"] for x in found if x["port"]},
        }
        facts = run.step("rdma", steps.RDMA_ARGS, rdma, steps.rdma_facts, changes=False)
        out["rdma"] = facts["rdma"]
        out["ansible_facts"] = {**facts["ansible_facts"], "meshkit_discovery": out["discovery"]}

    steps.run_steps(module, body)


if __name__ == "__main__":
    main()
