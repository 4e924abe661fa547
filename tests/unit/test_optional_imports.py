"""Third-party imports in module_utils are guarded (ansible-test's import sanity test loads every
module and module_utils file without them): the file still imports, and the module that needs the
library fails saying which one is missing, instead of a traceback at import."""

from __future__ import annotations

import importlib
import sys

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import topology
from ansible_collections.meshkit.cluster.plugins.modules import cabling_plan

from .module_harness import patch_exits, run_module


@pytest.fixture
def without_networkx(monkeypatch):
    """Fresh copies of topology and cabling_plan, imported on a Python without networkx; the
    modules every other test uses are left as they are (and back in sys.modules afterwards)."""
    monkeypatch.setitem(sys.modules, "networkx", None)  # "import networkx" raises ImportError
    for loaded in (topology, cabling_plan):
        package, _dot, name = loaded.__name__.rpartition(".")
        monkeypatch.delitem(sys.modules, loaded.__name__)
        monkeypatch.setattr(sys.modules[package], name, loaded)  # restored after the fresh import
    return importlib.import_module(topology.__name__), importlib.import_module(cabling_plan.__name__)


def test_topology_imports_without_networkx(without_networkx):
    bare, _module = without_networkx
    assert not bare.HAS_NETWORKX
    assert "import networkx" in bare.NETWORKX_IMPORT_ERROR
    assert bare is not topology and topology.HAS_NETWORKX


def test_cabling_plan_names_the_missing_library(without_networkx, monkeypatch, tmp_path):
    _bare, module = without_networkx
    patch_exits(monkeypatch)
    args = {"discovery": {"node1": []}, "pool": "198.18.128.0/17", "record": str(tmp_path / "plan.json")}
    ok, result = run_module(module, args)
    assert not ok
    assert "Failed to import the required Python library (networkx)" in result["msg"]
    assert "import networkx" in result["exception"]
    assert not (tmp_path / "plan.json").exists()


def test_with_networkx_the_plan_is_made():
    assert topology.HAS_NETWORKX and topology.NETWORKX_IMPORT_ERROR is None
