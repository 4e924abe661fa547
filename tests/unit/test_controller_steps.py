"""The controller's steps (meshkit/cabling_plan.py, cabling_picture.py, meshccl_wheel.py, lab.py) as
their action plugins run them in ansible-playbook's Python: the arguments each takes are the ones
its module file documents, check mode writes nothing, and after a recabling the next run changes
nothing while the picture still shows what the recabling removed (issue 33)."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.meshkit.cluster.plugins.action import cabling_picture as picture_action
from ansible_collections.meshkit.cluster.plugins.action import cabling_plan as plan_action
from ansible_collections.meshkit.cluster.plugins.module_utils.hostfiles import fingerprint
from ansible_collections.meshkit.cluster.plugins.plugin_utils.controller import ControllerStep

from meshkit import cabling_picture, cabling_plan, lab, meshccl_wheel, watch

from .module_harness import run_action

REPO = Path(__file__).resolve().parents[2]
STEPS = {
    "cabling_plan": cabling_plan,
    "cabling_picture": cabling_picture,
    "meshccl_wheel": meshccl_wheel,
    "lab": lab,
    "watch": watch,
}
POOL = "198.18.128.0/17"


def documented_options(name: str) -> dict[str, Any]:
    text = (REPO / "plugins" / "modules" / f"{name}.py").read_text()
    start = text.index('DOCUMENTATION = r"""') + len('DOCUMENTATION = r"""')
    return yaml.safe_load(text[start : text.index('"""', start)])["options"]


@pytest.mark.parametrize("name", sorted(STEPS))
def test_each_step_takes_the_options_its_module_documents(name):
    action = importlib.import_module(f"ansible_collections.meshkit.cluster.plugins.action.{name}").ActionModule
    assert issubclass(action, ControllerStep)
    assert f"meshkit.{name}" == action.STEP
    spec, docs = STEPS[name].ARGUMENT_SPEC, documented_options(name)
    assert sorted(spec) == sorted(docs)
    for option, given in spec.items():
        doc = docs[option]
        for key in ("type", "elements", "choices"):
            assert given.get(key) == doc.get(key), (option, key)
        assert bool(given.get("required")) == bool(doc.get("required")), option
        assert given.get("default") == doc.get("default"), option


def port(host: str, name: str, peer: str | None) -> dict[str, Any]:
    return {"port": name, "ident": f"{host}-{name}", "seen": [peer] if peer else [], "up": True}


def discovery(cables: list[tuple[str, str]]) -> dict[str, list[dict[str, Any]]]:
    """What discover reports for cables ("node1:tb0", "node2:tb0") on hosts node1 to node4."""
    found: dict[str, list[dict[str, Any]]] = {f"node{i}": [] for i in range(1, 5)}
    for a, b in cables:
        (ha, pa), (hb, pb) = a.split(":"), b.split(":")
        found[ha].append(port(ha, pa, f"{hb}-{pb}"))
        found[hb].append(port(hb, pb, f"{ha}-{pa}"))
    return found


RING = [("node1:tb0", "node2:tb0"), ("node2:tb1", "node3:tb0"), ("node3:tb1", "node4:tb0"), ("node4:tb1", "node1:tb1")]
# node3 <-> node4 moved: node3's tb1 now goes to node1's tb2.
MOVED = [*RING[:2], ("node1:tb2", "node3:tb1"), RING[3]]


def setup_run(found: dict[str, Any], dest: Path, check: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """setup.yml's two controller steps, as setup.yml calls them: the plan, then the picture."""
    ok, planned = run_action(plan_action, {"discovery": found, "pool": POOL, "record": str(dest / "plan.json")}, check)
    assert ok, planned
    args = {"plan": planned["plan"], "dest": str(dest), "title": "lab", "removed": planned["changes"]["removed"]}
    if not shutil.which("dot"):
        args["formats"] = []
    ok, drawn = run_action(picture_action, args, check)
    assert ok, drawn
    return planned, drawn


def test_after_a_recabling_the_next_run_changes_nothing_and_still_shows_what_was_removed(tmp_path):
    first, _ = setup_run(discovery(RING), tmp_path)
    again, drawn = setup_run(discovery(RING), tmp_path)
    assert first["changed"] and not again["changed"] and not drawn["changed"]
    assert "removed" not in again["plan"] and 'label="gone since last plan"' not in drawn["dot"]

    recabled, drawn = setup_run(discovery(MOVED), tmp_path)
    gone = ["node3:tb1 <-> node4:tb0"]
    assert recabled["changed"] and drawn["changed"]
    assert recabled["changes"]["removed"] == gone and recabled["changes"]["added"] == ["node1:tb2 <-> node3:tb1"]
    assert recabled["plan"]["removed"] == gone
    assert json.loads((tmp_path / "plan.json").read_text())["removed"] == gone
    picture = (tmp_path / "cabling.dot").read_text()
    (line,) = [e for e in picture.splitlines() if 'label="gone since last plan"' in e]
    assert line.strip().startswith('"node3" -- "node4"') and 'taillabel="tb1"' in line

    # The run after: the cabling is as recorded, nothing changes, the picture is the same.
    after, drawn = setup_run(discovery(MOVED), tmp_path)
    assert after["changes"]["removed"] == [] and after["changes"]["added"] == []
    assert not after["changed"] and not drawn["changed"], (after.get("diff"), drawn)
    assert after["plan"]["removed"] == gone and (tmp_path / "cabling.dot").read_text() == picture

    # The removed cables are explanations: the fingerprint (and so every hostfile) does not cover them.
    plain = {k: v for k, v in after["plan"].items() if k != "removed"}
    assert fingerprint(plain) == after["plan"]["fingerprint"]

    # The next cabling change replaces them: the cable moved back, the moved one is gone now; then a
    # cable added and none removed, and nothing is drawn as gone any more.
    back, drawn = setup_run(discovery(RING), tmp_path)
    assert (
        back["changed"]
        and back["changes"]["added"] == gone
        and back["plan"]["removed"] == [MOVED[2][0] + " <-> " + MOVED[2][1]]
    )
    (line,) = [e for e in drawn["dot"].splitlines() if 'label="gone since last plan"' in e]
    assert line.strip().startswith('"node1" -- "node3"')
    added, drawn = setup_run(discovery([*RING, ("node2:tb2", "node4:tb2")]), tmp_path)
    assert added["changed"] and added["changes"]["removed"] == [] and "removed" not in added["plan"]
    assert 'label="gone since last plan"' not in drawn["dot"] and drawn["changed"]


def test_check_mode_writes_neither_the_plan_nor_the_picture(tmp_path):
    planned, drawn = setup_run(discovery(RING), tmp_path, check=True)
    assert planned["changed"] and drawn["changed"]
    assert planned["diff"]["before"] == "" and json.loads(planned["diff"]["after"]) == planned["plan"]
    assert list(tmp_path.iterdir()) == []


def test_a_bad_argument_fails_as_a_module_did(tmp_path):
    ok, out = run_action(plan_action, {"discovery": {}, "pool": POOL, "record": str(tmp_path / "p"), "backend": "rung"})
    assert not ok and out["msg"] == "value of backend must be one of: , ring, jaccl, jaccl-ring, got: rung"
    ok, out = run_action(plan_action, {"discovery": {}, "pool": POOL})
    assert not ok and out["msg"] == "missing required arguments: record"
    ok, out = run_action(plan_action, {"discovery": {}, "pool": POOL, "record": str(tmp_path / "p"), "rdma": "maybe"})
    assert not ok and "The value 'maybe' is not a valid boolean" in out["msg"]
    ok, out = run_action(picture_action, {"plan": {}, "dest": str(tmp_path), "colour": "red"})
    assert not ok
    assert out["msg"].startswith("Unsupported parameters for (meshkit.cluster.cabling_picture) module: colour.")
