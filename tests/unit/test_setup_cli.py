"""`meshkit setup -i INV [--undo] [ansible-playbook options]`: which of the collection's playbooks runs, with
what inventory and command line (ansible_runner is replaced by a recorder; the lab tests run the real thing)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from meshkit import cli


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    def run(**kwargs: Any) -> SimpleNamespace:
        seen.append(kwargs)
        return SimpleNamespace(rc=0)

    monkeypatch.setitem(sys.modules, "ansible_runner", SimpleNamespace(run=run))
    return seen


def test_setup_runs_the_setup_playbook_with_ansible_playbooks_own_options(runs, tmp_path: Path) -> None:
    inventory = tmp_path / "inv.yml"
    assert cli.main(["setup", "-i", str(inventory), "--", "--check", "--diff"]) == 0
    assert runs[0]["playbook"] == "meshkit.cluster.setup"
    assert runs[0]["inventory"] == str(inventory.resolve())
    assert runs[0]["cmdline"] == "--check --diff"


def test_setup_undo_runs_the_teardown_playbook(runs, tmp_path: Path) -> None:
    inventory = tmp_path / "inv.yml"
    assert cli.main(["setup", "-i", str(inventory), "--undo", "-e", "teardown_own_only=true"]) == 0
    assert runs[0]["playbook"] == "meshkit.cluster.teardown"
    assert runs[0]["cmdline"] == "-e teardown_own_only=true"


def test_the_teardown_playbook_exists_where_the_collection_name_points() -> None:
    root = Path(__file__).resolve().parents[2]
    assert (root / "playbooks" / "teardown.yml").is_file()
    assert "meshkit.cluster.teardown" in (root / "teardown.yml").read_text()
