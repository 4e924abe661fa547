"""launch.yml and `meshkit launch` on a real lab: a 4-host full mesh reached over SSH, converged by
setup.yml once, then jobs of 4 hosts x 2 ranks: meshccl, MLX and PyTorch programs, a failing rank,
a hanging one, a program missing on one host, stale hostfiles, and stdin typed once into every rank."""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.meshkit.cluster.plugins.module_utils import meshccl_build

from meshkit import lab_netns, launch_fast
from meshkit.check_report import edge_id
from meshkit.lab_spec import HOST_MGMT_PORT

from .conftest import ENV, REPO, LabHandle, PlaybookRun, drop_lab, ip_json, new_lab, run_playbook, sh

PROGRAMS = Path(__file__).parent / "programs"
PYTHON = str(REPO / ".venv" / "bin" / "python")
MESHKIT = str(REPO / ".venv" / "bin" / "meshkit")  # make venv installs the package (editable)
VENV = "/var/lib/meshkit/meshccl"  # each lab host's own meshccl (its /var/lib/meshkit is its own)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabHandle, Path]]:
    """A 4-host mesh reached the way real clusters are: hosts by name (ansible_host resolves on the
    controller and on the hosts, each of which maps its own short name to 127.0.1.1), as the login
    user meshadmin with sudo (root cannot log in; setup.yml becomes root, jobs run as meshadmin).
    Plus an uncabled head node outside the cluster's group (inventory group `heads`): Slurm's
    slurmctld runs there, as on clusters whose login node is not a compute node."""
    handle = new_lab(tag="l", lab_size=4, lab_shape="mesh", lab_access="sudo", lab_names=True, lab_head=True)
    artifacts = tmp_path_factory.mktemp("launch-artifacts")
    try:
        built = handle.up()
        assert built.rc == 0, built.output
        # node3 and node4 build meshccl on a host (their group's first: node3), from the sdist; node1 and node2
        # get the controller's wheel. The lab's hosts all match the controller, so only this inventory option
        # makes a host-built group here; its cached wheelhouse is dropped so that node3 really builds.
        inventory = yaml.safe_load(handle.inventory.read_text())
        for node in HOST_BUILT:
            inventory["all"]["children"]["cluster"]["hosts"][node]["meshkit_meshccl_build_on"] = "group"
        # Slurm too (the slurm role), slurmctld on the head node: its tests are at the end of this file.
        inventory["all"]["vars"]["meshkit_slurm"] = True
        inventory["all"]["vars"]["meshkit_slurm_controller"] = HEAD
        # Where setup.yml and every launch keep plan.json and the logs: in the inventory, so that a
        # `meshkit launch` without -e can plan from the checks it remembered (the Slurm tests do).
        inventory["all"]["vars"]["meshkit_artifacts_dir"] = str(artifacts)
        handle.inventory.write_text(yaml.safe_dump(inventory, sort_keys=False))
        drop_host_built_wheelhouses()
        run = run_playbook("setup.yml", "-e", f"meshkit_artifacts_dir={artifacts}", inventory=str(handle.inventory))
        (artifacts / "setup-output.txt").write_text(run.output)
        assert run.rc == 0, run.output
        yield handle, artifacts
    finally:
        drop_lab(handle)


HOST_BUILT = ("node3", "node4")
HEAD = "head"  # the lab's head node: slurmctld, no cables, not a cluster host
WHEEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshkit" / "meshccl-wheels"


def current_build() -> str:
    """The build id setup.yml computes (the controller's Python, this one, pins numpy)."""
    return meshccl_build.build_id(str(REPO / "collective"), meshccl_build.pinned(["numpy"]))


def drop_host_built_wheelhouses() -> None:
    """The controller's cached wheelhouses of the current sources that hosts built (its own are kept)."""
    for path in (WHEEL_CACHE / current_build()).glob("*"):
        if path.is_dir() and not path.name.startswith(("controller-", "sdist", "kit-", ".")):
            shutil.rmtree(path)


def installed_record(handle: LabHandle, host: str) -> dict[str, Any]:
    """meshccl's install record in ``host``'s own environment (its /var/lib/meshkit is its own)."""
    pid = holders(handle)[host]
    return json.loads(sh("nsenter", "-t", str(pid), "-m", "--", "cat", f"{VENV}/meshkit-meshccl.json").stdout)


def task_lines(output: str, task: str) -> list[str]:
    """The sorted per-host lines of one task of a play's output."""
    found = re.search(rf"TASK \[{re.escape(task)}[^\n]*\n(.*?)\n\n", output, re.S)
    assert found is not None, output
    return sorted(line for line in found.group(1).splitlines() if line.startswith(("ok:", "changed:", "skipping:")))


def launch(lab: tuple[LabHandle, Path], **variables: Any) -> tuple[int, str, dict[str, Any] | None]:
    """Run launch.yml; (rc, output, summary.json of the job or None)."""
    handle, artifacts = lab
    job = variables.setdefault("launch_job_id", f"t{uuid.uuid4().hex[:10]}")
    run = run_playbook(
        "launch.yml",
        "-e",
        f"meshkit_artifacts_dir={artifacts}",
        "-e",
        json.dumps(variables),
        inventory=str(handle.inventory),
    )
    summary = artifacts / "launch" / job / "summary.json"
    return run.rc, run.output, json.loads(summary.read_text()) if summary.exists() else None


def holders(handle: LabHandle) -> dict[str, int]:
    """Each cluster host's namespace holder (this machine's pid); the head node is not a cluster host."""
    cluster = handle.hosts()
    return {h: pid for h, pid in json.loads((handle.dir / "state.json").read_text())["holders"].items() if h in cluster}


def links_as_seen(handle: LabHandle) -> str:
    """Every lab host's links, IPv6 addresses and neighbours (what discovery reads), for a failure message."""
    out = []
    for host, vars_ in handle.hosts().items():
        netns = vars_["meshkit_lab_netns"]
        for what in (["-br", "link"], ["-br", "-6", "addr"], ["-6", "neigh"]):
            text = sh("ip", "-n", netns, *what, check=False).stdout
            out.append(f"--- {host}: ip {' '.join(what)}\n{text}")
    return "\n" + "\n".join(out)


def ps_on_every_host(handle: LabHandle) -> dict[str, str]:
    """`ps -eo pid,args` inside each lab host's own PID namespace."""
    out = {}
    for host, pid in holders(handle).items():
        proc = sh("nsenter", "-t", str(pid), "-p", "-m", "--", "ps", "-ww", "-eo", "pid,args")
        out[host] = proc.stdout
    return out


def processes_with_env(marker: str) -> list[str]:
    """Every process on the machine (all lab hosts included) whose environment holds ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{proc.name}: {cmdline}")
        except OSError:
            continue
    return found


def put_program(handle: LabHandle, program: str, hosts: str) -> None:
    """A script at ``program`` on ``hosts`` only (/var/lib/meshkit is each lab host's own)."""
    made = handle.ansible(
        "-b", "-m", "ansible.builtin.shell",
        "-a", f"mkdir -p /var/lib/meshkit/bin && printf '#!/bin/sh\\necho hi\\n' > {program} && chmod +x {program}",
        pattern=hosts,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr


def test_setup_by_name_as_a_sudo_user_converged_is_idempotent_and_check_changes_nothing(lab):
    """The fixture's setup.yml converged a cluster reached by name as meshadmin with become, where no
    module saw SSH_CONNECTION (sudo drops it) and each host maps its own name to loopback: the
    management interface came from the name resolved on the host and the route back to the
    controller. A second run changes nothing; --check --diff changes nothing and says so."""
    handle, artifacts = lab
    hosts = handle.hosts()
    assert all(h["ansible_host"] == f"{n}.{handle.name}.meshkit.test" for n, h in hosts.items()), hosts
    found = handle.ansible(
        "-b", "-m", "meshkit.cluster.management", "-a", "host={{ inventory_hostname }} address={{ ansible_host }}",
        pattern="cluster",
    )  # fmt: skip
    assert found.returncode == 0, found.stdout + found.stderr
    # The result (ansible.cfg prints it as YAML): per host, the interface it established.
    assert sorted(re.findall(r"^(\S+) \| SUCCESS", found.stdout, re.M)) == sorted(hosts), found.stdout
    assert len(re.findall(r"^    interface: mgmt0$", found.stdout, re.M)) == 4, found.stdout
    assert "SSH_CONNECTION" not in found.stdout, found.stdout  # become's environment has none
    assert found.stdout.count(".meshkit.test' resolved on the host") == 4, found.stdout

    before = {n: ip_json("-n", h["meshkit_lab_netns"], "addr", "show") for n, h in hosts.items()}
    again = run_playbook("setup.yml", "-e", f"meshkit_artifacts_dir={artifacts}", inventory=str(handle.inventory))
    assert again.rc == 0, again.output
    # The head node takes part in Slurm's play only (slurmctld).
    assert set(again.recap) == set(hosts) | {HEAD} and again.changed == 0, again.output
    assert "TASK [meshkit.cluster.slurm : Run slurmd (restarted where" in again.output, again.output
    assert task_lines(again.output, "meshkit.cluster.slurm : Run slurmctld") == [
        f"ok: [{HEAD}]",
        *(f"skipping: [{h}]" for h in sorted(hosts)),
    ], again.output
    assert re.search(r"node1: management mgmt0 \(never touched\)", again.output), again.output
    check = run_playbook(
        "setup.yml", "--check", "--diff", "-e", f"meshkit_artifacts_dir={artifacts}", inventory=str(handle.inventory)
    )
    assert check.rc == 0, check.output
    assert check.changed == 0, check.output
    after = {n: ip_json("-n", h["meshkit_lab_netns"], "addr", "show") for n, h in hosts.items()}
    strip = lambda state: {  # noqa: E731 - lifetimes of addresses tick; what is there must not change
        n: sorted((link["ifname"], a["local"], a["prefixlen"]) for link in links for a in link.get("addr_info", []))
        for n, links in state.items()
    }
    assert strip(after) == strip(before)


def test_discovery_as_the_login_user_finds_every_cable_from_empty_neighbour_tables(lab):
    """What a reboot or a reseated cable leaves: no neighbour entry on any port. Discovery runs as
    meshadmin (launch.yml discovers without become; iputils ping refuses it sub-second multicast
    intervals) and still names every planned peer, by resolving each answer's MAC itself."""
    handle, artifacts = lab
    hosts = handle.hosts()
    for vars_ in hosts.values():
        sh("ip", "-n", vars_["meshkit_lab_netns"], "-6", "neigh", "flush", "all")
    found = handle.ansible(
        "-m", "meshkit.cluster.discover", "-a", json.dumps({"peer_ports": ["tb*"], "management_interface": "mgmt0"}),
        "-o", pattern="cluster",
    )  # fmt: skip
    assert found.returncode == 0, found.stdout + found.stderr
    ports = {}
    for line in found.stdout.splitlines():
        host, _, rest = line.partition(" | SUCCESS => ")
        for port in json.loads(rest)["ports"]:
            ports[(host, port["port"])] = port
    assert {host for host, _ in ports} == set(hosts), found.stdout
    plan = json.loads((artifacts / "plan.json").read_text())
    for host, links in plan["per_host"].items():
        for link in links:
            mine, peer = ports[(host, link["port"])], ports[(link["peer_host"], link["peer_port"])]
            where = f"{host}:{link['port']}"
            assert mine["probe_error"] is None, (where, mine)
            assert mine["seen"] == [peer["ident"]], (where, mine, link)


def test_meshccl_built_on_a_host_from_the_sdist_for_two_hosts_and_by_the_controller_for_two(lab):
    """setup.yml grouped node3 and node4 apart (meshkit_meshccl_build_on: group), made meshccl's source
    distribution, had node3 build the wheel from it with no package index, fetched the wheel into the
    controller's cache and installed it on node3 and node4; node1 and node2 got the controller's own wheel."""
    handle, artifacts = lab
    output = (artifacts / "setup-output.txt").read_text()
    flat = " ".join(output.split())  # the YAML callback wraps long lines
    # The build setup.yml installed (the sources' id then; they may have been edited since).
    build = installed_record(handle, "node1")["build"]
    group = "linux-x86_64-cp311-glibc2.36"
    # The controller's wheel may be in its cache from an earlier run of the same sources.
    assert re.search(rf"node1, node2 \(\S+\): meshccl {build} (building on|built on) the controller", flat), output
    assert f"node3, node4 ({group}): meshccl {build} building on node3 (from the source distribution)" in flat, output
    built = task_lines(output, "meshkit.cluster.meshccl : Build meshccl's wheel on this host from the source")
    assert built == ["changed: [node3]", "skipping: [node1]", "skipping: [node2]", "skipping: [node4]"], built
    fetched = task_lines(output, "meshkit.cluster.meshccl : Fetch the built wheel into the group's wheelhouse")
    assert fetched == ["changed: [node3]", "skipping: [node1]", "skipping: [node2]", "skipping: [node4]"], fetched
    installed = task_lines(output, "meshkit.cluster.meshccl : Install meshccl from one archive")
    assert installed == [f"changed: [node{i}]" for i in range(1, 5)], installed
    # One archive per host: node1 and node2 a ready environment made on the controller with their interpreter
    # path; node3 and node4 (their wheel built on node3) the group's wheels, installed with pip there.
    assert re.search(r"to install on node1, node2 from a ready environment", flat), output
    assert re.search(r"to install on node3, node4 from its wheels \(its wheel is built on node3\)", flat), output
    # The controller's cache holds the group's wheelhouse, marked as node3's; the hosts' records agree.
    house = WHEEL_CACHE / build / group
    mark = json.loads((house / "meshkit-wheelhouse.json").read_text())
    assert mark["built_on"] == "node3" and mark["build"] == build, mark
    (host_wheel,) = house.glob("meshccl-*.whl")
    (ctrl_wheel,) = next((WHEEL_CACHE / build).glob("controller-*")).glob("meshccl-*.whl")
    digest = {w: hashlib.sha256(w.read_bytes()).hexdigest() for w in (host_wheel, ctrl_wheel)}
    assert digest[host_wheel] != digest[ctrl_wheel]  # two builds: node3's and the controller's
    records = {host: installed_record(handle, host) for host in ("node1", "node2", "node3", "node4")}
    for host, record in records.items():
        wheel = host_wheel if host in HOST_BUILT else ctrl_wheel
        assert record["build"] == build, (host, record)  # one build id everywhere: same sources
        assert record["built_on"] == ("node3" if host in HOST_BUILT else "controller"), (host, record)
        assert record["sha256"][wheel.name] == digest[wheel], (host, record)
        assert record["method"] == ("wheels" if host in HOST_BUILT else "environment"), (host, record)
    # node3 left no build directory behind; no host keeps a copied wheelhouse.
    for host, pid in holders(handle).items():
        left = sh("nsenter", "-t", str(pid), "-m", "--", "ls", "-A", "/var/lib/meshkit/meshccl-wheels", check=False)
        assert left.stdout.split() == [], (host, left.stdout)


def test_meshccl_all_reduce_on_4_hosts_x_2_ranks(lab):
    # A bare "python3": the launch puts each host's own meshccl environment first on PATH.
    rc, output, summary = launch(
        lab,
        launch_program=["python3", str(PROGRAMS / "meshccl_allreduce.py")],
        launch_ranks_per_host=2,
        launch_timeout=120,
    )
    assert rc == 0, output
    assert summary is not None and summary["ok"], summary
    assert [(r["rank"], r["state"], r["exit_code"]) for r in summary["ranks"]] == [(r, "ok", 0) for r in range(8)]
    # Ring order host by host, two ranks each; every rank's own line, prefixed with its rank and host.
    hosts = [r["host"] for r in summary["ranks"]]
    assert hosts[0::2] == hosts[1::2] and len(set(hosts)) == 4
    for r in range(8):
        assert re.search(rf"^\[{r}\|{hosts[r]}\] meshccl rank {r}/8 on {hosts[r]}: all_reduce exact$", output, re.M), (
            output
        )
        log = Path(summary["log_dir"]) / f"rank-{r}.log"
        assert f"meshccl rank {r}/8" in log.read_text()
    # Every host ran its own install (setup.yml put one in each host's /var/lib/meshkit).
    installs = dict(re.findall(r"^\[\d+\|(\S+)\] meshccl from (\S+ inode \S+)$", output, re.M))
    assert len(installs) == 4 and len(set(installs.values())) == 4, installs
    assert all(v.startswith(f"{VENV}/lib/") for v in installs.values()), installs
    # The job spans both kinds of install: the controller's wheel (node1, node2) and node3's (node3, node4).
    handle, _ = lab
    built_on = {host: installed_record(handle, host)["built_on"] for host in installs}
    assert built_on == {"node1": "controller", "node2": "controller", "node3": "node3", "node4": "node3"}, built_on
    # The token reaches the ranks but no log and no summary; job.json names it, its value hidden
    # (test_meshkit_launch_keeps_the_token_and_secrets_out_... looks for the value itself).
    log_dir = Path(summary["log_dir"])
    logs = "".join(p.read_text() for p in log_dir.iterdir() if p.is_file() and p.name != "job.json")
    assert "MESHCCL_TOKEN" not in logs and "MESHCCL_TOKEN" not in output
    planned = json.loads((log_dir / "job.json").read_text())
    assert {r["env"]["MESHCCL_TOKEN"] for r in planned["ranks"]} == {"<hidden>"}


def test_launch_installs_meshccl_where_it_is_missing(lab):
    handle, _ = lab
    node3 = holders(handle)["node3"]
    sh("nsenter", "-t", str(node3), "-m", "--", "rm", "-rf", VENV)
    rc, output, summary = launch(
        lab, launch_program=["meshccl-bench", "all_reduce", "-b", "4K", "-e", "16K", "-n", "2"], launch_timeout=120
    )
    assert rc == 0, output
    assert summary is not None and summary["ok"], summary
    # Only node3 got the wheelhouse and an install; the other hosts' builds were current. Its group's wheel
    # (built on node3 by setup.yml) came from the controller's cache: nothing was built again.
    assert task_lines(output, "meshkit.cluster.meshccl : Install meshccl from one archive") == [
        "changed: [node3]",
        "skipping: [node1]",
        "skipping: [node2]",
        "skipping: [node4]",
    ], output
    rebuilt = task_lines(output, "meshkit.cluster.meshccl : Build meshccl's wheel on this host")
    assert rebuilt == [f"skipping: [node{i}]" for i in range(1, 5)], rebuilt
    assert installed_record(handle, "node3")["built_on"] == "node3"
    # meshccl-bench (found on PATH in node3's fresh install) printed rank 0's table.
    assert re.search(r"^\[0\|\S+\] +4096 +1024 +float32 +sum", output, re.M), output
    listing = sh("nsenter", "-t", str(node3), "-m", "--", "ls", f"{VENV}/bin").stdout.split()
    assert "meshccl-bench" in listing and "python3" in listing, listing


def test_a_failing_rank_stops_every_rank_on_every_host(lab):
    handle, _ = lab
    marker = f"mkjob{uuid.uuid4().hex[:8]}"
    script = (
        'echo "rank $MESHKIT_RANK up"; '
        'if [ "$MESHKIT_RANK" = 5 ]; then sleep 2; echo "rank 5: giving up" >&2; exit 3; fi; '
        "sleep 300 & wait"
    )
    started = time.monotonic()
    rc, output, summary = launch(
        lab,
        launch_program=["sh", "-c", script, marker],
        launch_ranks_per_host=2,
        launch_runtime="plain",
        launch_env={"MARKER": marker},
    )
    took = time.monotonic() - started
    assert rc != 0
    failed_host = summary["ranks"][5]["host"]
    assert re.search(rf"failed: rank 5 \({failed_host}\) exit code 3", output), output
    assert "rank 5: giving up" in output  # its last lines
    states = {r["rank"]: r["state"] for r in summary["ranks"]}
    assert states == {**{r: "stopped" for r in range(8)}, 5: "failed"}
    # The job ended within seconds of the failure, not after the survivors' 300 s.
    assert summary["wall_s"] < 30, summary
    assert took < 120
    for host, listing in ps_on_every_host(handle).items():
        assert marker not in listing and "sleep 300" not in listing, (host, listing)
    assert processes_with_env(f"MARKER={marker}") == []


def test_a_hanging_rank_meets_the_overall_timeout(lab):
    handle, _ = lab
    marker = f"mkjob{uuid.uuid4().hex[:8]}"
    script = 'if [ "$MESHKIT_RANK" = 6 ]; then echo hanging; exec sleep 1000; fi; echo done'
    rc, output, summary = launch(
        lab,
        launch_program=["sh", "-c", script, marker],
        launch_ranks_per_host=2,
        launch_runtime="plain",
        launch_timeout=4,
        launch_env={"MARKER": marker},
    )
    assert rc != 0
    assert "failed: timeout after 4 s" in output, output
    states = {r["rank"]: r["state"] for r in summary["ranks"]}
    assert states == {**{r: "ok" for r in range(8)}, 6: "timeout"}
    assert summary["ranks"][6]["last_lines"] == ["hanging"]
    for host, listing in ps_on_every_host(handle).items():
        assert marker not in listing, (host, listing)
    assert processes_with_env(f"MARKER={marker}") == []


def test_mlx_ring_program_gets_its_environment(lab):
    rc, output, summary = launch(
        lab,
        launch_program=[PYTHON, str(PROGRAMS / "mlx_all_sum.py")],
        launch_ranks_per_host=2,
        launch_runtime="mlx",
        launch_timeout=120,
    )
    assert rc == 0, output
    hosts = [r["host"] for r in summary["ranks"]]
    for r in range(8):
        # 1 + 2 + ... + 8 = 36 on every rank.
        assert f"[{r}|{hosts[r]}] mlx rank {r}/8 on {hosts[r]} MLX_RANK={r} sum=36" in output, output


def test_torch_gloo_program_through_meshkit_launch(lab):
    handle, artifacts = lab
    proc = subprocess.run(
        [PYTHON, MESHKIT, "launch", "-i", str(handle.inventory), "-r", "torch", "-n", "2", "-t", "180", "--no-stdin",
         "-e", f"meshkit_artifacts_dir={artifacts}", "--", PYTHON, str(PROGRAMS / "torch_gloo.py")],
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=400, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = re.findall(r"^\[(\d)\|(node\d)\] torch rank (\d)/8 on (node\d) (.*) sum=36$", proc.stdout, re.M)
    assert sorted(int(r) for r, *_ in lines) == list(range(8)), proc.stdout
    masters = set()
    for rank, host, rank2, host2, env in lines:
        fields = dict(item.split("=", 1) for item in env.split())
        assert rank == rank2 == fields["RANK"] and host == host2
        assert fields["WORLD_SIZE"] == "8" and fields["LOCAL_RANK"] == str(int(rank) % 2)
        masters.add((fields["MASTER_ADDR"], fields["MASTER_PORT"]))
    assert len(masters) == 1
    # The rendezvous is rank 0's host, on its management address.
    rank0_host = next(host for rank, host, *_ in lines if rank == "0")
    assert masters == {(handle.hosts()[rank0_host]["ansible_host"], "29500")}


def meshkit_launch(
    lab: tuple[LabHandle, Path], runtime: str, *program: str, timeout: int = 300
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`meshkit launch -r RUNTIME -n 2 -- PROGRAM` on the lab (8 ranks on 4 hosts); the run and the
    job's log directory on the controller."""
    handle, artifacts = lab
    (artifacts / "launch").mkdir(parents=True, exist_ok=True)
    before = set((artifacts / "launch").iterdir())
    proc = subprocess.run(
        [PYTHON, MESHKIT, "launch", "-i", str(handle.inventory), "-r", runtime, "-n", "2", "-t", str(timeout),
         "--no-stdin", "-e", f"meshkit_artifacts_dir={artifacts}", "--", *program],
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=timeout + 300, check=False,
    )  # fmt: skip
    made = set((artifacts / "launch").iterdir()) - before
    assert len(made) == 1, (made, proc.stdout + proc.stderr)
    return proc, made.pop()


def cable_addresses(handle: LabHandle) -> dict[str, list[str]]:
    """Every lab host's cable addresses (the /30s setup.yml gave them), read from its namespace."""
    out = {}
    for host, vars_ in handle.hosts().items():
        found = ip_json("-n", vars_["meshkit_lab_netns"], "-4", "addr")
        out[host] = sorted(a["local"] for link in found for a in link["addr_info"] if a["prefixlen"] == 30)
    return out


def cable_between(cables: dict[str, list[str]], host: str, peer: str) -> tuple[str, str]:
    """(host's address, peer's address) on the one cable between them: the two in one /30."""
    [pair] = [
        (mine, theirs)
        for mine in cables[host]
        for theirs in cables[peer]
        if ipaddress.ip_address(theirs) in ipaddress.ip_network(f"{mine}/30", strict=False)
    ]
    return pair


# Under `-r torch`, without torch: meshccl.init() in a rank (what the "meshccl" process group does)
# must find torch's own rank in meshkit's hostfile, and a token.
MESHCCL_UNDER_TORCH = """
import os, meshccl, numpy as np
c = meshccl.init()
x = np.full(1 << 18, c.rank + 1, dtype=np.float32)
c.all_reduce(x)
listen = ",".join(sorted({a for a, _ in c.plan.listen}))
peers = " ".join(f"{p}@{'+'.join(a for a, _ in eps)}" for p, (eps, _) in sorted(c.plan.peers.items()))
print(f"under-torch RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']} comm={c.rank}/{c.size} "
      f"source={c.plan.source} token={bool(os.environ.get('MESHCCL_TOKEN'))} "
      f"exact={bool((x == c.size * (c.size + 1) / 2).all())} listen={listen} peers={peers}", flush=True)
c.close()
"""


def test_torch_ranks_get_meshccls_hostfile_with_torchs_ranks_and_a_token(lab):
    """`meshkit launch -r torch`: every rank gets the job's meshccl.json and a job token, so meshccl
    started in a torch rank is torch's rank of torch's world, listens on every cable of its host and
    reaches every other host's ranks over the cable between them (the lab is a full mesh), its own
    host's other rank over loopback; an all_reduce across the 8 ranks is exact."""
    handle, _ = lab
    proc, job_dir = meshkit_launch(lab, "torch", PYTHON, "-c", MESHCCL_UNDER_TORCH)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = {
        int(r): (host, dict(kv.split("=", 1) for kv in fields.split()), peers)
        for r, host, fields, peers in re.findall(r"^\[(\d)\|(node\d)\] under-torch (.*) peers=(.*)$", proc.stdout, re.M)
    }
    assert sorted(said) == list(range(8)), proc.stdout
    cables = cable_addresses(handle)
    assert all(len(addresses) == 3 for addresses in cables.values()), cables  # 4-host mesh: 3 cables each
    host_of = {r: host for r, (host, _, _) in said.items()}
    for r, (host, fields, peers) in said.items():
        assert fields["RANK"] == str(r) and fields["WORLD_SIZE"] == "8" and fields["comm"] == f"{r}/8", fields
        assert fields["source"] == f"/var/lib/meshkit/jobs/{job_dir.name}/meshccl.json", fields
        assert fields["token"] == "True" and fields["exact"] == "True", fields
        assert fields["listen"] == ",".join(sorted([*cables[host], "127.0.0.1"])), (host, fields, cables)
        expected = []
        for p in range(8):
            if p == r:
                continue
            if host_of[p] == host:
                expected.append(f"{p}@127.0.0.1")
            else:
                expected.append(f"{p}@{cable_between(cables, host, host_of[p])[1]}")
        assert peers == " ".join(expected), (r, host, peers, cables)


DDP_PARITY = str(PROGRAMS / "torch_ddp_parity.py")


def test_ddp_over_meshccl_gives_the_parameters_gloo_gives_under_meshkit_launch_torch(lab):
    """`init_process_group("meshccl")` under `meshkit launch -r torch -n 2` (8 ranks on the 4-host mesh):
    DDP trains a model for 5 steps over meshccl and, in the same job, a copy over a Gloo group; every
    rank's meshccl copy matches Gloo's and a local reference within the program's stated tolerance,
    bit-identical on every rank, and its meshccl connections leave from every cable of its host."""
    proc, job_dir = meshkit_launch(lab, "torch", PYTHON, DDP_PARITY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = {
        int(r): (host, host2, dict(kv.split("=", 1) for kv in rest.split()))
        for r, host, host2, rest in re.findall(
            r"^\[(\d)\|(node\d)\] ddp-parity rank \1/8 on (node\d) (.*) ok$", proc.stdout, re.M
        )
    }
    assert sorted(said) == list(range(8)), proc.stdout + proc.stderr
    for r, (host, host2, fields) in said.items():
        assert host == host2, (r, host, host2)
        assert fields["backend"] == "meshccl" and fields["steps"] == "5", fields
        tol = float(fields["tol"])
        assert tol == 1e-5, fields
        assert float(fields["max_diff_gloo"]) <= tol and float(fields["max_diff_ref"]) <= tol, fields
        assert float(fields["moved"]) >= 100 * tol, fields
        assert fields["same_on_every_rank"] == "yes", fields
        assert fields["cables"] == "3/3", fields  # every cable of a 4-host mesh's host
    assert len({fields["params"] for _, _, fields in said.values()}) == 1
    summary = json.loads((job_dir / "summary.json").read_text())
    assert [(r["rank"], r["state"]) for r in summary["ranks"]] == [(r, "ok") for r in range(8)]


def test_ddp_parity_fails_naming_the_rank_whose_parameters_differ(lab):
    """The same job with one parameter of rank 5's meshccl copy nudged by 1e-3 after training: the
    comparison catches it, the rank exits 1 saying what differs, and the launch fails."""
    proc, job_dir = meshkit_launch(lab, "torch", PYTHON, DDP_PARITY, "--perturb", "5")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    summary = json.loads((job_dir / "summary.json").read_text())
    failed = [r for r in summary["ranks"] if r["state"] == "failed"]
    assert failed and all(r["exit_code"] == 1 for r in failed), summary
    assert not any(r["state"] == "ok" for r in summary["ranks"]), summary
    assert re.search(r"^meshkit launch: rank \d \(node\d\) failed: exit code 1$", output, re.M), output
    named = re.findall(r"ddp-parity rank (\d)/8 on node\d: FAILED: (.*)$", output, re.M)
    assert named, output
    assert all(
        what == "DDP over meshccl: parameters not bit-identical on ranks [5] and rank 0"
        or (r == "5" and what.startswith(("DDP over meshccl and over gloo differ: 0.weight by 0.001 > 1e-05",
                                          "DDP over meshccl and the reference differ: 0.weight by 0.001 > 1e-05")))
        for r, what in named
    ), named  # fmt: skip


MLX_DP_STEP = str(PROGRAMS / "mlx_dp_step.py")


def test_mlx_data_parallel_step_over_meshccl_averages_the_gradients(lab):
    """An MLX data-parallel step whose gradients meshccl averages, under `meshkit launch -r meshccl -n 2`:
    every rank of 8 says its averaged gradients are right (the program exits 0 only then)."""
    proc, job_dir = meshkit_launch(lab, "meshccl", PYTHON, MLX_DP_STEP)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = re.findall(r"^\[(\d)\|node\d\] mlx-dp rank (\d)/(\d) ok max_err=(\S+) params=(\d+)$", proc.stdout, re.M)
    assert sorted(int(r) for r, *_ in said) == list(range(8)), proc.stdout + proc.stderr
    assert all(r == r2 and n == "8" for r, r2, n, _, _ in said), said
    assert all(float(err) >= 0 for *_, err, _ in said), said
    assert len({params for *_, params in said}) == 1 and int(said[0][4]) > 0, said
    summary = json.loads((job_dir / "summary.json").read_text())
    assert [(r["rank"], r["state"], r["exit_code"]) for r in summary["ranks"]] == [(r, "ok", 0) for r in range(8)]


def test_mpi_program_through_one_mpirun_on_the_controller(lab):
    rc, output, summary = launch(
        lab,
        launch_program=[PYTHON, str(PROGRAMS / "mpi_allreduce.py")],
        launch_runtime="mpi",
        launch_ranks_per_host=2,
        launch_env={"GREETING": "hello"},
        launch_timeout=120,
    )
    assert rc == 0, output
    assert summary is not None and summary["ok"], summary
    assert [(r["host"], r["state"]) for r in summary["ranks"]] == [("controller", "ok")]
    job = summary["log_dir"].rsplit("/", 1)[1]
    # Ranks in ring order, -map-by slot: two per host, each host's pair consecutive; -x passed the env.
    lines = re.findall(
        r"^\[(\d)\|(\S+)\] mpi rank (\d)/8 on (\S+) sum=36 local=(\d) job=(\S+) greeting=(\S+)$", output, re.M
    )
    assert len(lines) == 8, output
    hostfile = (Path(summary["log_dir"]) / "mpi-hostfile").read_text().split()
    ring = hostfile[0::2]
    for shown, shown_host, rank, host, local, job_env, greeting in lines:
        assert shown == rank and shown_host == host == ring[int(rank) // 2], (lines, ring)
        assert int(local) == int(rank) % 2 and job_env == job and greeting == "hello"
    # Each rank's output kept on the controller, taken from mpirun's tagged stream (no file of
    # mpirun's own: those would be written on the hosts).
    assert re.match(r"mpi rank 5/8 on \S+ sum=36", (Path(summary["log_dir"]) / "rank-5.log").read_text())
    last = {r["rank"]: (r["host"], r["last_lines"]) for r in summary["rank_output"]}
    assert sorted(last) == list(range(8)) and last[5][0] == ring[2], last
    assert last[5][1][-1].startswith("mpi rank 5/8"), last
    assert not (Path(summary["log_dir"]) / "mpi").exists()


def test_mpi_failing_rank_is_named_and_nothing_is_left(lab):
    handle, _ = lab
    marker = f"mkmpi{uuid.uuid4().hex[:8]}"
    script = (
        'echo "rank $OMPI_COMM_WORLD_RANK up"; '
        'if [ "$OMPI_COMM_WORLD_RANK" = 5 ]; then sleep 2; echo "rank 5: giving up" >&2; exit 3; fi; '
        "sleep 300"
    )
    rc, output, summary = launch(
        lab,
        launch_program=["sh", "-c", script, marker],
        launch_runtime="mpi",
        launch_ranks_per_host=2,
        launch_env={"MARKER": marker},
        launch_timeout=120,
    )
    assert rc != 0
    assert summary is not None, output  # the job ran (a failure before it is not the one tested)
    hosts = (Path(summary["log_dir"]) / "mpi-hostfile").read_text().split()[0::2]
    if "mpirun did not say which" not in output:
        assert re.search(rf"failed: rank 5 \({hosts[2]}\) exit code 3 \(reported by mpirun", output), output
        # Its last lines, in the failure message (from mpirun's tagged stream).
        assert re.search(
            rf"rank 5 on {hosts[2]}: failed, exit code 3; last lines:\s+rank 5 up\s+rank 5: giving up", output
        ), output
    else:  # Open MPI 4.1 cut its report short (about one run in ten): no rank guessed, the code kept
        assert "mpirun (controller) exit code 3: a rank exited with a non-zero code" in output, output
        assert "rank 5: giving up" in (Path(summary["log_dir"]) / "rank-5.log").read_text()
    assert summary["wall_s"] < 60, summary
    for host, listing in ps_on_every_host(handle).items():
        assert marker not in listing and "sleep 300" not in listing and "orted" not in listing, (host, listing)
    assert processes_with_env(f"MARKER={marker}") == []


def test_a_program_missing_on_one_host_fails_the_preflight(lab):
    handle, _ = lab
    program = "/var/lib/meshkit/bin/mk-hello"
    put_program(handle, program, "node1,node2,node3")
    try:
        rc, output, summary = launch(lab, launch_program=program, launch_runtime="plain")
        assert rc != 0
        assert "preflight failed; no rank of job" in output, output
        assert f"node4: program {program} not found, or not executable" in output, output
        assert "node1: program" not in output
        assert summary is None  # nothing started
    finally:
        handle.ansible(
            "-b", "-m", "ansible.builtin.file", "-a", f"path={program} state=absent", pattern="node1,node2,node3"
        )


def test_stale_hostfiles_fail_the_launch(lab):
    handle, _ = lab
    manifest = "/var/lib/meshkit/hostfiles/manifest.json"
    node2 = holders(handle)["node2"]
    enter = ["nsenter", "-t", str(node2), "-m", "--"]
    original = sh(*enter, "cat", manifest).stdout
    data = json.loads(original)
    data["fingerprint"] = "sha256:" + "0" * 64
    subprocess.run([*enter, "sh", "-c", f"cat > {manifest}"], input=json.dumps(data), text=True, check=True)
    try:
        rc, output, _ = launch(lab, launch_program="true", launch_runtime="plain")
        assert rc != 0
        assert "hostfiles are stale; nothing was started" in output, output
        assert "node2: the hostfiles in /var/lib/meshkit/hostfiles were made from another cabling" in output
        assert "node1: the hostfiles" not in output
    finally:
        subprocess.run([*enter, "sh", "-c", f"cat > {manifest}"], input=original, text=True, check=True)


def test_meshkit_launch_into_a_paused_pager_still_runs_its_job(lab):
    """`meshkit launch ... | less`, the pager paused for the whole job: 8 ranks print 3 MB between
    them, far beyond what the pipe holds, and with a 3 s host timeout no host is lost (the launcher
    keeps its heartbeats going), the job ends ok, the logs have every line; when the pager reads
    again it gets what was kept and a notice of what was left out."""
    handle, artifacts = lab
    lines = 15000
    script = f'i=0; while [ $i -lt {lines} ]; do echo "rank $MESHKIT_RANK line $i"; i=$((i+1)); done; sleep 6'
    argv = [PYTHON, MESHKIT, "launch", "-i", str(handle.inventory), "-r", "plain", "-n", "2", "-t", "120",
            "--host-timeout", "3", "--no-stdin", "-e", f"meshkit_artifacts_dir={artifacts}",
            "--", "sh", "-c", script]  # fmt: skip
    (artifacts / "launch").mkdir(parents=True, exist_ok=True)
    before = set((artifacts / "launch").iterdir())
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
    try:
        # Nothing is read from its output (stdout and stderr both: the pager holds both) until
        # the job has ended: its summary is written before the launch waits for the terminal.
        wait_for(
            "the job's summary",
            lambda: any((d / "summary.json").exists() for d in set((artifacts / "launch").iterdir()) - before),
            240,
            0.5,
        )
        [job_dir] = set((artifacts / "launch").iterdir()) - before
        summary = json.loads((job_dir / "summary.json").read_text())
        out, _ = proc.communicate(timeout=60)  # the pager reads again
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert summary["ok"] and [r["state"] for r in summary["ranks"]] == ["ok"] * 8, summary
    assert summary["host_errors"] == {}, summary
    for r in range(8):
        log = (job_dir / f"rank-{r}.log").read_text().splitlines()
        assert log == [f"rank {r} line {i}" for i in range(lines)], (r, len(log))
    missed = re.findall(r"the terminal did not keep up: (\d+) lines of output not shown here", text)
    assert missed, text[-3000:]
    shown = len(re.findall(r"^\[\d\|node\d\] rank \d line \d+$", text, re.M))
    assert shown + sum(map(int, missed)) == 8 * lines, (shown, missed)


def test_meshkit_launch_broadcasts_a_typed_line_to_every_rank(lab):
    handle, artifacts = lab
    main, sub = pty.openpty()
    argv = [PYTHON, MESHKIT, "launch", "-i", str(handle.inventory), "-r", "plain", "-n", "2", "-t", "120",
            "-e", f"meshkit_artifacts_dir={artifacts}", "--",
            "sh", "-c", 'echo "rank $MESHKIT_RANK waiting"; read l; echo "rank $MESHKIT_RANK got: $l"']  # fmt: skip
    proc = subprocess.Popen(argv, stdin=sub, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
    os.close(sub)
    seen = b""
    try:
        deadline = time.monotonic() + 240
        # Type the line once, when every rank waits for it.
        while seen.count(b" waiting") < 8 and time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([proc.stdout], [], [], 1)
            if ready:
                seen += os.read(proc.stdout.fileno(), 65536)
        assert seen.count(b" waiting") == 8, seen.decode()
        os.write(main, b"hello mesh\n")
        rest, _ = proc.communicate(timeout=120)
        seen += rest
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
        os.close(main)
    text = seen.decode()
    assert proc.returncode == 0, text
    for r in range(8):
        assert re.search(rf"^\[{r}\|node\d\] rank {r} got: hello mesh\r?$", text, re.M), text


def settled_port(handle: LabHandle, host: str, port: str) -> bool:
    """The port has carrier and a link-local IPv6 address that is no longer tentative."""
    netns = handle.hosts()[host]["meshkit_lab_netns"]
    [info] = ip_json("-n", netns, "addr", "show", "dev", port) or [{}]
    return "LOWER_UP" in info.get("flags", []) and any(
        a.get("family") == "inet6" and a.get("scope") == "link" and not a.get("tentative")
        for a in info.get("addr_info", [])
    )


def test_meshkit_launch_remembers_the_checked_plan_and_rechecks_on_the_hosts(lab, tmp_path):
    """The first `meshkit launch` runs launch.yml and remembers what it planned from; the next
    plans from that and has every host check it (cables by the MAC that answers, hostfiles,
    meshccl build, preflight) instead of running Ansible; what no longer holds goes back through
    launch.yml."""
    handle, artifacts = lab
    # The inventory's own variables (no -e: -e always runs launch.yml): the test's artifacts dir.
    inventory = tmp_path / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "lab.yml").write_text(handle.inventory.read_text())
    (inventory / "group_vars" / "all.yml").write_text(f"meshkit_artifacts_dir: {artifacts}\n")
    cache = tmp_path / "cache"
    env = dict(ENV, MESHKIT_LAUNCH_CACHE=str(cache))

    def meshkit_launch(*program: str, runtime: str = "plain") -> subprocess.CompletedProcess[str]:
        argv = [PYTHON, MESHKIT, "launch", "-i", str(inventory), "-r", runtime, "-n", "2", "-t", "120", "--", *program]
        opts: dict[str, Any] = {"capture_output": True, "text": True, "env": env, "cwd": REPO}
        return subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, **opts)

    hello = ("sh", "-c", 'echo "rank $MESHKIT_RANK of $MESHKIT_WORLD_SIZE"')
    first = meshkit_launch(*hello)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "no checked plan remembered for this inventory and runtime yet; running every check" in first.stderr
    [remembered] = list(cache.iterdir())
    assert remembered.stat().st_mode & 0o777 == 0o600

    second = meshkit_launch(*hello)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    assert "checked 4 hosts against the plan of the last full check" in second.stderr, out
    assert "running every check" not in out and "Discover the cabling" not in out, out
    for r in range(8):
        assert re.search(rf"^\[{r}\|node\d\] rank {r} of 8$", second.stdout, re.M), out

    # What every host reported for its cables: the MAC that answers for the peer's address on a
    # port is the peer port's own MAC (read here in the peer's namespace).
    record = json.loads(remembered.read_text())
    context, connections = record["context"], record["connections"]
    macs = {}
    for host, pid in holders(handle).items():
        for link in json.loads(sh("nsenter", "-t", str(pid), "-n", "--", "ip", "-j", "link", "show").stdout):
            macs[(host, link["ifname"])] = link["address"]
    settings = launch_fast.validate({"program": ["true"], "runtime": "plain", "ranks_per_host": 1})
    job = launch_fast.make_job(context["plan"], settings, context["inputs"])
    specs = launch_fast.check_specs(job, context)
    answers = launch_fast.run_checks(connections, specs)
    checked = 0
    for host, spec in specs.items():
        for link in spec["links"]:
            found = answers[host]["facts"]["ports"][link["port"]]
            assert found["neighbour"] == macs[(link["peer_host"], link["peer_port"])], (host, link, found)
            assert found["route"] == link["port"] and found["up"], (host, link, found)
            checked += 1
    assert checked == 12  # 6 cables, both ends

    # A program missing on one host: refused by the hosts' own preflight, without launch.yml.
    program = "/var/lib/meshkit/bin/mk-fast"
    put_program(handle, program, "node1,node2,node4")
    try:
        refused = meshkit_launch(program)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "preflight failed; no rank of job" in refused.stderr, refused.stderr
        assert f"node3: program {program} not found, or not executable" in refused.stderr, refused.stderr
        assert "running every check" not in refused.stderr and "node1: program" not in refused.stderr
    finally:
        handle.ansible(
            "-b", "-m", "ansible.builtin.file", "-a", f"path={program} state=absent", pattern="node1,node2,node4"
        )

    # A cable taken down: the hosts' check names both ends, launch.yml rediscovers and refuses.
    link = context["plan"]["per_host"]["node3"][0]
    node3 = ["nsenter", "-t", str(holders(handle)["node3"]), "-n", "--"]
    sh(*node3, "ip", "link", "set", link["port"], "down")
    try:
        down = meshkit_launch(*hello)
        assert down.returncode == 2, down.stdout + down.stderr
        assert f"node3:{link['port']} is down" in down.stderr, down.stderr
        assert "running every check (launch.yml)" in down.stderr
        assert "the cabling differs from the plan setup.yml made" in down.stderr, down.stderr
        assert f"{link['port']} is down" in down.stderr, down.stderr
        assert "[0|" not in down.stdout  # nothing started
    finally:
        sh(*node3, "ip", "link", "set", link["port"], "up")
        # The lab settled again before anything else runs: both ends of the cable up with a usable
        # IPv6 link-local address (duplicate-address detection done), as discovery's probe needs.
        ends = [("node3", link["port"]), (link["peer_host"], link["peer_port"])]
        wait_for(f"both ends of {ends} settled", lambda: all(settled_port(handle, *end) for end in ends), 60, 0.1)

    # Back up (its neighbours resolved afresh): the remembered plan holds again.
    again = meshkit_launch(*hello)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "checked 4 hosts against the plan" in again.stderr, again.stderr


# ---- faults: a partitioned host, a killed agent -------------------------------------------------------


def launch_in_background(lab: tuple[LabHandle, Path], **variables: Any) -> tuple[subprocess.Popen[str], str]:
    """launch.yml started, not waited for: (the process, its job id)."""
    handle, artifacts = lab
    job = variables.setdefault("launch_job_id", f"t{uuid.uuid4().hex[:10]}")
    argv = ["ansible-playbook", "launch.yml", "-i", str(handle.inventory), "-e", f"meshkit_artifacts_dir={artifacts}",
            "-e", json.dumps(variables)]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=ENV, cwd=REPO
    )
    return proc, job


def wait_for(what: str, condition: Any, within: float, every: float = 0.1) -> float:
    """Wait until ``condition()`` is true; the seconds it took (the test fails after ``within``)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            pytest.fail(f"not within {within:g} s: {what}")
        time.sleep(every)
    return time.monotonic() - started


def kill_if_running(proc: subprocess.Popen[str]) -> None:
    """A launch the test gave up on: killed, and what it had said printed."""
    if proc.poll() is None:
        proc.kill()
        print(f"the launch, killed:\n{proc.communicate()[0]}")


def still(proc: subprocess.Popen[str]) -> bool:
    """True while the launch runs; a launch that ended before the test wanted it to fails the test
    with what it said."""
    if proc.poll() is not None:
        pytest.fail(f"the launch ended early (exit {proc.returncode}):\n{proc.communicate()[0]}")
    return True


def finished(proc: subprocess.Popen[str], within: float) -> str:
    try:
        out, _ = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"launch.yml still running {within:g} s later:\n{out}")
    return out


def lines_with(handle: LabHandle, text: str) -> dict[str, int]:
    """Per lab host, how many of its processes have ``text`` in their command line."""
    return {
        host: sum(text in line for line in listing.splitlines()) for host, listing in ps_on_every_host(handle).items()
    }


@contextlib.contextmanager
def partitioned(handle: LabHandle, host: str) -> Iterator[None]:
    """Every packet in or out of ``host``'s management interface silently dropped, inside its own
    namespace: no close, no reset, nothing. This kernel has neither netem nor tc's drop action
    (gact), nor nft/iptables userland; tc's u32 classifier with a mirred redirect to a device that
    is down drops the packet (mirred answers TC_ACT_SHOT when it cannot deliver)."""
    net = ["nsenter", "-t", str(holders(handle)[host]), "-n", "--"]
    sh(*net, "ip", "link", "add", "mkdrop", "type", "veth", "peer", "name", "mkdrop-peer")  # both ends stay down
    try:
        sh(*net, "tc", "qdisc", "add", "dev", HOST_MGMT_PORT, "clsact")
        for direction in ("ingress", "egress"):
            sh(*net, "tc", "filter", "add", "dev", HOST_MGMT_PORT, direction, "protocol", "all",
               "u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", "mkdrop")  # fmt: skip
        address = handle.hosts()[host]["ansible_host"]
        assert sh("ping", "-c", "1", "-W", "1", address, check=False).returncode != 0, f"{host} still answers"
        yield
    finally:
        sh(*net, "tc", "qdisc", "del", "dev", HOST_MGMT_PORT, "clsact", check=False)
        sh(*net, "ip", "link", "del", "mkdrop", check=False)
        address = handle.hosts()[host]["ansible_host"]
        assert sh("ping", "-c", "1", "-W", "2", address, check=False).returncode == 0, f"{host} is still cut off"


def job_processes(marker: str) -> dict[str, list[int]]:
    """Per lab host (MESHKIT_HOST), the pids (this machine's numbering) whose environment holds ``marker``."""
    out: dict[str, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in env:
            host = next((e[13:].decode() for e in env if e.startswith(b"MESHKIT_HOST=")), "?")
            out.setdefault(host, []).append(int(proc.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def test_a_partitioned_host_fails_the_launch_within_the_bound_and_every_rank_stops(lab):
    """node3's traffic dropped mid-job: the launch fails naming node3 within the default host
    timeout (20 s) plus the grace; every rank elsewhere is gone by then, and node3's own once its
    agent has not heard from the controller for as long."""
    handle, _ = lab
    marker = f"MARKER=mkpart{uuid.uuid4().hex[:8]}"
    proc, _job = launch_in_background(
        lab,
        launch_program=["sh", "-c", 'echo "rank $MESHKIT_RANK up"; sleep 600 & wait'],
        launch_ranks_per_host=2,
        launch_runtime="plain",
        launch_env={"MARKER": marker.split("=", 1)[1]},
        launch_timeout=300,
    )
    bound = 20 + 3  # the default host timeout, then the grace of the others' SIGTERM
    try:
        # Every rank runs: sh and its sleep, two ranks on each of the 4 hosts.
        wait_for("8 ranks running", lambda: still(proc) and sorted(map(len, job_processes(marker).values())) == [4] * 4,
                 180, 0.5)  # fmt: skip
        with partitioned(handle, "node3"):
            cut = time.monotonic()
            output = finished(proc, within=bound + 60)
            to_exit = time.monotonic() - cut
            at_exit = job_processes(marker)
            wait_for("node3's ranks stopped by its own agent", lambda: not job_processes(marker), bound + 30)
            to_node3_gone = time.monotonic() - cut
        print(f"partition to launch exit: {to_exit:.1f} s; to node3's ranks gone: {to_node3_gone:.1f} s")
        print("\n".join(line for line in output.splitlines() if "node3" in line and "meshkit launch:" in line))
    finally:
        kill_if_running(proc)
    assert proc.returncode != 0
    assert re.search(r"failed: rank \d \(node3\) lost the host's agent", output), output
    # Whichever saw it first (ssh's keepalives or the launcher's heartbeats), the silence is named.
    assert re.search(r"node3\).*(no word|without a word) from its agent", output), output
    assert not re.search(r"rank \d \(node[124]\) lost", output), output
    assert to_exit < bound + 10, (to_exit, output)  # + Ansible's own end of the play
    assert set(at_exit) <= {"node3"}, at_exit  # every other host's ranks were gone when the launch ended
    assert to_node3_gone < bound + 10
    for host, listing in ps_on_every_host(handle).items():
        assert "sleep 600" not in listing, (host, listing)
    # The lab is usable again: a launch on every host works.
    rc, again, _ = launch(lab, launch_program=["sh", "-c", "echo back"], launch_runtime="plain")
    assert rc == 0, again + links_as_seen(handle)


def test_a_bad_host_timeout_is_named_before_any_rank_starts(lab):
    rc, output, summary = launch(lab, launch_program="true", launch_runtime="plain", launch_host_timeout="soon")
    assert rc != 0
    assert "launch_host_timeout = 'soon': not a number; give the seconds without a word from a host" in output, output
    assert summary is None  # nothing started


def test_meshkit_launch_host_timeout_bounds_a_partition(lab):
    """`meshkit launch --host-timeout 6`: node1 cut off, the launch exits 1 naming node1 within 6 s
    plus the grace, and nothing of the job is left anywhere after node1's agent noticed too."""
    handle, artifacts = lab
    marker = f"MARKER=mkcli{uuid.uuid4().hex[:8]}"
    argv = [PYTHON, MESHKIT, "launch", "-i", str(handle.inventory), "-r", "plain", "-n", "2", "-t", "300",
            "--host-timeout", "6", "--grace", "1", "--no-stdin", "-x", marker,
            "-e", f"meshkit_artifacts_dir={artifacts}",
            "--", "sh", "-c", 'echo "rank $MESHKIT_RANK up"; sleep 600 & wait']  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=REPO)
    try:
        wait_for("8 ranks running", lambda: still(proc) and sorted(map(len, job_processes(marker).values())) == [4] * 4,
                 180, 0.5)  # fmt: skip
        with partitioned(handle, "node1"):
            cut = time.monotonic()
            output = finished(proc, within=60)
            to_exit = time.monotonic() - cut
            at_exit = job_processes(marker)
            wait_for("node1's ranks stopped by its own agent", lambda: not job_processes(marker), 30)
            to_node1_gone = time.monotonic() - cut
        print(f"--host-timeout 6: partition to exit {to_exit:.1f} s; to node1's ranks gone {to_node1_gone:.1f} s")
    finally:
        kill_if_running(proc)
    assert proc.returncode == 1, output
    assert re.search(r"rank \d \(node1\) lost the host's agent.*(no word|without a word) from its agent", output), (
        output
    )
    assert to_exit < 6 + 1 + 4, (to_exit, output)
    assert set(at_exit) <= {"node1"}, at_exit
    assert to_node1_gone < 6 + 1 + 4


def test_a_killed_agent_leaves_nothing_of_its_ranks(lab):
    """SIGKILL to node2's agent while its ranks run, each with a child, a grandchild and two
    daemons (one without the job's environment): nothing of them is left, and the launch fails
    naming node2."""
    handle, _ = lab
    marker = f"MARKER=mkkill{uuid.uuid4().hex[:8]}"
    seconds = str(100000 + uuid.uuid4().int % 800000)  # what every process of the families sleeps
    proc, _job = launch_in_background(
        lab,
        launch_program=[PYTHON, str(PROGRAMS / "daemon_family.py"), seconds],
        launch_ranks_per_host=2,
        launch_runtime="plain",
        launch_env={"MARKER": marker.split("=", 1)[1]},
        launch_timeout=300,
    )
    try:
        # Per host, 2 ranks x (the rank, sh, its sleep, a daemon, a daemon without environment).
        wait_for("every family up", lambda: still(proc) and set(lines_with(handle, seconds).values()) == {10}, 180, 0.5)
        ranks = [pid for pid in job_processes(marker)["node2"] if "daemon_family.py" in cmdline(pid)]
        assert len(ranks) == 2, ranks
        [agent] = {parent(pid) for pid in ranks}
        watchdog = parent(agent)
        assert "meshkit-launch-agent" in cmdline(agent) and "meshkit-launch-agent" in cmdline(watchdog)
        killed = time.monotonic()
        os.kill(agent, signal.SIGKILL)
        gone = wait_for(
            "nothing of node2's ranks left",
            lambda: lines_with(handle, seconds)["node2"] == 0 and "node2" not in job_processes(marker),
            within=30,
            every=0.02,
        )
        output = finished(proc, within=60)
        ended = time.monotonic() - killed
        print(f"agent SIGKILL to nothing left on node2: {gone:.2f} s; to launch exit: {ended:.1f} s")
    finally:
        kill_if_running(proc)
    assert proc.returncode != 0
    assert re.search(r"failed: rank \d \(node2\) lost the host's agent", output), output
    assert "node2: meshkit agent (pid" in output and "killed by SIGKILL; its watchdog killed" in output, output
    assert gone < 5
    # The other hosts' ranks were stopped by the launcher as usual, families included.
    assert lines_with(handle, seconds) == {"node1": 0, "node2": 0, "node3": 0, "node4": 0}
    assert job_processes(marker) == {}


# ---- a non-root login user (lab_access=sudo) ---------------------------------------------------------


def test_ranks_run_as_the_login_user_in_a_job_directory_of_its_own(lab):
    """Reached as meshadmin with sudo (setup.yml becomes root): a job's ranks run as meshadmin, in a
    job directory of meshadmin's own (0700) inside <state_dir>/jobs, which setup.yml made sticky and
    world-writable; a host whose state directory lacks it is refused naming the fix."""
    handle, _ = lab
    jobs = "/var/lib/meshkit/jobs"
    shown = handle.ansible("-m", "ansible.builtin.command", "-a", f"stat -c '%U %a' {jobs}", pattern="cluster")
    assert shown.stdout.count("root 1777") == 4, shown.stdout
    script = 'echo "$(id -un) in $(stat -c "%U %a" /var/lib/meshkit/jobs/$MESHKIT_JOB_ID)"'
    rc, output, summary = launch(lab, launch_program=["sh", "-c", script], launch_runtime="plain")
    assert rc == 0, output
    assert re.findall(r"^\[\d\|node\d\] (.*)$", output, re.M) == ["meshadmin in meshadmin 700"] * 4, output
    assert summary is not None and summary["ok"]
    # An older state directory without the shared jobs directory: the launch names host, directory, fix.
    node3 = holders(handle)["node3"]
    sh("nsenter", "-t", str(node3), "-m", "--", "rm", "-rf", jobs)
    try:
        rc, output, _ = launch(lab, launch_program="true", launch_runtime="plain")
        assert rc != 0
        assert f"node3: cannot start the job: cannot create {jobs} as meshadmin" in output, output
        assert f"run setup.yml, or as root: install -d -m 1777 {jobs}" in output, output
    finally:
        fixed = handle.ansible(
            "-b", "-m", "ansible.builtin.file", "-a", f"path={jobs} state=directory mode=01777", pattern="cluster"
        )  # fmt: skip
        assert fixed.returncode == 0, fixed.stdout + fixed.stderr


# ---- secrets: the job token and the user's secrets reach the ranks, nothing else ------------------------

# A rank that says what secrets it got (hashes) and waits until the test has looked at every process.
RANK_SECRETS = str(PROGRAMS / "rank_secrets.py")


def sha256(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def rank_environments(marker: str) -> dict[int, dict[str, str]]:
    """The environment of every rank process on the machine (lab hosts included) that carries ``marker``."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(e.split("=", 1) for e in (proc / "environ").read_text(errors="replace").split("\0") if "=" in e)
        except OSError:
            continue
        if marker in env.values() and ("MESHKIT_RANK" in env or "OMPI_COMM_WORLD_RANK" in env):
            out[int(proc.name)] = env
    return out


def command_lines_holding(values: list[str], but: int) -> list[str]:
    """Every process on the machine but ``but`` whose command line holds one of ``values``."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != but:
            try:
                argv = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            found += [f"{proc.name}: value {i}" for i, v in enumerate(values) if v.encode() in argv]
    return found


def everything_under(root: Path) -> bytes:
    out = b""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out += str(path).encode() + b"\n" + path.read_bytes() + b"\n"
    return out


def hosts_job_files(handle: LabHandle, job_id: str) -> bytes:
    """Every file of the job's directory on every lab host (each host's own /var/lib/meshkit)."""
    out = b""
    for pid in holders(handle).values():
        out += everything_under(Path(f"/proc/{pid}/root/var/lib/meshkit/jobs/{job_id}"))
    return out


@pytest.fixture
def go() -> Iterator[Path]:
    """A file the ranks wait for: in a directory of /tmp (every lab host's /tmp is the machine's) that
    the login user may look into; removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="mksecrets-", dir="/tmp"))
    where.chmod(0o755)
    try:
        yield where / "go"
    finally:
        shutil.rmtree(where, ignore_errors=True)


def secrets_job(
    marker: str, ranks: int, proc: subprocess.Popen[str], go: Path, api: str, pw: str
) -> tuple[str, list[str]]:
    """Once every rank runs: the job token (read from the ranks' environment, the same in each) and
    the processes whose command line holds a secret (the launch's own left out: -x VALUE is the
    user's); then the ranks are let go."""

    def running() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"the launch ended early (exit {proc.returncode})")
        return len(rank_environments(marker)) == ranks

    try:
        wait_for(f"{ranks} ranks running", running, 300, 0.2)
        envs = rank_environments(marker)
        tokens = {env.get("MESHCCL_TOKEN") for env in envs.values()}
        assert len(tokens) == 1, f"{len(tokens)} different tokens among the ranks"
        [token] = tokens
        assert token and re.fullmatch(r"[0-9a-f]{64}", token), "the job token is not 32 random bytes in hex"
        leaks = command_lines_holding([token, api, pw], but=proc.pid)
    finally:
        go.touch()
    return token, leaks


def test_meshkit_launch_keeps_the_token_and_secrets_out_of_files_output_and_command_lines(lab, tmp_path, go):
    """`meshkit launch -r torch -x API_TOKEN=... -x MY_PASS --secret MY_PASS`: every rank gets the job
    token, the job id and both secrets (their hashes prove it); no process's command line, no file of
    the job on the controller or the hosts, and nothing the launch prints holds any of them."""
    handle, artifacts = lab
    api, pw = f"api-{uuid.uuid4().hex}", f"pw-{uuid.uuid4().hex}"
    marker = f"mksec{uuid.uuid4().hex[:8]}"
    argv = [PYTHON, MESHKIT, "launch", "-i", str(handle.inventory), "-r", "torch", "-n", "2", "-t", "300",
            "--no-stdin", "-x", f"API_TOKEN={api}", "-x", "MY_PASS", "--secret", "MY_PASS", "-x", f"MARKER={marker}",
            "-e", f"meshkit_artifacts_dir={artifacts}", "--", PYTHON, RANK_SECRETS, str(go)]  # fmt: skip
    (artifacts / "launch").mkdir(parents=True, exist_ok=True)
    before = set((artifacts / "launch").iterdir())
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=dict(ENV, MY_PASS=pw), cwd=REPO)
        try:
            token, leaks = secrets_job(marker, 8, proc, go, api, pw)
            proc.wait(timeout=120)
        finally:
            kill_if_running(proc)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert proc.returncode == 0, stdout + stderr
    assert leaks == [], leaks
    [job_dir] = set((artifacts / "launch").iterdir()) - before
    job_id = job_dir.name
    said = dict(re.findall(r"^\[\d\|node\d\] secrets rank (\d) (.*)$", stdout, re.M))
    expected = (
        f"MESHCCL_TOKEN={sha256(token)}/64 API_TOKEN={sha256(api)}/{len(api)} MY_PASS={sha256(pw)}/{len(pw)} "
        f"job={job_id} argv-leaks=none"
    )
    assert said == {str(r): expected for r in range(8)}, stdout
    job = json.loads((job_dir / "job.json").read_text())
    for r in job["ranks"]:
        assert {r["env"][n] for n in ("MESHCCL_TOKEN", "API_TOKEN", "MY_PASS")} == {"<hidden>"}, r["env"]
        assert r["env"]["MESHCCL_JOB_ID"] == job_id
    assert {"job.json", "summary.json", "output.log", "rank-7.log"} <= {p.name for p in job_dir.iterdir()}
    on_hosts = hosts_job_files(handle, job_id)
    assert b"agent.log" in on_hosts, "no job directory found on the hosts"
    written = everything_under(job_dir) + on_hosts
    for value in (token, api, pw):
        assert value.encode() not in written
        assert value not in stdout + stderr


def test_launch_yml_keeps_the_token_and_secrets_out_of_its_output_at_vvv(lab, tmp_path, go):
    """launch.yml at -vvv, launch_env holding API_TOKEN and MY_PASS (marked by launch_secret_env), an
    MPI job (one mpirun on the controller passes the environment on): every MPI rank gets the token
    and the secrets; Ansible's output, job.json, the logs, the hosts' job files and every command
    line hold none of them."""
    handle, artifacts = lab
    api, pw = f"api-{uuid.uuid4().hex}", f"pw-{uuid.uuid4().hex}"
    marker = f"mksec{uuid.uuid4().hex[:8]}"
    job_id = f"t{uuid.uuid4().hex[:10]}"
    variables = tmp_path / "vars.json"
    variables.write_text(json.dumps({
        "launch_program": [PYTHON, RANK_SECRETS, str(go)],
        "launch_runtime": "mpi",
        "launch_ranks_per_host": 2,
        "launch_timeout": 300,
        "launch_job_id": job_id,
        "launch_env": {"API_TOKEN": api, "MY_PASS": pw, "MARKER": marker},
        "launch_secret_env": ["MY_PASS"],
    }))  # fmt: skip
    variables.chmod(0o600)
    argv = ["ansible-playbook", "-vvv", "launch.yml", "-i", str(handle.inventory),
            "-e", f"meshkit_artifacts_dir={artifacts}", "-e", f"@{variables}"]  # fmt: skip
    with open(tmp_path / "out", "w+") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                env=ENV, cwd=REPO)  # fmt: skip
        try:
            token, leaks = secrets_job(marker, 8, proc, go, api, pw)
            proc.wait(timeout=120)
        finally:
            kill_if_running(proc)
        out.seek(0)
        output = out.read()
    assert proc.returncode == 0, output[-5000:]
    assert leaks == [], leaks
    assert "ESTABLISH SSH CONNECTION FOR USER: meshadmin" in output, output[-3000:]  # -vvv indeed
    said = dict(re.findall(r"^\[\d\|node\d\] secrets rank (\d) (.*)$", output, re.M))
    expected = (
        f"MESHCCL_TOKEN={sha256(token)}/64 API_TOKEN={sha256(api)}/{len(api)} MY_PASS={sha256(pw)}/{len(pw)} "
        f"job={job_id} argv-leaks=none"
    )
    assert said == {str(r): expected for r in range(8)}, output[-5000:]
    job_dir = artifacts / "launch" / job_id
    job = json.loads((job_dir / "job.json").read_text())
    assert job["secret_env"] == ["MESHCCL_TOKEN", "API_TOKEN", "MY_PASS"], job["secret_env"]
    assert {r["env"][n] for r in job["ranks"] for n in job["secret_env"]} == {"<hidden>"}
    written = everything_under(job_dir) + hosts_job_files(handle, job_id)
    assert b"mpirun.log" in written and b"rank-7.log" in written
    for value in (token, api, pw):
        assert value.encode() not in written
        assert value not in output


def test_launch_yml_check_mode_leaves_no_file_behind(lab):
    """launch.yml --check (launch_env with a secret): says what would start; the artifacts directory
    and every host's jobs directory are exactly as before (no job.json, no log directory)."""
    handle, artifacts = lab
    (artifacts / "launch").mkdir(parents=True, exist_ok=True)

    def listing() -> list[tuple[str, int, int]]:
        roots = [artifacts, *(Path(f"/proc/{pid}/root/var/lib/meshkit/jobs") for pid in holders(handle).values())]
        paths = [p for root in roots for p in sorted(root.rglob("*"))]
        return [(str(p), p.lstat().st_size, p.lstat().st_mtime_ns) for p in paths]

    before = listing()
    job_id = f"t{uuid.uuid4().hex[:10]}"
    run = run_playbook(
        "launch.yml",
        "--check",
        "-e", f"meshkit_artifacts_dir={artifacts}",
        "-e", json.dumps({"launch_program": ["sh", "-c", "echo never"], "launch_job_id": job_id,
                          "launch_env": {"API_TOKEN": "check-secret-value"}}),
        inventory=str(handle.inventory),
    )  # fmt: skip
    assert run.rc == 0, run.output
    assert f"check mode: job {job_id} would start 4 ranks" in run.output, run.output
    assert "check-secret-value" not in run.output
    assert listing() == before
    assert not (artifacts / "launch" / job_id).exists()


# ---- the collection and the controller package as users install them ----------------------------


def installed_env(tmp: Path, collections: Path) -> dict[str, str]:
    """Ansible configured like the checkout (ansible.cfg's settings) but finding meshkit.cluster only
    in ``collections``: not the checkout's .collections, and not on sys.path either."""
    cfg = (
        (REPO / "ansible.cfg")
        .read_text()
        .replace("collections_path = .collections", f"collections_path = {collections}")
    )
    cfg = cfg.replace("[defaults]\n", "[defaults]\ncollections_scan_sys_path = False\n", 1)
    assert str(collections) in cfg
    (tmp / "ansible.cfg").write_text(cfg)
    return dict(ENV, ANSIBLE_CONFIG=str(tmp / "ansible.cfg"), ANSIBLE_HOME=str(tmp / "ansible-home"))


def test_the_built_collection_installed_into_an_empty_directory_runs_setup(lab, tmp_path):
    """ansible-galaxy collection build (galaxy.yml's build_ignore applies), installed into an empty
    directory, then meshkit.cluster.setup from there against the lab: the cluster as converged stays so."""
    handle, artifacts = lab
    build = sh("ansible-galaxy", "collection", "build", "--output-path", str(tmp_path / "dist"), str(REPO))
    [artifact] = (tmp_path / "dist").glob("meshkit-cluster-*.tar.gz")
    names = subprocess.run(["tar", "-tzf", str(artifact)], capture_output=True, text=True, check=True).stdout.split()
    assert "playbooks/setup.yml" in names and "plugins/modules/plan_verify.py" in names, build.stdout
    leaked = [n for n in names if n.split("/")[0] in {".cache", ".venv", "artifacts", "tests", "bench", "meshkit"}]
    assert not leaked and not [n for n in names if n.startswith("collective/build")], leaked
    env = installed_env(tmp_path, tmp_path / "collections")
    (tmp_path / "collections").mkdir()
    installed = subprocess.run(
        ["ansible-galaxy", "collection", "install", "-p", str(tmp_path / "collections"), str(artifact)],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr

    def setup() -> subprocess.CompletedProcess[str]:
        """meshkit.cluster.setup as the installed copy has it, against the lab."""
        return subprocess.run(
            ["ansible-playbook", "meshkit.cluster.setup", "-i", str(handle.inventory),
             "-e", f"meshkit_artifacts_dir={artifacts}"],
            capture_output=True, text=True, env=env, cwd=tmp_path, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    run = setup()
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    # Earlier tests took cables down and up (their host routes went with the carrier): this run may
    # have restored them. A second run from the installed copy changes nothing.
    run = setup()
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    # That configuration finds the installed copy only (the one that ran), and the run changed nothing.
    doc = subprocess.run(
        ["ansible-doc", "--json", "-t", "module", "meshkit.cluster.plan_verify"],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=True,
    )  # fmt: skip
    found = json.loads(doc.stdout)["meshkit.cluster.plan_verify"]["doc"]["filename"]
    assert found.startswith(str(tmp_path / "collections" / "ansible_collections" / "meshkit" / "cluster")), found
    recap = [line for line in out.splitlines() if re.match(r"^node\d\s+:", line)]
    assert len(recap) == 4 and all("changed=0" in line and "failed=0" in line for line in recap), out


def test_pip_install_of_the_checkout_gives_a_working_meshkit_command(lab, tmp_path):
    """A regular (not editable) install of the controller package: its `meshkit` command launches on the
    lab with the collection it carries, the checkout's nowhere on its paths."""
    handle, artifacts = lab
    site = tmp_path / "site"
    pip = sh(PYTHON, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(REPO), check=False)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert (site / "ansible_collections" / "meshkit" / "cluster" / "playbooks" / "launch.yml").is_file()
    assert (site / "ansible_collections" / "meshkit" / "cluster" / "collective" / "src").is_dir()
    env = installed_env(tmp_path, site)
    env["PYTHONPATH"] = str(site)
    env["MESHKIT_LAUNCH_CACHE"] = str(tmp_path / "cache")
    where = subprocess.run(
        [PYTHON, "-c", "import meshkit.collection as c; print(c.collection_root())"],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=True,
    ).stdout.strip()  # fmt: skip
    assert where == str(site / "ansible_collections" / "meshkit" / "cluster")
    run = subprocess.run(
        [str(site / "bin" / "meshkit"), "launch", "-i", str(handle.inventory), "-r", "plain", "--no-stdin",
         "-e", f"meshkit_artifacts_dir={artifacts}", "--",
         "sh", "-c", 'echo "rank $MESHKIT_RANK of $MESHKIT_WORLD_SIZE"'],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=False, stdin=subprocess.DEVNULL, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(line.split("] ", 1)[1] for line in run.stdout.splitlines() if "] rank " in line) == [
        f"rank {r} of 4" for r in range(4)
    ], run.stdout


def test_meshkit_launch_reaches_hosts_with_ansible_cfg_settings_and_honours_become(lab, tmp_path):
    """The login user, key and SSH options given only in ansible.cfg (not in the inventory) reach the
    hosts as Ansible's own ssh connection would; with become on, the ranks run as the become user."""
    handle, artifacts = lab
    hosts = yaml.safe_load(handle.inventory.read_text())
    given = hosts["all"]["vars"]
    user, key, common = (
        given.pop(k) for k in ("ansible_user", "ansible_ssh_private_key_file", "ansible_ssh_common_args")
    )
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump(hosts))
    cfg = (REPO / "ansible.cfg").read_text()
    cfg = cfg.replace("collections_path = .collections", f"collections_path = {REPO / '.collections'}")
    cfg = cfg.replace("[defaults]\n", f"[defaults]\nremote_user = {user}\nprivate_key_file = {key}\n", 1)
    cfg = cfg.replace("ssh_args = ", f"ssh_args = {common} ", 1)
    (tmp_path / "ansible.cfg").write_text(cfg)
    env = dict(ENV, ANSIBLE_CONFIG=str(tmp_path / "ansible.cfg"), MESHKIT_LAUNCH_CACHE=str(tmp_path / "cache"))

    def whoami(*extra: str) -> list[str]:
        run = subprocess.run(
            [MESHKIT, "launch", "-i", str(inventory), "-r", "plain", "--no-stdin",
             "-e", f"meshkit_artifacts_dir={artifacts}", *extra, "--", "id", "-un"],
            capture_output=True, text=True, env=env, cwd=tmp_path, check=False, stdin=subprocess.DEVNULL, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        return sorted(line.split("] ", 1)[1] for line in run.stdout.splitlines() if line.startswith("["))

    assert whoami() == [user] * 4
    assert whoami("-e", "ansible_become=true") == ["root"] * 4


# --- meshkit check on the same lab ---------------------------------------------------------------------------------
# The lab's cables are unlimited veth pairs: the check's tests give every cable port the rate a
# lab built with lab_link_rate gets (tc tbf, as the lab role applies it) and the inventory the
# meshkit_link_rate such a lab writes, then degrade one cable at a time; every change is undone.

CHECK_RATE = "100mbit"  # low enough that 12 flows at once leave this 2-core machine's CPUs to spare
CHECK_BITS = 100e6


def lab_ports(handle: LabHandle) -> dict[tuple[str, str], str]:
    """(host, port) -> the host's network namespace, for every cable port."""
    return {
        (host, port): vars_["meshkit_lab_netns"]
        for host, vars_ in handle.hosts().items()
        for port in vars_["meshkit_lab_ports"]
    }


def shape(netns: str, port: str, rate: str | None) -> None:
    """The port's egress limited to ``rate`` (tc tbf, the lab role's burst), or unlimited (None).
    The queue holds 200 ms (the lab role's 20 ms drops TCP's bursts, and every drop is a stall of
    a retransmit timeout): a NIC at its line rate pushes back on the sender rather than dropping."""
    if rate is None:
        sh("ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", port, "root", check=False)
        return
    burst = str(lab_netns.tbf_burst(rate))
    sh("ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", port, "root", "tbf", "rate", rate,
       "burst", burst, "latency", "200ms")  # fmt: skip


@pytest.fixture(scope="module")
def checked(lab: tuple[LabHandle, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The lab's cables at CHECK_RATE, an inventory that says so (meshkit_link_rate), and the plan."""
    handle, artifacts = lab
    where = tmp_path_factory.mktemp("check")
    inventory = where / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "lab.yml").write_text(handle.inventory.read_text())
    (inventory / "group_vars" / "all.yml").write_text(
        f"meshkit_artifacts_dir: {artifacts}\nmeshkit_link_rate: {CHECK_RATE}\n"
    )
    ports = lab_ports(handle)
    try:
        for (_host, port), netns in ports.items():
            shape(netns, port, CHECK_RATE)
        yield {
            "handle": handle,
            "inventory": inventory,
            "artifacts": artifacts,
            "ports": ports,
            "plan": json.loads((artifacts / "plan.json").read_text()),
            "cache": where / "cache",
            "where": where,
        }
    finally:
        for (_host, port), netns in ports.items():
            shape(netns, port, None)


def meshkit_check(checked: dict[str, Any], name: str, *extra: str) -> tuple[int, str, str, dict[str, Any], Path]:
    """`meshkit check` on the lab; (exit status, stdout, stderr, the JSON report, the output folder)."""
    out = checked["where"] / name
    out.mkdir()
    argv = [PYTHON, MESHKIT, "check", "-i", str(checked["inventory"]), "--json", str(out / "check.json"),
            "--prometheus", str(out / "check.prom"), "--picture", str(out / "cabling-check.svg"), *extra]  # fmt: skip
    env = dict(ENV, MESHKIT_LAUNCH_CACHE=str(checked["cache"]))
    started = time.monotonic()
    run = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, check=False,
                         stdin=subprocess.DEVNULL, timeout=900)  # fmt: skip
    (out / "stdout.txt").write_text(run.stdout)
    (out / "stderr.txt").write_text(run.stderr + f"\n(took {time.monotonic() - started:.1f} s)\n")
    report = json.loads((out / "check.json").read_text()) if (out / "check.json").exists() else {}
    return run.returncode, run.stdout, run.stderr, report, out


def check_cable(plan: dict[str, Any], a: str, b: str) -> tuple[str, tuple[str, str], tuple[str, str]]:
    """The display name of the cable between hosts a and b, and its two ends (host, port)."""
    for cable in plan["cables"]:
        ends = [(e["host"], e["port"]) for e in cable["ends"]]
        if {ends[0][0], ends[1][0]} == {a, b}:
            return f"{ends[0][0]}:{ends[0][1]} \u2194 {ends[1][0]}:{ends[1][1]}", ends[0], ends[1]
    raise AssertionError(f"no cable between {a} and {b} in the plan")


def prometheus_series(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples
    ]


def svg_edges(path: Path) -> dict[str, tuple[str, str]]:
    """Every edge of a GraphViz SVG: its tooltip/title -> (stroke colour, its label text)."""
    import xml.etree.ElementTree as ET

    ns = {"svg": "http://www.w3.org/2000/svg"}
    out = {}
    for group in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}g"):
        if group.get("class") != "edge":
            continue
        anchor = group.find(".//svg:a", ns)
        title = (anchor.get("{http://www.w3.org/1999/xlink}title") if anchor is not None else None) or (
            group.findtext("svg:title", default="", namespaces=ns)
        )
        path_el = group.find(".//svg:path", ns)
        text = " ".join(t.text or "" for t in group.iter("{http://www.w3.org/2000/svg}text"))
        out[title] = ((path_el.get("stroke") if path_el is not None else "") or "", text)
    return out


def test_check_passes_a_healthy_mesh_with_every_cable_near_its_rate(checked):
    """Every cable, alone in each direction and all at once, near the rate the inventory gives
    (meshkit_link_rate = the cables' tbf rate); all_reduce against what a 4-host mesh allows; exit 0."""
    rc, stdout, stderr, report, out = meshkit_check(checked, "healthy")
    assert rc == 0, stdout + stderr
    assert report["ok"] and not report["flagged"] and not report["problems"], stdout
    assert len(report["cables"]) == 6
    for cable in report["cables"]:
        assert cable["expected_bps"] == CHECK_BITS and "meshkit_link_rate" in cable["expected_from"], cable
        for mode in ("alone", "load"):
            for direction in ("ab", "ba"):
                # At least the threshold of the rate (else it would be flagged), and no more than the
                # limit lets through (the figure is the cable's, not a buffer's).
                assert 0.8 * CHECK_BITS <= cable[mode][direction] <= 1.1 * CHECK_BITS, (cable, stdout)
        assert cable["loss"]["ab"] == 0 and cable["loss"]["ba"] == 0, cable
        assert cable["rtt_us"] > 0 and not cable["flags"], cable
    cluster = report["cluster"]
    assert cluster["shape"] == "mesh" and cluster["factor"] == 3 and not cluster["flags"], cluster
    assert all(row["correct"] for row in cluster["rows"]) and cluster["busbw_bps"] > 0, cluster
    series = prometheus_series((out / "check.prom").read_text())
    assert [value for name, _labels, value in series if name == "meshkit_check_ok"] == [1.0], series
    assert not [s for s in series if s[0] == "meshkit_check_cable_flagged" and s[2]], series
    for name, _ in ((c["cable"], c) for c in report["cables"]):
        assert name in stdout, stdout

    # Again, from the remembered plan: the hosts check it in one round trip (no Ansible).
    rc, stdout, stderr, report, out = meshkit_check(checked, "healthy-again", "--quick")
    assert rc == 0, stdout + stderr
    assert "checked 4 hosts against the plan of the last full check" in stderr, stderr
    assert report["quick"] and report["ok"], stdout
    assert all(c["alone"] is None and c["load"] is None and c["rtt_us"] > 0 for c in report["cables"]), report


def test_check_flags_the_one_cable_at_half_rate_everywhere(checked):
    """One cable (both ends) at half the rate: that cable, and only that one, flagged by name in the
    table, the JSON, the Prometheus file and the picture (red, with its figure); exit 1."""
    name, a, b = check_cable(checked["plan"], "node2", "node3")
    half = f"{int(CHECK_BITS / 2 / 1e6)}mbit"
    try:
        for end in (a, b):
            shape(checked["ports"][end], end[1], half)
        rc, stdout, stderr, report, out = meshkit_check(checked, "half-rate")
    finally:
        for end in (a, b):
            shape(checked["ports"][end], end[1], CHECK_RATE)
    assert rc == 1, stdout + stderr
    assert report["flagged"] == [name], stdout
    [slow] = [c for c in report["cables"] if c["cable"] == name]
    assert "slow" in [f["flag"] for f in slow["flags"]], slow
    assert all(0.4 * CHECK_BITS <= slow["alone"][d] <= 0.6 * CHECK_BITS for d in ("ab", "ba")), slow
    for cable in report["cables"]:
        if cable["cable"] != name:
            assert not cable["flags"], cable
    # The table: the flagged cable's line names it and the flag; no other cable's line is flagged.
    lines = [line for line in stdout.splitlines() if "\u2194" in line]
    assert [line for line in lines if "slow" in line] and all(
        (name in line) == ("slow" in line) for line in lines if "slow" in line
    ), stdout
    series = prometheus_series((out / "check.prom").read_text())
    flagged = {s[1]["cable"] for s in series if s[0] == "meshkit_check_cable_flagged" and s[2]}
    assert flagged == {name}, series
    assert [value for name, _labels, value in series if name == "meshkit_check_ok"] == [0.0], series
    edges = svg_edges(out / "cabling-check.svg")
    red = [title for title, (stroke, _) in edges.items() if stroke.lower() in ("red", "#ff0000", "#d62728")]
    assert len(red) == 1, edges
    assert "Mb/s" in edges[red[0]][1] or "Gb/s" in edges[red[0]][1], edges
    shutil.copy(out / "cabling-check.svg", checked["artifacts"] / "cabling-check-flagged.svg")


def test_check_quick_flags_a_lossy_cable_and_an_mtu_mismatch(checked):
    """--quick (no job-sized traffic): a cable dropping 5 % of what reaches one end (nftables random
    drop: this kernel has no netem) is flagged lossy; a cable whose ends differ in MTU is flagged."""
    lossy, _a, (host, port) = check_cable(checked["plan"], "node1", "node4")
    mismatched, (mtu_host, mtu_port), _b = check_cable(checked["plan"], "node1", "node2")
    netns, mtu_netns = checked["ports"][(host, port)], checked["ports"][(mtu_host, mtu_port)]
    table = f"meshkit_test_loss_{port}"
    rules = (
        f'table netdev {table} {{ chain ingress {{ type filter hook ingress device "{port}" priority 0; '
        "policy accept; numgen random mod 1000 < 50 drop; }; }"
    )
    try:
        sh("ip", "netns", "exec", netns, "nft", rules)
        sh("ip", "-n", mtu_netns, "link", "set", "dev", mtu_port, "mtu", "9000")
        rc, stdout, stderr, report, _out = meshkit_check(checked, "lossy-mtu", "--quick")
    finally:
        sh("ip", "netns", "exec", netns, "nft", "delete", "table", "netdev", table, check=False)
        sh("ip", "-n", mtu_netns, "link", "set", "dev", mtu_port, "mtu", "1500", check=False)
    assert rc == 1, stdout + stderr
    flags = {c["cable"]: [f["flag"] for f in c["flags"]] for c in report["cables"]}
    assert "lossy" in flags[lossy], (flags, stdout)
    [cable] = [c for c in report["cables"] if c["cable"] == lossy]
    assert max(cable["loss"]["ab"], cable["loss"]["ba"]) > 0.01, cable
    assert "mtu-mismatch" in flags[mismatched], (flags, stdout)
    assert sorted(report["flagged"]) == sorted([lossy, mismatched]), stdout
    assert "9000" in stdout and "lossy" in stdout, stdout


def test_check_playbook_reports_as_meshkit_check_does(checked):
    """check.yml (launch.yml's checks, the same job, every host's facts, the same report): a cable
    whose ends differ in MTU fails the play, named, and check.json says it is the only one."""
    mismatched, (host, port), _b = check_cable(checked["plan"], "node3", "node4")
    try:
        sh("ip", "-n", checked["ports"][(host, port)], "link", "set", "dev", port, "mtu", "9000")
        run = run_playbook("check.yml", "-e", "check_quick=true", inventory=str(checked["inventory"]))
    finally:
        sh("ip", "-n", checked["ports"][(host, port)], "link", "set", "dev", port, "mtu", "1500", check=False)
    assert run.rc != 0, run.output
    assert "mtu-mismatch" in run.output and mismatched in run.output, run.output
    # A check changes nothing: the one task that reports a change is the job's start (its ranks ran).
    changed = re.findall(r"TASK \[([^\]]*)\][^\n]*\n(?:(?!TASK \[).*\n)*?changed: ", run.output)
    assert run.changed == 1 and len(changed) == 1 and changed[0].startswith("Check every host's preflight, start"), (
        changed,
        run.output,
    )
    report = json.loads((checked["artifacts"] / "check" / "check.json").read_text())
    assert report["quick"] and len(report["cables"]) == 6 and report["flagged"] == [mismatched], report
    assert all(c["rtt_us"] > 0 and c["loss"]["ab"] == 0 for c in report["cables"]), report


# --- meshkit watch on the same lab: a live Prometheus and node_exporter, a real browser -----------------------------


def crontab_lines() -> list[str]:
    done = sh("crontab", "-l", check=False)
    return done.stdout.splitlines() if done.returncode == 0 else []


def test_watch_feeds_a_live_prometheus_that_alerts_on_the_one_throttled_cable_and_a_browser_shows_it(
    checked: dict[str, Any], tmp_path: Path
) -> None:
    """`meshkit watch enable --scheduler cron` installs a crontab line; each "tick" runs that line's command as
    cron runs it (/bin/sh, cron's bare environment) rather than waiting for cron's minute. Debian's
    prometheus-node-exporter reads the textfile the runs write, Debian's prometheus scrapes it every second and
    evaluates the shipped rules with their `for: 5m` made 2 s (promtool's unit tests cover the 5 minutes).
    Healthy: no alert. One end of one cable at a quarter of its rate: MeshkitCableSlow fires for that cable, and
    no other cable has an alert. Throttle gone: resolved. A run while a job holds the hosts: skipped, counted.
    The status page the runs write, in headless Chromium: that cable red, with its figures and history.
    `meshkit watch disable`: no crontab line left."""
    from . import watch_stack as ws

    name, end, _other = check_cable(checked["plan"], "node2", "node3")
    quarter = f"{int(CHECK_BITS / 4 / 1e6)}mbit"
    textfiles, state = tmp_path / "textfile", tmp_path / "state"
    textfiles.mkdir()
    env = dict(ENV, MESHKIT_LAUNCH_CACHE=str(checked["cache"]), MESHKIT_STATE_DIR=str(state))
    inventory = str(checked["inventory"])
    watch_dir = checked["artifacts"] / "watch"
    kept = crontab_lines()

    def meshkit(*words: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([MESHKIT, *words], capture_output=True, text=True, env=env, cwd=REPO, check=False,
                              stdin=subprocess.DEVNULL, timeout=600)  # fmt: skip

    enabled = meshkit("watch", "enable", "-i", inventory, "--every", "1m", "--full-every", "1m",
                      "--textfile-dir", str(textfiles), "--scheduler", "cron")  # fmt: skip
    try:
        assert enabled.returncode == 0, enabled.stdout + enabled.stderr
        ours = [line for line in crontab_lines() if "meshkit-watch" in line]
        assert len(ours) == 1 and ours[0].startswith("* * * * * cd "), crontab_lines()
        assert [line for line in crontab_lines() if "meshkit-watch" not in line] == kept
        scheduled = ours[0].split(" ", 5)[5]
        textfile = Path(json.loads((watch_dir / "watch.json").read_text())["textfile"])
        ticks: list[float] = []

        def tick(expect: str) -> dict[str, Any]:
            """One scheduled run, as cron starts it; the watch's state after it."""
            started = time.monotonic()
            done = subprocess.run(["/bin/sh", "-c", scheduled], env={"HOME": str(Path.home()), "LOGNAME": "root",
                                  "PATH": "/usr/bin:/bin", "SHELL": "/bin/sh"}, capture_output=True, text=True,
                                  check=False, timeout=600)  # fmt: skip
            ticks.append(time.monotonic() - started)
            log = (watch_dir / "watch.log").read_text()
            assert done.returncode == 0, log[-4000:]
            now = json.loads((watch_dir / "state.json").read_text())
            assert now["last_outcome"] == expect, (now, log[-4000:])
            return now

        def settled(url: str, after: dict[str, Any]) -> None:
            """Prometheus has scraped this run's textfile and evaluated every rule on it for longer than `for:`."""
            ws.wait_for(
                "Prometheus to scrape the run's textfile",
                lambda: [
                    r
                    for r in ws.query(url, "meshkit_watch_last_run_timestamp_seconds")
                    if float(r["value"][1]) == after["last_run_at"]
                ],
            )
            seen = time.time()
            ws.wait_for("every rule evaluated 3 s after the scrape", lambda: ws.evaluated_after(url, seen + 3))

        with ws.prometheus(tmp_path / "prometheus", textfiles, "2s") as url:
            after = tick("checked")
            after = tick("checked")
            settled(url, after)
            assert ws.meshkit_alerts(url) == [], ws.meshkit_alerts(url)
            ok = ws.query(url, "meshkit_check_ok")
            assert [float(r["value"][1]) for r in ok] == [1.0], ok

            try:
                shape(checked["ports"][end], end[1], quarter)
                after = tick("checked")
            finally:
                shape(checked["ports"][end], end[1], CHECK_RATE)
            firing = ws.wait_for(
                f"MeshkitCableSlow firing for {name}",
                lambda: [
                    a
                    for a in ws.meshkit_alerts(url)
                    if a["labels"]["alertname"] == "MeshkitCableSlow" and a["state"] == "firing"
                ],
                timeout=60,
            )
            assert {a["labels"]["cable"] for a in firing} == {name}, firing
            settled(url, after)
            alerts = ws.meshkit_alerts(url)
            assert {a["labels"].get("cable") for a in alerts if "cable" in a["labels"]} == {name}, alerts
            assert all("cable" in a["labels"] or a["labels"]["alertname"] == "MeshkitClusterAllReduceLow"
                       for a in alerts), alerts  # fmt: skip
            page = checked["where"] / "status-throttled.html"
            shutil.copy(watch_dir / "status.html", page)

            after = tick("checked")
            ws.wait_for("every meshkit alert resolved", lambda: ws.meshkit_alerts(url) == [], timeout=60)
            settled(url, after)
            assert ws.meshkit_alerts(url) == []

        # A job holds the hosts: the run is skipped, said and counted.
        job = subprocess.Popen(
            [MESHKIT, "launch", "-i", inventory, "-r", "plain", "-n", "1", "-t", "600", "--no-stdin", "--",
             "sleep", "600"], env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            ws.wait_for("the job's lease on its hosts", lambda: list((state / "jobs" / "running").glob("*.json")),
                        timeout=300)  # fmt: skip
            after = tick("skipped")
        finally:
            os.killpg(job.pid, signal.SIGINT)
            job.communicate(timeout=120)
        assert after["runs"] == {"checked": 4, "skipped": 1}, after
        lines = (watch_dir / "history.jsonl").read_text().splitlines()
        last = json.loads(lines[-1])
        assert last["outcome"] == "skipped" and "holds node" in last["reason"], last
        series = prometheus_series(textfile.read_text())
        runs = {s[1]["outcome"]: s[2] for s in series if s[0] == "meshkit_watch_runs_total"}
        assert runs == {"checked": 4.0, "skipped": 1.0, "failed": 0.0}, runs
        # The figures of the last check stay in the textfile through the skipped run.
        assert [s[2] for s in series if s[0] == "meshkit_check_ok"] == [1.0], series
    finally:
        disabled = meshkit("watch", "disable", "-i", inventory)
        left = crontab_lines()
        if left != kept:  # put back what was there, whatever happened
            sh("sh", "-c", "crontab -r; true")
            if kept:
                subprocess.run(["crontab", "-"], input="\n".join(kept) + "\n", text=True, check=True)
    assert disabled.returncode == 0, disabled.stdout + disabled.stderr
    assert "removed 1 line(s)" in disabled.stdout, disabled.stdout
    assert not [line for line in left if "meshkit-watch" in line] and left == kept, left
    print(f"\n[watch] scheduled runs took {', '.join(f'{t:.1f}' for t in ticks)} s")

    # The same through Ansible (watch.yml: the meshkit.cluster.watch task): check mode writes nothing, a second run
    # changes nothing, state=absent takes the line away (and then changes nothing either).
    def play(*extra: str) -> PlaybookRun:
        given = ["-e", "watch_scheduler=cron", "-e", f"watch_textfile_dir={textfiles}", "-e", "watch_every=5m"]
        return run_playbook("watch.yml", *given, *extra, inventory=inventory)

    try:
        runs = {"check": play("--check"), "first": play()}
        mine = [line for line in crontab_lines() if "meshkit-watch" in line]
        runs |= {"second": play(), "absent": play("-e", "watch_state=absent")}
        runs["absent again"] = play("-e", "watch_state=absent")
        left = crontab_lines()
    finally:
        if crontab_lines() != kept:
            sh("sh", "-c", "crontab -r; true")
            if kept:
                subprocess.run(["crontab", "-"], input="\n".join(kept) + "\n", text=True, check=True)
    assert all(r.rc == 0 for r in runs.values()), {k: r.output[-2000:] for k, r in runs.items() if r.rc}
    assert {k: r.changed for k, r in runs.items()} == {"check": 1, "first": 1, "second": 0, "absent": 1,
                                                        "absent again": 0}  # fmt: skip
    assert len(mine) == 1 and mine[0].startswith("*/5 * * * * cd "), mine
    assert left == kept, left

    seen = ws.render(page, checked["artifacts"] / "status-throttled.png")
    shutil.copy(page, checked["artifacts"] / "status-throttled.html")
    rows = {r["cable"]: r for r in seen["rows"]}
    assert len(rows) == 6, seen
    red = "rgb(214, 39, 40)"
    assert [c for c, r in rows.items() if r["colour"] == red] == [name], rows
    slow = rows[name]
    assert any("Mb/s" in cell for cell in slow["cells"]), slow
    assert slow["points"] >= 3 and slow["red_points"] == 1, slow  # two healthy checks, then the throttled one
    assert all(r["points"] >= 3 and r["red_points"] == 0 for c, r in rows.items() if c != name), rows
    assert any(link.endswith("#slow") for link in slow["runbook"]), slow
    edges = {e["id"]: e["stroke"] for e in seen["edges"]}
    assert len(edges) == 6 and [i for i, s in edges.items() if s == red] == [edge_id(name.replace(" \u2194 ", " <-> "))]
    assert "FLAGGED" in seen["summary"], seen["summary"]


# --- Slurm (meshkit_slurm: true in the lab's inventory; the slurm role ran in the fixture's setup.yml) ----------

# A rank of the Slurm tests: says who it is to Slurm and to meshkit, then fails (FAIL_RANK) or waits.
SLURM_RANK = (
    "import os, socket, sys, time\n"
    "r = int(os.environ['MESHKIT_RANK'])\n"
    "print(f\"up rank={r} procid={os.environ['SLURM_PROCID']} host={socket.gethostname()} "
    "user={os.environ.get('USER', '?')}\", flush=True)\n"
    "fail = int(os.environ.get('FAIL_RANK', '-1'))\n"
    "time.sleep(1)\n"
    "sys.exit(int(os.environ['FAIL_CODE'])) if r == fail else time.sleep(float(os.environ.get('HOLD', '0')))\n"
)


def slurm_launch_argv(lab: tuple[LabHandle, Path], *args: str) -> list[str]:
    handle, _artifacts = lab
    # No -e: the inventory names the artifacts directory, so launches after the first plan from the
    # remembered checks (every host verifies them in one round trip) instead of running launch.yml.
    return [PYTHON, MESHKIT, "launch", "-i", str(handle.inventory), "--scheduler", "slurm", "-n", "2", "-t", "240",
            "--no-stdin", *args]  # fmt: skip


def on_node(handle: LabHandle, host: str, command: str, become: bool = False) -> str:
    """A shell command on a lab host as the login user (meshadmin), or root with become; its output."""
    args = ["-m", "ansible.builtin.shell", "-a", command] + (["-b"] if become else [])
    proc = handle.ansible(*args, pattern=host)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split("\n", 1)[1] if "\n" in proc.stdout else ""


def ring_order(artifacts: Path) -> list[str]:
    return json.loads((artifacts / "plan.json").read_text())["ring"]


def nothing_left(handle: LabHandle, marker: str) -> None:
    """No process of the job on any host, and no job in Slurm's queue."""
    wait_for(f"every process of job {marker} gone", lambda: not job_processes(marker), within=30)
    # The job leaves Slurm's queue once slurmctld has heard from every node (COMPLETING until then).
    wait_for(
        "Slurm's queue empty",
        lambda: on_node(handle, "node1", "squeue --noheader --format='%i %j %T'").strip() == "",
        within=60,
        every=0.5,
    )


def test_slurm_has_four_idle_nodes_one_munge_key_and_a_topology_from_the_cabling(lab):
    """setup.yml with meshkit_slurm: true and slurmctld on the head node (the fixture's;
    test_setup_by_name_... shows a second run changes nothing, the role included): every compute node
    idle (the head is not one), one munge key everywhere, slurmctld on the head only and slurmd on the
    cluster's hosts only, slurm.conf from each host's own slurmd -C, topology.conf from the cabling
    (a full mesh: one switch)."""
    handle, artifacts = lab
    for host in ("node2", HEAD):
        sinfo = on_node(handle, host, "sinfo --noheader --Node --format='%N %T %c %P'")
        assert sorted(sinfo.strip().split("\n")) == [f"node{i} idle 2 meshkit*" for i in range(1, 5)], (host, sinfo)
    # Each lab host has its own PID namespace: pgrep sees that host's daemons only.
    look = "for d in slurmctld slurmd munged; do pgrep -x $d >/dev/null && echo $d; done; true"
    daemons = {h: on_node(handle, h, look).split() for h in [*handle.hosts(), HEAD]}
    assert daemons == {HEAD: ["slurmctld", "munged"], **{h: ["slurmd", "munged"] for h in handle.hosts()}}, daemons
    keys = {h: on_node(handle, h, "sha256sum /etc/munge/munge.key; stat -c '%U %a' /etc/munge/munge.key", True)
            for h in [*handle.hosts(), HEAD]}  # fmt: skip
    assert len({k.split()[0] for k in keys.values()}) == 1, keys
    assert all(k.split("\n")[1] == "munge 400" for k in keys.values()), keys
    kept = artifacts / "secrets" / "munge.key"
    assert oct(kept.stat().st_mode & 0o777) == "0o600" and oct(kept.parent.stat().st_mode & 0o777) == "0o700"
    assert hashlib.sha256(kept.read_bytes()).hexdigest() == next(iter(keys.values())).split()[0]
    conf = on_node(handle, "node3", "cat /etc/slurm/slurm.conf")
    assert on_node(handle, HEAD, "cat /etc/slurm/slurm.conf") == conf
    head_addr = yaml.safe_load(handle.inventory.read_text())["all"]["children"]["heads"]["hosts"][HEAD]["ansible_host"]
    assert f"\nSlurmctldHost={HEAD}({head_addr})\n" in conf and f"NodeName={HEAD}" not in conf, conf
    hardware = on_node(handle, "node3", "slurmd -C | head -1", True).split(maxsplit=1)[1].strip()
    assert f"NodeName=node3 NodeAddr={handle.hosts()['node3']['ansible_host']} {hardware} State=UNKNOWN" in conf, (
        conf,
        hardware,
    )
    assert f"PartitionName=meshkit Nodes={','.join(ring_order(artifacts))} Default=YES" in conf, conf
    topology = on_node(handle, "node4", "cat /etc/slurm/topology.conf")
    assert re.search(r"^SwitchName=mesh Nodes=node[1-4](,node[1-4]){3}$", topology, re.M), topology
    assert "full mesh of 4 hosts" in topology, topology


def test_meshccl_all_reduce_through_slurm_in_ring_order(lab):
    """meshkit launch --scheduler slurm: one srun on node1 (rank 0's host), Slurm's task r is
    meshkit's rank r on the ring's host, meshccl's rank is the same, all_reduce exact."""
    _handle, artifacts = lab
    before = set((artifacts / "launch").iterdir()) if (artifacts / "launch").exists() else set()
    proc = subprocess.run(
        slurm_launch_argv(lab, "--", "python3", str(PROGRAMS / "meshccl_allreduce.py")),
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "8 ranks of meshccl on 4 hosts through Slurm (srun on node1)" in output, output
    ring = ring_order(artifacts)
    for r in range(8):
        host = ring[r // 2]
        assert re.search(rf"^\[{r}\|{host}\] meshccl rank {r}/8 on {host}: all_reduce exact$", output, re.M), output
    [log_dir] = set((artifacts / "launch").iterdir()) - before
    assert "srun exited 0" in output and (log_dir / "srun.log").exists(), output
    assert all(f"meshccl rank {r}/8" in (log_dir / f"rank-{r}.log").read_text() for r in range(8))
    assert "MESHCCL_TOKEN" not in output, output


def test_a_failing_rank_fails_the_slurm_job_naming_it_and_nothing_is_left(lab):
    handle, _ = lab
    marker = f"MKMARK={uuid.uuid4().hex}"
    proc = subprocess.run(
        slurm_launch_argv(lab, "-r", "plain", "-x", marker, "-x", "FAIL_RANK=5", "-x", "FAIL_CODE=3", "-x", "HOLD=300",
                          "--", "python3", "-c", SLURM_RANK),
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 3, output
    ring = ring_order(lab[1])
    assert f"rank 5 ({ring[2]}) exited with exit code 3 (reported by srun; Slurm stopped the others)" in output, output
    # Every rank had started (Slurm's task r = meshkit's rank r) before the failure stopped the others.
    for r in range(8):
        assert re.search(rf"^\[{r}\|{ring[r // 2]}\] up rank={r} procid={r} host={ring[r // 2]} user=meshadmin$",
                         output, re.M), output  # fmt: skip
    nothing_left(handle, marker)


def test_scancel_and_ctrl_c_stop_every_rank_of_a_slurm_job(lab):
    """scancel of the running job (by its name, as its user, from the head node), then Ctrl-C on
    meshkit launch: each time every rank on every host stops and nothing is left in Slurm's queue."""
    handle, _ = lab
    for how in ("scancel", "ctrl-c"):
        marker = f"MKMARK={uuid.uuid4().hex}"
        proc = subprocess.Popen(
            slurm_launch_argv(lab, "-r", "plain", "-x", marker, "-x", "HOLD=300", "--", "python3", "-c", SLURM_RANK),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=ENV, cwd=REPO,
        )  # fmt: skip

        def ranks_running(proc: subprocess.Popen[str] = proc, marker: str = marker) -> bool:
            # One process per rank with its MESHKIT_HOST (the wrapper execs the program); srun has none.
            found = job_processes(marker)
            return still(proc) and sum(len(pids) for host, pids in found.items() if host != "?") >= 8

        try:
            wait_for("8 ranks running", ranks_running, within=120)
        except BaseException:
            kill_if_running(proc)
            raise
        if how == "scancel":
            # From the head node, as a user on a login node would.
            name = on_node(handle, HEAD, "squeue --noheader --format=%j").strip()
            assert name.startswith("meshkit-"), name
            on_node(handle, HEAD, f"scancel --name={name}")
        else:
            proc.send_signal(signal.SIGINT)
        out = finished(proc, within=60)
        assert proc.returncode != 0, out
        if how == "scancel":
            assert "the Slurm job step was cancelled from outside" in out, out
        else:
            assert proc.returncode == 130 and "interrupted (Ctrl-C)" in out, out
        nothing_left(handle, marker)


def test_a_users_own_srun_forms_the_meshccl_job_from_slurms_environment(lab):
    """No meshkit launch: the login user's own srun on the head node (block distribution, 2 tasks per
    node) of a meshccl program with a token; meshccl takes the layout from Slurm's environment and the
    hostfile setup.yml wrote on the nodes (/var/lib/meshkit/hostfiles/meshccl.json): all_reduce exact,
    ranks in ring order."""
    handle, artifacts = lab
    out = on_node(
        handle,
        HEAD,
        "export MESHCCL_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n') MESHKIT_WORLD_SIZE=8; "
        f"srun --nodes=4 --ntasks-per-node=2 --label {VENV}/bin/python3 {PROGRAMS / 'meshccl_allreduce.py'}",
    )
    ring = ring_order(artifacts)
    found = re.findall(r"^\s*(\d+): meshccl rank (\d+)/8 on (\S+): all_reduce exact$", out, re.M)
    assert len(found) == 8, out
    # Slurm numbers tasks by its node order; meshccl's rank follows the ring: host ring[k] holds ranks 2k, 2k+1.
    assert sorted(int(m) for _t, m, _h in found) == list(range(8)), found
    assert all(ring[int(m) // 2] == h for _t, m, h in found), (found, ring)


def test_slurm_runs_an_mpi_job_through_srun_pmix_and_a_batch_job_through_sbatch(lab):
    """-r mpi --scheduler slurm: srun --mpi=pmix starts every MPI rank itself (no mpirun), in ring
    order; --batch: sbatch returns once the job is queued, and the job's labelled output lands in
    the file it names on rank 0's host, every rank's all_reduce exact."""
    handle, artifacts = lab
    ring = ring_order(artifacts)
    proc = subprocess.run(
        slurm_launch_argv(lab, "-r", "mpi", "-x", "GREETING=hi", "--", PYTHON, str(PROGRAMS / "mpi_allreduce.py")),
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for r in range(8):
        assert re.search(rf"^\[{r}\|{ring[r // 2]}\] mpi rank {r}/8 on {ring[r // 2]} sum=36 .*greeting=hi$", output,
                         re.M), output  # fmt: skip

    proc = subprocess.run(
        slurm_launch_argv(lab, "--batch", "--", "python3", str(PROGRAMS / "meshccl_allreduce.py")),
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    number = proc.stdout.split()[-1]  # the Slurm job id, last on stdout
    assert number.isdigit(), output
    said = rf"submitted Slurm batch job {number} \(meshkit-\S+\): 8 ranks in ring order; their output "
    found = re.search(said + rf"\(labelled by rank\) goes to {ring[0]}:(/tmp/meshkit-\S+-{number}\.out)\.", output)
    assert found, output
    wait_for(
        f"batch job {number} to leave the queue",
        lambda: on_node(handle, "node2", f"squeue --noheader --jobs={number} 2>/dev/null || true").strip() == "",
        within=120,
        every=1,
    )
    written = on_node(handle, ring[0], f"cat {found.group(1)}")
    for r in range(8):
        assert re.search(rf"^\s*{r}: meshccl rank {r}/8 on {ring[r // 2]}: all_reduce exact$", written, re.M), written


def test_slurm_runs_torch_ddp_over_meshccl_and_an_mlx_ring_job_with_their_environments(lab):
    """-r torch and -r mlx through srun: each task gets the environment meshkit's own launcher gives
    its rank (torch's RANK/LOCAL_RANK from Slurm's numbers, each host's own NODE_RANK and interfaces,
    the job's meshccl.json and MLX ring file written into the job directory on every host). DDP over
    meshccl matches Gloo on every rank and uses every cable; MLX's all_sum is 36 on every rank."""
    _handle, artifacts = lab
    ring = ring_order(artifacts)
    proc = subprocess.run(
        slurm_launch_argv(lab, "-r", "torch", "--", PYTHON, DDP_PARITY),
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    said = dict(re.findall(r"^\[(\d)\|node\d\] ddp-parity rank \1/8 on (node\d) .* ok$", output, re.M))
    assert said == {str(r): ring[r // 2] for r in range(8)}, output
    for line in re.findall(r"ddp-parity rank \d/8 on node\d (.*) ok$", output, re.M):
        fields = dict(kv.split("=", 1) for kv in line.split())
        assert fields["backend"] == "meshccl" and fields["same_on_every_rank"] == "yes", fields
        assert float(fields["max_diff_gloo"]) <= float(fields["tol"]) and fields["cables"] == "3/3", fields
    proc = subprocess.run(
        slurm_launch_argv(lab, "-r", "mlx", "--", PYTHON, str(PROGRAMS / "mlx_all_sum.py")),
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for r in range(8):
        assert f"[{r}|{ring[r // 2]}] mlx rank {r}/8 on {ring[r // 2]} MLX_RANK={r} sum=36" in output, output


def test_slurm_through_launch_yml(lab):
    """launch.yml with launch_scheduler: slurm: the same job through srun, shown per rank, and the play
    fails naming the rank when one exits non-zero."""
    ring = ring_order(lab[1])
    rc, output, summary = launch(
        lab,
        launch_program=["python3", str(PROGRAMS / "meshccl_allreduce.py")],
        launch_ranks_per_host=2,
        launch_scheduler="slurm",
        launch_timeout=120,
    )
    assert rc == 0, output
    for r in range(8):
        assert f"[{r}|{ring[r // 2]}] meshccl rank {r}/8 on {ring[r // 2]}: all_reduce exact" in output, output
    assert summary is not None and summary["ok"] and summary["ranks"][0]["rank"] == -1, summary
    rc, output, _ = launch(
        lab,
        launch_program=["python3", "-c", SLURM_RANK],
        launch_runtime="plain",
        launch_env={"FAIL_RANK": "6", "FAIL_CODE": "4", "HOLD": "300"},
        launch_ranks_per_host=2,
        launch_scheduler="slurm",
        launch_timeout=120,
    )
    assert rc != 0 and f"rank 6 ({ring[3]}) exited with exit code 4 (reported by srun" in output, output


def test_a_check_if_idle_measures_nothing_while_a_slurm_job_meshkit_did_not_start_runs(lab, checked):
    """A batch job submitted with Slurm's own sbatch (no meshkit lease): `meshkit check --if-idle` (what meshkit
    watch runs) finds its step on the host (slurmstepd), measures nothing, names the job and exits 3. (Before
    the test that takes Slurm away, below.)"""
    handle, _artifacts = lab
    number = on_node(handle, "node1", "sbatch --parsable --nodes=1 --wrap 'sleep 600'").strip().split(";")[0]
    assert number.isdigit(), number
    out = checked["where"] / "slurm-busy.json"
    try:
        wait_for(
            f"Slurm job {number} running",
            lambda: on_node(handle, "node1", f"squeue --noheader --jobs={number} --format=%T").strip() == "RUNNING",
            within=60,
            every=0.5,
        )
        node = on_node(handle, "node1", f"squeue --noheader --jobs={number} --format=%N").strip()
        proc = subprocess.run(
            [PYTHON, MESHKIT, "check", "-i", str(checked["inventory"]), "--quick", "--if-idle", "--json", str(out)],
            capture_output=True, text=True, env=dict(ENV, MESHKIT_LAUNCH_CACHE=str(checked["cache"])), cwd=REPO,
            timeout=600, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        on_node(handle, "node1", f"scancel {number}")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"skipped (--if-idle): Slurm job {number} runs on {node}" in proc.stderr, proc.stderr
    assert not out.exists()
    wait_for(
        "Slurm's queue empty",
        lambda: on_node(handle, "node1", "squeue --noheader --format='%i %j %T'").strip() == "",
        within=60,
        every=0.5,
    )


MUNGE_KEY = "/etc/munge/munge.key"


# The last test of this module (pytest keeps file order): every Slurm test above needs Slurm.
def test_slurm_state_absent_takes_slurm_away_and_a_second_run_changes_nothing(lab):
    """The slurm role with slurm_state: absent over the compute nodes and the head node (as a teardown
    runs it). --check --diff first names every daemon that would stop and changes nothing; the run then
    stops every Slurm daemon of every lab host (each has its own processes and Slurm/munge directories)
    and removes the role's files, the munge key, slurmctld's and slurmd's state and the controller's copy
    of the key; the logs stay. A second run, and a second --check --diff, change nothing."""
    handle, artifacts = lab
    nodes = sorted(handle.hosts())
    playbook = artifacts / "slurm-absent.yml"
    role_vars = {
        "slurm_state": "absent",
        "slurm_controller": HEAD,
        "slurm_nodes": nodes,
        "slurm_plan": {},
        "slurm_secrets_dir": str(artifacts / "secrets"),
    }
    include = {"ansible.builtin.include_role": {"name": "meshkit.cluster.slurm"}, "vars": role_vars}
    play = {"name": "Take Slurm away", "hosts": f"cluster:{HEAD}", "gather_facts": False, "become": True}
    playbook.write_text(yaml.safe_dump([play | {"tasks": [{"name": "Take Slurm away"} | include]}], sort_keys=False))
    pids = json.loads((handle.dir / "state.json").read_text())["holders"]
    assert sorted(pids) == sorted([*nodes, HEAD]), pids

    def in_host(host: str, command: str) -> str:
        return sh("nsenter", "-t", str(pids[host]), "-m", "-p", "--", "sh", "-c", command).stdout

    def daemons() -> dict[str, list[str]]:
        return {h: in_host(h, "pgrep -l -x 'slurmd|slurmctld|munged' || true").split()[1::2] for h in pids}

    running = {HEAD: ["slurmctld", "munged"], **{h: ["slurmd", "munged"] for h in nodes}}
    assert {h: sorted(d) for h, d in daemons().items()} == {h: sorted(d) for h, d in running.items()}
    # Each lab host has its own boot links (/etc/rc?.d, a copy of the machine's), as each machine of a cluster
    # does: the role turns the daemons off at boot on the hosts, never on this machine.
    links = "ls /etc/rc?.d | grep -E '^[SK][0-9]+(munge|slurmd|slurmctld)$' | sort"
    boot_links = sh("sh", "-c", links).stdout
    check = run_playbook(str(playbook), "--check", "--diff", inventory=str(handle.inventory))
    assert check.rc == 0 and set(check.recap) == set(pids), check.output
    assert task_lines(check.output, "meshkit.cluster.slurm : Stop Slurm's daemons") == sorted(
        f"changed: [{h}] => (item={d})" for h, ds in running.items() for d in ds
    ), check.output
    for path in [f"/etc/slurm/{name}" for name in ("slurm.conf", "topology.conf", "mpi.conf")] + [MUNGE_KEY]:
        gone = f"    path: {path}\n-    state: file\n+    state: absent"
        assert check.output.count(gone) == len(pids), (path, check.output)
    assert {h: sorted(d) for h, d in daemons().items()} == {h: sorted(d) for h, d in running.items()}
    assert (artifacts / "secrets" / "munge.key").is_file()

    run = run_playbook(str(playbook), inventory=str(handle.inventory))
    assert run.rc == 0 and run.changed > 0, run.output
    assert daemons() == {h: [] for h in pids}, run.output
    # Each host's own Slurm and munge directories were empty before setup.yml: the packages' directories
    # the role used stay (slurmctld's on the head, slurmd's on the nodes), empty.
    for host in pids:
        left = in_host(host, "find /etc/slurm /etc/munge /var/lib/slurm -mindepth 1").split()
        assert left == ["/var/lib/slurm/slurmctld" if host == HEAD else "/var/lib/slurm/slurmd"], (host, left)
        logs = in_host(host, "ls /var/log/slurm").split()
        assert logs == (["slurmctld.log"] if host == HEAD else ["slurmd.log"]), (host, logs)
    assert not (artifacts / "secrets").exists()

    again = run_playbook(str(playbook), inventory=str(handle.inventory))
    assert again.rc == 0 and set(again.recap) == set(pids) and again.changed == 0, again.output
    check = run_playbook(str(playbook), "--check", "--diff", inventory=str(handle.inventory))
    assert check.rc == 0 and check.changed == 0 and "--- before" not in check.output, check.output
    assert sh("sh", "-c", links).stdout == boot_links
    assert re.search(r"^S\d+munge$", boot_links, re.M), boot_links
    # On each host the role's own daemons no longer start at boot: munge everywhere, slurmctld on the head,
    # slurmd on the nodes (the other package's links are left as the host had them).
    own = {HEAD: "munge|slurmctld", **dict.fromkeys(nodes, "munge|slurmd")}
    for host, names in own.items():
        starting = re.findall(rf"^S\d+(?:{names})$", in_host(host, links), re.M)
        assert starting == [], (host, starting)
