"""`meshkit launch` without Ansible in front: the cache key over the inventory's files, ansible.cfg,
the runtime and ANSIBLE_* settings; the remembered context saved and loaded; the checks each host
runs (check_specs) and what their answers say against the plan (stale_reasons); and the checks run
for real over a local connection."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import hostfiles

from meshkit import launch_fast, launch_plan

from .test_hostfiles import plan_of

Stale = launch_fast.Stale
HOSTS = ["node1", "node2", "node3"]
# A triangle: node1:tb0 .1 <-> node2:tb0 .2, node1:tb1 .5 <-> node3:tb1 .6, node2:tb1 .9 <-> node3:tb0 .10
PLAN = plan_of([(1, 2), (2, 3), (3, 1)], 3)
TORCH_ENV = {"node1": "NCCL_SOCKET_IFNAME==tb0,tb1\n", "node3": "NCCL_IB_DISABLE=1\n"}  # node2 has none
INPUTS = {
    "state_dir": "/var/lib/meshkit",
    "cluster": "c",
    "ssh": {h: f"10.9.0.{i}" for i, h in enumerate(HOSTS, 1)},
    "torch_env": TORCH_ENV,
    "management_interface": dict.fromkeys(HOSTS, "mgmt0"),
}
CONFIG = {"node1": {"meshkit_meshccl_venv": "/opt/meshccl", "meshkit_peer_ports": ["tb*"]}, "node2": {}}


def sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def context_for(meshccl: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "plan": copy.deepcopy(PLAN),
        "inputs": copy.deepcopy(INPUTS),
        "meshccl": {"build": "abc"} if meshccl is None else meshccl,
        "config": copy.deepcopy(CONFIG),
    }


def job_for(runtime: str = "meshccl") -> dict[str, Any]:
    settings = launch_plan.validate({"program": "python3 /shared/train.py", "runtime": runtime})
    return launch_plan.make_job(PLAN, settings, INPUTS, job_id="job-1")


def specs_for(runtime: str = "meshccl", context: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    return launch_fast.check_specs(job_for(runtime), context or context_for())


def mac(host: str, port: str) -> str:
    return f"02:00:00:00:0{host[-1]}:0{port[-1]}"


def good_answers(specs: dict[str, dict[str, Any]], context: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What every host answers when everything the context rests on still holds."""
    fp = hostfiles.fingerprint(context["plan"])
    answers = {}
    for host, spec in specs.items():
        planned = context["inputs"]["torch_env"].get(host)
        ports = {
            link["port"]: {
                "exists": True,
                "up": True,
                "mac": mac(host, link["port"]),
                "addresses": [f"{link['address']}/{link['prefix']}"],
                "route": link["port"],
                "neighbour": mac(link["peer_host"], link["peer_port"]),
            }
            for link in spec["links"]
        }
        facts = {
            "platform": "linux",
            "fingerprint": fp,
            "torch_env": sha(planned) if planned else None,  # no torch.env there: the agent says None
            "meshccl_build": context["meshccl"]["build"] if context.get("meshccl") else None,
            "management_up": True,
            "ports": ports,
            "unplanned": [],
        }
        answers[host] = {"t": "checked", "preflight": {"problems": []}, "facts": facts}
    return answers


# ---- the cache key -------------------------------------------------------------------------------


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    for name in [n for n in os.environ if n.startswith("ANSIBLE_")]:
        monkeypatch.delenv(name)
    inv = tmp_path / "inv"
    inv.mkdir()
    (inv / "hosts.yml").write_text("all:\n  hosts:\n    node1:\n")
    playbooks = tmp_path / "playbooks"
    playbooks.mkdir()
    cfg = tmp_path / "ansible.cfg"
    cfg.write_text("[defaults]\nforks = 5\n")
    return {"inventory": inv / "hosts.yml", "playbooks": playbooks, "cfg": cfg}


def key_of(layout: dict[str, Path], runtime: str = "meshccl", inventory: Path | None = None) -> str:
    # The collection root: its playbooks/ directory is where group_vars/host_vars beside the playbook live.
    return launch_fast.cache_key(inventory or layout["inventory"], runtime, layout["playbooks"].parent, layout["cfg"])


def test_key_is_stable_and_follows_the_inventory_its_vars_ansible_cfg_and_runtime(layout: dict[str, Path]) -> None:
    assert key_of(layout) == key_of(layout)
    seen = {key_of(layout)}

    def changed() -> None:
        key = key_of(layout)
        assert key not in seen
        seen.add(key)

    layout["inventory"].write_text("all:\n  hosts:\n    node1:\n    node2:\n")
    changed()
    group_vars = layout["inventory"].parent / "group_vars"
    group_vars.mkdir()
    (group_vars / "all.yml").write_text("meshkit_cluster: a\n")
    changed()
    (group_vars / "all.yml").write_text("meshkit_cluster: b\n")
    changed()
    host_vars = layout["playbooks"] / "host_vars"
    host_vars.mkdir()
    (host_vars / "node1.yml").write_text("meshkit_peer_ports: [tb*]\n")
    changed()
    (layout["playbooks"] / "launch.yml").write_text("- hosts: all\n")  # meshkit's own launch code
    changed()
    (layout["playbooks"].parent / "plugins" / "module_utils").mkdir(parents=True)
    (layout["playbooks"].parent / "plugins" / "module_utils" / "launch_agent.py").write_text("CHECK = 1\n")
    changed()
    layout["cfg"].write_text("[defaults]\nforks = 10\n")
    changed()
    assert key_of(layout, runtime="torch") not in seen
    assert key_of(layout) in seen  # nothing else moved


def test_key_follows_ansible_environment_variables_only(
    layout: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = key_of(layout)
    monkeypatch.setenv("MESHKIT_UNRELATED", "1")
    assert key_of(layout) == before
    monkeypatch.setenv("ANSIBLE_INVENTORY_ENABLED", "yaml")
    one = key_of(layout)
    monkeypatch.setenv("ANSIBLE_INVENTORY_ENABLED", "ini")
    two = key_of(layout)
    assert len({before, one, two}) == 3


def test_key_of_an_inventory_directory_follows_every_file_in_it(layout: dict[str, Path]) -> None:
    inv = layout["inventory"].parent
    before = key_of(layout, inventory=inv)
    assert key_of(layout, inventory=inv) == before
    nested = inv / "group_vars" / "rack"
    nested.mkdir(parents=True)
    (nested / "vars.yml").write_text("x: 1\n")
    after_add = key_of(layout, inventory=inv)
    (nested / "vars.yml").write_text("x: 2\n")
    after_change = key_of(layout, inventory=inv)
    (inv / "hosts.yml").write_text("all: {}\n")
    assert len({before, after_add, after_change, key_of(layout, inventory=inv)}) == 4


def test_dynamic_or_missing_inventories_are_stale(layout: dict[str, Path], tmp_path: Path) -> None:
    script = tmp_path / "inv.py"
    script.write_text("#!/usr/bin/env python3\nprint('{}')\n")
    script.chmod(0o755)
    with pytest.raises(Stale, match="dynamic inventory"):
        key_of(layout, inventory=script)
    plain = tmp_path / "inventory"  # a script as often named: no suffix
    plain.write_text("#!/bin/sh\necho '{}'\n")
    plain.chmod(0o755)
    with pytest.raises(Stale, match="dynamic inventory"):
        key_of(layout, inventory=plain)
    static = tmp_path / "static.yml"  # executable by accident, not a script: a key as usual
    static.write_text("all: {}\n")
    static.chmod(0o755)
    assert key_of(layout, inventory=static)
    plugin = tmp_path / "aws_ec2.yml"
    plugin.write_text("---\nplugin: amazon.aws.aws_ec2\nregions: [eu-west-1]\n")
    with pytest.raises(Stale, match="inventory plugin"):
        key_of(layout, inventory=plugin)
    (layout["inventory"].parent / "cloud.yaml").write_text("plugin: constructed\n")
    with pytest.raises(Stale, match="inventory plugin"):
        key_of(layout, inventory=layout["inventory"].parent)
    with pytest.raises(Stale, match="does not exist"):
        key_of(layout, inventory=tmp_path / "absent.yml")


# ---- save / load ---------------------------------------------------------------------------------


def test_save_and_load_round_trip_private(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "x-meshccl.json"
    context = {"plan": PLAN, "inputs": INPUTS}
    connections = {"node1": {"kind": "ssh", "host": "10.9.0.1", "user": "me", "key": "/k"}}
    launch_fast.save(path, "key-1", context, connections)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    record = launch_fast.load(path, "key-1")
    assert record["context"] == json.loads(json.dumps(context))
    assert record["connections"] == connections
    assert record["key"] == "key-1"
    with pytest.raises(Stale, match="changed"):
        launch_fast.load(path, "key-2")
    with pytest.raises(Stale, match="no checked plan"):
        launch_fast.load(tmp_path / "cache" / "other.json", "key-1")
    for text in ("{not json", "[]", "null"):
        path.write_text(text)
        with pytest.raises(Stale, match="unreadable"):
            launch_fast.load(path, "key-1")


def test_cache_path_per_runtime_and_inventory(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yml", tmp_path / "b.yml"
    paths = {
        launch_fast.cache_path(tmp_path, a, "meshccl"),
        launch_fast.cache_path(tmp_path, a, "torch"),
        launch_fast.cache_path(tmp_path, b, "meshccl"),
    }
    assert len(paths) == 3 and all(p.parent == tmp_path for p in paths)


# ---- check_specs ---------------------------------------------------------------------------------


def test_check_specs_per_host() -> None:
    job = job_for()
    context = context_for()
    specs = launch_fast.check_specs(job, context)
    assert set(specs) == set(HOSTS)
    for host in HOSTS:
        assert specs[host]["preflight"] == launch_plan.host_preflight(job, host)
        assert specs[host]["links"] == PLAN["per_host"][host]
        assert specs[host]["management_interface"] == "mgmt0"
        assert specs[host]["state_dir"] == "/var/lib/meshkit"
        assert "meshccl_venv" in specs[host]
    assert specs["node1"]["peer_ports"] == ["tb*"]
    assert specs["node2"]["peer_ports"] == specs["node3"]["peer_ports"] == ["thunderbolt*"]
    assert specs["node1"]["meshccl_venv"] == "/opt/meshccl"


def test_meshccl_venv_only_for_meshccl_with_a_build() -> None:
    assert not any("meshccl_venv" in s for s in specs_for("torch").values())
    assert not any("meshccl_venv" in s for s in specs_for("meshccl", context_for(meshccl={})).values())
    context = context_for()
    context["config"]["node2"]["meshkit_meshccl_install"] = False
    specs = specs_for("meshccl", context)
    assert ["meshccl_venv" in specs[h] for h in HOSTS] == [True, False, True]


# ---- stale_reasons -------------------------------------------------------------------------------


def test_all_good_is_no_reason() -> None:
    context = context_for()
    specs = specs_for(context=context)
    answers = good_answers(specs, context)
    assert answers["node2"]["facts"]["torch_env"] is None  # none planned, none there
    assert launch_fast.stale_reasons(answers, specs, context) == []


def port(answers: dict[str, Any], host: str, name: str) -> dict[str, Any]:
    return answers[host]["facts"]["ports"][name]


# node2:tb1 faces node3:tb0 (10.50.0.10).
CHANGES = {
    "down": (lambda a: port(a, "node2", "tb1").update(up=False), "node2:tb1 is down"),
    "gone": (lambda a: a["node2"]["facts"]["ports"].update(tb1={"exists": False}), "node2:tb1 is gone"),
    "no address": (
        lambda a: port(a, "node2", "tb1").update(addresses=["10.50.0.99/30"]),
        "node2:tb1 lacks its address 10.50.0.9/30",
    ),
    "route": (
        lambda a: port(a, "node2", "tb1").update(route="tb0"),
        "node2:tb1: the route to 10.50.0.10 leaves through tb0",
    ),
    "silent": (
        lambda a: port(a, "node2", "tb1").update(neighbour=None),
        "node2:tb1: nothing answers for 10.50.0.10 (node3:tb0)",
    ),
    "recabled": (
        lambda a: port(a, "node2", "tb1").update(neighbour=mac("node1", "tb1")),
        f"node2:tb1: 10.50.0.10 answers from {mac('node1', 'tb1')}, not node3:tb0 ({mac('node3', 'tb0')})",
    ),
    "new cable": (
        lambda a: a["node2"]["facts"].update(unplanned=["tb2"]),
        "node2: tb2 up but not in the plan (a new cable?)",
    ),
    "fingerprint": (
        lambda a: a["node2"]["facts"].update(fingerprint="sha256:other"),
        "node2: its hostfiles were not made from the remembered plan",
    ),
    "torch.env": (lambda a: a["node1"]["facts"].update(torch_env=sha("other\n")), "node1: its torch.env changed"),
    "torch.env appeared": (
        lambda a: a["node2"]["facts"].update(torch_env=sha("NCCL_X=1\n")),
        "node2: its torch.env changed",
    ),
    "meshccl": (
        lambda a: a["node1"]["facts"].update(meshccl_build="old"),
        "node1: meshccl there is missing, incomplete or not build abc",
    ),
    "not linux": (
        lambda a: a["node2"]["facts"].update(platform="darwin"),
        "node2: the quick checks need Linux (this host is darwin)",
    ),
    "error": (lambda a: a.update(node2={"error": "no answer within 30 s"}), "node2: no answer within 30 s"),
    "management": (
        lambda a: a["node2"]["facts"].update(management_up=False),
        "node2: management interface mgmt0 is not up",
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_one_change_is_one_reason_naming_it(change: str) -> None:
    context = context_for()
    specs = specs_for(context=context)
    answers = good_answers(specs, context)
    apply, reason = CHANGES[change]
    apply(answers)
    assert launch_fast.stale_reasons(answers, specs, context) == [reason]


def test_meshccl_build_counts_only_where_it_is_installed() -> None:
    context = context_for()
    specs = specs_for("torch", context)
    answers = good_answers(specs, context)
    for answer in answers.values():
        answer["facts"]["meshccl_build"] = None
    assert launch_fast.stale_reasons(answers, specs, context) == []


# ---- run_checks over a real local connection ---------------------------------------------------


def local_spec(state_dir: Path) -> dict[str, Any]:
    return {
        "preflight": {"argv": ["sh", "-c", "true"], "ports": []},
        "state_dir": str(state_dir),
        "links": [],
        "management_interface": "",
    }


def test_run_checks_on_this_machine(tmp_path: Path) -> None:
    (tmp_path / "hostfiles").mkdir()
    (tmp_path / "hostfiles" / "manifest.json").write_text(json.dumps({"fingerprint": "sha256:x"}))
    (tmp_path / "hostfiles" / "torch.env").write_bytes(b"NCCL_IB_DISABLE=1\n")
    connections = {
        "here": {"kind": "local", "python": sys.executable},
        "broken": {"kind": "local", "python": "/nonexistent/python"},
    }
    specs = {"here": local_spec(tmp_path), "broken": local_spec(tmp_path)}
    answers = launch_fast.run_checks(connections, specs)
    assert set(answers) == {"here", "broken"}
    here = answers["here"]
    assert here["t"] == "checked"
    assert here["facts"]["fingerprint"] == "sha256:x"
    assert here["facts"]["torch_env"] == sha(b"NCCL_IB_DISABLE=1\n")
    assert here["preflight"]["problems"] == []
    assert here["preflight"]["program"] == os.path.realpath(shutil.which("sh"))
    assert set(answers["broken"]) == {"error"}
    assert "/nonexistent/python" in answers["broken"]["error"]


def test_run_checks_reports_a_silent_or_failing_connection(tmp_path: Path) -> None:
    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'Welcome!'\necho 'Permission denied (publickey).' >&2\nexit 255\n")
    for script in (slow, failing):
        script.chmod(0o755)
    connections = {h: {"kind": "local", "python": str(tmp_path / h)} for h in ("slow", "failing")}
    specs = {h: local_spec(tmp_path) for h in connections}
    answers = launch_fast.run_checks(connections, specs, timeout=0.5)
    assert answers["slow"] == {"error": "no answer within 0.5 s"}
    assert answers["failing"] == {"error": "connection exited 255: Permission denied (publickey)."}


def test_a_record_others_may_write_is_not_used_and_saving_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "x-plain.json"
    launch_fast.save(path, "k", {"plan": PLAN}, {})
    assert [p.name for p in path.parent.iterdir()] == ["x-plain.json"]
    assert launch_fast.load(path, "k")["key"] == "k"
    path.chmod(0o620)
    with pytest.raises(Stale, match="others may write it"):
        launch_fast.load(path, "k")
    path.chmod(0o600)
    path.parent.chmod(0o777)
    with pytest.raises(Stale, match="others may write it"):
        launch_fast.load(path, "k")


def test_the_job_carries_the_host_timeout_when_one_is_given() -> None:
    plain = launch_plan.validate({"program": "true", "runtime": "plain"})
    assert "host_timeout" not in launch_plan.make_job(PLAN, plain, INPUTS, job_id="j")  # the launcher's default
    given = launch_plan.validate({"program": "true", "runtime": "plain", "host_timeout": "45"})
    assert launch_plan.make_job(PLAN, given, INPUTS, job_id="j")["host_timeout"] == 45.0


# ---- launch.yml's preflight through the agent (preflight_everywhere) -----------------------------


def test_the_preflight_everywhere_checks_program_and_cables(tmp_path: Path) -> None:
    """launch.yml's checks and messages (agent_preflight.check_host): the program on every host, and
    each cable's peer probed from the ranks' interpreter (here: loopback, refused = reachable)."""
    job = {
        "runtime": "plain",
        "ports": {},
        "ranks": [
            {"rank": 0, "host": "a", "argv": ["sh", "-c", "true"], "env": {}},
            {"rank": 1, "host": "b", "argv": [str(tmp_path / "missing")], "env": {}},
        ],
    }
    link = {"port": "lo", "address": "127.0.0.1", "prefix": 8, "peer_address": "127.0.0.1", "peer_host": "b"}
    connections = {host: {"kind": "local", "python": sys.executable} for host in ("a", "b")}
    found = launch_fast.preflight_everywhere(job, connections, {"a": [link]})
    assert found["a"]["problems"] == [] and found["a"]["program"] == os.path.realpath(shutil.which("sh"))
    [peer] = found["a"]["peers"]
    assert peer["kind"] == "reachable" and peer["peer_host"] == "b", peer
    assert found["a"]["bridged"] == {} and "via" in found["a"]["context"]
    assert found["b"]["problems"] == [f"program {tmp_path / 'missing'} not found, or not executable"]
    assert launch_plan.preflight_problems(found) == [f"b: program {tmp_path / 'missing'} not found, or not executable"]


def test_the_cable_checks_run_the_module_utils_the_controller_sent(tmp_path: Path) -> None:
    """The host has no collection: the agent imports what the check carries (macos, linux_net) and its
    own parts (agent_preflight, launch_agent) from what the controller sent, never a copy the host may
    have of another version (this test's host has the checkout's collection on its path)."""
    fake = (
        "from ansible_collections.meshkit.cluster.plugins.module_utils import agent_preflight, launch_agent\n"
        "def launch_checks(links, run, system, interpreter=None, **kw):\n"
        "    rc, out, _err = run(['sh', '-c', 'echo ran'])\n"
        "    sent = sorted({type(m.__loader__).__name__ for m in (agent_preflight, launch_agent)})\n"
        "    found = callable(agent_preflight.preflight)\n"
        "    return {'problems': [f'sent {len(links)} {out.strip()} {found} {sent}'], 'notes': [],\n"
        "            'peers': [], 'bridged': {}, 'context': {}, 'probed_with': None}\n"
    )
    spec = {
        "preflight": {"argv": ["sh"], "ports": []},
        "cables": [{"port": "lo", "peer_address": "127.0.0.1"}],
        "facts": False,
        "modules": {"macos": fake},
    }
    answers = launch_fast.run_checks({"here": {"kind": "local", "python": sys.executable}}, {"here": spec})
    assert answers["here"]["preflight"]["problems"] == ["sent 1 ran True ['SentSources']"], answers
    assert "facts" not in answers["here"]


def test_a_plan_setup_yml_changed_refuses_the_remembered_job_naming_the_change(tmp_path: Path) -> None:
    """After a recabling (setup.yml rewrote plan.json), the job planned from the remembered plan is not started,
    and the reason names what changed: the host added, the cables added and removed."""
    grown = plan_of([(1, 2), (2, 3), (3, 4), (4, 1)], 4)
    record_file = tmp_path / "plan.json"
    record_file.write_text(json.dumps(grown))
    context = {**context_for(), "plan_record": str(record_file), "plan_sha": sha("the plan when it was remembered")}
    with pytest.raises(Stale) as stale:
        launch_fast.prepare({"context": context, "connections": {}}, {"program": ["true"], "runtime": "plain"})
    said = str(stale.value)
    assert said == (
        f"{record_file} changed since the last full check (setup.yml ran: hosts added node4; cables added "
        "node1:tb1 <-> node4:tb1, node3:tb1 <-> node4:tb0; cables removed node1:tb1 <-> node3:tb1); the job planned "
        "from the old plan is not started"
    )
    # An unreadable plan.json still refuses the remembered job, without the details.
    record_file.write_text("{")
    with pytest.raises(Stale, match=r"changed since the last full check \(setup.yml ran\); the job"):
        launch_fast.prepare({"context": context, "connections": {}}, {"program": ["true"], "runtime": "plain"})
