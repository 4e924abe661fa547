"""Who this rank is and whom it talks to, from the environment a launcher sets.

Four conventions, tried in this order:

- ``MESHCCL_RANK`` + ``MESHCCL_HOSTFILE``: meshccl's own hostfile (meshkit writes it; format
  ``meshccl-hostfile`` version 1, see docs/hostfiles.md): per rank its port and, per cable of
  its host, the address it listens on and the peer's address on the same cable.
- ``MLX_RANK`` + ``MLX_HOSTFILE``: MLX's ring format (what ``mlx.launch`` hands each rank): a
  JSON list, per rank, of "ip:port" strings; rank i listens on its own and connects to rank
  i+1's, as MLX does.
- torchrun's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``: rank 0 runs a
  small rendezvous on ``MASTER_ADDR`` (port ``MESHCCL_MASTER_PORT``, default MASTER_PORT + 1,
  leaving MASTER_PORT to torch's own store); every rank claims its place with the address it
  reaches rank 0 from and a port, both ends proving the job token without sending it, and all
  ranks connect to all.
- Slurm: a task ``srun`` started (``SLURM_PROCID`` set) with meshkit's hostfile
  (``MESHCCL_HOSTFILE``, else /var/lib/meshkit/hostfiles/meshccl.json): the step's nodes
  (``SLURM_STEP_NODELIST``, expanded by ``scontrol show hostnames``) and task counts
  (``SLURM_STEP_TASKS_PER_NODE``), this task's node and local id (``SLURMD_NODENAME``,
  ``SLURM_LOCALID``). Ranks follow the hostfile's ring order: the step's hosts in that order,
  each with its Slurm task count of consecutive ranks (see plan_from_slurm).

A job of more than one rank needs a token (``MESHCCL_TOKEN``) unless the user opts out
(``MESHCCL_ALLOW_NO_TOKEN=1``); without one it is refused before anything is sent.

The result is a :class:`Plan`; the C++ core does the connecting. Every problem found here is a
:class:`meshccl.BootstrapError` naming the file, rank and field.

Each convention is a :class:`Source` in its own module: ``hostfile``, ``mlx_hostfile``,
``torchrun`` (the rendezvous itself is ``rendezvous``) and ``slurm``; :data:`SOURCES` lists them in
the order above and :func:`plan_from_env` takes the first that applies. ``plan`` holds what they
share (Plan, Source, the checks, the token's rules); ``torch_store`` the plans meshccl.torch makes
through torch's store for groups the environment does not describe.
"""

from __future__ import annotations

import os

from meshccl._meshccl import BootstrapError
from meshccl.bootstrap import hostfile, mlx_hostfile, slurm, torchrun
from meshccl.bootstrap.hostfile import MESHCCL_FORMAT, MESHCCL_VERSION, one_host_hostfile, plan_from_meshccl_hostfile
from meshccl.bootstrap.mlx_hostfile import plan_from_mlx_hostfile
from meshccl.bootstrap.plan import (
    Endpoint,
    Options,
    Plan,
    Source,
    allow_no_token_from_env,
    check_token,
    job_id_from_env,
    no_token_message,
)
from meshccl.bootstrap.rendezvous import (
    RDV_HANDSHAKE_S,
    RDV_LINE_MAX,
    RDV_MAX_PENDING,
    RDV_VERSION,
    Claim,
    Entry,
    Hello,
    RateLimitedLog,
    Refusal,
    RendezvousServer,
    claim_line,
    claim_proof,
    hello_line,
    host_identity,
    parse_claim,
    parse_hello,
    parse_table,
    table_limit,
    table_line,
    table_proof,
)
from meshccl.bootstrap.slurm import (
    MESHKIT_HOSTFILE,
    SCONTROL_TIMEOUT_S,
    expand_nodelist,
    parse_tasks_per_node,
    plan_from_slurm,
    slurm_hostfile,
    slurm_hostfile_path,
)
from meshccl.bootstrap.torchrun import plan_from_torchrun

# isort: split
# Private names that code outside bootstrap.py used while it was one module (torch.py, tests).
from meshccl.bootstrap.plan import _int_env, _load_json  # noqa: F401
from meshccl.bootstrap.rendezvous import _CLAIM_FIELDS, _free_port, _mac, _resolve, _serve  # noqa: F401

# Every public name the single module bootstrap.py had is still meshccl.bootstrap.X. A test
# standing in for one (monkeypatch) must patch the module that reads it: rendezvous.host_identity,
# slurm.MESHKIT_HOSTFILE.
__all__ = [
    "MESHCCL_FORMAT",
    "MESHCCL_VERSION",
    "MESHKIT_HOSTFILE",
    "RDV_HANDSHAKE_S",
    "RDV_LINE_MAX",
    "RDV_MAX_PENDING",
    "RDV_VERSION",
    "SCONTROL_TIMEOUT_S",
    "SOURCES",
    "Claim",
    "Endpoint",
    "Entry",
    "Hello",
    "Options",
    "Plan",
    "RateLimitedLog",
    "Refusal",
    "RendezvousServer",
    "Source",
    "allow_no_token_from_env",
    "check_token",
    "claim_line",
    "claim_proof",
    "expand_nodelist",
    "hello_line",
    "host_identity",
    "job_id_from_env",
    "no_token_message",
    "one_host_hostfile",
    "parse_claim",
    "parse_hello",
    "parse_table",
    "parse_tasks_per_node",
    "plan_from_env",
    "plan_from_meshccl_hostfile",
    "plan_from_mlx_hostfile",
    "plan_from_slurm",
    "plan_from_torchrun",
    "slurm_hostfile",
    "slurm_hostfile_path",
    "table_limit",
    "table_line",
    "table_proof",
]

SOURCES: tuple[Source, ...] = (hostfile.SOURCE, mlx_hostfile.SOURCE, torchrun.SOURCE, slurm.SOURCE)


def plan_from_env(
    env: dict[str, str] | None = None,
    token: str = "",
    timeout: float = 60.0,
    job_id: str = "",
    allow_no_token: bool = False,
) -> Plan:
    """This rank's plan from the environment. A job of more than one rank without `token` is
    refused (AuthError, before any rendezvous or connect) unless allow_no_token."""
    env = dict(os.environ if env is None else env)
    source = next((s for s in SOURCES if s.applies(env)), None)
    if source is None:
        raise BootstrapError(
            "no rank in the environment: set MESHCCL_RANK + MESHCCL_HOSTFILE (meshkit), MLX_RANK + MLX_HOSTFILE "
            "(mlx.launch), or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun), or start the program with "
            "Slurm's srun (SLURM_PROCID) beside meshkit's hostfile"
        )
    plan = source.plan(env, Options(token, timeout, job_id, allow_no_token))
    if "MESHCCL_WORLD_SIZE" in env and _int_env(env, "MESHCCL_WORLD_SIZE") != plan.size:
        raise BootstrapError(
            f"MESHCCL_WORLD_SIZE={env['MESHCCL_WORLD_SIZE']} but {plan.source} describes {plan.size} ranks"
        )
    if not source.checks_token:  # torchrun's checks before its rendezvous
        check_token(plan.rank, plan.size, token, allow_no_token)
    return plan
