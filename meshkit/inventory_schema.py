# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The variables a user sets in an inventory, validated with Cerberus before any host is touched."""

from __future__ import annotations

import copy
import difflib
import ipaddress
import os
from dataclasses import dataclass
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils.defaults import DEFAULT_POOL, DEFAULTS, DISCOVER_PORTS
from ansible_collections.meshkit.cluster.plugins.module_utils.naming import natural_key
from cerberus import Validator

from meshkit.launch_settings import SETTING
from meshkit.rates import parse_rate
from meshkit.topology import BACKENDS

# Set once for the whole cluster: every host must agree.
CLUSTER_WIDE = (
    "meshkit_cluster_name",
    "meshkit_backend",
    "meshkit_address_pool",
    "meshkit_ranks_per_host",
    "meshkit_master_port",
    "meshkit_meshccl_port",
    "meshkit_slurm",
    "meshkit_slurm_controller",
    "meshkit_slurm_partition",
    "meshkit_slurm_munge_key",
)


@dataclass(frozen=True)
class Variable:
    """One inventory variable, written once: its rule (Cerberus: type, range, choices), what to do
    about a bad value, and how README's table shows a default that is not a value (None in DEFAULTS:
    derived, or found on the host). Its default is DEFAULTS' (plugins/module_utils/defaults.py:
    the modules that run on the hosts read it too); tests/unit/test_settings.py checks DEFAULTS,
    README's table and the roles' defaults against this table."""

    rule: dict[str, Any]
    hint: str = ""
    shown: str | None = None  # README's default, where it is not DEFAULTS' value as it is
    user: bool = True  # False: written by the playbooks (lab inventories), no default, not in README
    blank_is_unset: bool = False  # "" (as -e gives an unset value) means unset


# The job's ranks per host defaults to the inventory's: one range for both.
RANKS = SETTING["ranks_per_host"]

VARIABLES: dict[str, Variable] = {
    "meshkit_cluster_name": Variable(
        {"type": "string", "regex": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"},
        "letters, digits, '.', '_' or '-'; it names the artifacts directory",
    ),
    "meshkit_fabric": Variable(
        {"type": "string", "allowed": ["thunderbolt", "ethernet", "roce"]}, "use thunderbolt, ethernet or roce"
    ),
    "meshkit_backend": Variable(
        {"type": "string", "allowed": list(BACKENDS)},
        "use ring, jaccl, jaccl-ring, or leave it unset for the best the cabling allows",
    ),
    "meshkit_address_pool": Variable(
        {"type": "string", "check_with": "pool"}, f"use an IPv4 network of /29 or larger, e.g. {DEFAULT_POOL}"
    ),
    "meshkit_peer_ports": Variable(
        {"type": "list", "schema": {"type": "string", "regex": r"^[A-Za-z0-9_.*?\[\]-]{1,15}$"}},
        "give interface name patterns such as ['thunderbolt*'] or ['enp1s0f*']",
        shown=f"`[]` (Linux: {', '.join(f'`{p}`' for p in DISCOVER_PORTS)})",
    ),
    "meshkit_bridge": Variable(
        {"type": "string", "regex": r"^[A-Za-z0-9_.-]{1,15}$"}, "the bridge the peer ports start in (bridge0 on macOS)"
    ),
    "meshkit_mtu": Variable(
        {"type": "integer", "nullable": True, "min": 1280, "max": 65520},
        "set an MTU from 1280 to 65520, or leave it unset to keep the interface's",
        blank_is_unset=True,
    ),
    "meshkit_link_rate": Variable(
        {"type": "string", "nullable": True, "check_with": "rate"},
        "the rate this host's cables should reach, e.g. 80gbit or 40Gb/s (meshkit check compares with it), or leave "
        "it unset to use the negotiated link speed",
    ),
    "meshkit_management_interface": Variable(
        {"type": "string", "nullable": True, "regex": r"^[A-Za-z0-9_.@-]{1,15}$"},
        "name the interface that carries SSH, or leave it unset to detect it",
        shown="established",
    ),
    "meshkit_state_dir": Variable({"type": "string", "regex": r"^/.*"}, "give an absolute path"),
    "meshkit_ping_count": Variable({"type": "integer", "min": 1, "max": 20}, "use 1 to 20"),
    "meshkit_ranks_per_host": Variable(
        {"type": "integer", "min": RANKS.min, "max": RANKS.max},
        f"use a whole number from {RANKS.min} (ranks started on each host)",
    ),
    "meshkit_master_port": Variable(
        {"type": "integer", "min": 1024, "max": 65535}, "use a free TCP port from 1024 to 65535 (torchrun rendezvous)"
    ),
    "meshkit_meshccl_port": Variable(
        {"type": "integer", "min": 1024, "max": 65279},
        "use a free TCP port from 1024; local rank k listens on this plus k",
    ),
    "meshkit_meshccl_install": Variable(
        {"type": "boolean"}, "true (setup.yml installs meshccl on every host) or false"
    ),
    "meshkit_meshccl_venv": Variable(
        {"type": "string", "nullable": True, "regex": r"^/.*"},
        "give an absolute path for meshccl's virtual environment (default: <state_dir>/meshccl)",
        shown="`<state_dir>/meshccl`",
        blank_is_unset=True,
    ),
    "meshkit_meshccl_python": Variable(
        {"type": "string", "empty": False}, "name the host's Python 3.9 or later that makes meshccl's environment"
    ),
    "meshkit_meshccl_build_on": Variable(
        {"type": "string", "allowed": ["controller", "group", "host"]},
        "use controller (the controller builds where its platform matches the host, else the host's group's first "
        "host), group (the group's first host always) or host (every host builds its own)",
    ),
    "meshkit_artifacts_dir": Variable({"type": "string", "nullable": True}, shown="`./artifacts/<cluster>`"),
    "meshkit_slurm": Variable({"type": "boolean"}, "true (setup.yml sets up Slurm: munge, slurmctld, slurmd) or false"),
    "meshkit_slurm_controller": Variable(
        {"type": "string", "nullable": True, "regex": r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
        "name the inventory host slurmctld runs on (a cluster host, or a head node outside the cluster's group), "
        "or leave it unset for the ring's first host",
        shown="the ring's first host",
    ),
    "meshkit_slurm_partition": Variable(
        {"type": "string", "regex": r"^[A-Za-z0-9_-]{1,40}$"},
        "letters, digits, '_' or '-' (the name of Slurm's one partition)",
    ),
    "meshkit_slurm_munge_key": Variable(
        {"type": "string", "nullable": True, "empty": False},
        "give the path of a munge key on the controller, or leave it unset to use the slurmctld host's",
    ),
    "meshkit_hosts": Variable({"type": "string"}, user=False),
    # Written by playbooks/lab.yml into lab inventories.
    "meshkit_lab_name": Variable({"type": "string"}, user=False),
    "meshkit_lab_dir": Variable({"type": "string"}, user=False),
    "meshkit_lab_netns": Variable({"type": "string"}, user=False),
    "meshkit_lab_ports": Variable({"type": "list"}, user=False),
}

SCHEMA: dict[str, dict[str, Any]] = {name: v.rule for name, v in VARIABLES.items()}
HINTS: dict[str, str] = {name: v.hint for name, v in VARIABLES.items() if v.hint}
# What _coerce() makes of the strings -e gives.
_WHOLE = tuple(name for name, v in VARIABLES.items() if v.rule["type"] == "integer")
_FLAGS = tuple(name for name, v in VARIABLES.items() if v.rule["type"] == "boolean")
_BLANK = tuple(name for name, v in VARIABLES.items() if v.blank_is_unset)


class _Validator(Validator):
    def _check_with_rate(self, field: str, value: Any) -> None:
        try:
            parse_rate(value)
        except ValueError as exc:
            self._error(field, str(exc))

    def _check_with_pool(self, field: str, value: Any) -> None:
        try:
            net = ipaddress.IPv4Network(value, strict=True)
        except ValueError as exc:
            self._error(field, f"not an IPv4 network ({exc})")
            return
        if net.prefixlen > 29:
            self._error(field, "too small: it must hold at least two /30 cable networks")


def _coerce(doc: dict[str, Any]) -> dict[str, Any]:
    out = dict(doc)
    for key in _WHOLE:
        value = out.get(key)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    for key in _FLAGS:
        flag = out.get(key)
        if isinstance(flag, str) and flag.strip().lower() in ("true", "yes", "1", "false", "no", "0"):
            out[key] = flag.strip().lower() in ("true", "yes", "1")
    for key in _BLANK:
        if out.get(key) == "":
            out[key] = None
    return out


# What meshkit's own modules and playbooks set on a host during a run (facts, registered results, play variables): a
# later play of the same run (launch.yml or check.yml after setup.yml, setup.yml imported twice) sees them among the
# host's meshkit_* variables, and they are no settings of the user's.
SET_BY_MESHKIT = frozenset(
    {
        "meshkit_discovery",
        "meshkit_rdma",
        "meshkit_cable_check",
        "meshkit_inventory",
        "meshkit_cfg",
        "meshkit_artifacts",
        "meshkit_ssh_names",
        "meshkit_host",
        "meshkit_planned",
        "meshkit_job",
        "meshkit_launch",
        "meshkit_check",
        "meshkit_check_facts",
    }
)


def validate_hosts(host_vars: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Validate every host's meshkit_* variables.

    Returns (normalised variables per host, problems). A problem names the hosts, the
    field, the bad value and what to do; a problem shared by several hosts (a group
    variable) is reported once with all of them.
    """
    grouped: dict[str, list[str]] = {}
    normalised: dict[str, dict[str, Any]] = {}
    validator = _Validator(SCHEMA)
    for host in sorted(host_vars):
        given = _coerce(
            {k: v for k, v in host_vars[host].items() if k.startswith("meshkit_") and k not in SET_BY_MESHKIT}
        )
        for key in given:
            if key not in SCHEMA:
                # Compare what follows "meshkit_", or every name looks close to every other.
                stems = {k.removeprefix("meshkit_"): k for k in SCHEMA}
                close = difflib.get_close_matches(key.removeprefix("meshkit_"), list(stems), n=1, cutoff=0.75)
                hint = f"did you mean {stems[close[0]]}?" if close else "remove it or check the spelling"
                grouped.setdefault(f"{key} is not a meshkit variable; {hint}", []).append(host)
        known = {k: v for k, v in given.items() if k in SCHEMA}
        if not validator.validate(known):
            for field, errors in validator.errors.items():
                message = "; ".join(str(e) for e in errors)
                text = f"{field} = {known.get(field)!r}: {message}; {HINTS.get(field, '')}".rstrip("; ")
                grouped.setdefault(text, []).append(host)
            continue
        merged = {**copy.deepcopy(DEFAULTS), **validator.document}
        if merged["meshkit_fabric"] != "thunderbolt" and not merged["meshkit_peer_ports"]:
            grouped.setdefault(
                f"meshkit_peer_ports is empty with meshkit_fabric={merged['meshkit_fabric']}: name the cabled "
                "interfaces, e.g. ['enp65s0f*']",
                [],
            ).append(host)
            continue
        # Derived, not set by users: the port patterns discovery probes.
        merged["meshkit_discover_ports"] = list(merged["meshkit_peer_ports"] or DISCOVER_PORTS)
        artifacts = merged["meshkit_artifacts_dir"] or os.path.join("artifacts", merged["meshkit_cluster_name"])
        merged["meshkit_artifacts_dir"] = os.path.abspath(artifacts)
        if not merged["meshkit_meshccl_venv"]:
            merged["meshkit_meshccl_venv"] = merged["meshkit_state_dir"].rstrip("/") + "/meshccl"
        normalised[host] = merged
    for key in CLUSTER_WIDE:
        values = {h: v[key] for h, v in normalised.items()}
        if len(set(map(str, values.values()))) > 1:
            shown = ", ".join(f"{h}={v!r}" for h, v in sorted(values.items()))
            grouped.setdefault(f"{key} differs between hosts ({shown}); set it once for the whole cluster", []).extend(
                sorted(values)
            )
    problems = [f"{', '.join(sorted(set(hosts), key=natural_key))}: {text}" for text, hosts in grouped.items()]
    return normalised, problems


def slurm_controller_problems(
    normalised: dict[str, dict[str, Any]], inventory_hosts: set[str], addresses: dict[str, str] | None = None
) -> list[str]:
    """meshkit_slurm_controller must name a host Ansible can reach: one of the inventory's (a cluster host, or
    a head node in a group of its own), whose address (``addresses``: its ansible_host, else its name) the
    nodes can reach too: slurm.conf gives every slurmd that address, so a loopback one (an inventory
    ``localhost`` without ansible_host) would have each node call itself. Checked before anything changes."""
    hosts: dict[str, list[str]] = {}
    for host, cfg in normalised.items():
        controller = cfg.get("meshkit_slurm_controller")
        if cfg.get("meshkit_slurm") and controller:
            hosts.setdefault(controller, []).append(host)
    problems = []
    for controller, names in sorted(hosts.items()):
        who = f"{', '.join(sorted(names, key=natural_key))}: meshkit_slurm_controller = {controller!r}"
        if controller not in inventory_hosts and controller not in normalised:
            problems.append(
                f"{who}: not a host of the inventory; name a cluster host, or add the head node slurmctld runs on to "
                "the inventory in a group of its own (outside the cluster's group; for the controller itself: "
                "localhost with ansible_connection=local and ansible_host set to its address on the cluster's network)"
            )
            continue
        address = (addresses or {}).get(controller, controller)
        if _loopback(address):
            problems.append(
                f"{who}: its address {address!r} (ansible_host, else the inventory name) is this machine's own to "
                "every host: each node's slurmd would call itself. Set ansible_host (or slurm_addr) of "
                f"{controller} to an address the cluster's hosts reach it at"
            )
    return problems


def _loopback(address: str) -> bool:
    if address.lower() in ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"):
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
