"""A cluster's life on one running lab with Slurm: a 4-host ring grown to 5 (node5 cabled in between node4
and node1), shrunk back to 4, recabled (plugs moved to other ports), node3 replaced by a new machine,
setup.yml converging each change in one run, and undone at the end (a host lost part-way). The lab changes in place
(playbooks/lab.yml: hosts and cables added and removed, the others untouched), as a cluster does while its
hosts keep running."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import ENV, REPO, LabHandle, drop_lab, ip_json, launch_allreduce, new_lab, run_playbook

POOL = ipaddress.IPv4Network("198.18.128.0/17")
PYTHON = str(REPO / ".venv" / "bin" / "python")
MESHKIT = str(REPO / ".venv" / "bin" / "meshkit")
# The 4-host ring with the plugs at node1 and node4 swapped (test_moved_cables_...): the lab from then on.
SWAPPED = [[4, 1], [1, 2], [2, 3], [3, 4]]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabHandle, Path]]:
    """A 4-host ring with Slurm (slurmctld on node1) whose hosts run systemd-networkd, converged by setup.yml. A
    recabled port keeps the configuration its host has for it (meshkit's networkd files), as a real port does."""
    handle = new_lab(tag="g", lab_size=4, lab_shape="ring", lab_slurm=True, lab_network_daemon="networkd")
    artifacts = tmp_path_factory.mktemp("lifecycle-artifacts")
    try:
        built = handle.up()
        assert built.rc == 0, built.output
        run = setup(handle, artifacts)
        assert run.rc == 0, run.output
        yield handle, artifacts
    finally:
        drop_lab(handle)


def setup(handle: LabHandle, artifacts: Path, *extra: str) -> Any:
    inventory = str(handle.inventory)
    return run_playbook("setup.yml", "-e", f"meshkit_artifacts_dir={artifacts}", *extra, inventory=inventory)


def flat(text: str) -> str:
    """Output with the YAML callback's folded lines joined again."""
    return " ".join(text.split())


def plan_of(artifacts: Path) -> dict[str, Any]:
    return json.loads((artifacts / "plan.json").read_text())


def networks(plan: dict[str, Any]) -> dict[str, str]:
    """Every cable of a plan, named by its ends, with its /30."""
    return {" <-> ".join(sorted(f"{e['host']}:{e['port']}" for e in c["ends"])): c["network"] for c in plan["cables"]}


def addresses(plan: dict[str, Any]) -> set[str]:
    return {e["address"] for c in plan["cables"] for e in c["ends"]}


def per_host(plan: dict[str, Any]) -> dict[str, set[str]]:
    """Every host's planned addresses."""
    return {host: {p["address"] for p in ports} for host, ports in plan["per_host"].items()}


def pool_addresses(handle: LabHandle) -> dict[str, set[str]]:
    """Every host's addresses from the cable pool, as the kernel has them."""
    out: dict[str, set[str]] = {}
    for host, hv in handle.hosts().items():
        out[host] = {
            a["local"]
            for link in ip_json("-n", hv["meshkit_lab_netns"], "addr", "show")
            for a in link.get("addr_info", [])
            if a["family"] == "inet" and ipaddress.IPv4Address(a["local"]) in POOL
        }
    return out


def on_node1(handle: LabHandle, command: str) -> str:
    done = handle.ansible("-m", "ansible.builtin.command", "-a", command, pattern="node1")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split(">>", 1)[1].strip() if ">>" in done.stdout else done.stdout


def sinfo(handle: LabHandle) -> dict[str, str]:
    """{node: state} as slurmctld (on node1) reports it."""
    return dict(line.split() for line in on_node1(handle, "sinfo -h -N -o '%N %t'").splitlines() if line.strip())


def launch(handle: LabHandle, artifacts: Path, hosts: int) -> None:
    """meshccl's all-reduce on every host, one rank each, through launch.yml."""
    _run, summary = launch_allreduce(handle, artifacts, f"g{uuid.uuid4().hex[:10]}")
    assert [(r["rank"], r["state"], r["exit_code"]) for r in summary["ranks"]] == [(r, "ok", 0) for r in range(hosts)]


def test_a_ring_grown_by_a_host_converges_in_one_run_keeping_every_unchanged_cable(lab):
    handle, artifacts = lab
    before = plan_of(artifacts)
    assert sorted(sinfo(handle)) == ["node1", "node2", "node3", "node4"]
    # A job queued before the change: held by its start time, it stays queued through it.
    queued = on_node1(handle, "sbatch --begin=now+1hour -N 1 --wrap true")
    job = re.search(r"Submitted batch job (\d+)", queued)
    assert job, queued

    grown = handle.up(lab_size=5)
    assert grown.rc == 0, grown.output
    assert "added node5" in flat(grown.output), grown.output
    run = setup(handle, artifacts)
    assert run.rc == 0, run.output

    after = plan_of(artifacts)
    assert after["hosts"] == ["node1", "node2", "node3", "node4", "node5"]
    kept = {name: net for name, net in networks(before).items() if name in networks(after)}
    assert sorted(kept) == ["node1:tb0 <-> node2:tb0", "node2:tb1 <-> node3:tb0", "node3:tb1 <-> node4:tb0"]
    for name, net in kept.items():
        assert networks(after)[name] == net, name  # every unchanged cable keeps its /30
    assert set(networks(after)) - set(kept) == {"node4:tb1 <-> node5:tb0", "node1:tb1 <-> node5:tb1"}
    assert re.search(r"cabling changed since the last plan: added [^;]*node5", flat(run.output)), run.output
    # The cable that went (node4:tb1 - node1:tb1): its addresses are on no host; every host holds exactly
    # its planned addresses.
    assert pool_addresses(handle) == per_host(after)

    launch(handle, artifacts, 5)
    assert sinfo(handle).get("node5") == "idle", sinfo(handle)
    state = on_node1(handle, f"squeue -h -j {job.group(1)} -o %T")
    assert state in ("PENDING", "RUNNING", "COMPLETED"), state


def test_the_ring_shrunk_back_to_four_leaves_no_address_of_a_removed_cable_and_slurm_forgets_node5(lab):
    handle, artifacts = lab
    five = plan_of(artifacts)
    shrunk = handle.up(lab_size=4)
    assert shrunk.rc == 0, shrunk.output
    run = setup(handle, artifacts)
    assert run.rc == 0, run.output
    four = plan_of(artifacts)
    assert four["hosts"] == ["node1", "node2", "node3", "node4"]
    # Every host holds exactly its planned addresses; of the removed cables' addresses, those the plan did not
    # give to a new cable are on no host.
    held = pool_addresses(handle)
    assert held == per_host(four)
    gone = {e["address"] for c in five["cables"] if "node5" in {x["host"] for x in c["ends"]} for e in c["ends"]}
    assert gone - addresses(four)
    assert not (gone - addresses(four)) & set().union(*held.values())
    assert sorted(sinfo(handle)) == ["node1", "node2", "node3", "node4"]


def test_moved_cables_are_named_by_check_mode_then_converge_and_a_job_planned_before_is_refused(lab, tmp_path):
    """Plugs moved: --check --diff names the cables removed and added and records nothing; the run converges
    them, keeping the /30 of the cable that stayed; the second run changes nothing and its picture still shows
    the cables that went; `meshkit launch` refuses the job it planned before, naming the change."""
    handle, artifacts = lab
    # `meshkit launch` remembers the plan it checked (its own cache for this test).
    cache = tmp_path / "cache"
    inventory = tmp_path / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "group_vars" / "all.yml").write_text(f"meshkit_artifacts_dir: {artifacts}\n")

    # The same inventory before and after (a recabling changes no host of it), so the launch's remembered
    # checks stay keyed to it.
    (inventory / "lab.yml").write_text(handle.inventory.read_text())

    def meshkit_launch() -> subprocess.CompletedProcess[str]:
        argv = [PYTHON, MESHKIT, "launch", "-i", str(inventory), "-r", "plain", "-n", "1", "-t", "60", "--", "true"]
        env = dict(ENV, MESHKIT_LAUNCH_CACHE=str(cache))
        opts: dict[str, Any] = {"capture_output": True, "text": True, "env": env, "cwd": REPO}
        return subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, **opts)

    first = meshkit_launch()
    assert first.returncode == 0, first.stdout + first.stderr
    before = plan_of(artifacts)

    # The plugs at node1 and node4 swapped: node4:tb0 - node1:tb0 and node3:tb1 - node4:tb1 (still a ring);
    # node2:tb1 - node3:tb0 stays.
    moved = handle.up(lab_size=4, lab_cables=SWAPPED)
    assert moved.rc == 0, moved.output
    removed = {"node1:tb0 <-> node2:tb0", "node3:tb1 <-> node4:tb0", "node1:tb1 <-> node4:tb1"}
    added = {"node1:tb0 <-> node4:tb0", "node1:tb1 <-> node2:tb0", "node3:tb1 <-> node4:tb1"}
    assert set(networks(before)) - {"node2:tb1 <-> node3:tb0"} == removed

    check = setup(handle, artifacts, "--check", "--diff")
    assert check.rc == 0, check.output
    shown = re.search(r"cabling changed since the last plan: added ([^;]*); removed ([^']*)'", flat(check.output))
    assert shown, check.output
    for cable in added:
        assert cable in shown.group(1), (cable, shown.group(0))
    for cable in removed:
        assert cable in shown.group(2), (cable, shown.group(0))
    assert plan_of(artifacts) == before  # --check records no plan

    run = setup(handle, artifacts)
    assert run.rc == 0, run.output
    after = plan_of(artifacts)
    assert set(networks(after)) == added | {"node2:tb1 <-> node3:tb0"}
    assert networks(after)["node2:tb1 <-> node3:tb0"] == networks(before)["node2:tb1 <-> node3:tb0"]
    assert pool_addresses(handle) == per_host(after)
    # The picture draws the cables that went, in red; a second run changes nothing ("Draw the cabling"
    # included: issue 33), keeps that picture and plan.json as they are, and names no change.
    picture = (artifacts / "cabling.dot").read_text()
    gone = {line.split(" [", 1)[0].strip() for line in picture.splitlines() if 'label="gone since last plan"' in line}
    assert gone == {'"node1" -- "node2"', '"node1" -- "node4"', '"node3" -- "node4"'}, picture
    second = setup(handle, artifacts)
    assert second.rc == 0 and second.changed == 0, second.output
    assert "cabling changed since the last plan" not in flat(second.output), second.output
    assert (artifacts / "cabling.dot").read_text() == picture
    assert "gone since last plan" in (artifacts / "cabling.svg").read_text()
    assert plan_of(artifacts) == after

    # The job planned from the plan `meshkit launch` remembered is not started; the change is named, and the
    # launch runs every check again (launch.yml) from the new plan.
    again = meshkit_launch()
    said = flat(again.stdout + again.stderr)
    assert again.returncode == 0, said
    assert "changed since the last full check (setup.yml ran: cables added" in said, said
    assert "the job planned from the old plan is not started; running every check (launch.yml)" in said, said
    for cable in removed:
        assert cable in said.split("cables removed", 1)[1], said


def test_a_replaced_host_follows_the_runbook_and_every_cable_keeps_its_network(lab):
    """docs/runbooks/replace-node.md on node3: a new machine under the same name, in the same ports. Its new
    host key is refused until SSH is re-keyed (ssh-host-keys.md step 4, the fingerprint compared with the
    host's own "console"); then one setup.yml run converges it: every cable keeps its /30, the new machine
    holds its addresses and the plan's hostfiles, Slurm has it idle again, discovery alone changes nothing,
    and meshccl runs on every host."""
    handle, artifacts = lab
    before = plan_of(artifacts)
    node3 = handle.hosts()["node3"]
    old_macs = {link["ifname"]: link["address"] for link in ip_json("-n", node3["meshkit_lab_netns"], "link", "show")}

    replaced = handle.up(lab_size=4, lab_cables=SWAPPED, lab_replace="node3")
    assert replaced.rc == 0, replaced.output
    assert "node3 replaced by a new machine" in flat(replaced.output), replaced.output
    new_macs = {link["ifname"]: link["address"] for link in ip_json("-n", node3["meshkit_lab_netns"], "link", "show")}
    assert all(new_macs[port] != old_macs[port] for port in ("tb0", "tb1")), (old_macs, new_macs)

    # The symptom: strict host-key checking refuses the new machine (nothing connects to it unverified).
    refused = handle.ansible("-m", "ansible.builtin.ping", pattern="node3")
    assert refused.returncode != 0, refused.stdout
    assert "Host key verification failed" in refused.stdout + refused.stderr, refused.stdout + refused.stderr

    # Step 3: the old key out, the new one collected and compared with the one on the host's own disk.
    known, name = handle.dir / "known_hosts", node3["ansible_host"]
    subprocess.run(["ssh-keygen", "-R", name, "-f", str(known)], check=True, capture_output=True, env=ENV)
    scanned = subprocess.run(
        ["ssh-keyscan", "-t", "ed25519", name], check=True, capture_output=True, text=True, env=ENV
    ).stdout
    with known.open("a") as f:
        f.write(scanned)

    def fingerprints(path: Path) -> set[str]:
        out = subprocess.run(["ssh-keygen", "-lf", str(path)], check=True, capture_output=True, text=True, env=ENV)
        return {line.split()[1] for line in out.stdout.splitlines()}

    console = handle.dir / "hosts" / "node3" / "ssh" / "ssh_host_ed25519_key.pub"
    assert fingerprints(console) <= fingerprints(known)
    pinged = handle.ansible("-m", "ansible.builtin.ping", pattern="node3")
    assert pinged.returncode == 0, pinged.stdout + pinged.stderr

    # Step 5: converge. Same names, same ports: no cable changed, every one keeps its /30.
    run = setup(handle, artifacts)
    assert run.rc == 0, run.output
    assert "cabling changed since the last plan" not in flat(run.output), run.output
    after = plan_of(artifacts)
    assert networks(after) == networks(before)
    assert pool_addresses(handle) == per_host(after)
    # Step 8: the new machine has the plan's hostfiles.
    controller = json.loads((artifacts / "hostfiles" / "manifest.json").read_text())["fingerprint"]
    on_host = handle.ansible("-m", "ansible.builtin.command", "-a", "cat /var/lib/meshkit/hostfiles/manifest.json",
                             pattern="node3")  # fmt: skip
    assert on_host.returncode == 0 and controller in on_host.stdout, on_host.stdout
    # Step 7: discovery alone changes nothing.
    discover = setup(handle, artifacts, "--tags", "discover")
    assert discover.rc == 0 and discover.changed == 0, discover.output

    launch(handle, artifacts, 4)
    assert sinfo(handle).get("node3") == "idle", sinfo(handle)


def test_undo_after_a_life_of_changes_takes_everything_away_slurm_too(lab):
    """teardown.yml after the grow, the shrink, the recabling and the replacement. node2 is lost part-way (its
    management link goes down once its cables' addresses are gone): the run stops, naming node2. With node2 back
    the next run finishes: every host's records were taken before its own first change (node5's when it joined,
    node3's new machine's when it was set up), so every port is back in bridge0, no cable address is left,
    Slurm's daemons are gone; a third run changes nothing."""
    handle, _artifacts = lab
    ns2 = handle.hosts()["node2"]["meshkit_lab_netns"]
    cmd = ["ansible-playbook", "teardown.yml", "-i", str(handle.inventory)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while pool_addresses(handle)["node2"] and proc.poll() is None:
            assert time.monotonic() < deadline, "node2's cable addresses never went"
            time.sleep(0.05)
        subprocess.run(["ip", "-n", ns2, "link", "set", "mgmt0", "down"], check=True, env=ENV)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "-n", ns2, "link", "set", "mgmt0", "up"], check=True, env=ENV)
    assert proc.returncode != 0, output
    assert re.search(r"fatal: \[node2\]: UNREACHABLE!", output), output

    deadline = time.monotonic() + 120
    while handle.ansible("-m", "ansible.builtin.ping", pattern="node2").returncode != 0:
        assert time.monotonic() < deadline, "node2 did not come back"
    run = run_playbook("teardown.yml", inventory=str(handle.inventory))
    assert run.rc == 0, run.output
    assert pool_addresses(handle) == {host: set() for host in handle.hosts()}
    for host, hv in handle.hosts().items():
        ns = hv["meshkit_lab_netns"]
        members = sorted(link["ifname"] for link in ip_json("-n", ns, "link", "show", "master", "bridge0"))
        assert members == ["tb0", "tb1"], (host, members)
        daemons = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, check=True, env=ENV
        ).stdout.split()
        names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in daemons if Path(f"/proc/{pid}").exists()}
        assert not names & {"slurmd", "slurmctld", "munged"}, (host, names)
    again = run_playbook("teardown.yml", inventory=str(handle.inventory))
    assert again.rc == 0 and again.changed == 0, again.output
