"""Reboots that are real, on labs reached as real clusters are (a sudo login user, hosts by name) whose
hosts run systemd-networkd: a host rebooted after setup.yml gets its cables back through networkd
alone, from the files setup.yml persisted; setup.yml then changes nothing and a launch works. A host
configured the way mlx.distributed_config does it (runtime `ip` commands only) loses it all by the
same reboot."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import LabHandle, drop_lab, ip_json, launch_allreduce, new_lab, run_playbook, sh
from .test_lab import settled_state

REAL = {"lab_access": "sudo", "lab_names": True, "lab_network_daemon": "networkd"}


FACTORY: dict[str, dict[str, Any]] = {}  # every host of the module's lab as built, before setup.yml


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabHandle, Path]]:
    """A 4-host ring, sudo + names + networkd, converged by setup.yml (as the login user, with become); what
    every host had before setup.yml is kept in FACTORY (for the undo tests at the end)."""
    handle = new_lab(tag="r", lab_size=4, lab_shape="ring", **REAL)
    artifacts = tmp_path_factory.mktemp("reboot-artifacts")
    try:
        built = handle.up()
        assert built.rc == 0, built.output
        FACTORY.clear()
        FACTORY.update({host: snapshot(handle, host) for host in handle.hosts()})
        run = setup(handle, artifacts)
        assert run.rc == 0, run.output
        yield handle, artifacts
    finally:
        drop_lab(handle)


def snapshot(handle: LabHandle, host: str) -> dict[str, Any]:
    """What undo must give back, as the kernel and the host's disk show it: `ip -j link`, `ip -j addr` and
    `ip -j route` less counters and what the kernel assigns anew (interface indexes, address lifetimes, the
    peer's namespace id), the systemd-networkd directory, meshkit's state directory."""
    ns = netns(handle, host)
    links = {
        link["ifname"]: {k: v for k, v in link.items() if k not in ("ifindex", "link_index", "link_netnsid", "link")}
        for link in ip_json("-n", ns, "link", "show")
    }
    addrs = {
        a["ifname"]: sorted(
            (i["family"], i["local"], i["prefixlen"], i.get("scope"), i.get("broadcast", "")) for i in a["addr_info"]
        )
        for a in ip_json("-n", ns, "addr", "show")
    }
    routes = sorted(json.dumps(r, sort_keys=True) for r in ip_json("-n", ns, "route", "show"))
    root = Path(f"/proc/{holders(handle)[host]}/root")
    base = root / "etc/systemd/network"
    network = {str(p.relative_to(base)): p.read_text() for p in sorted(base.rglob("*")) if p.is_file()}
    state = sorted(str(p.relative_to(root)) for p in (root / "var/lib/meshkit").iterdir())
    return {"link": links, "addr": addrs, "route": routes, "networkd": network, "state_dir": state}


def differences(want: dict[str, Any], have: dict[str, Any]) -> list[str]:
    out = []
    for part, wanted in want.items():
        got = have[part]
        if wanted == got:
            continue
        if isinstance(wanted, dict):
            out += [
                f"{part} {key}: {wanted.get(key)} != {got.get(key)}"
                for key in sorted(set(wanted) | set(got))
                if wanted.get(key) != got.get(key)
            ]
        else:
            out.append(f"{part}: {wanted} != {got}")
    return out


def wait_for_factory(handle: LabHandle, timeout: float = 90.0) -> dict[str, list[str]]:
    """Wait until every host is as it was before setup.yml (a bridge port forwards, and the bridge gets its
    link-local address, only once STP has passed it through listening and learning); what still differs
    per host at the deadline (empty: every host is back)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {h: d for h in FACTORY if (d := differences(FACTORY[h], snapshot(handle, h)))}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def setup(handle: LabHandle, artifacts: Path) -> Any:
    return run_playbook("setup.yml", "-e", f"meshkit_artifacts_dir={artifacts}", inventory=str(handle.inventory))


def holders(handle: LabHandle) -> dict[str, int]:
    return json.loads((handle.dir / "state.json").read_text())["holders"]


def netns(handle: LabHandle, host: str) -> str:
    return handle.hosts()[host]["meshkit_lab_netns"]


def in_host(handle: LabHandle, host: str, *argv: str, check: bool = True) -> Any:
    """A command inside a lab host, entered from the machine (no meshkit, no Ansible)."""
    return sh("nsenter", "-t", str(holders(handle)[host]), "-n", "-m", "-u", "-i", "-p", "--", *argv, check=check)


def ipv4(handle: LabHandle, host: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for link in ip_json("-n", netns(handle, host), "addr", "show"):
        out[link["ifname"]] = [
            f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a["family"] == "inet"
        ]
    return out


def bridge_members(handle: LabHandle, host: str) -> list[str]:
    return sorted(link["ifname"] for link in ip_json("-n", netns(handle, host), "link", "show", "master", "bridge0"))


def ping(handle: LabHandle, host: str, port: str, address: str) -> bool:
    proc = sh(
        "ip", "netns", "exec", netns(handle, host), "ping", "-c", "1", "-W", "2", "-I", port, address, check=False
    )
    return proc.returncode == 0


def reboot(handle: LabHandle, host: str) -> Any:
    run = handle.up(lab_reboot=host)
    assert run.rc == 0, run.output
    shown = re.search(
        r"rebooted\s+\S+:\s+booted\s+in\s+([0-9.]+)\s+s,\s+the\s+lab\s+settled\s+([0-9.]+)\s+s", run.output
    )
    assert shown, run.output
    print(f"\n{handle.name}: rebooted {host}: booted in {shown.group(1)} s, settled {shown.group(2)} s later")
    return run


def test_a_rebooted_host_gets_its_cables_back_through_networkd_alone(lab):
    handle, artifacts = lab
    plan = json.loads((artifacts / "plan.json").read_text())
    cables = [c for c in plan["cables"] if "node2" in (c["ends"][0]["host"], c["ends"][1]["host"])]
    assert len(cables) == 2
    mgmt = handle.hosts()["node2"]
    # Runtime-only state a reboot must take away: an address, a route, a sysctl, a process.
    ns = netns(handle, "node2")
    sh("ip", "-n", ns, "addr", "add", "192.0.2.77/32", "dev", "lo")
    sh("ip", "-n", ns, "route", "add", "203.0.113.0/24", "dev", "mgmt0")
    sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
    in_host(handle, "node2", "sh", "-c", "sleep 600 >/dev/null 2>&1 &")
    old_init = holders(handle)["node2"]
    pid_ns = os.stat(f"/proc/{old_init}/ns/pid").st_ino
    sleepers = [p for p in _pids_in(pid_ns) if _cmd(p).startswith("sleep 600")]
    assert len(sleepers) == 1, sleepers

    reboot(handle, "node2")

    # Its processes ended: the old init and everything under it are gone from the machine.
    assert holders(handle)["node2"] != old_init
    assert not Path(f"/proc/{old_init}").exists()
    assert not sleepers[0].exists()
    assert _pids_in(pid_ns) == []
    # Its runtime network state is gone.
    assert "192.0.2.77/32" not in ipv4(handle, "node2").get("lo", [])
    assert not [r for r in ip_json("-n", ns, "route", "show") if r.get("dst") == "203.0.113.0/24"]
    assert in_host(handle, "node2", "cat", "/proc/sys/net/ipv4/ip_forward").stdout.strip() == "0"
    # Without meshkit running: every cable of node2 carries its planned address (networkd applied
    # meshkit's files), and pings across from both ends; bridge0 holds no peer port; the management
    # link is up, and the host is settled.
    addrs = ipv4(handle, "node2")
    for c in cables:
        mine, theirs = c["ends"] if c["ends"][0]["host"] == "node2" else reversed(c["ends"])
        assert addrs[mine["port"]] == [f"{mine['address']}/{ipaddress.IPv4Network(c['network']).prefixlen}"], addrs
        assert ping(handle, "node2", mine["port"], theirs["address"]), (mine, theirs)
        assert ping(handle, theirs["host"], theirs["port"], mine["address"]), (theirs, mine)
        status = json.loads(in_host(handle, "node2", "networkctl", "status", "--json=short", mine["port"]).stdout)
        assert status["NetworkFile"] == f"/etc/systemd/network/00-meshkit-{mine['port']}.network", status
    assert bridge_members(handle, "node2") == []
    mgmt_link = ip_json("-n", ns, "link", "show", "mgmt0")[0]
    assert "UP" in mgmt_link["flags"] and "LOWER_UP" in mgmt_link["flags"]
    assert f"{handle.subnet.rsplit('.', 1)[0]}.3/24" in addrs["mgmt0"]
    assert mgmt["ansible_host"] == f"node2.{handle.name}.meshkit.test"
    assert settled_state(handle) == {}
    hello = handle.ansible("-b", "-m", "ansible.builtin.command", "-a", "id -un", pattern="node2")
    assert hello.returncode == 0 and "root" in hello.stdout, hello.stdout + hello.stderr


def test_setup_after_the_reboot_changes_nothing_and_a_launch_works(lab):
    handle, artifacts = lab
    again = setup(handle, artifacts)
    assert again.rc == 0, again.output
    assert set(again.recap) == {"node1", "node2", "node3", "node4"}
    assert again.changed == 0, again.output
    run, summary = launch_allreduce(handle, artifacts, f"r{uuid.uuid4().hex[:10]}")
    assert summary["ok"], summary
    assert [(r["rank"], r["state"], r["exit_code"]) for r in summary["ranks"]] == [(r, "ok", 0) for r in range(4)]
    assert re.search(r"meshccl rank \d/4 on node2: all_reduce exact", run.output), run.output


class ManagementWatch:
    """Watches every host's management link from the machine while a playbook runs (no Ansible, no SSH):
    each moment mgmt0 is not up with carrier and its address is noted."""

    def __init__(self, handle: LabHandle) -> None:
        self.hosts = {h: (netns(handle, h), FACTORY[h]["addr"]["mgmt0"]) for h in handle.hosts()}
        self.lapses: list[str] = []
        self.looks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for host, (ns, ip) in self.hosts.items():  # ip: mgmt0's addresses before setup
                link = (ip_json("-n", ns, "addr", "show", "dev", "mgmt0") or [{}])[0]
                flags = link.get("flags", [])
                have = sorted(
                    (i["family"], i["local"], i["prefixlen"], i.get("scope"), i.get("broadcast", ""))
                    for i in link.get("addr_info", [])
                )
                if "UP" not in flags or "LOWER_UP" not in flags or have != ip:
                    self.lapses.append(f"{host}: mgmt0 flags {flags}, addresses {have}")
            self.looks += 1
            self._stop.wait(0.5)

    def __enter__(self) -> ManagementWatch:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


def teardown(handle: LabHandle, *extra: str) -> Any:
    return run_playbook("teardown.yml", *extra, inventory=str(handle.inventory))


def test_undo_check_mode_names_every_change_and_changes_nothing(lab):
    handle, _artifacts = lab
    converged = {h: snapshot(handle, h) for h in FACTORY}
    run = teardown(handle, "--check", "--diff")
    assert run.rc == 0, run.output
    assert run.changed > 0
    for host in FACTORY:
        assert differences(converged[host], snapshot(handle, host)) == [], host
    # The exact commands, per host: the cables' addresses, then each port back into bridge0.
    assert re.search(r"ip addr del 198\.18\.\d+\.\d+/30 dev tb0", run.output), run.output
    assert "ip link set dev tb0 master bridge0" in run.output
    assert "00-meshkit-tb0.network" in run.output and "record.json" in run.output


def test_undo_gives_every_host_back_what_it_had_before_setup(lab):
    handle, _artifacts = lab
    with ManagementWatch(handle) as watch:
        run = teardown(handle)
    assert run.rc == 0, run.output
    assert set(run.recap) == set(FACTORY)
    assert watch.looks > 0 and watch.lapses == []
    # ip link, addr and route, the networkd directory and meshkit's state directory: as before setup.yml.
    assert wait_for_factory(handle) == {}
    for host in FACTORY:
        assert bridge_members(handle, host) == ["tb0", "tb1"]
    hello = handle.ansible("-b", "-m", "ansible.builtin.command", "-a", "id -un")
    assert hello.returncode == 0 and hello.stdout.count("root") == 4, hello.stdout + hello.stderr

    again = teardown(handle)
    assert again.rc == 0, again.output
    assert again.changed == 0, again.output


def test_a_reboot_after_undo_brings_back_none_of_meshkits_configuration(lab):
    handle, _artifacts = lab
    reboot(handle, "node2")
    assert wait_for_factory(handle) == {}
    assert bridge_members(handle, "node2") == ["tb0", "tb1"]
    assert ipv4(handle, "node2")["tb0"] == [] and ipv4(handle, "node2")["tb1"] == []
    assert settled_state(handle) == {}


def test_a_runtime_only_configuration_is_lost_by_the_same_reboot():
    """Two hosts cabled and addressed the mlx.distributed_config way: `ip` commands, nothing persisted.
    Hosts without a network daemon (on a networkd host, networkd itself puts a port it manages back
    into its bridge within a second of `ip link set ... nomaster`, no reboot needed): the addresses
    hold until the reboot, which brings back the factory network only."""
    handle = new_lab(tag="m", lab_size=2, lab_shape="line", **{**REAL, "lab_network_daemon": "none"})
    try:
        built = handle.up()
        assert built.rc == 0, built.output
        address = {"node1": "192.168.77.1", "node2": "192.168.77.2"}
        for host, ip in address.items():
            done = handle.ansible(
                "-b",
                "-m",
                "ansible.builtin.shell",
                "-a",
                f"ip link set tb0 nomaster && ip addr add {ip}/30 dev tb0 && ip link set tb0 up",
                pattern=host,
            )
            assert done.returncode == 0, done.stdout + done.stderr
        assert ping(handle, "node1", "tb0", address["node2"])
        assert bridge_members(handle, "node2") == []

        reboot(handle, "node2")

        # node2 booted into its factory network: tb0 back in bridge0, no address; the cable is dead.
        assert ipv4(handle, "node2")["tb0"] == []
        assert bridge_members(handle, "node2") == ["tb0"]
        assert ipv4(handle, "node1")["tb0"] == [f"{address['node1']}/30"]  # node1 was not rebooted
        assert not ping(handle, "node1", "tb0", address["node2"])
        assert settled_state(handle) == {}
    finally:
        drop_lab(handle)


def _pids_in(pid_ns: int) -> list[Path]:
    """Every process of the machine in a PID namespace."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.stat(proc / "ns" / "pid").st_ino == pid_ns:
                found.append(proc)
        except OSError:
            continue
    return found


def _cmd(proc: Path) -> str:
    try:
        return proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
