"""How the launch agent's parts reach a host (plugins/module_utils/agent_sources.py; meshkit/launcher.py
agent_source()): the parts sent are everything the agent imports from the collection; on a host, the agent
imports them from what the controller sent, never from a copy of the collection the host has (here: a decoy
whose every module raises); a check adds the module_utils it carries to the same finder."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils import agent_sources
from ansible_collections.meshkit.cluster.plugins.module_utils.agent_sources import AGENT_PARTS, MODULE_UTILS

from meshkit.launcher import BOOTSTRAP, agent_input, agent_source

from .test_port_rules import imported_module_utils

HERE = Path(agent_sources.__file__).parent
DECOY = "raise ImportError('the host copy of the collection was imported')\n"
LOOPBACK = {"port": "lo", "address": "127.0.0.1", "prefix": 8, "peer_address": "127.0.0.1", "peer_host": "b"}


def test_the_parts_sent_are_everything_the_agent_imports_from_the_collection() -> None:
    closure: set[str] = set()
    todo = ["launch_agent"]
    while todo:
        name = todo.pop()
        if name not in closure:
            closure.add(name)
            todo += imported_module_utils(name)
    assert closure == {*AGENT_PARTS, "agent_sources"}  # agent_sources is the program itself
    program = agent_source().decode()
    own = (HERE / "agent_sources.py").read_text()
    assert program.startswith(own)
    call = ast.parse(program[len(own) :]).body
    assert len(call) == 1 and isinstance(call[0], ast.Raise), program[len(own) :][:200]
    sent = ast.literal_eval(call[0].exc.args[0].args[0])  # raise SystemExit(run({...}))
    assert sent == {name: (HERE / f"{name}.py").read_text() for name in AGENT_PARTS}
    framed = agent_input(b'{"t": "hb"}\n')
    assert framed == f"{len(program.encode()):010d}".encode() + program.encode() + b'{"t": "hb"}\n'


def decoy_collection(root: Path) -> Path:
    """A copy of the collection on the host's path in which every module and package raises on import."""
    where = root / "ansible_collections" / "meshkit" / "cluster" / "plugins" / "module_utils"
    where.mkdir(parents=True)
    for name in (*AGENT_PARTS, "agent_sources", "macos", "linux_net", "__init__"):
        (where / f"{name}.py").write_text(DECOY)
    for package in where.parents:
        if package == root:
            break
        (package / "__init__.py").write_text(DECOY)
    return root


def on_host(tmp_path: Path, first: dict[str, Any], until: str | None = None) -> list[dict[str, Any]]:
    """The agent started as the launcher starts it, on a "host" whose Python path has the decoy first;
    what it says until it ends. Its input stays open until it says ``until`` (the end of input stops a
    job, as a controller that went away would)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(decoy_collection(tmp_path / "host"))
    # Unbuffered (bufsize=0): communicate() reads the descriptor, so a "bye" that readline() had
    # already taken into a Python buffer would be lost.
    proc = subprocess.Popen(
        [sys.executable, "-u", "-c", BOOTSTRAP], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=env, cwd=tmp_path, bufsize=0,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    said: list[dict[str, Any]] = []
    try:
        proc.stdin.write(agent_input((json.dumps(first) + "\n").encode()))
        proc.stdin.flush()
        while until and not any(m["t"] == until for m in said):
            line = proc.stdout.readline()
            if not line:
                break
            said.append(json.loads(line))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and b"host copy" not in err, (proc.returncode, err)
    return said + [json.loads(line) for line in out.decode().splitlines()]


def test_a_check_runs_from_the_sent_sources_never_from_the_hosts_collection(tmp_path: Path) -> None:
    modules = {name: (HERE / f"{name}.py").read_text() for name in ("macos", "linux_net")}
    check = {
        "preflight": {"argv": ["sh"]},
        "cables": [LOOPBACK],
        "modules": modules,
        "state_dir": str(tmp_path),
        "links": [],
        "peer_ports": ["lo*"],
    }
    [answer] = on_host(tmp_path, {"check": check})
    assert answer["t"] == "checked", answer
    assert answer["preflight"]["problems"] == [] and [p["kind"] for p in answer["preflight"]["peers"]] == ["reachable"]
    assert answer["facts"]["platform"] == sys.platform


def test_a_job_runs_from_the_sent_sources_never_from_the_hosts_collection(tmp_path: Path) -> None:
    rank = {"rank": 0, "argv": ["sh", "-c", "echo sent"], "env": {}, "cwd": None}
    job = {"job": f"sent-{uuid.uuid4().hex}", "dir": str(tmp_path / "job"), "grace": 0.5, "ranks": [rank]}
    said = [m for m in on_host(tmp_path, job, until="exit") if m["t"] != "hb"]
    assert [m["t"] for m in said] == ["started", "out", "exit", "bye"], said
    assert said[1]["d"] == "sent\n" and said[2]["code"] == 0


def test_module_util_imports_what_a_check_sent_and_a_later_check_adds_to_the_same_finder(monkeypatch) -> None:
    """In a process where the collection is imported as usual (the agent under test), sent module_utils
    are found through one SentSources finder; a module_util not sent is imported as usual."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    tag = uuid.uuid4().hex
    first, second = f"sent_first_{tag}", f"sent_second_{tag}"
    try:
        one = agent_sources.module_util(first, {first: "WHO = 'first'\n"})
        two = agent_sources.module_util(second, {second: f"from {MODULE_UTILS}.{first} import WHO\nTOO = WHO + '+'\n"})
        assert (one.WHO, two.TOO) == ("first", "first+")
        assert sum(isinstance(f, agent_sources.SentSources) for f in sys.meta_path) == 1
        assert isinstance(sys.meta_path[0], agent_sources.SentSources)
        assert agent_sources.module_util("port_rules", None).__file__ == str(HERE / "port_rules.py")
    finally:
        for name in (first, second):
            sys.modules.pop(f"{MODULE_UTILS}.{name}", None)
