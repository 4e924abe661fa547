"""Imports that may be missing on the controller are guarded: networkx (the planner names it when it
plans), and the meshkit package itself (every action plugin still imports - ansible-test's import
sanity test loads them without it - and a task run without it fails saying to pip install meshkit)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from ansible.errors import AnsibleError
from ansible_collections.meshkit.cluster.plugins.action import cabling_plan as cabling_plan_action
from ansible_collections.meshkit.cluster.plugins.action import check_report as check_report_action

from meshkit import cabling_plan, topology

from .module_harness import run_action

ACTIONS = Path(__file__).resolve().parents[2] / "plugins" / "action"


def fresh(monkeypatch: pytest.MonkeyPatch, *loaded):
    """Fresh copies of the modules ``loaded``, imported now; the ones every other test uses are
    back in sys.modules (and as their packages' attributes) afterwards."""
    for module in loaded:
        package, _dot, name = module.__name__.rpartition(".")
        monkeypatch.delitem(sys.modules, module.__name__)
        monkeypatch.setattr(sys.modules[package], name, module)  # restored after the fresh import
    return [importlib.import_module(module.__name__) for module in loaded]


@pytest.fixture
def without_networkx(monkeypatch):
    """Fresh copies of topology and cabling_plan, imported on a Python without networkx."""
    monkeypatch.setitem(sys.modules, "networkx", None)  # "import networkx" raises ImportError
    return fresh(monkeypatch, topology, cabling_plan)


def test_topology_imports_without_networkx(without_networkx):
    bare, _step = without_networkx
    assert not bare.HAS_NETWORKX
    assert "import networkx" in bare.NETWORKX_IMPORT_ERROR
    assert bare is not topology and topology.HAS_NETWORKX


def test_cabling_plan_names_the_missing_library(without_networkx, tmp_path):
    args = {"discovery": {"node1": []}, "pool": "198.18.128.0/17", "record": str(tmp_path / "plan.json")}
    ok, result = run_action(cabling_plan_action, args)
    assert not ok
    assert "Failed to import the required Python library (networkx)" in result["msg"]
    assert "import networkx" in result["exception"]
    assert not (tmp_path / "plan.json").exists()


def test_with_networkx_the_plan_is_made():
    assert topology.HAS_NETWORKX and topology.NETWORKX_IMPORT_ERROR is None


@pytest.mark.parametrize("plugin", sorted(p.stem for p in ACTIONS.glob("*.py")))
def test_every_action_plugin_imports_without_the_meshkit_package(monkeypatch, plugin):
    for name in [m for m in sys.modules if m == "meshkit" or m.startswith("meshkit.")]:
        monkeypatch.setitem(sys.modules, name, None)  # "import meshkit..." raises ImportError
    monkeypatch.setitem(sys.modules, "meshkit", None)
    module = importlib.import_module(f"ansible_collections.meshkit.cluster.plugins.action.{plugin}")
    (bare,) = fresh(monkeypatch, module)
    assert bare.ActionModule


def test_a_step_without_the_meshkit_package_says_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "meshkit.cabling_plan", None)
    args = {"discovery": {"node1": []}, "pool": "198.18.128.0/17", "record": str(tmp_path / "plan.json")}
    with pytest.raises(AnsibleError) as info:
        run_action(cabling_plan_action, args)
    assert str(info.value).startswith(
        "meshkit.cluster's cabling_plan runs on the controller with the meshkit Python package, which this Python "
        "cannot import (import of meshkit.cabling_plan halted; None in sys.modules); "
    ), info.value
    assert str(info.value).endswith("install it where ansible-playbook runs: pip install meshkit")
    assert not (tmp_path / "plan.json").exists()


def test_an_action_importing_meshkit_says_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "meshkit.check_report", None)
    monkeypatch.delattr(sys.modules["meshkit"], "check_report")
    (bare,) = fresh(monkeypatch, check_report_action)
    assert isinstance(bare.MESHKIT.error, ImportError)
    args = {"plan": {}, "log_dir": str(tmp_path), "dest": str(tmp_path)}
    with pytest.raises(
        AnsibleError, match=r"meshkit.cluster's check_report runs on the controller .* pip install meshkit"
    ):
        run_action(bare, args)
    assert list(tmp_path.iterdir()) == []
