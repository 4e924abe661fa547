#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the launch_plan action (it runs entirely on the controller)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: launch_plan
short_description: Plan a launch from the topology model - ranks in ring order, environment per runtime, ports
description:
  - Runs on the controller (action plugin) and touches no host.
  - Validates the launch settings (Cerberus) and fails naming the variable and what to do.
  - Numbers the ranks in ring order, host by host, and gives each its environment for the runtime - meshccl
    (C(MESHCCL_RANK), C(MESHCCL_HOSTFILE), C(MESHCCL_WORLD_SIZE)), MLX (C(MLX_RANK), C(MLX_HOSTFILE), or
    C(MLX_IBV_DEVICES) and C(MLX_JACCL_COORDINATOR) for JACCL), PyTorch (C(RANK), C(WORLD_SIZE), C(LOCAL_RANK),
    C(MASTER_ADDR), C(MASTER_PORT), the NCCL variables from the RDMA facts, C(GLOO_SOCKET_IFNAME)) - plus the
    user's own variables, and lists the files each host needs and the ports that must be free.
  - Every rank of every runtime also gets C(MESHCCL_JOB_ID) (the job id) and C(MESHCCL_TOKEN), planned as
    C(<hidden>) (M(meshkit.cluster.launch) makes a fresh token per job).
  - A variable of the user's whose name holds C(TOKEN), C(KEY), C(SECRET) or C(PASSWORD) (any case), or that the
    settings' C(secret_env) names, is a secret - the job (returned, and written to C(job.json)) holds it as
    C(<hidden>) and lists it in its C(secret_env); M(meshkit.cluster.launch) puts the value in. In check mode
    nothing is written.
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
  plan:
    description: The topology model (M(meshkit.cluster.cabling_plan)'s C(plan)).
    type: dict
    required: true
  settings:
    description:
      - The launch settings (launch.yml's C(launch_<name>) variables), validated before anything is planned; a bad
        one fails naming its variable and what to do. An unset one takes its default.
      - Secrets given in C(env) are task arguments (give them through O(env_var) instead).
    type: dict
    required: true
    suboptions:
      program:
        description: The command every rank runs - a string, split as a shell would, or a list.
        type: raw
        required: true
      runtime:
        description: The environment every rank gets.
        type: str
        choices: [meshccl, mlx, torch, mpi, plain]
        default: meshccl
      ranks_per_host:
        description: Ranks on each host (1-256); launch.yml gives the inventory's C(meshkit_ranks_per_host).
        type: int
        default: 1
      env:
        description: More environment for every rank (wins over meshkit's); names holding C(TOKEN), C(KEY), C(SECRET)
          or C(PASSWORD) are secrets.
        type: dict
        default: {}
      secret_env:
        description: More names of O(settings.env) whose values are secrets, whatever their names.
        type: list
        elements: str
        default: []
      timeout:
        description: Seconds before every rank is stopped and the job fails; 0 for none.
        type: float
        default: 0
      grace:
        description: Seconds between SIGTERM and SIGKILL when ranks are stopped (0-120).
        type: float
        default: 3
      host_timeout:
        description: Seconds without a word from a host before it counts as lost (1-3600).
        type: float
        default: 20
      cwd:
        description: The ranks' working directory, absolute, on every host (default - the login directory).
        type: str
      mlx_port:
        description: The first port MLX ring ranks listen on (1024-65000).
        type: int
        default: 32323
  state_dir:
    description: meshkit's state directory on the hosts; the job's files go to C(<state_dir>/jobs/<job id>) (made
      0700 by the launching user, inside C(<state_dir>/jobs), which setup.yml makes sticky and world-writable).
    type: str
    required: true
  cluster:
    description: The cluster's name.
    type: str
    required: true
  ssh:
    description: Per host, its management address.
    type: dict
  nccl:
    description: Per host, its NCCL variables (from its RDMA facts).
    type: dict
  management_interface:
    description: Per host, the interface that carries its management address.
    type: dict
  master_port:
    description: torch's C(MASTER_PORT) (the inventory's C(meshkit_master_port)).
    type: int
    required: true
  meshccl_port:
    description: meshccl's first port; local rank k listens on this plus k (C(meshkit_meshccl_port)).
    type: int
    required: true
  bin_dirs:
    description: Per host, a directory put in front of the ranks' C(PATH) (meshccl's virtual environment), unless
      the job's own environment sets C(PATH).
    type: dict
  env_var:
    description: The name of a variable (a mapping, launch.yml's C(launch_env)) read from the task's variables
      for the job's environment (over the settings' C(env)), so no secret value is ever a task argument.
    type: str
  job_id:
    description: The job's id; a time stamp and a random suffix when not given.
    type: str
  manifests:
    description: Per host, the text of its C(<state_dir>/hostfiles/manifest.json) (empty when missing); a host whose
      set was made from another plan than O(plan) (another cabling or backend) fails the launch (run setup.yml).
    type: dict
  torch_env:
    description: Per host, the text of its C(torch.env); its C(NCCL_*) variables go to PyTorch ranks.
    type: dict
  dest:
    description: Where the job's directory (C(job.json), the logs) is made on the controller (not in check mode).
    type: path
"""

EXAMPLES = r"""
- name: Plan the job
  meshkit.cluster.launch_plan:
    plan: "{{ meshkit_planned.plan }}"
    settings: {program: "python3 /shared/train.py", runtime: torch}
    state_dir: /var/lib/meshkit
    cluster: lab
  run_once: true
"""

RETURN = r"""
job:
  description: The job - id, runtime, world size, per-rank host/argv/env (secrets C(<hidden>)), per-host files and
    ports, log directory, C(secret_env) (the variables whose values are hidden).
  returned: success
  type: dict
inputs:
  description: What the job was planned from besides the plan and the settings (state_dir, cluster, ssh, nccl,
    torch_env, management_interface, master_port, meshccl_port, bin_dirs, dest); C(meshkit launch) remembers it.
  returned: success
  type: dict
"""
