"""Which interfaces may be cables (plugins/module_utils/port_rules.py), and that it is the one definition:
discovery (linux_net, host_steps), the management checks, host_facts and the launch agent all use it, and
discovery does not depend on the launch agent."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from ansible_collections.meshkit.cluster.plugins.module_utils import (
    host_facts,
    host_steps,
    linux_net,
    management,
    port_rules,
)

from .test_linux_net import cluster_links, link

MODULE_UTILS = Path(port_rules.__file__).parent
PREFIX = "ansible_collections.meshkit.cluster.plugins.module_utils."


def test_candidate_ports_match_patterns_and_skip_management_lo_and_bridges():
    links = [
        *cluster_links(),
        link("thunderbolt-br", kind="bridge"),
        link("enp1s0f1"),
        link("enp1s0f0"),
    ]
    names = [p["ifname"] for p in port_rules.candidate_ports(links, ["thunderbolt*", "enp1s0f*", "lo"], "enp1s0f1")]
    assert names == ["enp1s0f0", "thunderbolt0", "thunderbolt1"]


def test_candidate_ports_keep_bridge_members_for_reporting():
    ports = port_rules.candidate_ports(cluster_links(), ["thunderbolt*"], "eth0")
    assert [(p["ifname"], p.get("master")) for p in ports] == [("thunderbolt0", "bridge0"), ("thunderbolt1", "bridge0")]


def test_candidate_ports_without_patterns_is_empty():
    assert port_rules.candidate_ports(cluster_links(), [], None) == []


# ---- one definition, and who depends on whom ----------------------------------------------------------


def imported_module_utils(name: str) -> set[str]:
    """The collection's module_utils that module_utils ``name`` imports (its import statements)."""
    tree = ast.parse((MODULE_UTILS / f"{name}.py").read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX[:-1]):
            if node.module == PREFIX[:-1]:
                out.update(alias.name for alias in node.names)
            else:
                out.add(node.module[len(PREFIX) :])
        elif isinstance(node, ast.Import):
            out.update(a.name[len(PREFIX) :] for a in node.names if a.name.startswith(PREFIX))
    return out


def test_discovery_management_host_facts_and_the_agent_use_the_port_rules():
    assert {"port_rules"} <= imported_module_utils("linux_net")
    assert {"port_rules"} <= imported_module_utils("management")
    assert {"port_rules"} <= imported_module_utils("host_steps")
    assert {"port_rules"} <= imported_module_utils("host_facts")
    assert linux_net.protected is port_rules.protected and linux_net.matches is port_rules.matches
    assert management.matches is port_rules.matches and management.protected is port_rules.protected
    assert host_steps.port_rules is port_rules
    assert host_facts.candidate_ports is port_rules.candidate_ports and host_facts.has_carrier is port_rules.has_carrier
    # linux_net no longer hands the rules on: its users import port_rules themselves.
    assert not hasattr(linux_net, "candidate_ports") and not hasattr(linux_net, "has_carrier")


def test_discovery_does_not_depend_on_the_launch_agent():
    """linux_net, host_steps (discovery) and management import no part of the launch agent, and a fresh
    Python that imports them has none of it loaded; the agent, in a fresh Python, has the port rules."""
    for name in ("linux_net", "management", "port_rules"):
        assert not {m for m in imported_module_utils(name) if m == "launch_agent" or m.startswith("agent_")}, name
    probe = (
        "import importlib, json, sys\n"
        "importlib.import_module(sys.argv[1] + sys.argv[2])\n"
        "print(json.dumps(sorted(m[len(sys.argv[1]):] for m in sys.modules if m.startswith(sys.argv[1]))))\n"
    )

    def loaded(name: str) -> set[str]:
        out = subprocess.run([sys.executable, "-c", probe, PREFIX, name], capture_output=True, text=True, check=True)
        return set(json.loads(out.stdout))

    for discovery in ("linux_net", "host_steps"):
        found = loaded(discovery)
        assert "port_rules" in found, found
        assert not {m for m in found if m == "launch_agent" or m.startswith("agent_")}, found
    assert "port_rules" in loaded("launch_agent")
