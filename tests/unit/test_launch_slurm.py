"""meshkit launch --scheduler slurm's pieces: the ring order Slurm is given, srun's and sbatch's
command lines, the per-task wrapper (run by a real /bin/sh with the variables srun sets), srun's
labelled output taken apart per rank, and the rank to blame read from srun's recorded reports."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from meshkit import launch_slurm

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
RING = ["node1", "node3", "node2", "node4"]


def job(per_host: int = 2, runtime: str = "meshccl", cwd: str | None = None) -> dict[str, Any]:
    ranks = []
    for i, host in enumerate(RING):
        for local in range(per_host):
            rank = i * per_host + local
            env = {
                "MESHKIT_RANK": str(rank),
                "MESHKIT_LOCAL_RANK": str(local),
                "MESHKIT_HOST": host,
                "MESHKIT_WORLD_SIZE": str(len(RING) * per_host),
                "MESHCCL_RANK": str(rank),
                "MESHCCL_HOSTFILE": "/var/lib/meshkit/jobs/j1/meshccl.json",
                "MESHCCL_TOKEN": "<hidden>",
            }
            ranks.append(
                {
                    "rank": rank,
                    "host": host,
                    "local_rank": local,
                    "argv": ["python3", "/shared/x.py", "--n", "1"],
                    "env": env,
                    "cwd": cwd,
                    "path_prepend": [f"/opt/{host}/bin"],
                }
            )
    return {
        "job_id": "j1",
        "runtime": runtime,
        "world_size": len(ranks),
        "job_dir": "/var/lib/meshkit/jobs/j1",
        "ranks": ranks,
        "files": {},
    }


def test_slurm_is_given_the_ring_rank_by_rank():
    assert launch_slurm.slurm_hostfile(job()).split() == [h for h in RING for _ in range(2)]


def test_srun_asks_for_the_ring_and_kills_the_job_on_a_bad_exit():
    argv = launch_slurm.srun_argv(job(cwd="/shared"), partition="gpu")
    head = argv[: argv.index("--")]
    assert head[:1] == ["srun"]
    for flag in ("--distribution=arbitrary", "--kill-on-bad-exit=1", "--label", "--export=ALL"):
        assert flag in head
    assert head[head.index("--nodes") + 1] == "4" and head[head.index("--ntasks") + 1] == "8"
    assert head[head.index("--partition") + 1] == "gpu" and head[head.index("--chdir") + 1] == "/shared"
    assert head[head.index("--job-name") + 1] == "meshkit-j1"
    assert argv[argv.index("--") + 1 : argv.index("--") + 3] == ["/bin/sh", "-c"]
    assert argv[-5:] == ["meshkit-rank", "python3", "/shared/x.py", "--n", "1"]


def test_every_task_shares_the_environment_but_the_per_rank_variables():
    env = launch_slurm.common_env(job(), "/var/lib/meshkit")
    assert not set(env) & set(launch_slurm.PER_RANK)
    # meshccl forms the job from Slurm's layout and the hostfile setup.yml wrote on every host.
    assert env["MESHCCL_HOSTFILE"] == "/var/lib/meshkit/hostfiles/meshccl.json"
    assert env["MESHKIT_WORLD_SIZE"] == "8"


@pytest.mark.parametrize(("procid", "localid", "node"), [(0, 0, "node1"), (5, 1, "node2"), (7, 1, "node4")])
def test_the_wrapper_sets_the_rank_from_slurm_and_the_hosts_path(tmp_path, procid, localid, node):
    """The wrapper line, run by /bin/sh as srun runs it: MESHKIT_RANK etc. from Slurm's variables,
    the host's own directory first on PATH, then the program with its arguments untouched."""
    argv = launch_slurm.srun_argv(job())
    wrapper = argv[argv.index("--") + 1 :]
    program = tmp_path / "show"
    program.write_text('#!/bin/sh\necho "$MESHKIT_RANK $MESHKIT_LOCAL_RANK $MESHKIT_HOST ${PATH%%:*} $*"\n')
    program.chmod(0o755)
    wrapper[-4:] = [str(program), "a b", "--n", "1"]
    env = {"PATH": "/usr/bin:/bin", "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURMD_NODENAME": node}
    out = subprocess.run(wrapper, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == f"{procid} {localid} {node} /opt/{node}/bin a b --n 1"


def test_only_meshccl_and_plain_jobs_run_through_slurm():
    conn = {"node1": {"kind": "local"}}
    with pytest.raises(launch_slurm.SlurmError, match="runs meshccl, plain, mpi jobs so far, not torch"):
        launch_slurm.host_job(
            job(runtime="torch"), conn, submit_host="node1", state_dir="/var/lib/meshkit", secret_values={}
        )
    with pytest.raises(launch_slurm.SlurmError, match="submit host 'head' is not a host of this job"):
        launch_slurm.host_job(job(), conn, submit_host="head", state_dir="/var/lib/meshkit", secret_values={})


def test_the_submit_hosts_agent_gets_srun_the_ring_and_the_token_in_its_environment():
    hj = launch_slurm.host_job(
        job(),
        {"node1": {"kind": "local"}},
        submit_host="node1",
        state_dir="/var/lib/meshkit",
        secret_values={"MESHCCL_TOKEN": "s3cret"},
    )
    [spec] = hj.ranks
    assert spec["rank"] == -1 and spec["driver"] == "srun" and spec["argv"][0] == "srun"
    assert spec["env"]["MESHCCL_TOKEN"] == "s3cret" and "s3cret" not in " ".join(spec["argv"])
    assert spec["env"]["SLURM_HOSTFILE"] == "/var/lib/meshkit/jobs/j1/slurm-hostfile"
    assert hj.files == {"slurm-hostfile": launch_slurm.slurm_hostfile(job())}


def test_sbatch_submits_a_script_that_writes_the_ring_and_runs_the_same_srun(tmp_path):
    argv = launch_slurm.sbatch_argv(job())
    assert argv[0] == "sbatch" and "--parsable" in argv and "--distribution=arbitrary" in argv
    assert argv[argv.index("--output") + 1] == "/tmp/meshkit-j1-%j.out"
    script = argv[argv.index("--wrap") + 1]
    # The script, run by sh with a stand-in srun: it writes the ring to $SLURM_HOSTFILE for srun.
    fake = tmp_path / "srun"
    fake.write_text('#!/bin/sh\ncat "$SLURM_HOSTFILE" > "$OUT"; echo "$@" >> "$OUT"; exit 3\n')
    fake.chmod(0o755)
    out = tmp_path / "seen"
    proc = subprocess.run(
        ["/bin/sh", "-c", script], env={"PATH": f"{tmp_path}:/usr/bin:/bin", "OUT": str(out)}, check=False
    )
    assert proc.returncode == 3  # srun's status is the script's
    seen = out.read_text().splitlines()
    assert seen[:8] == [h for h in RING for _ in range(2)]
    assert "--distribution=arbitrary" in seen[8] and "meshkit-rank python3 /shared/x.py" in seen[8]
    assert launch_slurm.batch_job_id("17\n") == "17" and launch_slurm.batch_job_id("18;lab\n") == "18"
    assert launch_slurm.batch_job_id("sbatch: error: Batch job submission failed\n") is None


def state(tail: list[str], driver: str = "srun") -> SimpleNamespace:
    return SimpleNamespace(
        rank=-1,
        host="node1",
        driver=driver,
        tail=tail,
        state="failed",
        describe=lambda: "exit code 143",
    )


def test_labelled_lines_are_each_ranks_and_srun_speaks_for_itself():
    lines = launch_slurm.Lines(job())
    srun = state([])
    assert lines(srun, "5: hello") == ["[5|node2] hello"]
    assert lines(srun, " 3: a: b") == ["[3|node3] a: b"]
    assert lines(srun, "srun: error: node2: task 3: Exited with exit code 7") == [
        "[srun] srun: error: node2: task 3: Exited with exit code 7"
    ]
    assert lines(srun, "9: not a rank of this job") == ["[srun] 9: not a rank of this job"]


def outcome(tail: list[str], rank_output: dict[int, tuple[str, list[str]]] | None = None) -> SimpleNamespace:
    srun = state(tail)
    return SimpleNamespace(failed=[srun], ranks=[srun], reason="srun (node1) failed", rank_output=rank_output or {})


def test_the_rank_that_exited_non_zero_is_blamed_not_the_ones_slurm_killed():
    said = (FIXTURES / "srun-bad-exit.txt").read_text().splitlines()
    assert launch_slurm.first_failure("\n".join(said)) == (3, "node2", 7, "Exited with exit code 7")
    reason, failures = launch_slurm.explain(job(), outcome(said, {3: ("node3", ["rank 3 says bye"])}))
    assert reason.startswith("rank 3 (node2) exited with exit code 7 (reported by srun"), reason
    assert failures == [("rank 3 on node2: failed, exit code 7", ["rank 3 says bye"])]
    assert launch_slurm.exit_code(job(), outcome(said)) == 7


def test_a_cancelled_job_is_said_to_be_cancelled_and_no_rank_is_blamed():
    said = (FIXTURES / "srun-scancel.txt").read_text().splitlines()
    reason, failures = launch_slurm.explain(job(), outcome(said))
    assert reason.startswith("the Slurm job step was cancelled from outside"), reason
    assert failures[0][0].startswith("srun on node1: failed")
    assert launch_slurm.exit_code(job(), outcome(said)) is None
