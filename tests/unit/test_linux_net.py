"""Linux planners (plugins/module_utils/linux_net.py) on `ip -j` shaped data.

The dicts copy the shapes `ip -j -d link show`, `ip -j addr show` and `ip -j route show` print
(iproute2): a bridge has linkinfo.info_kind "bridge"; a bridge member has "master" and
linkinfo.info_slave_kind "bridge"; a host route's "dst" has no /32.
"""

from __future__ import annotations

import json

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import linux_net

POOL = "198.18.128.0/17"


def link(name, *, up=True, master=None, kind=None, mtu=1500, mac=None):
    out = {
        "ifname": name,
        "flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"] if up else ["BROADCAST", "MULTICAST"],
        "mtu": mtu,
        "operstate": "UP" if up else "DOWN",
        "link_type": "ether",
        "address": mac or "02:00:00:00:00:01",
    }
    info = {}
    if kind:
        info["info_kind"] = kind
    if master:
        out["master"] = master
        info["info_slave_kind"] = "bridge"
    if info:
        out["linkinfo"] = info
    return out


def addr(name, *cidrs):
    infos = []
    for cidr in cidrs:
        local, prefix = cidr.split("/")
        infos.append({"family": "inet6" if ":" in local else "inet", "local": local, "prefixlen": int(prefix)})
    return {"ifname": name, "addr_info": infos}


LO = {**link("lo"), "flags": ["LOOPBACK", "UP", "LOWER_UP"], "link_type": "loopback", "mtu": 65536}


def cluster_links(*, bridge_up=True):
    return [
        LO,
        link("eth0"),
        link("bridge0", kind="bridge", up=bridge_up),
        link("thunderbolt0", master="bridge0"),
        link("thunderbolt1", master="bridge0"),
        link("tb-extra", master="bridge0"),
    ]


# ---- plan_bridge -------------------------------------------------------------------------
def test_plan_bridge_detaches_every_member_and_brings_the_bridge_down():
    plan = linux_net.plan_bridge(cluster_links(), "bridge0", [], "eth0")
    assert plan["refused"] is None
    assert plan["members"] == ["tb-extra", "thunderbolt0", "thunderbolt1"]
    assert plan["detach"] == ["tb-extra", "thunderbolt0", "thunderbolt1"]
    assert plan["kept"] == []
    assert plan["commands"] == [
        ["ip", "link", "set", "dev", "tb-extra", "nomaster"],
        ["ip", "link", "set", "dev", "thunderbolt0", "nomaster"],
        ["ip", "link", "set", "dev", "thunderbolt1", "nomaster"],
        ["ip", "link", "set", "dev", "bridge0", "down"],
    ]


def test_plan_bridge_with_patterns_keeps_other_members_and_the_bridge_up():
    plan = linux_net.plan_bridge(cluster_links(), "bridge0", ["thunderbolt*"], "eth0")
    assert plan["detach"] == ["thunderbolt0", "thunderbolt1"]
    assert plan["kept"] == ["tb-extra"]
    assert plan["commands"] == [
        ["ip", "link", "set", "dev", "thunderbolt0", "nomaster"],
        ["ip", "link", "set", "dev", "thunderbolt1", "nomaster"],
    ]


def test_plan_bridge_already_down_is_not_downed_again():
    links = [LO, link("eth0"), link("bridge0", kind="bridge", up=False)]
    plan = linux_net.plan_bridge(links, "bridge0", [], "eth0")
    assert plan["commands"] == []
    assert plan["members"] == []


def test_plan_bridge_empty_but_up_is_brought_down():
    links = [LO, link("eth0"), link("bridge0", kind="bridge", up=True)]
    assert linux_net.plan_bridge(links, "bridge0", [], "eth0")["commands"] == [
        ["ip", "link", "set", "dev", "bridge0", "down"]
    ]


def test_plan_bridge_without_the_bridge_does_nothing():
    plan = linux_net.plan_bridge([LO, link("eth0"), link("thunderbolt0")], "bridge0", [], "eth0")
    assert plan == {"commands": [], "members": [], "detach": [], "kept": [], "refused": None}


def test_plan_bridge_refuses_when_management_is_a_member():
    plan = linux_net.plan_bridge(cluster_links(), "bridge0", ["thunderbolt*"], "thunderbolt1")
    assert plan["commands"] == []
    assert plan["detach"] == []
    assert "thunderbolt1 is a member of bridge0" in plan["refused"]
    assert "nothing was changed" in plan["refused"]
    assert plan["members"] == ["tb-extra", "thunderbolt0", "thunderbolt1"]


def test_plan_bridge_refuses_when_management_is_the_bridge():
    plan = linux_net.plan_bridge(cluster_links(), "bridge0", [], "bridge0")
    assert plan["commands"] == []
    assert "bridge0 itself" in plan["refused"]


def test_plan_bridge_member_of_another_bridge_is_not_refused():
    links = [*cluster_links(), link("br-mgmt", kind="bridge"), link("eth1", master="br-mgmt")]
    plan = linux_net.plan_bridge(links, "bridge0", [], "eth1")
    assert plan["refused"] is None
    assert "eth1" not in plan["detach"]


# ---- plan_peer_links ---------------------------------------------------------------------
def port(name, address, peer, prefix=30):
    return {"port": name, "address": address, "prefix": prefix, "peer_address": peer}


P0 = port("thunderbolt0", "198.18.128.1", "198.18.128.2")
P1 = port("thunderbolt1", "198.18.128.5", "198.18.128.6")


def detached_links(**kw):
    return [
        LO,
        link("eth0"),
        link("bridge0", kind="bridge", up=False),
        link("thunderbolt0", **kw),
        link("thunderbolt1", **kw),
    ]


def test_plan_peer_links_fresh_ports():
    commands, notes = linux_net.plan_peer_links(
        detached_links(up=False),
        [addr("eth0", "192.0.2.10/24")],
        [P0, P1],
        POOL,
        ["thunderbolt*"],
        9000,
        "eth0",
        {},
    )
    assert commands == [
        ["ip", "link", "set", "dev", "thunderbolt0", "mtu", "9000"],
        ["ip", "link", "set", "dev", "thunderbolt0", "up"],
        ["ip", "addr", "add", "198.18.128.1/30", "dev", "thunderbolt0"],
        ["ip", "route", "replace", "198.18.128.2/32", "dev", "thunderbolt0", "src", "198.18.128.1"],
        ["ip", "link", "set", "dev", "thunderbolt1", "mtu", "9000"],
        ["ip", "link", "set", "dev", "thunderbolt1", "up"],
        ["ip", "addr", "add", "198.18.128.5/30", "dev", "thunderbolt1"],
        ["ip", "route", "replace", "198.18.128.6/32", "dev", "thunderbolt1", "src", "198.18.128.5"],
    ]
    assert notes == []


def test_plan_peer_links_converged_is_empty():
    links = detached_links(mtu=9000)
    addrs = [addr("thunderbolt0", "198.18.128.1/30", "fe80::2/64"), addr("thunderbolt1", "198.18.128.5/30")]
    routes = {
        "thunderbolt0": [{"dst": "198.18.128.0/30"}, {"dst": "198.18.128.2"}],
        "thunderbolt1": [{"dst": "198.18.128.6/32"}],
    }
    assert linux_net.plan_peer_links(links, addrs, [P0, P1], POOL, ["thunderbolt*"], 9000, "eth0", routes) == ([], [])


def test_plan_peer_links_without_mtu_leaves_it():
    commands, _ = linux_net.plan_peer_links(
        detached_links(mtu=1500),
        [addr("thunderbolt0", "198.18.128.1/30")],
        [P0],
        POOL,
        [],
        None,
        "eth0",
        {"thunderbolt0": [{"dst": "198.18.128.2"}]},
    )
    assert commands == []


def test_plan_peer_links_replaces_an_old_pool_address_but_keeps_foreign_ones():
    addrs = [addr("thunderbolt0", "198.18.128.9/30", "10.1.2.3/24")]
    commands, notes = linux_net.plan_peer_links(
        detached_links(), addrs, [P0], POOL, ["thunderbolt*"], None, "eth0", {"thunderbolt0": [{"dst": "198.18.128.2"}]}
    )
    assert commands == [
        ["ip", "addr", "del", "198.18.128.9/30", "dev", "thunderbolt0"],
        ["ip", "addr", "add", "198.18.128.1/30", "dev", "thunderbolt0"],
    ]
    assert notes == []


def test_plan_peer_links_clears_pool_addresses_from_uncabled_peer_ports_only():
    links = [*detached_links(), link("enp1s0")]
    addrs = [
        addr("thunderbolt0", "198.18.128.1/30"),
        addr("thunderbolt1", "198.18.128.5/30", "10.1.2.3/24"),  # no cable planned on it any more
        addr("enp1s0", "198.18.200.1/24"),  # not a peer port: never touched
        addr("eth0", "198.18.130.1/24"),  # management: never touched
    ]
    commands, notes = linux_net.plan_peer_links(
        links, addrs, [P0], POOL, ["thunderbolt*", "eth*"], None, "eth0", {"thunderbolt0": [{"dst": "198.18.128.2"}]}
    )
    assert commands == [["ip", "addr", "del", "198.18.128.5/30", "dev", "thunderbolt1"]]
    assert notes == ["thunderbolt1: removed 198.18.128.5/30 (no cable planned on this port)"]


@pytest.mark.parametrize(
    ("links", "ports", "mgmt", "message"),
    [
        (detached_links(), [P0], "thunderbolt0", "management interface thunderbolt0; refusing"),
        (
            detached_links(),
            [port("thunderbolt9", "198.18.128.1", "198.18.128.2")],
            "eth0",
            "thunderbolt9 of the plan does not exist",
        ),
        (cluster_links(), [P0], "eth0", "thunderbolt0 is still enslaved to bridge0"),
    ],
    ids=["management", "missing", "enslaved"],
)
def test_plan_peer_links_refusals(links, ports, mgmt, message):
    with pytest.raises(linux_net.NetError, match=message):
        linux_net.plan_peer_links(links, [], ports, POOL, ["thunderbolt*"], None, mgmt, {})


# ---- runners -------------------------------------------------------------------------------
def test_links_and_addresses_run_ip_json():
    calls = []

    def run(argv):
        calls.append(argv)
        return 0, json.dumps([LO]) if "link" in argv else "", ""

    assert linux_net.links(run) == [LO]
    assert linux_net.addresses(run) == []
    assert calls == [["ip", "-j", "-d", "link", "show"], ["ip", "-j", "addr", "show"]]


def test_ip_failure_is_a_net_error():
    with pytest.raises(linux_net.NetError, match=r"ip -j -d link show failed \(rc=255\): Cannot open netlink socket"):
        linux_net.links(lambda argv: (255, "", "Cannot open netlink socket\n"))
