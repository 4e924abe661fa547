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


def job(
    per_host: int = 2, runtime: str = "meshccl", cwd: str | None = None, job_dir: str = "/var/lib/meshkit/jobs/j1"
) -> dict[str, Any]:
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
                "MESHCCL_HOSTFILE": f"{job_dir}/meshccl.json",
                "MESHCCL_TOKEN": "<hidden>",
                "NODE_RANK": str(i),
                "GLOO_SOCKET_IFNAME": "mgmt0" if host != "node4" else "eth0",
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
        "job_dir": job_dir,
        "ranks": ranks,
        "files": {h: {"meshccl.json": '{"format": "meshccl-hostfile"}\n'} for h in RING},
    }


def test_slurm_is_given_the_ring_rank_by_rank():
    assert launch_slurm.slurm_hostfile(job()).split() == [h for h in RING for _ in range(2)]


def test_srun_asks_for_the_ring_and_kills_the_job_on_a_bad_exit():
    planned = job(cwd="/shared")
    planned["timeout"] = 90.5
    argv = launch_slurm.srun_argv(planned, partition="gpu")
    head = argv[: argv.index("--")]
    # Without the agent's job mark: what Slurm started is Slurm's to stop, never the agent's sweep.
    assert head[:4] == ["env", "-u", "MESHKIT_JOB_MARK", "srun"]
    for flag in ("--distribution=arbitrary", "--kill-on-bad-exit=1", "--label", "--export=ALL", "--exclusive"):
        assert flag in head
    assert "--time=1:31" in head and "--mpi=pmix" not in head
    plain = launch_slurm.srun_argv(job(runtime="mpi"))
    assert "--mpi=pmix" in plain and "--exclusive" not in plain and not any(a.startswith("--time") for a in plain)
    assert head[head.index("--nodes") + 1] == "4" and head[head.index("--ntasks") + 1] == "8"
    assert head[head.index("--partition") + 1] == "gpu" and head[head.index("--chdir") + 1] == "/shared"
    assert head[head.index("--job-name") + 1] == "meshkit-j1"
    assert argv[argv.index("--") + 1 : argv.index("--") + 3] == ["/bin/sh", "-c"]
    assert argv[-5:] == ["meshkit-rank", "python3", "/shared/x.py", "--n", "1"]


def test_the_plans_environment_splits_into_common_per_rank_and_per_host():
    common, per_rank, per_host = launch_slurm.split_env(job())
    assert common["MESHKIT_WORLD_SIZE"] == "8" and common["MESHCCL_TOKEN"] == "<hidden>"
    assert per_rank == {
        "MESHCCL_RANK": "SLURM_PROCID",
        "MESHKIT_LOCAL_RANK": "SLURM_LOCALID",
        "MESHKIT_RANK": "SLURM_PROCID",
    }
    assert per_host["node2"] == {
        "GLOO_SOCKET_IFNAME": "mgmt0",
        "MESHKIT_HOST": "node2",
        "NODE_RANK": "2",
        "PATH": "/opt/node2/bin:$PATH",
    }
    assert per_host["node4"]["GLOO_SOCKET_IFNAME"] == "eth0" and "GLOO_SOCKET_IFNAME" not in common


def test_what_srun_cannot_give_per_rank_is_refused_by_name():
    odd = job()
    odd["ranks"][3]["env"]["ODD"] = "x"  # one rank only
    with pytest.raises(launch_slurm.SlurmError, match="ODD is set for some ranks only"):
        launch_slurm.split_env(odd)
    odd = job()
    for r in odd["ranks"]:
        r["env"]["SEED"] = str(r["rank"] * 7)  # differs on one host, not as a rank number
    with pytest.raises(launch_slurm.SlurmError, match="SEED differs between ranks of one host"):
        launch_slurm.split_env(odd)
    odd = job()
    odd["ranks"][0]["env"]["API_KEY"] = "<hidden>"
    for r in odd["ranks"][1:]:
        r["env"]["API_KEY"] = "plain"
    with pytest.raises(launch_slurm.SlurmError, match="API_KEY is a secret that differs"):
        launch_slurm.split_env(odd)


@pytest.mark.parametrize(("procid", "localid", "node"), [(0, 0, "node1"), (5, 1, "node2"), (7, 1, "node4")])
def test_the_wrapper_gives_each_task_its_ranks_environment_and_the_job_files(tmp_path, procid, localid, node):
    """The wrapper line, run by /bin/sh as srun runs it, with the environment srun gives every task:
    the rank's variables from Slurm's, its host's own values and PATH, the job's file written into
    the job directory (the variable holding it gone), then the program with its arguments as given."""
    (tmp_path / "jobs").mkdir(mode=0o1777)  # setup.yml makes <state dir>/jobs: sticky, world-writable
    planned = job(job_dir=str(tmp_path / "jobs" / "j1"))
    argv = launch_slurm.srun_argv(planned)
    wrapper = argv[argv.index("--") + 1 :]
    program = tmp_path / "show"
    program.write_text(
        "#!/bin/sh\n"
        'echo "$MESHKIT_RANK $MESHCCL_RANK $MESHKIT_LOCAL_RANK $MESHKIT_HOST $NODE_RANK $GLOO_SOCKET_IFNAME '
        '${PATH%%:*} ${MESHKIT_JOB_FILE_0:-unset} $*"\n'
        'cat "$MESHCCL_HOSTFILE"\n'
    )
    program.chmod(0o755)
    wrapper[-4:] = [str(program), "a b", "--n", "1"]
    common, _per_rank, _per_host = launch_slurm.split_env(planned)
    contents, _files = launch_slurm.job_files(planned)
    env = {**common, **contents, "PATH": "/usr/bin:/bin", "SLURM_PROCID": str(procid),
           "SLURM_LOCALID": str(localid), "SLURMD_NODENAME": node}  # fmt: skip
    out = subprocess.run(wrapper, env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    iface = "eth0" if node == "node4" else "mgmt0"
    assert out[0] == f"{procid} {procid} {localid} {node} {RING.index(node)} {iface} /opt/{node}/bin unset a b --n 1"
    assert out[1] == '{"format": "meshccl-hostfile"}'
    assert oct((tmp_path / "jobs" / "j1").stat().st_mode & 0o777) == "0o700"


def test_the_wrapper_refuses_a_node_that_is_not_the_jobs(tmp_path):
    argv = launch_slurm.srun_argv(job(job_dir=str(tmp_path / "j")))
    wrapper = argv[argv.index("--") + 1 :]
    env = {"PATH": "/usr/bin:/bin", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "node9"}
    proc = subprocess.run(wrapper, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 97 and "node9 is not a host of this job" in proc.stderr


def test_the_submit_host_must_be_a_host_of_the_job():
    conn = {"node1": {"kind": "local"}}
    with pytest.raises(launch_slurm.SlurmError, match="runs meshccl, plain, mpi, torch, mlx jobs so far, not tpu"):
        launch_slurm.host_job(job(runtime="tpu"), conn, submit_host="node1", secret_values={})
    with pytest.raises(launch_slurm.SlurmError, match="submit host 'head' is not a host of this job"):
        launch_slurm.host_job(job(), conn, submit_host="head", secret_values={})


def test_the_submit_hosts_agent_gets_srun_the_ring_and_the_token_in_its_environment():
    hj = launch_slurm.host_job(
        job(),
        {"node1": {"kind": "local"}},
        submit_host="node1",
        secret_values={"MESHCCL_TOKEN": "s3cret"},
    )
    [spec] = hj.ranks
    assert spec["rank"] == -1 and spec["driver"] == "srun" and spec["argv"][3] == "srun"
    assert spec["env"]["MESHCCL_TOKEN"] == "s3cret" and "s3cret" not in " ".join(spec["argv"])
    assert spec["env"]["SLURM_HOSTFILE"] == "/var/lib/meshkit/jobs/j1/slurm-hostfile"
    assert hj.files == {"slurm-hostfile": launch_slurm.slurm_hostfile(job())}
    # The job's file travels in srun's environment (the wrapper writes it on each host), not as a file here.
    assert spec["env"]["MESHKIT_JOB_FILE_0"] == '{"format": "meshccl-hostfile"}\n'
    assert "MESHKIT_RANK" not in spec["env"] and spec["env"]["MESHKIT_WORLD_SIZE"] == "8"


def test_sbatch_submits_a_script_that_writes_the_ring_and_runs_the_same_srun(tmp_path):
    argv = launch_slurm.sbatch_argv(job())
    assert argv[:4] == ["env", "-u", "MESHKIT_JOB_MARK", "sbatch"]
    assert "--parsable" in argv and "--distribution=arbitrary" in argv and "--exclusive" in argv
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


def test_a_batch_launch_names_the_job_and_where_its_output_goes():
    ok = SimpleNamespace(ranks=[state(["17"], driver="sbatch")])
    number, message = launch_slurm.submitted(job(), ok)
    assert number == "17"
    assert message == (
        "submitted Slurm batch job 17 (meshkit-j1): 8 ranks in ring order; their output (labelled by rank) goes to "
        "node1:/tmp/meshkit-j1-17.out. squeue -j 17 shows it, scancel 17 stops it"
    )
    number, message = launch_slurm.submitted(job(), SimpleNamespace(ranks=[state(["queued?"], driver="sbatch")]))
    assert number is None and "printed no Slurm job id" in message


def test_the_wrapper_refuses_a_job_directory_that_is_not_the_users_private_one(tmp_path):
    """The job directory's parent is world-writable and its name public: one made first by someone
    else (here: mode 0755), or a link, fails the task before any file is written there."""
    for made in ("open", "link"):
        d = tmp_path / made / "j1"
        d.parent.mkdir()
        if made == "open":
            d.mkdir(mode=0o755)
            d.chmod(0o755)
        else:
            (tmp_path / "elsewhere").mkdir(mode=0o700, exist_ok=True)
            d.symlink_to(tmp_path / "elsewhere")
        argv = launch_slurm.srun_argv(job(job_dir=str(d)))
        wrapper = argv[argv.index("--") + 1 :]
        common, _r, _h = launch_slurm.split_env(job(job_dir=str(d)))
        contents, _f = launch_slurm.job_files(job(job_dir=str(d)))
        env = {**common, **contents, "PATH": "/usr/bin:/bin", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
               "SLURMD_NODENAME": "node1"}  # fmt: skip
        proc = subprocess.run(wrapper, env=env, capture_output=True, text=True, check=False)
        assert proc.returncode == 97 and "is not a private directory of" in proc.stderr, (made, proc.stderr)
        assert not (tmp_path / "elsewhere" / "meshccl.json").exists()


def test_a_job_file_too_large_for_the_environment_is_refused():
    big = job()
    big["files"]["node1"]["meshccl.json"] = "x" * (130 * 1024)
    with pytest.raises(launch_slurm.SlurmError, match=r"meshccl\.json is 130 KiB"):
        launch_slurm.job_files(big)


def test_the_rank_is_found_in_srun_log_when_the_ranks_output_pushed_it_out_of_the_tail(tmp_path):
    """srun's last lines hold the ranks' labelled output too: the report that names the failing rank
    is read from srun.log whole; a signal is named; a timeout keeps its own reason."""
    report = (FIXTURES / "srun-bad-exit.txt").read_text().splitlines()
    noise = [f"{r}: Traceback: peer closed the connection" for r in (0, 1, 2, 4, 5, 6, 7) for _ in range(5)]
    (tmp_path / "srun.log").write_text("\n".join([report[0], *noise, *report[1:]]) + "\n")
    srun = state(noise[-20:])
    done = SimpleNamespace(failed=[srun], ranks=[srun], reason="srun failed", rank_output={}, log_dir=tmp_path)
    reason, _ = launch_slurm.explain(job(), done)
    assert reason.startswith("rank 3 (node2) exited with exit code 7"), reason
    (tmp_path / "srun.log").write_text(
        "srun: error: node3: task 5: Segmentation fault (core dumped)\n"
        "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.\n"
        "srun: error: node1: tasks 0-1: Killed\n"
    )
    reason, _failures = launch_slurm.explain(job(), done)
    assert reason.startswith("rank 5 (node3): Segmentation fault (core dumped) (reported by srun"), reason
    assert launch_slurm.exit_code(job(), done) is None
    srun.state = "timeout"
    timed = SimpleNamespace(failed=[], ranks=[srun], reason="timeout after 10 s", rank_output={}, log_dir=tmp_path)
    assert launch_slurm.explain(job(), timed)[0] == "timeout after 10 s"
