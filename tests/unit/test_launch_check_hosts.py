"""launch.yml's preflight inside the launch action (check_hosts): every host checks itself over the
connection its ranks then use, and nothing starts unless every host passes; in check mode too. Three
local "hosts" through Ansible itself."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml

from .test_launch_secrets import ENV, HOSTS, plan_of_ring

PLAYBOOK = """
- name: Plan and launch a job, every host checked first
  hosts: cluster
  gather_facts: false
  tasks:
    - name: Plan the job
      meshkit.cluster.launch_plan:
        plan: "{{ lookup('ansible.builtin.file', plan_file) | from_json }}"
        settings:
          program: "{{ program }}"
          runtime: plain
        job_id: "{{ job_id }}"
        state_dir: "{{ state_dir }}"
        cluster: c
        master_port: 29500
        meshccl_port: 29600
        dest: "{{ dest }}"
      run_once: true
      delegate_to: localhost
      register: planned

    - name: Check every host's preflight, start every rank
      meshkit.cluster.launch:
        job: "{{ planned.job }}"
        check_hosts: true
      run_once: true
      delegate_to: localhost
      register: launched

    - name: Say what happened
      ansible.builtin.debug:
        msg: "{{ launched.msg }}"
      run_once: true
"""


def run(tmp_path: Path, program: list[str], *extra: str) -> tuple[subprocess.CompletedProcess[str], str, Path]:
    (tmp_path / "plan.json").write_text(json.dumps(plan_of_ring()))
    (tmp_path / "launch.yml").write_text(PLAYBOOK)
    inventory = {
        "all": {
            "children": {"cluster": {"hosts": {host: {} for host in HOSTS}}},
            "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        }
    }
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inventory))
    job_id = f"pf-{uuid.uuid4().hex[:8]}"
    given: dict[str, Any] = {
        "plan_file": str(tmp_path / "plan.json"),
        "program": program,
        "job_id": job_id,
        "state_dir": str(tmp_path / "state"),
        "dest": str(tmp_path / "artifacts" / "launch"),
    }
    (tmp_path / "vars.json").write_text(json.dumps(given))
    done = subprocess.run(
        ["ansible-playbook", "-i", str(tmp_path / "inventory.yml"), "-e", f"@{tmp_path / 'vars.json'}", *extra,
         str(tmp_path / "launch.yml")],
        capture_output=True, text=True, env=ENV, cwd=tmp_path, check=False, stdin=subprocess.DEVNULL, timeout=300,
    )  # fmt: skip
    return done, job_id, tmp_path / "artifacts" / "launch" / job_id


def test_a_program_missing_everywhere_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-program")
    done, job_id, logs = run(tmp_path, [missing])
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert f"preflight failed; no rank of job {job_id} was started:" in out, out
    for host in HOSTS:
        assert f"{host}: program {missing} not found, or not executable" in out, out
    assert not (logs / "summary.json").exists() and not (tmp_path / "state" / "jobs").exists()


def test_check_mode_runs_the_preflight_and_starts_nothing(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-program")
    refused, job_id, _logs = run(tmp_path, [missing], "--check")
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0 and f"preflight failed; no rank of job {job_id} was started:" in out, out
    passed, job_id, logs = run(tmp_path, ["sh", "-c", "echo never"], "--check")
    out = passed.stdout + passed.stderr
    assert passed.returncode == 0 and f"check mode: job {job_id} would start 3 ranks" in out, out
    assert "never" not in out.replace("echo never", "") and not logs.exists()


def test_every_host_passing_starts_the_job_over_the_same_connections(tmp_path: Path) -> None:
    done, _job_id, logs = run(tmp_path, ["sh", "-c", 'echo "hello $MESHKIT_RANK"'])
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["ok"] and [r["last_lines"] for r in summary["ranks"]] == [[f"hello {r}"] for r in range(3)]
