"""Persistence of the peer-port configuration through systemd-networkd or NetworkManager."""

from __future__ import annotations

import os
from pathlib import Path

from ansible_collections.meshkit.cluster.plugins.module_utils import linux_persist as lp

PORT = {"port": "thunderbolt0", "address": "198.18.128.1", "prefix": 30, "peer_address": "198.18.128.2"}


def fake(answers: dict[tuple[str, ...], tuple[int, str, str]], calls: list[list[str]]):
    def run(argv: list[str]) -> tuple[int, str, str]:
        calls.append(argv)
        return answers.get(tuple(argv), (1, "", "not answered"))

    return run


def test_detect_prefers_networkd_then_networkmanager_else_runtime():
    have_all = lambda _b: True  # noqa: E731
    networkd = fake({("systemctl", "is-active", "systemd-networkd"): (0, "active\n", "")}, [])
    assert lp.detect(networkd, have_all) == "networkd"
    nm = fake(
        {
            ("systemctl", "is-active", "systemd-networkd"): (3, "inactive\n", ""),
            ("nmcli", "-t", "-g", "RUNNING", "general"): (0, "running\n", ""),
        },
        [],
    )
    assert lp.detect(nm, have_all) == "networkmanager"
    calls: list[list[str]] = []
    assert lp.detect(fake({}, calls), lambda _b: False) is None
    assert calls == []  # no binary, no command run
    assert "runtime only" in lp.describe(None)


def test_networkd_port_file_keeps_the_port_out_of_any_bridge(tmp_path):
    path, content = lp.networkd_port(str(tmp_path), "thunderbolt0")
    assert path == str(tmp_path / "00-meshkit-thunderbolt0.network")
    assert "[Match]\nName=thunderbolt0\n" in content
    assert "Bridge=" not in content
    assert "ConfigureWithoutCarrier=yes" in content


def test_networkd_address_dropin(tmp_path):
    path, content = lp.networkd_address(str(tmp_path), PORT, 9000)
    assert path == str(tmp_path / "00-meshkit-thunderbolt0.network.d" / "50-address.conf")
    assert "Address=198.18.128.1/30\n" in content
    assert "[Route]\nDestination=198.18.128.2/32\nPreferredSource=198.18.128.1\n" in content
    assert "MTUBytes=9000" in content
    assert "MTUBytes" not in lp.networkd_address(str(tmp_path), PORT, None)[1]


def test_fileset_writes_once_then_reports_no_change_and_removes_stale(tmp_path):
    files = lp.FileSet()
    path, content = lp.networkd_address(str(tmp_path), PORT, None)
    files.wanted[path] = content
    assert [c["path"] for c in files.changes()] == [path]
    files.apply()
    assert Path(path).read_text() == content
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    assert files.changes() == []
    # thunderbolt0 lost its cable: its drop-in is stale and goes, with its empty directory.
    assert lp.networkd_stale_dropins(str(tmp_path), {"thunderbolt1"}) == [path]
    assert lp.networkd_stale_dropins(str(tmp_path), {"thunderbolt0"}) == []
    gone = lp.FileSet({path: None})
    assert gone.changes()[0]["after"] == ""
    gone.apply()
    assert not os.path.exists(os.path.dirname(path))


NM_SHOW = ("nmcli", "-t", "-f", "NAME,TYPE,DEVICE", "connection", "show")
SLAVE_KEYS = "connection.master,connection.interface-name,connection.autoconnect"


def test_networkmanager_bridge_slaves_stop_autoconnecting_and_ports_get_profiles():
    calls: list[list[str]] = []
    run = fake(
        {
            NM_SHOW: (
                0,
                "bridge0:bridge:bridge0\nbridge-slave-tb0:ethernet:thunderbolt0\nWired\\: 1:ethernet:eth0\n",
                "",
            ),
            ("nmcli", "-t", "-g", SLAVE_KEYS, "connection", "show", "bridge-slave-tb0"): (
                0,
                "bridge0\nthunderbolt0\nyes\n",
                "",
            ),
            ("nmcli", "-t", "-g", SLAVE_KEYS, "connection", "show", "Wired: 1"): (0, "\neth0\nyes\n", ""),
            ("nmcli", "-t", "-g", SLAVE_KEYS, "connection", "show", "bridge0"): (0, "\nbridge0\nyes\n", ""),
        },
        calls,
    )
    assert lp.nm_bridge_commands(run, ["thunderbolt0"], "bridge0") == [
        ["nmcli", "connection", "modify", "bridge-slave-tb0", "connection.autoconnect", "no"],
        [
            "nmcli", "connection", "add", "type", "ethernet", "con-name", "meshkit-thunderbolt0",
            "ifname", "thunderbolt0", "ipv4.method", "disabled", "ipv6.method", "link-local",
            "connection.autoconnect", "yes",
        ],
    ]  # fmt: skip


def test_networkmanager_address_only_what_differs():
    keys = "ipv4.method,ipv4.addresses,ipv4.routes,802-3-ethernet.mtu"
    show = ("nmcli", "-t", "-g", keys, "connection", "show", "meshkit-thunderbolt0")
    fresh = fake({show: (0, "disabled\n\n\nauto\n", "")}, [])
    assert lp.nm_address_commands(fresh, [PORT], None) == [
        [
            "nmcli", "connection", "modify", "meshkit-thunderbolt0",
            "ipv4.method", "manual", "ipv4.addresses", "198.18.128.1/30", "ipv4.routes", "198.18.128.2/32",
        ]
    ]  # fmt: skip
    done = fake({show: (0, "manual\n198.18.128.1/30\n198.18.128.2/32 0\nauto\n", "")}, [])
    assert lp.nm_address_commands(done, [PORT], None) == []
    missing = fake({}, [])
    cmds = lp.nm_address_commands(missing, [PORT], 9000)
    assert cmds[0][:4] == ["nmcli", "connection", "add", "type"]
    assert cmds[1][-2:] == ["802-3-ethernet.mtu", "9000"]
