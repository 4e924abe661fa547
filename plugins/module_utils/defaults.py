# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The default of every meshkit_* inventory variable, defined here once.

The inventory schema (the meshkit package's inventory_schema.py) fills these in for variables a
user leaves unset; the planner, the hostfile builders and the launch planner read their defaults
from here; the modules take the values from the playbooks (no defaults of their own). Plain data:
modules and the controller import it alike.
"""

from __future__ import annotations

from typing import Any

DEFAULTS: dict[str, Any] = {
    "meshkit_cluster_name": "cluster",
    "meshkit_fabric": "thunderbolt",
    "meshkit_backend": "",
    # Inside 198.18.0.0/15 (RFC 2544, benchmarking): no real network routes it.
    "meshkit_address_pool": "198.18.128.0/17",
    "meshkit_peer_ports": [],
    "meshkit_bridge": "bridge0",
    "meshkit_mtu": None,
    # What every cable of the host should carry (bits/s as "80gbit", "40Gb/s"); None: the negotiated speed.
    "meshkit_link_rate": None,
    "meshkit_management_interface": None,
    "meshkit_state_dir": "/var/lib/meshkit",
    "meshkit_ping_count": 3,
    "meshkit_ranks_per_host": 1,
    "meshkit_master_port": 29500,
    "meshkit_meshccl_port": 29600,
    "meshkit_meshccl_install": True,
    "meshkit_meshccl_venv": None,
    "meshkit_meshccl_python": "python3",
    # Where each group of like hosts gets its meshccl build: controller, group (its first host) or host.
    "meshkit_meshccl_build_on": "controller",
    # Slurm (the slurm role, opt-in): slurmctld's host (None: the first host in the cabling's ring),
    # the partition, and a munge key on the controller (None: the slurmctld host's own).
    "meshkit_slurm": False,
    "meshkit_slurm_controller": None,
    "meshkit_slurm_partition": "meshkit",
    "meshkit_slurm_munge_key": None,
    # None: artifacts/<meshkit_cluster_name> under the directory ansible-playbook (or meshkit) runs in.
    "meshkit_artifacts_dir": None,
}

# What discovery probes when meshkit_peer_ports is empty (the schema gives it as meshkit_discover_ports;
# an empty meshkit_peer_ports still means "every member" to the bridge role).
DISCOVER_PORTS: list[str] = ["thunderbolt*"]

# Not an inventory variable: the first port of MLX's ring file, mlx.launch's own --starting-port.
MLX_STARTING_PORT: int = 32323

DEFAULT_POOL: str = DEFAULTS["meshkit_address_pool"]
MASTER_PORT: int = DEFAULTS["meshkit_master_port"]
MESHCCL_PORT: int = DEFAULTS["meshkit_meshccl_port"]
