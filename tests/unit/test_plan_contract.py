"""plan.json, the contract from setup to launch (meshkit/plan_contract.py): sealed,
validated on load, checked against the live cabling; and an RDMA plan made from recorded RDMA
facts (a Mac's rdma_ctl / ibv_devinfo output, tests/fixtures/rdma) launched through launch.yml's
planning step: meshkit.cluster.plan_verify, then meshkit.cluster.launch_plan."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import hostfiles, rdma

from meshkit import plan_contract
from meshkit.topology import Observation, build_plan
from tests.unit.test_rdma import REC, transcript

REPO = Path(__file__).resolve().parents[2]
ENV = dict(
    os.environ,
    PATH=f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}",
    ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
    ANSIBLE_NOCOLOR="1",
)
SSH = {"mac1": "mac1.example", "mac2": "mac2.example"}


def discovery() -> dict[str, list[dict[str, Any]]]:
    """Two Macs, one Thunderbolt cable en2 <-> en2, as discover reports it."""
    return {
        "mac1": [{"port": "en2", "ident": "AA:01", "seen": ["aa:02"], "up": True, "rdma": "rdma_en2"}],
        "mac2": [{"port": "en2", "ident": "AA:02", "seen": ["aa:01"], "up": True, "rdma": "rdma_en2"}],
    }


@pytest.fixture
def jaccl_ring() -> dict[str, Any]:
    """A jaccl-ring plan whose RDMA facts come from a real Mac's recorded output."""
    rec = transcript(REC / "macos_ibv_devinfo_v_rdma_en2_gid_table_tn3205_ABRIDGED.txt", ["ibv_devinfo -d rdma_en2 -v"])
    ports = rdma.parse_ibv_devinfo(rec["ibv_devinfo -d rdma_en2 -v"])
    facts = rdma.host_facts("Darwin", ports, ["en2"], True, ["rdma_en2", "rdma_en3", "rdma_en4"])
    assert facts["ports"]["en2"]["usable"] is True
    found = discovery()
    obs = [Observation(h, p["port"], p["ident"], p["seen"]) for h, ps in found.items() for p in ps]
    plan = build_plan(list(found), obs, "198.18.128.0/17", "jaccl-ring", {h: facts["ports"] for h in found})
    return plan_contract.seal(plan.as_dict(), found)


def test_a_sealed_plan_loads_and_names_its_ends(jaccl_ring: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(jaccl_ring))
    plan = plan_contract.load(str(path))
    assert (plan["format"], plan["version"], plan["backend"]) == ("meshkit-plan", 2, "jaccl-ring")
    assert [e["ident"] for e in plan["cables"][0]["ends"]] == ["AA:01", "AA:02"]
    assert [e["rdma"] for e in plan["cables"][0]["ends"]] == ["rdma_en2", "rdma_en2"]
    assert plan_contract.live_differences(plan, discovery()) == []


def test_the_fingerprint_covers_the_backend_and_the_hostfiles_carry_it(jaccl_ring: dict[str, Any]) -> None:
    ring = dict(jaccl_ring, backend="ring")
    assert plan_contract.fingerprint(ring) != plan_contract.fingerprint(jaccl_ring)
    files, _ = hostfiles.render(jaccl_ring, SSH, {}, "macs")
    manifest = json.loads(files["manifest.json"])
    assert manifest["fingerprint"] == jaccl_ring["fingerprint"] and manifest["backend"] == "jaccl-ring"


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda p: p.update(version=1), "version 1 was written by an older meshkit (this one reads version 2)"),
        (lambda p: p.update(version=3), "version 3 was written by another meshkit"),
        (lambda p: p.pop("format"), "format None is not 'meshkit-plan'"),
        (lambda p: p.update(backend="jaccl"), "fingerprint: is 'sha256:"),
        (lambda p: p.update(backend="rdma"), "backend: 'rdma' is not one of"),
        (lambda p: p["cables"][0]["ends"][1].update(host="mac9"), "cables[0].ends[1].host: 'mac9' is not in hosts"),
        (lambda p: p.update(hosts=[]), "hosts: must be a non-empty list"),
    ],
)
def test_a_plan_this_meshkit_cannot_launch_from_is_refused_by_field(
    jaccl_ring: dict[str, Any], tmp_path: Path, edit: Any, says: str
) -> None:
    edit(jaccl_ring)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(jaccl_ring))
    with pytest.raises(plan_contract.PlanError) as caught:
        plan_contract.load(str(path))
    assert str(caught.value).startswith(f"{path}: "), caught.value
    assert says in str(caught.value), caught.value


def test_no_plan_or_no_json_says_to_run_setup(tmp_path: Path) -> None:
    with pytest.raises(plan_contract.PlanError) as missing:
        plan_contract.load(str(tmp_path / "plan.json"))
    assert str(missing.value).endswith("no plan; run setup.yml on this inventory first")
    (tmp_path / "plan.json").write_text("{")
    with pytest.raises(plan_contract.PlanError) as broken:
        plan_contract.load(str(tmp_path / "plan.json"))
    assert "not JSON" in str(broken.value) and str(broken.value).endswith("run setup.yml to plan again")


def test_live_differences_name_the_cable_and_what_its_end_reports(jaccl_ring: dict[str, Any]) -> None:
    cable = "mac1:en2 <-> mac2:en2"
    down = discovery()
    down["mac2"][0]["up"] = False
    assert plan_contract.live_differences(jaccl_ring, down) == [f"{cable}: mac2:en2 is down"]
    gone = discovery()
    gone["mac1"] = []
    assert plan_contract.live_differences(jaccl_ring, gone) == [f"{cable}: mac1:en2 is gone (no such port now)"]
    bridged = discovery()
    bridged["mac1"][0]["in_bridge"] = "bridge0"
    assert plan_contract.live_differences(jaccl_ring, bridged) == [f"{cable}: mac1:en2 is in bridge0 again"]
    replaced = discovery()
    replaced["mac2"][0]["ident"] = "AA:99"
    replaced["mac1"][0]["seen"] = ["aa:99"]
    # A replaced adapter (or Thunderbolt controller): the end with the new identity is named once.
    assert plan_contract.live_differences(jaccl_ring, replaced) == [
        f"{cable}: mac2:en2 is now AA:99, the plan has AA:02 (replaced?)"
    ]
    crossed = discovery()
    crossed["mac1"][0]["seen"] = ["aa:55"]
    assert plan_contract.live_differences(jaccl_ring, crossed) == [f"{cable}: mac1:en2 sees aa:55 instead of mac2:en2"]
    silent = discovery()
    silent["mac2"][0]["seen"] = []
    assert plan_contract.live_differences(jaccl_ring, silent) == [f"{cable}: mac2:en2 sees no peer instead of mac1:en2"]
    moved = discovery()
    moved["mac1"].append({"port": "en3", "ident": "AA:03", "seen": ["aa:04"], "up": True})
    moved["mac2"].append({"port": "en3", "ident": "AA:04", "seen": ["aa:03"], "up": True})
    assert plan_contract.live_differences(jaccl_ring, moved) == [
        "mac1:en3 <-> mac2:en3: a cable the plan does not have",
        "mac2:en3 <-> mac1:en3: a cable the plan does not have",
    ]


def launch_planning(
    tmp_path: Path, plan: dict[str, Any], manifests_from: dict[str, Any]
) -> subprocess.CompletedProcess:
    """launch.yml's planning step on the controller: the plan loaded and checked against the
    discovery (plan_verify), then the job planned from it (launch_plan), with the arguments
    launch.yml gives them."""
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    files, _ = hostfiles.render(manifests_from, SSH, {}, "macs")
    variables = {
        "discovery": discovery(),
        "manifests": dict.fromkeys(SSH, files["manifest.json"]),
        "record": str(tmp_path / "plan.json"),
        "dest": str(tmp_path / "launch"),
    }
    (tmp_path / "vars.json").write_text(json.dumps(variables))
    playbook = tmp_path / "planning.yml"
    playbook.write_text(
        """- name: launch.yml's planning step
  hosts: localhost
  connection: local
  gather_facts: false
  vars:
    ansible_python_interpreter: "{{ ansible_playbook_python }}"
  tasks:
    - name: Load setup.yml's plan and check the cabling against it
      meshkit.cluster.plan_verify:
        record: "{{ record }}"
        discovery: "{{ discovery }}"
      register: meshkit_planned
    - name: Plan the job
      meshkit.cluster.launch_plan:
        plan: "{{ meshkit_planned.plan }}"
        settings: {program: [python3, /shared/train.py], runtime: mlx, ranks_per_host: 1}
        job_id: j1
        state_dir: /var/lib/meshkit
        cluster: macs
        ssh: {mac1: mac1.example, mac2: mac2.example}
        manifests: "{{ manifests }}"
        torch_env: {}
        management_interface: {mac1: en0, mac2: en0}
        master_port: 29500
        meshccl_port: 29600
        bin_dirs: {}
        dest: "{{ dest }}"
      register: meshkit_job
    - name: Show the job
      ansible.builtin.copy:
        content: "{{ meshkit_job.job | to_json }}"
        dest: "{{ dest }}/job-as-planned.json"
        mode: "0600"
"""
    )
    return subprocess.run(
        ["ansible-playbook", "-i", "localhost,", "-e", f"@{tmp_path / 'vars.json'}", str(playbook)],
        capture_output=True, text=True, env=ENV, cwd=REPO, check=False,
    )  # fmt: skip


def test_a_jaccl_ring_plan_goes_through_launch_planning_to_the_jaccl_environment(
    jaccl_ring: dict[str, Any], tmp_path: Path
) -> None:
    run = launch_planning(tmp_path, jaccl_ring, jaccl_ring)
    assert run.returncode == 0, run.stdout + run.stderr
    job = json.loads((tmp_path / "launch" / "job-as-planned.json").read_text())
    assert job["runtime"] == "mlx" and job["world_size"] == 2
    devices = [[None, "rdma_en2"], ["rdma_en2", None]]  # MLX's JACCL device matrix, from the recorded facts
    for rank, host in enumerate(["mac1", "mac2"]):
        env = job["ranks"][rank]["env"]
        assert (env["MLX_RANK"], env["MLX_WORLD_SIZE"]) == (str(rank), "2")
        assert env["MLX_IBV_DEVICES"] == "/var/lib/meshkit/jobs/j1/mlx-ibv-devices.json"
        assert env["MLX_JACCL_COORDINATOR"] == "mac1.example:32323"
        assert "MLX_HOSTFILE" not in env
        assert json.loads(job["files"][host]["mlx-ibv-devices.json"]) == devices
    assert job["ports"]["mac1"] == [["0.0.0.0", 32323, "JACCL coordinator"]]


def test_hostfiles_made_for_another_backend_stop_launch_planning(jaccl_ring: dict[str, Any], tmp_path: Path) -> None:
    ring = plan_contract.seal({k: v for k, v in jaccl_ring.items() if k != "fingerprint"} | {"backend": "ring"}, {})
    run = launch_planning(tmp_path, jaccl_ring, ring)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "hostfiles are stale; nothing was started" in out, out
    assert "were made for backend 'ring' and the plan says 'jaccl-ring'; run setup.yml" in out, out
    assert not (tmp_path / "launch" / "job-as-planned.json").exists()


def test_a_cable_unlike_the_plan_stops_launch_planning(jaccl_ring: dict[str, Any], tmp_path: Path) -> None:
    changed = dict(jaccl_ring)
    changed["cables"] = json.loads(json.dumps(jaccl_ring["cables"]))
    changed["cables"][0]["ends"][1]["ident"] = "AA:77"
    changed = plan_contract.seal({k: v for k, v in changed.items() if k != "fingerprint"}, {})
    run = launch_planning(tmp_path, changed, changed)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "the cabling differs from the plan setup.yml made; run setup.yml, then launch again" in out, out
    assert "mac1:en2 <-> mac2:en2: mac2:en2 is now AA:02, the plan has AA:77 (replaced?)" in out, out
    assert not (tmp_path / "launch" / "job-as-planned.json").exists()
