# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The variables a user sets in an inventory, validated with Cerberus before any host is touched."""

from __future__ import annotations

import copy
import difflib
import ipaddress
import os
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils.defaults import DEFAULT_POOL, DEFAULTS, DISCOVER_PORTS
from ansible_collections.meshkit.cluster.plugins.module_utils.naming import natural_key
from cerberus import Validator

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

SCHEMA: dict[str, dict[str, Any]] = {
    "meshkit_cluster_name": {"type": "string", "regex": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"},
    "meshkit_fabric": {"type": "string", "allowed": ["thunderbolt", "ethernet", "roce"]},
    "meshkit_backend": {"type": "string", "allowed": list(BACKENDS)},
    "meshkit_address_pool": {"type": "string", "check_with": "pool"},
    "meshkit_peer_ports": {"type": "list", "schema": {"type": "string", "regex": r"^[A-Za-z0-9_.*?\[\]-]{1,15}$"}},
    "meshkit_bridge": {"type": "string", "regex": r"^[A-Za-z0-9_.-]{1,15}$"},
    "meshkit_mtu": {"type": "integer", "nullable": True, "min": 1280, "max": 65520},
    "meshkit_link_rate": {"type": "string", "nullable": True, "check_with": "rate"},
    "meshkit_management_interface": {"type": "string", "nullable": True, "regex": r"^[A-Za-z0-9_.@-]{1,15}$"},
    "meshkit_state_dir": {"type": "string", "regex": r"^/.*"},
    "meshkit_ping_count": {"type": "integer", "min": 1, "max": 20},
    "meshkit_ranks_per_host": {"type": "integer", "min": 1, "max": 256},
    "meshkit_master_port": {"type": "integer", "min": 1024, "max": 65535},
    "meshkit_meshccl_port": {"type": "integer", "min": 1024, "max": 65279},
    "meshkit_meshccl_install": {"type": "boolean"},
    "meshkit_meshccl_venv": {"type": "string", "nullable": True, "regex": r"^/.*"},
    "meshkit_meshccl_python": {"type": "string", "empty": False},
    "meshkit_meshccl_build_on": {"type": "string", "allowed": ["controller", "group", "host"]},
    "meshkit_artifacts_dir": {"type": "string", "nullable": True},
    "meshkit_slurm": {"type": "boolean"},
    "meshkit_slurm_controller": {"type": "string", "nullable": True, "regex": r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
    "meshkit_slurm_partition": {"type": "string", "regex": r"^[A-Za-z0-9_-]{1,40}$"},
    "meshkit_slurm_munge_key": {"type": "string", "nullable": True, "empty": False},
    "meshkit_hosts": {"type": "string"},
    # Written by playbooks/lab.yml into lab inventories.
    "meshkit_lab_name": {"type": "string"},
    "meshkit_lab_dir": {"type": "string"},
    "meshkit_lab_netns": {"type": "string"},
    "meshkit_lab_ports": {"type": "list"},
}

HINTS = {
    "meshkit_cluster_name": "letters, digits, '.', '_' or '-'; it names the artifacts directory",
    "meshkit_fabric": "use thunderbolt, ethernet or roce",
    "meshkit_backend": "use ring, jaccl, jaccl-ring, or leave it unset for the best the cabling allows",
    "meshkit_address_pool": f"use an IPv4 network of /29 or larger, e.g. {DEFAULT_POOL}",
    "meshkit_peer_ports": "give interface name patterns such as ['thunderbolt*'] or ['enp1s0f*']",
    "meshkit_bridge": "the bridge the peer ports start in (bridge0 on macOS)",
    "meshkit_mtu": "set an MTU from 1280 to 65520, or leave it unset to keep the interface's",
    "meshkit_link_rate": (
        "the rate this host's cables should reach, e.g. 80gbit or 40Gb/s (meshkit check compares with it), or leave "
        "it unset to use the negotiated link speed"
    ),
    "meshkit_management_interface": "name the interface that carries SSH, or leave it unset to detect it",
    "meshkit_state_dir": "give an absolute path",
    "meshkit_ping_count": "use 1 to 20",
    "meshkit_ranks_per_host": "use a whole number from 1 (ranks started on each host)",
    "meshkit_master_port": "use a free TCP port from 1024 to 65535 (torchrun rendezvous)",
    "meshkit_meshccl_port": "use a free TCP port from 1024; local rank k listens on this plus k",
    "meshkit_meshccl_install": "true (setup.yml installs meshccl on every host) or false",
    "meshkit_meshccl_venv": "give an absolute path for meshccl's virtual environment (default: <state_dir>/meshccl)",
    "meshkit_meshccl_python": "name the host's Python 3.9 or later that makes meshccl's environment",
    "meshkit_slurm": "true (setup.yml sets up Slurm: munge, slurmctld, slurmd) or false",
    "meshkit_slurm_controller": (
        "name the inventory host slurmctld runs on (a cluster host, or a head node outside the cluster's group), "
        "or leave it unset for the ring's first host"
    ),
    "meshkit_slurm_partition": "letters, digits, '_' or '-' (the name of Slurm's one partition)",
    "meshkit_slurm_munge_key": (
        "give the path of a munge key on the controller, or leave it unset to use the slurmctld host's"
    ),
    "meshkit_meshccl_build_on": (
        "use controller (the controller builds where its platform matches the host, else the host's group's first "
        "host), group (the group's first host always) or host (every host builds its own)"
    ),
}


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
    for key in (
        "meshkit_mtu",
        "meshkit_ping_count",
        "meshkit_ranks_per_host",
        "meshkit_master_port",
        "meshkit_meshccl_port",
    ):
        value = out.get(key)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    if out.get("meshkit_mtu") == "":
        out["meshkit_mtu"] = None
    for key in ("meshkit_meshccl_install", "meshkit_slurm"):
        flag = out.get(key)
        if isinstance(flag, str) and flag.strip().lower() in ("true", "yes", "1", "false", "no", "0"):
            out[key] = flag.strip().lower() in ("true", "yes", "1")
    if out.get("meshkit_meshccl_venv") == "":
        out["meshkit_meshccl_venv"] = None
    return out


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
        given = _coerce({k: v for k, v in host_vars[host].items() if k.startswith("meshkit_")})
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
