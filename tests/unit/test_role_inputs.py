"""Roles used on their own (not through setup.yml): an input that only the plan can give is
required, and a role run without it stops at its argument check, before any task runs. (The roles that
take the plan by default from the plan role refuse in a task of their own, after the read-only
preflight: tests/integration/test_roles.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = dict(
    os.environ,
    PATH=f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}",
    ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
    ANSIBLE_NOCOLOR="1",
)


@pytest.mark.parametrize(
    ("role", "missing"),
    [
        ("slurm", "slurm_controller, slurm_plan"),
    ],
)
def test_a_role_without_the_plan_refuses_before_any_task(tmp_path: Path, role: str, missing: str) -> None:
    playbook = tmp_path / "alone.yml"
    playbook.write_text(
        "- name: The role alone, with its defaults\n"
        "  hosts: localhost\n"
        "  connection: local\n"
        "  gather_facts: false\n"
        "  roles:\n"
        f"    - meshkit.cluster.{role}\n"
    )
    run = subprocess.run(
        ["ansible-playbook", "-i", "localhost,", str(playbook)],
        capture_output=True, text=True, env=ENV, cwd=REPO, check=False,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert f"missing required arguments: {missing}" in out, out
    # The argument check is the only task that ran: nothing was changed, nothing was probed.
    assert [line for line in out.splitlines() if line.startswith("TASK [")] == [
        line for line in out.splitlines() if line.startswith(f"TASK [meshkit.cluster.{role} : Validating arguments")
    ], out
    assert out.count("TASK [") == 1 and "ok=0" in out and "changed=0" in out, out
