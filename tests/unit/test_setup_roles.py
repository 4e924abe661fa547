"""setup.yml is a sequence of the collection's roles: every task that reads or changes a host runs inside a role,
every role setup.yml runs is one a user can put in a playbook of their own (argument specs, a README with an
example play, variables prefixed with the role's name), and every role of the collection but the lab is one
setup.yml runs (no second path for the same job)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"
COLLECTION = "meshkit.cluster."
# Tasks that neither read nor change a host: they run on the controller, on values the play already holds.
CONTROLLER_ONLY = {
    "ansible.builtin.debug",
    "ansible.builtin.fail",
    "ansible.builtin.assert",
    "ansible.builtin.set_fact",
}
ROLE_TASKS = {"ansible.builtin.import_role", "ansible.builtin.include_role"}
# Roles that are not steps of converging a cluster.
NOT_SETUP = {"lab"}


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def action(task: dict[str, Any]) -> str:
    keywords = {
        "name", "when", "tags", "vars", "register", "run_once", "delegate_to", "delegate_facts", "become", "loop",
        "loop_control", "changed_when", "failed_when", "check_mode", "any_errors_fatal", "ignore_errors", "no_log",
    }  # fmt: skip
    found = [key for key in task if key not in keywords]
    assert len(found) == 1, f"cannot tell the action of {task}"
    return found[0]


def setup_plays() -> list[dict[str, Any]]:
    return load(REPO / "playbooks" / "setup.yml")


def roles_setup_runs() -> set[str]:
    used: set[str] = set()
    for play in setup_plays():
        for entry in play.get("roles", []):
            name = entry["role"] if isinstance(entry, dict) else entry
            used.add(name)
        for task in play.get("tasks", []) + play.get("pre_tasks", []) + play.get("post_tasks", []):
            if action(task) in ROLE_TASKS:
                used.add(task[action(task)]["name"])
    return used


def test_every_task_of_setup_yml_that_touches_a_host_is_a_role():
    for play in setup_plays():
        for entry in play.get("roles", []):
            name = entry["role"] if isinstance(entry, dict) else entry
            assert name.startswith(COLLECTION), f"setup.yml runs a role from outside the collection: {name}"
        for task in play.get("tasks", []) + play.get("pre_tasks", []) + play.get("post_tasks", []):
            what = action(task)
            assert what in ROLE_TASKS | CONTROLLER_ONLY, (
                f"setup.yml's task {task.get('name')!r} runs {what} itself: a step that reads or changes a host "
                "belongs in one of the collection's roles"
            )
            if what in ROLE_TASKS:
                assert task[what]["name"].startswith(COLLECTION), task


def test_every_role_but_the_lab_is_a_step_of_setup_yml():
    ours = {p.name for p in ROLES.iterdir() if p.is_dir()} - NOT_SETUP
    assert {COLLECTION + name for name in ours} == roles_setup_runs()


@pytest.mark.parametrize("role", sorted(p.name for p in ROLES.iterdir() if p.is_dir() and p.name not in NOT_SETUP))
def test_each_role_works_alone_documented_with_an_example_play(role: str):
    base = ROLES / role
    specs = load(base / "meta" / "argument_specs.yml")["argument_specs"]
    assert "main" in specs, role
    defaults = load(base / "defaults" / "main.yml") or {}
    documented = {name for entry in specs.values() for name in (entry.get("options") or {})}
    for name in defaults:
        assert name.startswith(f"{role}_"), f"{role}: the variable {name} lacks the role's prefix"
        assert name in documented, f"{role}: {name} has a default but no entry in meta/argument_specs.yml"
    for entry in specs.values():
        for name, option in (entry.get("options") or {}).items():
            assert name.startswith(f"{role}_"), f"{role}: option {name} lacks the role's prefix"
            if "default" in option:
                assert option["default"] == defaults.get(name), f"{role}: {name}'s spec default differs from defaults/"
    readme = (base / "README.md").read_text()
    plays = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    assert plays, f"{role}: README.md has no example play"
    play = yaml.safe_load(plays[0])
    assert isinstance(play, list) and ("hosts" in play[0] or "ansible.builtin.include_role" in play[0]), role
    assert f"meshkit.cluster.{role}" in plays[0], f"{role}: the first example does not use the role"
