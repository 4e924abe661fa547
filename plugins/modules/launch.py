#!/usr/bin/python
# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the launch action (it runs on the controller and reaches every host itself)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: launch
short_description: Start a planned job on every host, supervise it, stop every rank when one fails
description:
  - Runs on the controller (action plugin). Checks the preflight of every host first (each host's problems, and a
    program, interpreter or script that is not at the same path everywhere) and starts nothing if any fails. With
    O(check_hosts) every host runs that preflight itself, all at once, in one round trip each over the connection its
    ranks then use (the supervisor's check mode); else O(preflight) gives the results.
  - The preflight changes nothing. It resolves the program (through C(PATH), the job's own C(PATH) when it sets one)
    and its interpreter (a script's C(#!) line, or the script or C(-m) module a Python is given) to real paths, checks
    the working directory and further commands (C(orted) for MPI), and tries to bind every planned listening address
    and port (a taken one named with the process that holds it). With O(cables), it checks that no cable port is a
    member of a bridge and connects to every peer's cable address from the ranks' own interpreter (Local Network
    Privacy on macOS named as such, with the fix).
  - Reaches every host with the inventory's connection settings (ssh with the inventory's address, user, key and
    options, so host key checking stays as configured; the lab's C(meshkit.cluster.netns) through C(nsenter)) and
    starts one supervisor per host over that connection; it starts the host's ranks and streams their output.
  - The first rank that exits non-zero, a host whose connection drops, the timeout, stop every rank on every host
    (SIGTERM, SIGKILL after O(grace) seconds, then anything the ranks left behind). The task then fails naming the
    failed ranks, their exit codes and their last lines.
  - A host not heard from for O(host_timeout) seconds (a network partition drops traffic without closing the
    connection) is lost, every other rank is stopped at once and the task fails naming the host; that host's
    supervisor stops its ranks when it has not heard from the controller for as long. ssh connections get keepalives
    and a connect timeout within it. No write to one host can hold the others, the timeout or Ctrl-C up.
  - The ranks run as the user the connection logs in as (O(job)'s directory on each host is that user's own, mode
    0700, in C(<state_dir>/jobs), which setup.yml makes root's, sticky and world-writable; a C(jobs) directory
    another user could change is refused). Every file there is made through the directory's open descriptor.
  - The ranks' output is shown prefixed C([rank|host]) as it comes and kept per rank on the controller, with a
    C(summary.json), in the job's directory. It is shown from a thread of its own, so a terminal that does not take
    it never holds the job up (lines beyond 1 MiB waiting are left out there, and said so; the logs keep them).
  - MPI jobs (one C(mpirun) on the controller) have each MPI rank's lines taken from C(mpirun)'s tagged output, kept
    in C(rank-N.log) and their last lines in the summary's C(rank_output); an error C(mpirun) reports and does not
    recover from fails the job within 5 s.
  - Every rank of every runtime gets C(MESHCCL_TOKEN), a fresh random job token (32 bytes), and C(MESHCCL_JOB_ID).
    The token, and the values of the job's other secrets (O(job)'s C(secret_env), read from the variable O(env_var)),
    go to the ranks in the supervisors' input (for MPI, in C(mpirun)'s environment, passed on with C(-x NAME)) and are
    on no command line, in no result, log or summary.
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
  job:
    description: M(meshkit.cluster.launch_plan)'s C(job).
    type: dict
    required: true
  preflight:
    description:
      - Per host, the preflight's result - C(program), C(interpreter), C(script), C(problems) (and, with cables,
        C(notes), C(peers), C(bridged), C(context), C(probed_with)).
    type: dict
  check_hosts:
    description:
      - Have every host run the preflight (the same checks and messages) over its launch connection, before anything
        starts. In check mode too (it changes nothing); then nothing starts.
    type: bool
    default: false
  cables:
    description:
      - With O(check_hosts), per host its cables as the plan has them (C(per_host) of plan.json), for the preflight's
        cable checks.
    type: dict
    default: {}
  log_dir:
    description: Where the logs go on the controller; the job's own C(log_dir) by default.
    type: path
  timeout:
    description: Seconds before every rank is stopped and the job fails; the job's own by default, 0 for none.
    type: float
  grace:
    description: Seconds between SIGTERM and SIGKILL when ranks are stopped.
    type: float
  host_timeout:
    description:
      - Seconds without a word from a host (heartbeats go both ways every quarter of it, at most every 5 s) before
        the host counts as lost. The job's own (launch_plan's C(host_timeout) setting) by default, else launch.yml's
        C(launch_host_timeout), else 20.
    type: float
  env_var:
    description:
      - The name of a variable (a mapping, launch.yml's C(launch_env)) holding the job's environment as the user
        gave it; the values of the job's secrets (O(job)'s C(secret_env), C(<hidden>) in O(job)) are taken from it.
        Read from the task's variables, so no secret value is ever a task argument.
    type: str
  prepare_to:
    description: Start nothing; write the checked job and every host's connection to this file (what C(meshkit launch)
      runs itself, with stdin).
    type: path
  context:
    description: With O(prepare_to), what the job was planned from (the cabling plan, the planning inputs, the
      inventory's settings, the meshccl build), written beside it; C(meshkit launch) remembers it to plan and check
      its next jobs without Ansible.
    type: dict
  quiet:
    description: Do not show the ranks' output while they run (it is still logged).
    type: bool
    default: false
  scheduler:
    description: Who starts the ranks - C(meshkit) (an agent on every host) or C(slurm) (one C(srun) on
      O(submit_host), ranks in ring order through C(SLURM_HOSTFILE); the cluster set up with C(meshkit_slurm));
      every runtime (MPI through C(srun --mpi=pmix)).
    type: str
    choices: [meshkit, slurm]
    default: meshkit
  submit_host:
    description: With O(scheduler=slurm), the host C(srun) runs on (default - rank 0's host).
    type: str
  partition:
    description: With O(scheduler=slurm), the Slurm partition (default - Slurm's default partition).
    type: str
  batch:
    description: With O(scheduler=slurm), submit with C(sbatch) and end once Slurm has queued the job; its output
      (every rank's lines, labelled) goes to C(/tmp/meshkit-<job id>-<Slurm job id>.out) on rank 0's host.
    type: bool
    default: false
"""

EXAMPLES = r"""
- name: Run the job
  meshkit.cluster.launch:
    job: "{{ meshkit_job.job }}"
  run_once: true
"""

RETURN = r"""
summary:
  description: Per rank - host, state (ok, failed, stopped, timeout, lost), exit code or signal, last lines; the wall
    time, the time until every rank ran, and the log directory; for MPI jobs C(rank_output), each MPI rank's host and
    last lines.
  returned: always
  type: dict
table:
  description: One line per rank, failures first.
  returned: always
  type: list
  elements: str
"""
