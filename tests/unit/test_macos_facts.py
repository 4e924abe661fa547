"""The macOS facts users trip on (issue 19, point 5), each on recorded outputs where one exists:

1. RDMA over a Thunderbolt 4/3 link: told by the link's negotiated speed (system_profiler), not by
   ibv_devices listing a device;
2. Thunderbolt RDMA ports publishing only link-local fe80:: GIDs (JACCL: errno 22);
3. the Thunderbolt Bridge holding cable ports (JACCL: errno 22);
4. Local Network Privacy refusing a program started inside tmux/screen or an app's terminal
   (EHOSTUNREACH, errno 65, to a peer on the same subnet).

Recordings: tests/fixtures/macos and tests/fixtures/rdma/recordings (SOURCES.md in each); the
hand-written inputs are in tests/fixtures/macos/synthetic (README.md says what each is derived from).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import agent_preflight, macos, rdma
from ansible_collections.meshkit.cluster.plugins.modules import rdma_facts

from .module_harness import patch_exits, run_module
from .test_rdma import script, transcript

FIX = Path(__file__).resolve().parents[1] / "fixtures"
MAC = FIX / "macos"
SYN = MAC / "synthetic"
REC = FIX / "rdma" / "recordings"
ROOT = Path(__file__).resolve().parents[2]


def read(path: Path) -> str:
    return path.read_text()


def links_of(profiler: str, ports: str) -> dict[str, dict[str, Any]]:
    hardware = macos.parse_hardware_ports(read(MAC / ports))
    return macos.thunderbolt_links(json.loads(read(MAC / profiler)), hardware)


def runbook_exists(path: str) -> bool:
    return (ROOT / path).is_file()


# ---- 1. Thunderbolt 4 or 5: the link's speed decides, not the device list -----------------------


def test_link_speed_of_every_port_from_recorded_system_profiler():
    m4 = links_of(
        "system_profiler_macbookpro_m4max_TRIMMED_tb5_and_tb4_links.json",
        "networksetup_listallhardwareports_macbookpro_m4max_TRIMMED.txt",
    )
    assert {p: (v["name"], v["speed"], v["linked"], v["generation"]) for p, v in m4.items()} == {
        "en1": ("Thunderbolt 1", "Up to 120 Gb/s", False, None),
        "en2": ("Thunderbolt 2", "80 Gb/s", True, "tb5"),
        "en3": ("Thunderbolt 3", "40 Gb/s", True, "tb4"),
    }
    assert m4["en3"]["far_end"] == "Mac Studio (Mac15,14)"
    assert m4["en1"]["port_generation"] == "tb5"  # an idle TB5 port: capability, not a link
    studio = links_of(
        "system_profiler_macstudio_m3ultra_TRIMMED_peer_via_tb3_dock.json",
        "networksetup_listallhardwareports_macstudio_m3ultra_TRIMMED.txt",
    )
    assert (studio["en4"]["speed"], studio["en4"]["far_end"]) == ("40 Gb/s", "ThunderBay Flex 8")
    assert studio["en7"]["generation"] == "tb5"


def test_a_listed_rdma_device_on_a_40_gbps_link_is_not_usable():
    """The osaurus peer Mac (all real, anonymized): RDMA enabled, ibv_devices lists rdma_en1/en6/en2, and
    en2 is linked at 40 Gb/s to a Thunderbolt 3 dock. en2 is ruled out by its speed, with its device listed."""
    devices = rdma.parse_ibv_devices(read(MAC / "ibv_devices_macbookpro_m5max_rdma_enabled_anonymized.txt"))
    ports = rdma.parse_ibv_devinfo(read(MAC / "ibv_devinfo_macbookpro_m5max_anonymized.txt"))
    links = links_of(
        "system_profiler_macbookpro_m5max_peer_tb3dock_anonymized.json",
        "networksetup_listallhardwareports_macbookpro_m5max_anonymized.txt",
    )
    facts = rdma.host_facts("Darwin", ports, ["en6", "en2"], True, devices, links=links)
    en2 = facts["ports"]["en2"]
    assert en2["usable"] is False
    assert en2["problem"] == (
        "en2 (Thunderbolt 3) is linked at 40 Gb/s to ACASIS TBU405Pro: a Thunderbolt 4/3 link, and RDMA does not "
        "run over it, although macOS lists rdma_en2 for it (Thunderbolt 5 needed at both ends and in the cable; "
        "JACCL over it crashes or never connects)"
    )
    assert en2["device"] is None and en2["listed_device"] == "rdma_en2"
    assert en2["link"]["speed"] == "40 Gb/s"
    assert facts["ports"]["en6"]["problem"] == "rdma_en6 port 1 is DOWN"  # an 80 Gb/s link: judged by its port
    assert facts["runbooks"] == [rdma.RUNBOOK_MACOS, rdma.RUNBOOK_TB]  # in the order of the ports
    assert all(runbook_exists(r) for r in facts["runbooks"])


def test_an_active_port_with_an_ipv4_gid_on_a_tb4_link_is_still_ruled_out():
    """M4 Max (real, trimmed): en2 at 80 Gb/s, en3 at 40 Gb/s to the same Mac Studio. The ports are Apple's
    TN3205 rdma_en2 (ACTIVE, GID[1] ::ffff:169.254.205.255), copied here to rdma_en3 as well: the state
    ml-explore/mlx#4485 and exo-explore/exo#1813 report (devices present on a 40 Gb/s link)."""
    tn = transcript(REC / "macos_ibv_devinfo_v_rdma_en2_gid_table_tn3205_ABRIDGED.txt", ["ibv_devinfo -d rdma_en2 -v"])
    (en2,) = rdma.parse_ibv_devinfo(tn["ibv_devinfo -d rdma_en2 -v"])
    en3 = dataclasses.replace(en2, device="rdma_en3", netdev="en3")
    links = links_of(
        "system_profiler_macbookpro_m4max_TRIMMED_tb5_and_tb4_links.json",
        "networksetup_listallhardwareports_macbookpro_m4max_TRIMMED.txt",
    )
    facts = rdma.host_facts("Darwin", [en2, en3], ["en2", "en3"], True, ["rdma_en2", "rdma_en3"], links=links)
    assert facts["ports"]["en2"]["usable"] is True and facts["ports"]["en2"]["device"] == "rdma_en2"
    en3_facts = facts["ports"]["en3"]
    assert en3_facts["usable"] is False and en3_facts["device"] is None
    assert en3_facts["state"] == "ACTIVE" and en3_facts["gid_ipv4"] == "169.254.205.255"
    assert en3_facts["problem"].startswith("en3 (Thunderbolt 3) is linked at 40 Gb/s to Mac Studio (Mac15,14)")
    assert facts["problems"] == [f"en3: {en3_facts['problem']}"]
    assert facts["runbook"] == rdma.RUNBOOK_TB


def test_idle_or_unknown_links_rule_nothing_out():
    assert rdma.slow_link("en1", {"linked": False, "generation": None, "port_generation": "tb4"}) is None
    assert rdma.slow_link("en1", None) is None
    assert rdma.slow_link("en1", {"generation": "tb5", "linked": True}) is None
    # discovery's generation alone (the first RDMA check in setup.yml passes it)
    assert rdma.slow_link("en1", {"generation": "tb4"}).startswith("en1 is linked at Thunderbolt 4 speed: ")


# ---- 2. only link-local fe80:: GIDs ------------------------------------------------------------


def test_link_local_only_gids_name_the_gids_and_jaccl_errno_22():
    ports = rdma.parse_ibv_devinfo(read(SYN / "ibv_devinfo_v_link_local_gids_only_derived_tn3205_mlx4191.txt"))
    assert [(p.device, p.state, [g.index for g in p.gids]) for p in ports] == [
        ("rdma_en2", "ACTIVE", [0, 2]),
        ("rdma_en3", "ACTIVE", [0]),
    ]
    assert all(p.link_local_only() and p.ipv4_gid() is None for p in ports)
    facts = rdma.host_facts("Darwin", ports, ["en2", "en3"], True, ["rdma_en2", "rdma_en3"])
    assert facts["ports"]["en2"]["problem"] == (
        "rdma_en2 port 1 has no IPv4 GID yet (its interface needs an IPv4 address): only link-local GIDs "
        "(GID[0] fe80::344d:4ff:feea:4e40, GID[2] fe80::1021:1bac:fe1:b5e3). JACCL needs an IPv4-mapped GID "
        "(::ffff:a.b.c.d) on every port it uses and fails without one with "
        "'[jaccl] Changing queue pair to RTR failed with errno 22'; it appears once en2 has an IPv4 address of its own"
    )
    assert facts["ports"]["en3"]["gid_index"] is None
    assert facts["runbooks"] == [rdma.RUNBOOK_GID]
    assert runbook_exists(rdma.RUNBOOK_GID)


def test_the_ipv4_mapped_gid_apple_documents_is_at_index_1_and_usable():
    tn = transcript(REC / "macos_ibv_devinfo_v_rdma_en2_gid_table_tn3205_ABRIDGED.txt", ["ibv_devinfo -d rdma_en2 -v"])
    (en2,) = rdma.parse_ibv_devinfo(tn["ibv_devinfo -d rdma_en2 -v"])
    assert not en2.link_local_only() and en2.gid_note() is None
    facts = rdma.host_facts("Darwin", [en2], ["en2"], True, ["rdma_en2"])
    assert facts["usable"] is True and facts["notes"] == []
    assert facts["ports"]["en2"]["gid_index"] == 1


def test_an_ipv4_gid_at_another_index_is_a_note_for_old_jaccl():
    """ml-explore/mlx#3389: on some ports the IPv4-mapped GID is at index 2, and JACCL then took index 1."""
    tn = transcript(REC / "macos_ibv_devinfo_v_rdma_en2_gid_table_tn3205_ABRIDGED.txt", ["ibv_devinfo -d rdma_en2 -v"])
    (en2,) = rdma.parse_ibv_devinfo(tn["ibv_devinfo -d rdma_en2 -v"])
    fe80_0, mapped, fe80_2 = en2.gids
    moved = dataclasses.replace(
        en2,
        gids=[fe80_0, dataclasses.replace(fe80_2, index=1), dataclasses.replace(mapped, index=2)],
    )
    facts = rdma.host_facts("Darwin", [moved], ["en2"], True, ["rdma_en2"])
    assert facts["usable"] is True
    assert facts["notes"] == [
        "rdma_en2: its IPv4-mapped GID is at index 2, not 1; MLX releases that took GID index 1 (before "
        "ml-explore/mlx#3412) fail on it with '[jaccl] Changing queue pair to RTR failed with errno 22', "
        "current JACCL finds it itself"
    ]


def test_a_roce_port_without_ipv4_keeps_its_roce_message():
    """Linux RoCE (sysfs recording) is untouched by the Thunderbolt wording."""
    ports = rdma.read_sysfs(str(FIX / "rdma" / "sysfs" / "roce_active_no_ipv4_ib_down"))
    mlx5_0 = next(p for p in ports if p.device == "mlx5_0")
    assert mlx5_0.problem() == "mlx5_0 port 1 has no RoCE v2 IPv4 GID yet (its interface needs an IPv4 address)"


# ---- 3. the Thunderbolt Bridge still holding the cable ports --------------------------------------


def test_bridges_from_recorded_ifconfig():
    glpi = macos.parse_ifconfig_bridges(
        read(MAC / "ifconfig_a_macbookpro16_apple_silicon_sonoma14.4_bridge0_3_tb_members.txt")
    )
    assert glpi == {"bridge0": {"members": ["en1", "en2", "en3"], "up": True, "active": False, "inet": []}}
    intel = macos.parse_ifconfig_bridges(read(MAC / "ifconfig_intel_mbp_bridge0_4_tb_members_bridge100_inet.txt"))
    assert intel["bridge0"]["members"] == ["en1", "en2", "en3", "en4"]
    assert intel["bridge100"] == {"members": ["en10"], "up": True, "active": True, "inet": ["192.168.64.1"]}
    tn = macos.parse_ifconfig_bridges(read(REC / "macos_ifconfig_bridge0_tn3205_ABRIDGED.txt"))
    assert tn == {"bridge0": {"members": ["en2", "en3", "en4"], "up": True, "active": True, "inet": []}}
    emptied = macos.parse_ifconfig_bridges(read(SYN / "ifconfig_bridge0_no_members.txt"))
    assert emptied["bridge0"]["members"] == [] and emptied["bridge0"]["up"] is False
    # no bridge in a plain interface's block
    assert macos.parse_ifconfig_bridges(read(REC / "macos_ifconfig_en2_tn3205_ABRIDGED.txt")) == {}


def test_rdma_check_names_every_cable_port_inside_the_bridge():
    """Apple's TN3205 Mac mini: rdma_en2..4, and bridge0 with en2, en3, en4 as members."""
    devices = rdma.parse_ibv_devices(read(REC / "macos_ibv_devices_macmini_m4pro_tn3205_EXAMPLE.txt"))
    tn = transcript(REC / "macos_ibv_devinfo_v_rdma_en2_gid_table_tn3205_ABRIDGED.txt", ["ibv_devinfo -d rdma_en2 -v"])
    ports = rdma.parse_ibv_devinfo(tn["ibv_devinfo -d rdma_en2 -v"])
    bridges = macos.parse_ifconfig_bridges(read(REC / "macos_ifconfig_bridge0_tn3205_ABRIDGED.txt"))
    facts = rdma.host_facts("Darwin", ports, ["en2", "en3"], True, devices, bridges=bridges)
    assert facts["ports"]["en2"]["problem"] == (
        "en2 is a member of bridge0 (the Thunderbolt Bridge is active): the IPv4 address sits on bridge0, rdma_en2 "
        "gets no IPv4-mapped GID, and JACCL fails with '[jaccl] Changing queue pair to RTR failed with errno 22'. "
        "Run setup.yml (its discovery step takes the ports out of bridge0 and keeps them out)"
    )
    assert facts["ports"]["en2"]["bridge"] == "bridge0"
    assert facts["ports"]["en3"]["problem"].startswith("en3 is a member of bridge0 (the Thunderbolt Bridge is active)")
    assert facts["runbook"] == rdma.RUNBOOK_BRIDGE and runbook_exists(rdma.RUNBOOK_BRIDGE)


def test_preflight_on_a_mac_names_the_bridged_cable_ports(monkeypatch):
    """A Mac whose ifconfig -a (recorded, glpi-agent) still has en1, en2, en3 in bridge0; the peers answer."""
    ifconfig = read(MAC / "ifconfig_a_macbookpro16_apple_silicon_sonoma14.4_bridge0_3_tb_members.txt")
    commands = {("ifconfig", "-a"): (0, ifconfig, ""), ("ps", "-A", "-o", "pid=,ppid=,comm="): (0, "", "")}

    def run(argv: list[str]) -> tuple[int, str, str]:
        if argv[:3] == ["route", "-n", "get"]:
            return 1, "", "not in table"
        return commands[tuple(argv)]

    monkeypatch.setattr(
        macos, "probe_peers", lambda targets, interpreter: {"results": [{"result": "connected"}] * len(targets)}
    )
    links = [
        {"port": "en1", "address": "198.18.128.1", "prefix": 30, "peer_address": "198.18.128.2", "peer_host": "b"},
        {"port": "en3", "address": "198.18.128.5", "prefix": 30, "peer_address": "198.18.128.6", "peer_host": "c"},
    ]
    found = macos.launch_checks(links, run, "Darwin", env={})
    assert found["bridged"] == {"en1": "bridge0", "en3": "bridge0"}
    assert found["problems"] == [
        "en1 is a member of bridge0: its cable address 198.18.128.1 is not used, the Thunderbolt Bridge is active "
        "again: JACCL fails with '[jaccl] Changing queue pair to RTR failed with errno 22', and three or more Macs "
        "cabled in a loop make a broadcast storm. Run setup.yml again (its discovery step takes the ports "
        "out of bridge0 and keeps them out); see docs/runbooks/thunderbolt-bridge.md",
        "en3 is a member of bridge0: its cable address 198.18.128.5 is not used, the Thunderbolt Bridge is active "
        "again: JACCL fails with '[jaccl] Changing queue pair to RTR failed with errno 22', and three or more Macs "
        "cabled in a loop make a broadcast storm. Run setup.yml again (its discovery step takes the ports "
        "out of bridge0 and keeps them out); see docs/runbooks/thunderbolt-bridge.md",
    ]
    assert [p["kind"] for p in found["peers"]] == ["reachable", "reachable"]


def fake_sysfs(root: Path, members: dict[str, str], others: list[str]) -> str:
    """<root>/class/net as the kernel lays it out: a bridge has bridge/, a member a master -> ../<bridge> link."""
    net = root / "class" / "net"
    for bridge in set(members.values()):
        (net / bridge / "bridge").mkdir(parents=True, exist_ok=True)
    for port, bridge in members.items():
        (net / port).mkdir(parents=True, exist_ok=True)
        (net / port / "master").symlink_to(f"../{bridge}")
    for port in others:
        (net / port).mkdir(parents=True, exist_ok=True)
    return str(root)


def test_linux_bridge_members_from_sysfs(tmp_path):
    root = fake_sysfs(tmp_path, {"tb0": "bridge0", "tb1": "bridge0"}, ["tb2", "eth0"])
    bridges = macos.linux_bridges(root)
    assert {b: sorted(v["members"]) for b, v in bridges.items()} == {"bridge0": ["tb0", "tb1"]}
    assert macos.bridged_ports(bridges, ["tb1", "tb2"]) == {"tb1": "bridge0"}
    assert macos.linux_bridges(str(tmp_path / "absent")) == {}


# ---- 4. Local Network Privacy ------------------------------------------------------------------

# The real route outputs (macOS 26 VM): the on-link neighbour 192.168.64.1 (no gateway line) and 8.8.8.8
# through the default gateway.
ONLINK = macos.parse_route_get(read(MAC / "route_get_192.168.64.1_onlink_gateway_en0_macos26vm.txt"))
VIA_GATEWAY = macos.parse_route_get(read(MAC / "route_get_8.8.8.8_default_gateway_en0_macos26vm.txt"))
LAN_LINK = {"port": "en0", "address": "192.168.64.3", "prefix": 24, "peer_address": "192.168.64.1", "peer_host": "b"}
TMUX = json.loads(read(SYN / "lnp_probe_tmux_ehostunreach_derived_spexcode73.json"))
SSHD = json.loads(read(SYN / "lnp_probe_sshd_connected_derived_spexcode73.json"))


def context_of(name: str, pid: int) -> dict[str, Any]:
    return macos.launch_context({}, macos.ancestry(macos.parse_ps(read(SYN / name)), pid))


def test_where_the_ranks_would_be_started_from():
    assert context_of("ps_pid_ppid_comm_module_inside_tmux.txt", 961)["via"] == "inside tmux"
    vscode = context_of("ps_pid_ppid_comm_module_from_vscode.txt", 702)
    assert (vscode["via"], vscode["app"]) == ("from Visual Studio Code.app", "Visual Studio Code.app")
    assert context_of("ps_pid_ppid_comm_module_over_ssh.txt", 831)["via"] == "over SSH"
    assert macos.launch_context({"TMUX": "/private/tmp/tmux-501/default,733,0"}, [])["multiplexer"] == "tmux"
    assert macos.launch_context({"STY": "1234.pts-0.mac"}, [])["via"] == "inside screen"
    assert macos.launch_context({"TERM_PROGRAM": "Apple_Terminal"}, [])["via"] == "from Terminal"
    assert macos.launch_context({"TERM_PROGRAM": "iTerm.app"}, [])["via"] == "from iTerm.app's terminal"


def test_ehostunreach_to_an_on_link_peer_on_a_mac_is_local_network_privacy():
    assert ONLINK == {"route to": "192.168.64.1", "destination": "192.168.64.1", "interface": "en0",
                      "flags": ["UP", "HOST", "DONE", "LLINFO", "WASCLONED", "IFSCOPE", "IFREF", "ROUTER"]}  # fmt: skip
    assert macos.on_link(LAN_LINK, ONLINK) is True
    context = context_of("ps_pid_ppid_comm_module_inside_tmux.txt", 961)
    verdict = macos.classify_probe(
        TMUX["results"][0] | {"address": "192.168.64.1"},
        LAN_LINK,
        "Darwin",
        ONLINK,
        euid=TMUX["euid"],
        interpreter="/opt/homebrew/bin/python3",
        host="studio1",
        context=context,
    )
    assert verdict["kind"] == "local_network_privacy"
    assert verdict["problem"] == (
        "studio1: /opt/homebrew/bin/python3 could not reach b at 192.168.64.1 (cable en0): connect() failed after "
        "0.001 s with EHOSTUNREACH (errno 65, 'No route to host'), although 192.168.64.1 is on the cable's own "
        "network. This is macOS's Local Network Privacy refusing the program, not the network (ping and ssh may "
        "still work); the ranks would be started inside tmux. Fix: allow the app the launch runs from in System "
        "Settings > Privacy & Security > Local Network and start the launch again (a tmux or screen server may not "
        "be listed there); or start it from a plain ssh session or Apple's Terminal, not inside tmux/screen or "
        "another app's terminal; or run it from a launchd daemon. See docs/runbooks/local-network-privacy.md"
    )
    vscode = context_of("ps_pid_ppid_comm_module_from_vscode.txt", 702)
    from_app = macos.classify_probe(TMUX["results"][0], LAN_LINK, "Darwin", ONLINK, euid=501, context=vscode)
    assert (
        "from Visual Studio Code.app. Fix: allow the app the launch runs from: Visual Studio Code.app in"
        in (from_app["problem"])
    )
    assert runbook_exists(macos.RUNBOOK_LNP)


def test_the_same_answer_is_not_local_network_privacy_elsewhere():
    result = TMUX["results"][0]
    # as root: exempt
    assert macos.classify_probe(result, LAN_LINK, "Darwin", ONLINK, euid=0)["kind"] == "unreachable"
    # on Linux (errno 113 there): a neighbour that does not answer
    linux = {"result": "error", "errno": 113, "strerror": "No route to host", "elapsed": 3.1}
    verdict = macos.classify_probe(linux, LAN_LINK, "Linux", {"interface": "en0"}, euid=1000)
    assert (verdict["kind"], verdict["errno"]) == ("unreachable", "EHOSTUNREACH")
    # a peer beyond a gateway is no local network
    far = {"port": "en0", "address": "192.168.64.3", "prefix": 24, "peer_address": "8.8.8.8"}
    assert macos.on_link(far, VIA_GATEWAY) is False
    assert macos.classify_probe(result, far, "Darwin", VIA_GATEWAY, euid=501)["kind"] == "unreachable"
    # the errno number alone is named per system
    assert macos.classify_probe({"result": "error", "errno": 65}, LAN_LINK, "Darwin", ONLINK, euid=501)["kind"] == (
        "local_network_privacy"
    )


def test_answers_that_prove_the_peer_reachable_and_the_rest():
    assert macos.classify_probe(SSHD["results"][0], LAN_LINK, "Darwin", ONLINK, euid=501)["kind"] == "reachable"
    refused = {"result": "error", "errno": 61, "name": "ECONNREFUSED", "strerror": "Connection refused"}
    assert macos.classify_probe(refused, LAN_LINK, "Darwin", ONLINK)["kind"] == "reachable"
    timeout = macos.classify_probe({"result": "timeout", "elapsed": 2.0, "port": 22}, LAN_LINK, "Darwin", ONLINK)
    assert timeout["kind"] == "no_answer" and timeout["problem"] is None
    assert "Local Network Privacy" in timeout["note"]
    # the route to the peer leaves through another port (synthetic: the default route on en0)
    route = macos.parse_route_get(read(SYN / "route_get_198.18.128.2_default_en0.txt"))
    cable = {"port": "en1", "address": "198.18.128.1", "prefix": 30, "peer_address": "198.18.128.2"}
    wrong = macos.classify_probe(TMUX["results"][0], cable, "Darwin", route, euid=501)
    assert wrong["kind"] == "wrong_route"
    assert wrong["problem"] == (
        "the route to 198.18.128.2 leaves through en0, not the cable port en1: run setup.yml again (it puts back "
        "the cable's address and host route)"
    )


def test_the_probe_runs_in_the_ranks_interpreter_and_really_connects():
    """On this machine, over loopback: a listener (connected) and a closed port (refused: reachable)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            closed_port = closed.getsockname()[1]  # bound, never listening: connect() is refused
            targets = [
                {"address": "127.0.0.1", "port": port, "timeout": 2.0},
                {"address": "127.0.0.1", "port": closed_port, "timeout": 2.0},
            ]
            found = macos.probe_peers(targets, sys.executable)
    assert found["probed_with"] == sys.executable and found["note"] is None
    assert found["euid"] == os.geteuid()
    assert [r["result"] for r in found["results"]] == ["connected", "error"]
    assert found["results"][1]["name"] == "ECONNREFUSED"
    link = {"port": "lo", "address": "127.0.0.1", "prefix": 8, "peer_address": "127.0.0.1"}
    assert [macos.classify_probe(r, link, "Linux")["kind"] for r in found["results"]] == ["reachable", "reachable"]
    shell = macos.probe_peers(targets[1:], "/bin/sh")
    assert shell["probed_with"] == sys.executable and "no Python" in shell["note"]


def test_ancestry_from_this_machines_ps():
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,comm="], capture_output=True, text=True, check=True).stdout
    table = macos.parse_ps(out)
    assert table[os.getpid()][0] == os.getppid()
    parents = macos.ancestry(table, os.getpid())
    assert parents and parents[0] == Path(f"/proc/{os.getppid()}/comm").read_text().strip()


# ---- the modules ---------------------------------------------------------------------------------


@pytest.fixture
def module(monkeypatch):
    patch_exits(monkeypatch)
    return run_module


def mac_tools(tmp_path: Path, **outputs: str) -> dict[str, str]:
    """rdma_facts' command options, each a script printing a recorded output (absent: a missing command)."""
    return {name: script(tmp_path / name, text) if text is not None else str(tmp_path / "absent" / name)
            for name, text in outputs.items()}  # fmt: skip


def test_rdma_facts_on_a_mac_rules_out_the_40_gbps_cable(module, tmp_path):
    tools = mac_tools(
        tmp_path,
        rdma_ctl="enabled\n",
        ibv_devices=read(MAC / "ibv_devices_macbookpro_m5max_rdma_enabled_anonymized.txt"),
        ibv_devinfo=read(MAC / "ibv_devinfo_macbookpro_m5max_anonymized.txt"),
        system_profiler=read(MAC / "system_profiler_macbookpro_m5max_peer_tb3dock_anonymized.json"),
        networksetup=read(MAC / "networksetup_listallhardwareports_macbookpro_m5max_anonymized.txt"),
        ifconfig=read(SYN / "ifconfig_bridge0_no_members.txt"),
    )
    ok, out = module(rdma_facts, {"system": "Darwin", "ports": ["en2"], "require": True, "backend": "jaccl", **tools})
    assert not ok
    assert out["msg"] == (
        "backend jaccl needs RDMA on every cable, and this host cannot: en2: en2 (Thunderbolt 3) is linked at "
        "40 Gb/s to ACASIS TBU405Pro: a Thunderbolt 4/3 link, and RDMA does not run over it, although macOS lists "
        "rdma_en2 for it (Thunderbolt 5 needed at both ends and in the cable; JACCL over it crashes or never "
        "connects). Fix: see docs/runbooks/tb4-vs-tb5.md"
    )
    assert out["rdma"]["notes"] == []


def test_rdma_facts_on_a_mac_names_bridged_ports_and_skips_what_it_cannot_read(module, tmp_path):
    rec = transcript(REC / "macos_ibv_devinfo_v_rdma_en2_gid_table_tn3205_ABRIDGED.txt", ["ibv_devinfo -d rdma_en2 -v"])
    tools = mac_tools(
        tmp_path,
        rdma_ctl="enabled\n",
        ibv_devices=read(REC / "macos_ibv_devices_macmini_m4pro_tn3205_EXAMPLE.txt"),
        ibv_devinfo=rec["ibv_devinfo -d rdma_en2 -v"],
        system_profiler=None,
        networksetup=None,
        ifconfig=read(REC / "macos_ifconfig_bridge0_tn3205_ABRIDGED.txt"),
    )
    ok, out = module(rdma_facts, {"system": "Darwin", "ports": ["en2"], **tools})
    assert ok, out
    facts = out["rdma"]
    assert facts["usable"] is False and facts["ports"]["en2"]["bridge"] == "bridge0"
    assert facts["runbook"] == "docs/runbooks/thunderbolt-bridge.md"
    assert facts["notes"] == ["system_profiler or networksetup not found: link speeds not read"]


def test_launch_preflight_checks_the_cables_from_the_ranks_python(tmp_path):
    """The preflight as the launch agent runs it (agent_preflight: preflight(), then macos.launch_checks with
    the agent's run_command and the ranks' interpreter, as cable_checks() does) on this machine: the ranks
    run `python script.py`; the peers are loopback addresses (one listening, one refusing: both reachable);
    a sysfs tree where the first cable port is a bridge member."""
    program = tmp_path / "train.py"
    program.write_text("print('hi')\n")
    root = fake_sysfs(tmp_path / "sys", {"lo": "bridge0"}, [])
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        links = [
            {"port": "lo", "address": "127.0.0.1", "prefix": 8, "peer_address": "127.0.0.1", "peer_host": "b"},
            {"port": "lo2", "address": "127.0.0.3", "prefix": 8, "peer_address": "127.0.0.2", "peer_host": "c"},
        ]
        found = agent_preflight.preflight([sys.executable, str(program)])
        out = macos.launch_checks(
            links, agent_preflight.run_command, "Linux", interpreter=found["interpreter"], probe_port=port,
            sysfs_root=root,
        )  # fmt: skip
    assert found["problems"] == []
    assert out["probed_with"] == os.path.realpath(sys.executable)
    assert [p["kind"] for p in out["peers"]] == ["reachable", "reachable"]
    assert out["bridged"] == {"lo": "bridge0"}
    assert out["problems"] == [
        "lo is a member of bridge0: its cable address 127.0.0.1 is not used, traffic for the cable goes through "
        "the bridge. Run setup.yml again (its discovery step takes the ports out of bridge0 and keeps them "
        "out); see docs/runbooks/thunderbolt-bridge.md"
    ]
    plain = agent_preflight.check_host({"preflight": {"argv": [sys.executable, str(program)]}, "facts": False})
    assert plain["preflight"]["problems"] == [] and "peers" not in plain["preflight"]  # no cables: no cable checks


def test_the_planner_does_not_choose_jaccl_over_a_tb4_cable():
    """Two Macs, one cable: the M4 Max's en3 (recorded at 40 Gb/s) to the other Mac's en2. Both ends have an
    ACTIVE device (TN3205's rdma_en2, as above); the planner reads `device` and `state` of the RDMA facts, and
    with the 40 Gb/s end it falls back to the ring backend, naming the end and the speed."""
    from meshkit.topology import (
        Observation,
        TopologyError,
        build_plan,
    )

    tn = transcript(REC / "macos_ibv_devinfo_v_rdma_en2_gid_table_tn3205_ABRIDGED.txt", ["ibv_devinfo -d rdma_en2 -v"])
    (en2,) = rdma.parse_ibv_devinfo(tn["ibv_devinfo -d rdma_en2 -v"])
    en3 = dataclasses.replace(en2, device="rdma_en3", netdev="en3")
    links = links_of(
        "system_profiler_macbookpro_m4max_TRIMMED_tb5_and_tb4_links.json",
        "networksetup_listallhardwareports_macbookpro_m4max_TRIMMED.txt",
    )
    mbp = rdma.host_facts("Darwin", [en3], ["en3"], True, ["rdma_en3"], links=links)
    studio = rdma.host_facts("Darwin", [en2], ["en2"], True, ["rdma_en2"])
    observations = [
        Observation("mbp", "en3", "UUID-MBP-3", ["UUID-STUDIO-2"], "40 Gb/s", "rdma_en3"),
        Observation("studio", "en2", "UUID-STUDIO-2", ["UUID-MBP-3"], "80 Gb/s", "rdma_en2"),
    ]
    rdma_ports = {"mbp": mbp["ports"], "studio": studio["ports"]}
    plan = build_plan(["mbp", "studio"], observations, rdma=rdma_ports).as_dict()
    assert (plan["backend"], plan["backend_reason"]) == ("ring", "ring through 2 hosts (no RDMA)")
    with pytest.raises(TopologyError, match=r"no RDMA on: mbp:en3 \(en3 \(Thunderbolt 3\) is linked at 40 Gb/s"):
        build_plan(["mbp", "studio"], observations, backend="jaccl", rdma=rdma_ports)
    # the same cable with the device counted (what the facts said before): jaccl
    listed = {"mbp": {"en3": {**mbp["ports"]["en3"], "device": "rdma_en3"}}, "studio": studio["ports"]}
    assert build_plan(["mbp", "studio"], observations, rdma=listed).as_dict()["backend"] == "jaccl"
