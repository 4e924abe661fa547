"""common.run_parallel: commands at once through AnsibleModule.run_command (real processes), and
cable_check, which pings every cable with it, against a stand-in `ping` on PATH."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import pytest
from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.testing import patch_module_args
from ansible_collections.meshkit.cluster.plugins.module_utils.common import run_parallel
from ansible_collections.meshkit.cluster.plugins.modules import cable_check

from .module_harness import patch_exits, run_module

# Waits until the file named by its second argument exists, after creating the one named by its
# first: two of these given each other's files finish only if they run at the same time (each
# gives up after about 10 s, exit 3).
MEET = (
    'touch "$1"; i=0; while [ ! -e "$2" ]; do i=$((i+1)); [ "$i" -gt 1000 ] && exit 3; sleep 0.01; done; echo "met $2"'
)


@pytest.fixture
def module():
    with patch_module_args({}):
        return AnsibleModule(argument_spec={})


def test_commands_run_at_the_same_time(module, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    runs = run_parallel(module, {"a": ["sh", "-c", MEET, "sh", a, b], "b": ["sh", "-c", MEET, "sh", b, a]})
    assert runs == {"a": (0, f"met {b}\n", ""), "b": (0, f"met {a}\n", "")}


def test_results_by_key_in_the_order_given_with_arguments_as_they_are(module):
    argvs = {3: ["sh", "-c", 'echo "$0"; echo err >&2; exit 4', "$HOME~"], 1: ["echo", "~/x"], 2: ["true"]}
    runs = run_parallel(module, argvs)
    assert list(runs) == [3, 1, 2]
    assert runs == {3: (4, "$HOME~\n", "err\n"), 1: (0, "~/x\n", ""), 2: (0, "", "")}


def test_a_command_past_its_timeout_is_killed(module):
    started = time.monotonic()
    runs = run_parallel(module, {"slow": ["sleep", "60"], "quick": ["echo", "done"]}, timeout=0.5)
    assert runs["slow"][0] == -9
    assert runs["quick"] == (0, "done\n", "")
    assert time.monotonic() - started < 30


def test_a_command_that_cannot_start_raises(module, tmp_path):
    with pytest.raises(FileNotFoundError):
        run_parallel(module, {"x": [str(tmp_path / "no-such-command")], "y": ["true"]})


def test_nothing_to_run(module):
    assert run_parallel(module, {}) == {}


# ---- cable_check ---------------------------------------------------------------------------------
# A stand-in for ping(8): the last argument is the peer. 198.18.128.2 and 198.18.128.6 answer only
# once both are being pinged (each waits for the other's mark), 198.18.128.10 never answers.
FAKE_PING = """#!/bin/sh
for peer; do :; done
echo "$*" >> "$MARKS/argv"
case "$peer" in
  198.18.128.2) touch "$MARKS/2"; other=6 ;;
  198.18.128.6) touch "$MARKS/6"; other=2 ;;
  *) exit 1 ;;
esac
i=0
while [ ! -e "$MARKS/$other" ]; do i=$((i+1)); [ "$i" -gt 1000 ] && exit 1; sleep 0.01; done
exit 0
"""


def port(name: str, peer: str, address: str) -> dict[str, str]:
    return {"port": name, "peer_host": peer, "peer_port": "eth1", "peer_address": address}


PORTS = [port("eth1", "node2", "198.18.128.2"), port("eth2", "node3", "198.18.128.6")]


@pytest.fixture
def fake_ping(monkeypatch, tmp_path) -> Path:
    bin_dir, marks = tmp_path / "bin", tmp_path / "marks"
    bin_dir.mkdir()
    marks.mkdir()
    ping = bin_dir / "ping"
    ping.write_text(FAKE_PING)
    ping.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MARKS", str(marks))
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    patch_exits(monkeypatch)
    return marks


def test_cable_check_pings_every_cable_at_once(fake_ping):
    ok, result = run_module(cable_check, {"ports": PORTS, "host": "node1"})
    assert ok, result
    assert [c["alive"] for c in result["cables"]] == [True, True]
    assert result["cables"][1] == {"port": "eth2", "peer": "node3:eth1", "peer_address": "198.18.128.6", "alive": True}
    assert result["dead"] == [] and result["dead_ends"] == []
    argv = sorted((fake_ping / "argv").read_text().splitlines())
    assert argv == [
        "-n -q -c 3 -i 0.2 -w 3 -I eth1 198.18.128.2",
        "-n -q -c 3 -i 0.2 -w 3 -I eth2 198.18.128.6",
    ]


def test_cable_check_names_a_dead_cable(fake_ping):
    ports = [*PORTS, port("eth3", "node4", "198.18.128.10")]
    ok, result = run_module(cable_check, {"ports": ports, "host": "node1"})
    assert not ok
    assert result["dead_ends"] == ["node1:eth3"]
    assert result["dead"] == ["node1:eth3 -> node4:eth1 (198.18.128.10): no reply"]
    assert result["msg"] == "dead cable(s): node1:eth3 -> node4:eth1 (198.18.128.10): no reply"
    assert [c["alive"] for c in result["cables"]] == [True, True, False]
    # fail: false reports the dead cable without failing.
    ok, result = run_module(cable_check, {"ports": ports, "host": "node1", "fail": False})
    assert ok and result["dead_ends"] == ["node1:eth3"]


def test_cable_check_in_check_mode_reports_without_failing(fake_ping):
    ok, result = run_module(cable_check, {"ports": [port("eth3", "node4", "198.18.128.10")]}, check=True)
    assert ok and result["dead_ends"] == ["this host:eth3"]
    assert not result["changed"]
