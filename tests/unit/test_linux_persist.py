"""Persistence of the peer-port configuration through systemd-networkd or NetworkManager."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import linux_persist as lp

PORT = {"port": "thunderbolt0", "address": "198.18.128.1", "prefix": 30, "peer_address": "198.18.128.2"}


def fake(answers: dict[tuple[str, ...], tuple[int, str, str]], calls: list[list[str]]):
    def run(argv: list[str]) -> tuple[int, str, str]:
        calls.append(argv)
        return answers.get(tuple(argv), (1, "", "not answered"))

    return run


def fake_proc(root: Path, procs: dict[int, tuple[str, str, str]]) -> str:
    """A /proc with ``self`` and processes {pid: (comm, argv0, netns)}; a netns is a file whose
    inode stands for the namespace (hard links: the same namespace)."""
    (root / "ns").mkdir(parents=True)
    for name in ("ours", "other"):
        (root / "ns" / name).write_text(name)
    entries = {"self": ("python3", "/usr/bin/python3", "ours"), **{str(k): v for k, v in procs.items()}}
    for pid, (comm, argv0, netns) in entries.items():
        (root / pid / "ns").mkdir(parents=True)
        (root / pid / "comm").write_text(comm + "\n")
        (root / pid / "cmdline").write_bytes(argv0.encode() + b"\0--flag\0")
        os.link(root / "ns" / netns, root / pid / "ns" / "net")
    return str(root)


def test_detect_finds_networkd_in_the_process_table_of_its_own_network_namespace(tmp_path):
    have_all = lambda _b: True  # noqa: E731
    calls: list[list[str]] = []
    # A lab host (or a container): no systemd as PID 1, systemctl cannot answer; networkd runs.
    networkd = ("systemd-network", "/lib/systemd/systemd-networkd", "ours")
    lab_host = fake_proc(tmp_path / "a", {1: ("python3", "/usr/bin/python3", "ours"), 15: networkd})
    assert lp.detect(fake({}, calls), have_all, lab_host) == "networkd"
    assert calls == []  # the process table was enough
    # The same name in another network namespace (a container's own networkd) does not count,
    # nor a process that only shares the 15-character name.
    others = fake_proc(tmp_path / "b", {15: ("systemd-network", "/lib/systemd/systemd-networkd", "other"),
                                        16: ("systemd-network", "/opt/systemd-networkd-exporter", "ours")})  # fmt: skip
    assert lp.networkd_running(others) is False
    assert lp.detect(fake({}, []), have_all, others) is None
    # No networkctl to reload it: not networkd, even when it runs.
    assert lp.detect(fake({}, []), lambda b: b != "networkctl", lab_host) is None


def test_detect_falls_back_to_systemd_then_networkmanager_else_runtime(tmp_path):
    have_all = lambda _b: True  # noqa: E731
    empty = fake_proc(tmp_path, {})
    networkd = fake({("systemctl", "is-active", "systemd-networkd"): (0, "active\n", "")}, [])
    assert lp.detect(networkd, have_all, empty) == "networkd"
    nm = fake(
        {
            ("systemctl", "is-active", "systemd-networkd"): (3, "inactive\n", ""),
            ("nmcli", "-t", "-g", "RUNNING", "general"): (0, "running\n", ""),
        },
        [],
    )
    assert lp.detect(nm, have_all, empty) == "networkmanager"
    calls: list[list[str]] = []
    assert lp.detect(fake({}, calls), lambda _b: False, empty) is None
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


def test_networkd_bridge_down_keeps_the_bridge_down_at_boot(tmp_path):
    path, content = lp.networkd_bridge_down(str(tmp_path), "bridge0")
    assert path == str(tmp_path / "00-meshkit-bridge0.network")
    assert "[Match]\nName=bridge0\n" in content
    assert "ActivationPolicy=down" in content
    assert sorted([os.path.basename(path), "20-bridge0.network"])[0] == "00-meshkit-bridge0.network"


def test_port_of_a_meshkit_file_or_dropin():
    assert lp.networkd_port_of("/etc/systemd/network/00-meshkit-tb0.network") == (
        "tb0",
        "/etc/systemd/network/00-meshkit-tb0.network",
    )
    assert lp.networkd_port_of("/etc/systemd/network/00-meshkit-tb0.network.d/50-address.conf") == (
        "tb0",
        "/etc/systemd/network/00-meshkit-tb0.network",
    )
    assert lp.networkd_port_of("/etc/systemd/network/30-tb.network") is None


def status_of(files: dict[str, str]):
    """networkctl status --json=short answers: {port: the NetworkFile networkd reports}."""
    return {
        ("networkctl", "status", "--json=short", port): (0, json.dumps({"Name": port, "NetworkFile": f}), "")
        for port, f in files.items()
    }


def test_not_applied_names_a_port_that_another_file_configures(tmp_path):
    sys_root = tmp_path / "sys"
    for port in ("tb0", "tb1"):
        (sys_root / "class" / "net" / port).mkdir(parents=True)
    net = "/etc/systemd/network"
    changes = [
        {"path": f"{net}/00-meshkit-tb0.network", "before": "", "after": "x"},
        {"path": f"{net}/00-meshkit-tb1.network.d/50-address.conf", "before": "", "after": "x"},
        {"path": f"{net}/00-meshkit-tb9.network", "before": "", "after": "x"},  # no such port now
        {"path": f"{net}/00-meshkit-tb2.network.d/50-address.conf", "before": "x", "after": ""},  # removed
    ]
    good = fake(status_of({"tb0": f"{net}/00-meshkit-tb0.network", "tb1": f"{net}/00-meshkit-tb1.network"}), [])
    assert lp.networkd_not_applied(good, changes, str(sys_root), timeout=0) == []
    calls: list[list[str]] = []
    bad = fake(status_of({"tb0": f"{net}/00-meshkit-tb0.network", "tb1": f"{net}/10-eth.network"}), calls)
    assert lp.networkd_not_applied(bad, changes, str(sys_root), timeout=0.3, interval=0.1) == [
        f"tb1: configured from {net}/10-eth.network, not {net}/00-meshkit-tb1.network"
    ]
    assert len(calls) >= 4  # it asked again until the deadline
    unmanaged = fake({}, [])
    assert lp.networkd_not_applied(unmanaged, changes[:1], str(sys_root), timeout=0) == [
        f"tb0: configured from no file (not answered), not {net}/00-meshkit-tb0.network"
    ]


class FakeModule:
    check_mode = False

    def fail_json(self, **kwargs):
        raise RuntimeError(kwargs["msg"])


def test_module_write_fails_clearly_when_networkd_cannot_reload(tmp_path):
    files = lp.FileSet()
    path, content = lp.networkd_port(str(tmp_path), "tb0")
    files.wanted[path] = content
    no_bus = fake({("networkctl", "reload"): (1, "", "Failed to connect system bus: No such file or directory\n")}, [])
    with pytest.raises(RuntimeError) as info:
        lp.module_write(FakeModule(), no_bus, files, files.changes())
    assert "networkctl reload failed (rc=1): Failed to connect system bus" in str(info.value)
    assert "systemd-networkd did not re-read them" in str(info.value)
    assert os.path.exists(path)  # written: the next run has nothing to write, only the reload to redo
    calls: list[list[str]] = []
    fine = fake({("networkctl", "reload"): (0, "", "")}, calls)
    lp.module_write(FakeModule(), fine, files, [])
    assert calls == []  # nothing changed: no reload


def test_module_write_checks_on_every_run_that_networkd_uses_meshkits_files(tmp_path):
    # A run with nothing to write still fails when another file (one that sorts first, added since)
    # configures a port: a second run must not pass just because the first one wrote the files.
    # "lo" stands for a port that exists on this machine (the check skips ports that do not).
    files = lp.FileSet()
    path, content = lp.networkd_port(str(tmp_path), "lo")
    files.wanted[path] = content
    files.apply()
    other = fake(status_of({"lo": "/etc/systemd/network/00-aaa.network"}), [])
    with pytest.raises(RuntimeError) as info:
        lp.module_write(FakeModule(), other, files, files.changes())
    assert f"lo: configured from /etc/systemd/network/00-aaa.network, not {path}" in str(info.value)
    ours = fake(status_of({"lo": path}), [])
    lp.module_write(FakeModule(), ours, files, files.changes())  # no failure
    old = fake(
        {("networkctl", "status", "--json=short", "lo"): (1, "", "networkctl: unrecognized option '--json=short'\n")},
        [],
    )
    lp.module_write(FakeModule(), old, files, files.changes())  # systemd < 250: nothing to check with
