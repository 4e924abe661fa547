"""MPI jobs (plugins/module_utils/launch_mpi.py) and mpirun's remote shell agent
(launch_connection.py run as a program), against a recorded Open MPI 4.1.4 report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from ansible_collections.meshkit.cluster.plugins.module_utils import launch_connection, launch_mpi

FIXTURE = Path(__file__).parents[1] / "fixtures" / "mpi" / "openmpi-4.1.4-rank5-exit3.log"


def job(per_host: int = 2) -> dict:
    hosts = ["node1", "node3", "node2", "node4"]  # ring order, not name order
    ranks = []
    for i, host in enumerate(hosts):
        for local in range(per_host):
            rank = i * per_host + local
            env = {"MESHKIT_JOB_ID": "j1", "MESHKIT_RANK": str(rank), "MESHKIT_LOCAL_RANK": str(local),
                   "MESHKIT_HOST": host, "MESHKIT_WORLD_SIZE": str(len(hosts) * per_host),
                   "GREETING": "hi"}  # fmt: skip
            ranks.append({"rank": rank, "host": host, "argv": ["./prog", "--x"], "env": env, "cwd": "/srv"})
    return {"job_id": "j1", "runtime": "mpi", "world_size": len(ranks), "ranks": ranks, "files": {}, "job_dir": "/x"}


def test_hostfile_is_in_ring_order_with_slots():
    assert launch_mpi.hostfile(job()) == "node1 slots=2\nnode3 slots=2\nnode2 slots=2\nnode4 slots=2\n"


def test_mpirun_argv_maps_by_slot_exports_the_common_env_and_uses_the_agent(tmp_path):
    argv = launch_mpi.mpirun_argv(job(), tmp_path, tmp_path / "c.json", mpirun="/usr/bin/mpirun", as_root=True)
    assert argv[0] == "/usr/bin/mpirun"
    joined = " ".join(argv)
    for part in ("-np 8", "-bind-to none", "-map-by slot", "--tag-output", "-mca plm_rsh_no_tree_spawn 1",
                 "--allow-run-as-root", "--wdir /srv", f"--hostfile {tmp_path}/mpi-hostfile"):  # fmt: skip
        assert part in joined, part
    exported = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    assert sorted(exported) == ["GREETING", "MESHKIT_JOB_ID", "MESHKIT_WORLD_SIZE"]  # not the per-rank ones
    agent = argv[argv.index("plm_rsh_agent") + 1].split(" ")
    assert agent[1].endswith("launch_connection.py") and agent[2] == str(tmp_path / "c.json")
    assert argv[-3:] == ["--", "./prog", "--x"]


def test_recorded_mpirun_report_names_the_first_failed_rank():
    text = FIXTURE.read_text()
    assert launch_mpi.first_failure(text) == (5, 3)
    assert launch_mpi.first_failure("mpirun: all fine\n") is None
    assert launch_mpi.split_line("[1,5]<stderr>:giving up") == (5, "giving up")
    assert launch_mpi.split_line("[1,12]<stdout>:") == (12, "")
    assert launch_mpi.split_line("Primary job  terminated normally") is None
    # Seen on the lab: a traceback line written in pieces, each piece tagged.
    line = "[1,6]<stderr>:ModuleNotFoundError[1,6]<stderr>:: [1,6]<stderr>:No module named 'mpi4py'[1,6]<stderr>:"
    assert launch_mpi.split_line(line) == (6, "ModuleNotFoundError: No module named 'mpi4py'")


def test_explain_names_the_rank_mpirun_reported_with_its_own_lines(tmp_path):
    (tmp_path / "mpi" / "1" / "rank.5").mkdir(parents=True)
    (tmp_path / "mpi" / "1" / "rank.5" / "stdout").write_text("[1,5]<stdout>:up 5\n")
    (tmp_path / "mpi" / "1" / "rank.5" / "stderr").write_text("[1,5]<stderr>:giving up\n")
    mpirun = SimpleNamespace(rank=-1, host="controller", state="failed", label="mpirun",
                             tail=FIXTURE.read_text().splitlines()[-20:], describe=lambda: "exit code 3")  # fmt: skip
    outcome = SimpleNamespace(failed=[mpirun], ranks=[mpirun], reason="mpirun (controller) failed", log_dir=tmp_path)
    reason, failures = launch_mpi.explain(job(), outcome)
    assert reason == "rank 5 (node2) exit code 3 (reported by mpirun, exit code 3)"  # rank 5: third ring host
    assert failures == [("rank 5 on node2: failed, exit code 3", ["up 5", "giving up"])]


def test_lines_show_tagged_lines_as_the_ranks_own():
    shown = launch_mpi.Lines(job())
    mpirun = SimpleNamespace(rank=-1, host="controller")
    assert shown(mpirun, "[1,3]<stdout>:hello") == ["[3|node3] hello"]
    assert shown(mpirun, "some mpirun notice") == ["[mpirun] some mpirun notice"]
    assert shown(SimpleNamespace(rank=2, host="node3"), "x") == ["[2|node3] x"]


def test_lines_put_back_writes_of_several_ranks_that_share_a_line():
    # Seen on the lab: rank 0's print wrote its text, rank 1's whole line came next, then rank 0's
    # newline.
    shown = launch_mpi.Lines(job())
    mpirun = SimpleNamespace(rank=-1, host="controller")
    assert shown(mpirun, "[1,0]<stdout>:mpi rank 0 sum=36[1,1]<stdout>:mpi rank 1 sum=36") == [
        "[1|node1] mpi rank 1 sum=36"
    ]
    assert shown(mpirun, "[1,0]<stdout>:") == ["[0|node1] mpi rank 0 sum=36"]
    line = "[1,6]<stderr>:ModuleNotFoundError[1,6]<stderr>:: [1,6]<stderr>:No module named 'mpi4py'[1,6]<stderr>:"
    assert shown(mpirun, line) == ["[6|node4] ModuleNotFoundError: No module named 'mpi4py'"]


def test_rsh_agent_runs_the_words_over_the_hosts_connection(tmp_path):
    conns = tmp_path / "c.json"
    conns.write_text(json.dumps({"here": {"kind": "local"}}))
    agent = [sys.executable, launch_connection.__file__, str(conns)]
    # mpirun hands the daemon's command as words already quoted for a shell.
    proc = subprocess.run([*agent, "here", " echo", '"a  b"', "$((1+2))"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout == "a  b 3\n", proc
    proc = subprocess.run([*agent, "elsewhere", "true"], capture_output=True, text=True, check=False)
    assert proc.returncode == 255 and "no connection for host 'elsewhere'" in proc.stderr


def test_shell_argv_per_connection_kind():
    ssh = {"kind": "ssh", "host": "10.0.0.2", "port": 2222, "user": "root", "key": "/k", "args": ["-o", "A=b"],
           "host_timeout": 12}  # fmt: skip
    # An orted's connection gets the keepalives of the job's host timeout too.
    assert launch_connection.shell_argv(ssh, "orted x") == [
        "ssh", "-T", "-o", "BatchMode=yes", "-p", "2222", "-l", "root", "-i", "/k", "-o", "A=b",
        "-o", "ServerAliveInterval=3", "-o", "ServerAliveCountMax=3", "-o", "ConnectTimeout=12", "10.0.0.2", "orted x",
    ]  # fmt: skip
    assert launch_connection.shell_argv({"kind": "nsenter", "pid": 7}, "c")[-3:] == ["sh", "-c", "c"]
    assert launch_connection.shell_argv({"kind": "local"}, "c") == ["sh", "-c", "c"]
