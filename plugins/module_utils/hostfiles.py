# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Every hostfile format, rendered from the one plan (topology.Plan.as_dict()).

Formats (docs/hostfiles.md has the details and examples):
- ``mlx-hostfile.json``: MLX's object form, read by ``mlx.launch --hostfile``. Hosts in ring
  order; a host's ``ips`` are its own addresses on the cable(s) to its left neighbour, one per
  parallel ring (rank i listens there; rank i-1 connects to them). JACCL adds the N x N
  ``rdma`` matrix (device of the cable from host i to host j, null on the diagonal).
- ``mlx-ring.json``: the runtime file ``MLX_HOSTFILE`` names, as ``mlx.launch`` writes it: per
  rank, ``"ip:port"`` strings, the port rising by one per (rank, ip, connection).
- ``mpi-hostfile``: ``host slots=N``.
- ``torch/<host>.env`` (``torch.env`` on the host): torchrun and NCCL variables.
- ``meshccl.json``: meshccl's own, versioned format (collective/HOSTFILE.md).
- ``manifest.json``: the cabling fingerprint and a SHA-256 per file, to tell a stale or
  hand-edited set.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils.defaults import (
    MASTER_PORT,
    MESHCCL_PORT,
    MLX_STARTING_PORT,
)

MESHCCL_FORMAT = "meshccl-hostfile"
MESHCCL_VERSION = 1
MANIFEST_FORMAT = "meshkit-hostfiles"
# Keys of plan.json that explain, not inputs: they do not change what any host runs.
DESCRIPTIVE = ("fingerprint", "backend_reason", "asymmetric", "unknown_peers", "missing_mesh", "removed")


def fingerprint(plan: dict[str, Any]) -> str:
    """The plan's fingerprint: SHA-256 of the plan less its explanations (hosts, cables with their
    ends' addresses, identities, RDMA devices and speeds, rings, backend, per-host ports and RDMA
    ports). plan.json is sealed with it (meshkit's plan_contract); every hostfile and the manifest
    carry it, so hosts compute it too."""
    core = {k: v for k, v in plan.items() if k not in DESCRIPTIVE}
    text = json.dumps(core, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def ring_order(plan: dict[str, Any]) -> list[str]:
    """Hosts in ring order when a ring runs through all of them, else in the plan's order."""
    ring = plan.get("ring") or []
    return list(ring) if len(ring) == len(plan["hosts"]) else list(plan["hosts"])


def links(plan: dict[str, Any], host: str, peer: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(my end, their end) of every cable between two hosts, in cable order."""
    out = []
    for c in plan.get("cables", []):
        a, b = c["ends"]
        if a["host"] == host and b["host"] == peer:
            out.append((a, b))
        elif b["host"] == host and a["host"] == peer:
            out.append((b, a))
    return out


def has_full_ring(plan: dict[str, Any]) -> bool:
    return len(plan["hosts"]) >= 2 and len(plan.get("ring") or []) == len(plan["hosts"])


def mlx_hostfile(plan: dict[str, Any], ssh: dict[str, str], envs: list[str] | None = None) -> dict[str, Any]:
    """MLX's object form for the plan's backend (``ring`` when nothing needs RDMA)."""
    order = ring_order(plan)
    backend = plan.get("backend") or ""
    parallel = max(1, len(plan.get("rings") or []))
    hosts = []
    for i, host in enumerate(order):
        entry: dict[str, Any] = {"ssh": ssh.get(host, host)}
        if backend in ("jaccl", "jaccl-ring"):
            # Rank 0's first ip is the coordinator every rank reaches: the management address.
            entry["ips"] = [ssh.get(host, host)] if i == 0 else []
            row: list[Any] = []
            for j, other in enumerate(order):
                if i == j:
                    row.append(None)
                    continue
                neighbour = abs(i - j) in (1, len(order) - 1)
                devices = [mine.get("rdma") for mine, _theirs in links(plan, host, other) if mine.get("rdma")]
                if not devices or (backend == "jaccl-ring" and not neighbour):
                    row.append(None)
                else:
                    row.append(devices[0] if len(devices) == 1 else devices)
            entry["rdma"] = row
        else:
            left = order[i - 1]
            entry["ips"] = [mine["address"] for mine, _theirs in links(plan, host, left)][:parallel]
        hosts.append(entry)
    return {"backend": backend or "ring", "envs": list(envs or []), "hosts": hosts}


def mlx_ring_runtime(
    hostfile: dict[str, Any],
    starting_port: int = MLX_STARTING_PORT,
    connections_per_ip: int = 1,
    ranks_per_host: int = 1,
) -> list:
    """The ``MLX_HOSTFILE`` runtime ring file, numbered as mlx.launch numbers it. With several ranks
    per host, a host's first rank listens on its cable addresses facing the previous host (as
    mlx.launch does) and the others on loopback, where the rank before them (same host) connects."""
    port = starting_port
    out = []
    for host in hostfile["hosts"]:
        for local in range(ranks_per_host):
            row = []
            for ip in host["ips"] if local == 0 else ["127.0.0.1"]:
                for _connection in range(connections_per_ip):
                    row.append(f"{ip}:{port}")
                    port += 1
            out.append(row)
    return out


def ranks(plan: dict[str, Any], ranks_per_host: int) -> list[dict[str, Any]]:
    """Global ranks in ring order: host by host, ``ranks_per_host`` each."""
    out = []
    for node_rank, host in enumerate(ring_order(plan)):
        for local in range(ranks_per_host):
            out.append({"rank": len(out), "host": host, "node_rank": node_rank, "local_rank": local})
    return out


def mpi_hostfile(plan: dict[str, Any], ssh: dict[str, str], ranks_per_host: int, fp: str) -> str:
    lines = [f"# MPI hostfile of {len(plan['hosts'])} hosts in ring order; cabling {fp}"]
    lines += [f"{ssh.get(h, h)} slots={ranks_per_host}" for h in ring_order(plan)]
    return "\n".join(lines) + "\n"


def torch_vars(
    plan: dict[str, Any],
    host: str,
    ssh: dict[str, str],
    ranks_per_host: int,
    master_port: int,
    nccl: dict[str, str],
    gloo_ifname: str | None = None,
    local_rank: int | None = None,
) -> dict[str, str]:
    """torchrun's variables for one host (``local_rank`` None), or for one of its ranks: the one
    builder of torch.env and of a PyTorch launch's environment."""
    order = ring_order(plan)
    node_rank = order.index(host)
    env = {
        # The rendezvous must be reachable from every host: the management address of the first
        # host in ring order (a cable address reaches only that cable's peer).
        "MASTER_ADDR": ssh.get(order[0], order[0]),
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(len(order) * ranks_per_host),
        "NNODES": str(len(order)),
        "NODE_RANK": str(node_rank),
        "GROUP_RANK": str(node_rank),
        "NPROC_PER_NODE": str(ranks_per_host),
        "LOCAL_WORLD_SIZE": str(ranks_per_host),
    }
    if local_rank is not None or ranks_per_host == 1:
        local = local_rank or 0
        env["RANK"] = str(node_rank * ranks_per_host + local)
        env["LOCAL_RANK"] = str(local)
    env.update(sorted(nccl.items()))
    if gloo_ifname:
        # Gloo gives every rank one address and connects every pair of ranks to it: on
        # point-to-point cables only the management network reaches every host.
        env["GLOO_SOCKET_IFNAME"] = gloo_ifname
    return env


def torch_env(
    plan: dict[str, Any],
    host: str,
    ssh: dict[str, str],
    ranks_per_host: int,
    master_port: int,
    nccl: dict[str, str],
    fp: str,
    gloo_ifname: str | None = None,
) -> str:
    """torchrun + NCCL variables for one host, as a shell/systemd EnvironmentFile."""
    env = torch_vars(plan, host, ssh, ranks_per_host, master_port, nccl, gloo_ifname)
    lines = [
        f"# torchrun / NCCL environment of {host}, rank order = ring order; cabling {fp}",
        "# Use: set -a; . ./torch.env; set +a   (or systemd EnvironmentFile=)",
    ]
    if ranks_per_host != 1:
        lines.append("# RANK = NODE_RANK * NPROC_PER_NODE + LOCAL_RANK, set per process by torchrun")
    lines += [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def meshccl_hostfile(
    plan: dict[str, Any],
    ssh: dict[str, str],
    ranks_per_host: int,
    base_port: int,
    cluster: str,
    fp: str,
) -> dict[str, Any]:
    """meshccl's own format: per rank its listen port and, per cable of its host, the address it
    listens on and the peer's address on the same cable (one entry per cable, doubled cables
    included), plus the ring order and the fingerprint of the cabling it was made from."""
    ring_of: dict[str, int] = {}
    for k, ring in enumerate(plan.get("rings") or []):
        for cable in ring:
            ring_of[cable] = k
    out_ranks = []
    for r in ranks(plan, ranks_per_host):
        host = r["host"]
        host_links = []
        for c in plan.get("cables", []):
            a, b = c["ends"]
            if host not in (a["host"], b["host"]):
                continue
            mine, theirs = (a, b) if a["host"] == host else (b, a)
            name = f"{a['host']}:{a['port']} <-> {b['host']}:{b['port']}"
            host_links.append(
                {
                    "cable": name,
                    "port": mine["port"],
                    "address": mine["address"],
                    "peer_host": theirs["host"],
                    "peer_address": theirs["address"],
                    "network": c["network"],
                    "ring": ring_of.get(name),
                }
            )
        out_ranks.append(r | {"port": base_port + r["local_rank"], "links": host_links})
    order = ring_order(plan)
    return {
        "format": MESHCCL_FORMAT,
        "version": MESHCCL_VERSION,
        "cluster": cluster,
        "fingerprint": fp,
        "world_size": len(out_ranks),
        "ranks_per_host": ranks_per_host,
        "ring": order if has_full_ring(plan) else [],
        "mesh": bool(plan.get("mesh")),
        "hosts": {
            h: {"management": ssh.get(h, h), "ranks": [r["rank"] for r in out_ranks if r["host"] == h]} for h in order
        },
        "ranks": out_ranks,
    }


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"


def render(
    plan: dict[str, Any],
    ssh: dict[str, str],
    nccl: dict[str, dict[str, str]],
    cluster: str,
    ranks_per_host: int = 1,
    master_port: int = MASTER_PORT,
    meshccl_port: int = MESHCCL_PORT,
    mlx_starting_port: int = MLX_STARTING_PORT,
    envs: list[str] | None = None,
    host: str | None = None,
    gloo: dict[str, str] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """(files, skipped): relative path -> content, and format -> why it was not written.

    With ``host``, the set that host keeps (its own torch.env); else the controller's set.
    """
    fp = fingerprint(plan)
    files: dict[str, str] = {}
    skipped: dict[str, str] = {}
    if has_full_ring(plan) or plan.get("backend") in ("jaccl", "jaccl-ring"):
        mlx = mlx_hostfile(plan, ssh, envs)
        files["mlx-hostfile.json"] = dumps(mlx)
        if mlx["backend"] == "ring":
            files["mlx-ring.json"] = dumps(mlx_ring_runtime(mlx, mlx_starting_port))
        else:
            skipped["mlx-ring.json"] = f"backend {mlx['backend']} uses RDMA, not the ring file"
    else:
        reason = "no ring through every host (MLX needs one)"
        skipped["mlx-hostfile.json"] = skipped["mlx-ring.json"] = reason
    files["mpi-hostfile"] = mpi_hostfile(plan, ssh, ranks_per_host, fp)
    targets = [host] if host else ring_order(plan)
    for h in targets:
        name = "torch.env" if host else f"torch/{h}.env"
        files[name] = torch_env(plan, h, ssh, ranks_per_host, master_port, nccl.get(h, {}), fp, (gloo or {}).get(h))
    files["meshccl.json"] = dumps(meshccl_hostfile(plan, ssh, ranks_per_host, meshccl_port, cluster, fp))
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": 1,
        "cluster": cluster,
        "fingerprint": fp,
        "backend": plan.get("backend") or "",
        "files": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(files.items())},
    }
    files["manifest.json"] = dumps(manifest)
    return files, skipped


def staleness(manifest_text: str | None, current: dict[str, str], fp: str) -> str | None:
    """Why the set described by an existing manifest no longer matches; None when it does."""
    if manifest_text is None:
        return None
    try:
        old = json.loads(manifest_text)
    except ValueError:
        return "manifest.json is not JSON"
    if old.get("fingerprint") != fp:
        return f"made from an older cabling ({old.get('fingerprint', 'no fingerprint')}; now {fp})"
    for name, digest in (old.get("files") or {}).items():
        text = current.get(name)
        if text is not None and hashlib.sha256(text.encode()).hexdigest() != digest:
            return f"{name} was edited by hand since it was written"
    return None
