"""Undo on the Linux path (bridge_detach and peer_link with state absent), on recorded `ip -j` outputs of a lab
host (tests/fixtures/linux/: node1 as the lab builds it, and as setup.yml leaves it): the record setup keeps
before its first change, the exact commands and files undo plans from it, refusals without a record, and
nothing mutated in check mode. The lab test (tests/integration/test_reboot.py) runs the same on real hosts."""

from __future__ import annotations

import json

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import host_record
from ansible_collections.meshkit.cluster.plugins.modules import bridge_detach, peer_link

from .module_harness import Fail
from .test_modules_linux import MGMT, NETWORKD, POOL, PORT, RUNTIME, linux, recorded  # noqa: F401 - the fixture

ADDR = ("ip", "-j", "addr", "show")
ROUTE = ("ip", "-j", "-4", "route", "show", "table", "main")


def detached() -> dict:
    """After setup's bridge step, before any address: tb0 out of bridge0, bridge0 down, no IPv4 on tb0."""
    return {**recorded("converged"), ADDR: recorded("fresh")[ADDR], ROUTE: recorded("fresh")[ROUTE], **NETWORKD}


@pytest.fixture
def dirs(tmp_path):
    network, state = tmp_path / "network", tmp_path / "state"
    network.mkdir()
    return network, state


def test_setup_records_the_host_before_its_first_change_and_keeps_the_first_record(linux, dirs):  # noqa: F811
    network, state = dirs
    args = {"management_address": MGMT, "peer_ports": ["tb*"], "networkd_dir": str(network), "state_dir": str(state)}
    result, _ = linux(bridge_detach, args, {**recorded("fresh"), **NETWORKD})
    assert result["record"] == str(state / "record.json")
    record = json.loads((state / "record.json").read_text())
    assert record["version"] == 1 and record["platform"] == "Linux" and record["meshkit_found"] == []
    assert record["management_interface"] == "mgmt0"
    assert record["ports"] == {
        "tb0": {
            "master": "bridge0",
            "mtu": 1500,
            "up": True,
            "addrgenmode": "eui64",
            "link_local": ["fe80::54ee:ddff:feaa:532a"],
        }
    }
    assert record["bridges"] == {"bridge0": {"exists": True, "up": True}}
    assert record["persistence"] == "networkd" and record["state_dir_existed"] is False
    assert str(state / "record.json") in result["diff"]["after"]
    # A later step (and a later run) keeps the first record: what the host had before meshkit.
    link_args = {"ports": [PORT], "pool": POOL, "peer_ports": ["tb*"], "management_address": MGMT,
                 "networkd_dir": str(network), "state_dir": str(state)}  # fmt: skip
    again, _ = linux(peer_link, link_args, detached())
    assert json.loads((state / "record.json").read_text()) == record
    assert str(state / "record.json") not in again["diff"]["after"]


def test_check_mode_records_nothing_and_says_it_would(linux, dirs):  # noqa: F811
    network, state = dirs
    args = {"management_address": MGMT, "peer_ports": ["tb*"], "networkd_dir": str(network), "state_dir": str(state)}
    result, mutating = linux(bridge_detach, args, {**recorded("fresh"), **NETWORKD}, check_mode=True)
    assert mutating == [] and not state.exists()
    assert result["changed"] and '"master": "bridge0"' in result["diff"]["after"]


def test_a_record_taken_after_meshkit_configured_the_host_lists_what_it_found(linux, dirs):  # noqa: F811
    network, state = dirs
    (network / "00-meshkit-tb0.network").write_text("[Match]\nName=tb0\n")
    args = {"management_address": MGMT, "peer_ports": ["tb*"], "networkd_dir": str(network), "state_dir": str(state)}
    linux(bridge_detach, args, {**recorded("converged"), **NETWORKD})
    record = json.loads((state / "record.json").read_text())
    assert record["meshkit_found"] == [str(network / "00-meshkit-tb0.network")]
    assert not host_record.trusted(record)


def setup_then(linux, network, state):  # noqa: F811
    """setup's two steps on node1 with networkd: the record, meshkit's files, the address (recorded states)."""
    args = {"management_address": MGMT, "peer_ports": ["tb*"], "networkd_dir": str(network), "state_dir": str(state)}
    linux(bridge_detach, args, {**recorded("fresh"), **NETWORKD})
    link_args = {"ports": [PORT], "pool": POOL, "peer_ports": ["tb*"], "management_address": MGMT,
                 "networkd_dir": str(network), "state_dir": str(state)}  # fmt: skip
    linux(peer_link, link_args, detached())
    assert sorted(p.name for p in network.iterdir()) == [
        "00-meshkit-bridge0.network",
        "00-meshkit-tb0.network",
        "00-meshkit-tb0.network.d",
    ]


def undo_args(network, state, **more):
    return {"state": "absent", "pool": POOL, "peer_ports": ["tb*"], "management_address": MGMT,
            "networkd_dir": str(network), "state_dir": str(state), **more}  # fmt: skip


def test_undo_takes_the_address_off_then_puts_the_port_back_into_the_bridge(linux, dirs):  # noqa: F811
    network, state = dirs
    setup_then(linux, network, state)
    # The bridge waits for the addresses: undoing it first is refused, and changes nothing.
    refused, mutating = linux(
        bridge_detach, undo_args(network, state), {**recorded("converged"), **NETWORKD}, expect=Fail
    )
    assert "tb0 (198.18.128.1/30)" in refused["msg"] and "peer_network role with state absent" in refused["msg"]
    assert mutating == [] and (state / "record.json").exists()

    links, mutating = linux(peer_link, undo_args(network, state), {**recorded("converged"), **NETWORKD})
    assert mutating == [
        ["ip", "route", "del", "198.18.128.2/32", "dev", "tb0"],
        ["ip", "addr", "del", "198.18.128.1/30", "dev", "tb0"],
        ["networkctl", "reload"],
    ]
    assert links["removed_addresses"] == {"tb0": ["198.18.128.1/30"]}
    assert not (network / "00-meshkit-tb0.network.d").exists()
    assert (state / "record.json").exists()  # the bridge's undo reads it

    bridge, mutating = linux(bridge_detach, undo_args(network, state), detached())
    assert mutating == [
        ["ip", "link", "set", "dev", "tb0", "master", "bridge0"],
        ["ip", "link", "set", "dev", "bridge0", "up"],
        ["networkctl", "reload"],
    ]
    assert list(network.iterdir()) == []
    # The record goes last, and the state directory setup made (empty now) with it.
    assert bridge["removed"] == [str(state / "record.json"), str(state)]
    assert not state.exists()


def test_a_second_undo_changes_nothing(linux, dirs):  # noqa: F811
    network, state = dirs
    links, mutating = linux(peer_link, undo_args(network, state), {**recorded("fresh"), **NETWORKD})
    assert links["changed"] is False and mutating == []
    bridge, mutating = linux(bridge_detach, undo_args(network, state), {**recorded("fresh"), **NETWORKD})
    assert bridge["changed"] is False and mutating == []


def test_undo_check_mode_shows_the_commands_and_changes_nothing(linux, dirs):  # noqa: F811
    network, state = dirs
    setup_then(linux, network, state)
    before = sorted(str(p) for p in network.rglob("*"))
    links, mutating = linux(
        peer_link, undo_args(network, state), {**recorded("converged"), **NETWORKD}, check_mode=True
    )
    assert mutating == [] and links["changed"]
    assert "ip addr del 198.18.128.1/30 dev tb0" in links["diff"]["after"]
    assert f"--- {network}/00-meshkit-tb0.network.d/50-address.conf" in links["diff"]["before"]
    bridge, mutating = linux(bridge_detach, undo_args(network, state), detached(), check_mode=True)
    assert mutating == [] and bridge["changed"]
    assert "ip link set dev tb0 master bridge0" in bridge["diff"]["after"]
    assert sorted(str(p) for p in network.rglob("*")) == before and (state / "record.json").exists()


def test_without_a_record_undo_refuses_naming_what_it_would_remove_unless_own_only(linux, dirs):  # noqa: F811
    network, state = dirs
    setup_then(linux, network, state)
    (state / "record.json").unlink()
    refused, mutating = linux(peer_link, undo_args(network, state), {**recorded("converged"), **NETWORKD}, expect=Fail)
    assert "no record of what this host had before setup.yml" in refused["msg"]
    assert refused["would_remove"] == ["tb0: 198.18.128.1/30", f"{network}/00-meshkit-tb0.network.d/50-address.conf"]
    assert mutating == []
    # own_only: meshkit's own configuration goes, nothing is restored (the port stays out of the bridge).
    linux(peer_link, undo_args(network, state, own_only=True), {**recorded("converged"), **NETWORKD})
    refused, _ = linux(bridge_detach, undo_args(network, state), detached(), expect=Fail)
    assert str(network / "00-meshkit-tb0.network") in refused["msg"]
    bridge, mutating = linux(bridge_detach, undo_args(network, state, own_only=True), detached())
    assert mutating == [["networkctl", "reload"]]
    assert list(network.iterdir()) == [] and bridge["notes"]


def test_undo_restores_the_mtu_and_the_link_local_setup_of_a_networkd_bridge_port(linux, dirs):  # noqa: F811
    """A networkd bridge port has no link-local address (LinkLocalAddressing=no under Bridge=): once the port
    stood alone and got one, undo puts back the address generation and takes the extra address off."""
    network, state = dirs
    state.mkdir()
    links = json.loads(recorded("converged")[("ip", "-j", "-d", "link", "show")][1])
    for link in links:
        if link["ifname"] == "tb0":
            link["mtu"] = 9000
    record = {
        "version": 1,
        "platform": "Linux",
        "meshkit_found": [],
        "state_dir_existed": True,
        "ports": {"tb0": {"master": "bridge0", "mtu": 1500, "up": True, "addrgenmode": "none", "link_local": []}},
        "bridges": {"bridge0": {"exists": True, "up": True}},
    }
    (state / "record.json").write_text(json.dumps(record))
    answers = {**detached(), ("ip", "-j", "-d", "link", "show"): (0, json.dumps(links), "")}
    _, mutating = linux(peer_link, undo_args(network, state), answers)
    assert mutating == [["ip", "link", "set", "dev", "tb0", "mtu", "1500"]]
    bridge, mutating = linux(bridge_detach, undo_args(network, state), answers)
    assert mutating[:3] == [
        ["ip", "link", "set", "dev", "tb0", "addrgenmode", "none"],
        ["ip", "-6", "addr", "flush", "dev", "tb0", "scope", "link"],
        ["ip", "link", "set", "dev", "tb0", "master", "bridge0"],
    ]
    # The state directory was there before setup: it stays.
    assert bridge["removed"] == [str(state / "record.json")] and state.is_dir()


def test_undo_refuses_without_the_management_interface_and_never_restores_onto_it(linux, dirs):  # noqa: F811
    network, state = dirs
    state.mkdir()
    record = {
        "version": 1,
        "meshkit_found": [],
        "ports": {"mgmt0": {"master": "bridge0", "mtu": 1500, "up": True}},
        "bridges": {"bridge0": {"exists": True, "up": True}},
    }
    (state / "record.json").write_text(json.dumps(record))
    refused, mutating = linux(
        bridge_detach, undo_args(network, state, management_address=None), {**detached(), **RUNTIME}, expect=Fail
    )
    assert mutating == []
    refused, mutating = linux(bridge_detach, undo_args(network, state), {**detached(), **RUNTIME}, expect=Fail)
    assert "management interface mgmt0" in refused["msg"] and mutating == []


def test_a_record_that_cannot_be_read_is_named(linux, dirs):  # noqa: F811
    network, state = dirs
    state.mkdir()
    (state / "record.json").write_text("{not json")
    refused, mutating = linux(bridge_detach, undo_args(network, state), detached(), expect=Fail)
    assert f"{state}/record.json cannot be read" in refused["msg"] and mutating == []
