"""The topology model (meshkit/topology.py): cables, rings, backend, addresses."""

from __future__ import annotations

import ipaddress
import random

import pytest

from meshkit.topology import (
    Cable,
    Observation,
    PortEnd,
    TopologyError,
    allocate,
    build_plan,
    cable_id,
    cables_from_observations,
    cabling_changes,
    choose_backend,
    longest_ring,
    missing_for_ring,
    ring_cables,
    why_removed,
)


def names(n: int) -> list[str]:
    return [f"node{i}" for i in range(1, n + 1)]


def cable(a: str, pa: str, b: str, pb: str) -> Cable:
    return Cable.between(PortEnd(a, pa), PortEnd(b, pb))


def mesh(n: int) -> list[Cable]:
    hosts = names(n)
    return [cable(a, f"to-{b}", b, f"to-{a}") for i, a in enumerate(hosts) for b in hosts[i + 1 :]]


def ring(n: int, port: str = "p") -> list[Cable]:
    """node1-node2-...-nodeN-node1; each host uses <port>0 towards the next, <port>1 towards the previous."""
    return [cable(f"node{i}", f"{port}0", f"node{i % n + 1}", f"{port}1") for i in range(1, n + 1)]


def line(n: int) -> list[Cable]:
    return ring(n)[:-1]


def observe(cables: list[Cable]) -> list[Observation]:
    """Both ends of every cable see each other; a port's identity is 'host:port' (like a MAC)."""
    out = []
    for c in cables:
        out.append(Observation(c.a.host, c.a.port, f"id-{c.a}", [f"id-{c.b}"]))
        out.append(Observation(c.b.host, c.b.port, f"id-{c.b}", [f"id-{c.a}"]))
    return out


def plan_of(hosts, cables, **kw):
    return build_plan(hosts, observe(cables), **kw)


# ---- cables_from_observations -------------------------------------------------------------
def test_symmetric_observation_gives_one_cable():
    obs = [
        Observation("node2", "eth1", "AA:AA", ["bb:bb"]),
        Observation("node1", "eth0", "bb:bb", ["aa:aa"]),  # identities compare case-insensitively
    ]
    cables, asymmetric, unknown = cables_from_observations(obs)
    assert cables == [Cable(PortEnd("node1", "eth0"), PortEnd("node2", "eth1"))]
    assert asymmetric == []
    assert unknown == []


def test_one_sided_observation_is_asymmetric_not_a_cable():
    obs = [
        Observation("node1", "eth0", "aa", ["bb"]),
        Observation("node2", "eth1", "bb", []),
    ]
    cables, asymmetric, unknown = cables_from_observations(obs)
    assert cables == []
    assert asymmetric == [
        {"seen_by": "node1:eth0", "peer": "node2:eth1", "reason": "node2:eth1 did not see node1:eth0"}
    ]
    assert unknown == []


def test_identity_outside_the_inventory_is_unknown():
    obs = [
        Observation("node1", "eth0", "aa", ["ff:ff:ff:00:00:01"]),
        Observation("node2", "eth0", "bb", []),
    ]
    cables, asymmetric, unknown = cables_from_observations(obs)
    assert cables == []
    assert asymmetric == []
    assert unknown == [
        {
            "host": "node1",
            "port": "eth0",
            "seen": ["ff:ff:ff:00:00:01"],
            "reason": "its peer is not a port of any inventory host",
        }
    ]


def test_port_seeing_a_known_peer_and_a_stranger_is_a_cable_not_unknown():
    obs = [
        Observation("node1", "eth0", "aa", ["bb", "stranger"]),
        Observation("node2", "eth0", "bb", ["aa"]),
    ]
    cables, _asym, unknown = cables_from_observations(obs)
    assert [str(c) for c in cables] == ["node1:eth0 <-> node2:eth0"]
    assert unknown == []


def test_seeing_an_own_port_is_not_a_cable():
    # A loop back into the same host (or a bridge echo) must not become a cable.
    obs = [
        Observation("node1", "eth0", "aa", ["ab"]),
        Observation("node1", "eth1", "ab", ["aa"]),
    ]
    cables, asymmetric, _unknown = cables_from_observations(obs)
    assert cables == []
    assert asymmetric == []


def test_two_parallel_cables_between_the_same_hosts_are_two_cables():
    cables = [cable("node1", "tb0", "node2", "tb0"), cable("node1", "tb1", "node2", "tb1")]
    found, asymmetric, unknown = cables_from_observations(observe(cables))
    assert found == sorted(cables, key=str)
    assert len(found) == 2
    assert asymmetric == [] and unknown == []


def test_a_port_seeing_two_peers_is_in_at_most_one_cable():
    obs = [
        Observation("node1", "eth0", "a", ["b", "c"]),
        Observation("node2", "eth0", "b", ["a", "c"]),
        Observation("node3", "eth0", "c", ["a", "b"]),
    ]
    plan = build_plan(names(3), obs, pool="10.0.0.0/24")
    ends = [end for c in plan.cables for end in (c.a, c.b)]
    assert len(ends) == len(set(ends)), [str(c) for c in plan.cables]
    for host in plan.hosts:
        for p in plan.host_ports(host):
            assert ipaddress.IPv4Address(p["address"]) in ipaddress.IPv4Network(p["network"]), p


def test_cable_ends_are_ordered_naturally():
    c = cable("node10", "tb0", "node2", "tb3")
    assert (c.a.host, c.b.host) == ("node2", "node10")


# ---- longest_ring / ring_cables / missing_for_ring ----------------------------------------
def test_full_mesh_of_3_is_a_ring_in_natural_order():
    assert longest_ring(names(3), mesh(3)) == ["node1", "node2", "node3"]


@pytest.mark.parametrize("n", [8, 10])
def test_full_mesh_ring_is_the_natural_order(n):
    hosts = names(n)
    shuffled = hosts[:]
    random.Random(n).shuffle(shuffled)
    assert longest_ring(shuffled, mesh(n)) == hosts  # node10 after node9, not after node1


def test_ring_of_5():
    assert longest_ring(names(5), ring(5)) == names(5)


def test_ring_of_5_cabled_out_of_order_starts_at_node1_towards_smaller_neighbour():
    hops = ["node1", "node3", "node5", "node2", "node4"]
    cables = [cable(hops[i], "a", hops[(i + 1) % 5], "b") for i in range(5)]
    assert longest_ring(names(5), cables) == ["node1", "node3", "node5", "node2", "node4"]


def test_line_of_3_has_no_ring():
    assert longest_ring(names(3), line(3)) == []


def test_ring_of_8_minus_one_cable_is_not_a_ring_of_8():
    cables = ring(8)
    cables.remove(cable("node8", "p0", "node1", "p1"))
    found = longest_ring(names(8), cables)
    assert len(found) < 8
    assert missing_for_ring(names(8), cables) == [("node1", "node8")]


def test_partial_ring_is_found_when_a_host_hangs_off_it():
    cables = [*ring(3), cable("node3", "x", "node4", "x")]
    assert longest_ring(names(4), cables) == ["node1", "node2", "node3"]


def test_missing_for_ring_on_a_line_names_the_closing_pair():
    assert missing_for_ring(names(3), line(3)) == [("node1", "node3")]


def test_missing_for_ring_with_an_uncabled_host():
    # node4 goes between the ends of the path node1-node2-node3: two cables to it
    assert missing_for_ring(names(4), ring(3)) == [("node3", "node4"), ("node1", "node4")]


def test_doubled_ring_gives_two_parallel_rings():
    cables = ring(4, "p") + ring(4, "q")
    host_ring = longest_ring(names(4), cables)
    assert host_ring == names(4)
    rings = ring_cables(host_ring, cables)
    assert len(rings) == 2
    for r in rings:
        assert len(r) == 4
        # each ring is a closed walk node1 -> node2 -> node3 -> node4 -> node1
        assert [set(c.hosts) for c in r] == [
            {"node1", "node2"},
            {"node2", "node3"},
            {"node3", "node4"},
            {"node4", "node1"},
        ]
    assert not set(rings[0]) & set(rings[1])  # no cable is used twice
    assert {c.a.port[0] for c in rings[0]} != {c.a.port[0] for c in rings[1]}


def test_two_hosts_with_two_cables_are_two_parallel_rings_of_two():
    cables = [cable("node1", "tb0", "node2", "tb0"), cable("node1", "tb1", "node2", "tb1")]
    host_ring = longest_ring(names(2), cables)
    assert host_ring == ["node1", "node2"]
    assert ring_cables(host_ring, cables) == [[cables[0]], [cables[1]]]


def test_two_hosts_with_one_cable_are_a_ring_of_two():
    one = [cable("node1", "tb0", "node2", "tb0")]
    assert longest_ring(names(2), one) == ["node1", "node2"]
    assert ring_cables(["node1", "node2"], one) == [one]


def test_two_hosts_without_a_cable_are_no_ring():
    assert longest_ring(names(2), []) == []


def test_single_ring_when_one_hop_is_doubled():
    cables = [*ring(3), cable("node1", "extra", "node2", "extra")]
    assert len(ring_cables(longest_ring(names(3), cables), cables)) == 1


def test_longest_ring_does_not_depend_on_input_order():
    hosts = names(5)
    cables = [c for c in mesh(5) if set(c.hosts) != {"node1", "node2"}]  # K5 minus one edge
    reference = longest_ring(hosts, cables)
    results = set()
    for seed in range(10):
        h, cs = hosts[:], cables[:]
        random.Random(seed).shuffle(h)
        random.Random(seed + 100).shuffle(cs)
        results.add(tuple(longest_ring(h, cs)))
    assert results == {tuple(reference)}


# ---- choose_backend -----------------------------------------------------------------------
def backend_for(requested, hosts, cables, rdma):
    pairs = {frozenset(c.hosts) for c in cables}
    missing_mesh = [(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1 :] if frozenset((a, b)) not in pairs]
    is_mesh = len(hosts) >= 2 and not missing_mesh
    return choose_backend(requested, hosts, longest_ring(hosts, cables), is_mesh, missing_mesh, cables, rdma)


@pytest.mark.parametrize(
    ("hosts", "cables"),
    [
        (names(3), line(3)),
        (names(3), []),
        (names(1), []),
        (names(2), [cable("node1", "a", "node2", "a")]),
        (names(8), ring(8)[:-1]),
        (names(4), ring(3)),
    ],
    ids=["line3", "no-cables", "one-host", "one-cable", "broken-ring8", "ring3-plus-loner"],
)
@pytest.mark.parametrize("rdma", [False, True])
def test_no_backend_requested_never_raises(hosts, cables, rdma):
    backend, reason = backend_for("", hosts, cables, rdma)
    assert backend in ("", "jaccl", "jaccl-ring", "ring")
    assert reason


def test_no_backend_on_a_line_is_addresses_only():
    assert backend_for("", names(3), line(3), True) == ("", "no ring through every host: addresses only")


def test_ring_requested_on_a_line_names_the_missing_cable():
    with pytest.raises(TopologyError, match=r"missing cable\(s\): node1 <-> node3$"):
        backend_for("ring", names(3), line(3), False)


def test_ring_requested_on_two_hosts_with_one_cable_is_a_ring():
    assert backend_for("ring", names(2), [cable("node1", "a", "node2", "a")], False) == (
        "ring",
        "ring through 2 hosts",
    )


def test_ring_requested_on_two_uncabled_hosts_names_the_cable():
    with pytest.raises(TopologyError, match=r"missing cable\(s\): node1 <-> node2$"):
        backend_for("ring", names(2), [], False)


def test_ring_requested_on_a_ring_is_ring():
    assert backend_for("ring", names(5), ring(5), False) == ("ring", "ring through 5 hosts")


def test_jaccl_without_rdma_raises():
    with pytest.raises(TopologyError, match="needs RDMA"):
        backend_for("jaccl", names(3), mesh(3), False)


def test_jaccl_ring_without_rdma_raises():
    with pytest.raises(TopologyError, match="needs RDMA"):
        backend_for("jaccl-ring", names(4), ring(4), False)


def test_jaccl_on_a_non_mesh_names_the_missing_pairs():
    with pytest.raises(TopologyError) as info:
        backend_for("jaccl", names(4), ring(4), True)
    assert str(info.value) == "backend jaccl needs a full mesh; missing cable(s): node1 <-> node3, node2 <-> node4"


def test_jaccl_ring_on_a_line_names_the_missing_cable():
    with pytest.raises(TopologyError, match="node1 <-> node4"):
        backend_for("jaccl-ring", names(4), line(4), True)


def test_rdma_and_mesh_choose_jaccl():
    assert backend_for("", names(4), mesh(4), True) == ("jaccl", "RDMA full mesh")
    assert backend_for("jaccl", names(4), mesh(4), True) == ("jaccl", "RDMA full mesh")


def test_rdma_and_ring_choose_jaccl_ring():
    assert backend_for("", names(5), ring(5), True) == ("jaccl-ring", "RDMA ring")


def test_mesh_without_rdma_chooses_tcp_ring():
    assert backend_for("", names(4), mesh(4), False) == ("ring", "ring through 4 hosts (no RDMA)")


# ---- allocate / build_plan ----------------------------------------------------------------
def test_allocate_gives_consecutive_30s_in_cable_order():
    cables = ring(3)
    subnets = allocate(cables, "10.9.0.0/24")
    assert [str(subnets[c]) for c in cables] == ["10.9.0.0/30", "10.9.0.4/30", "10.9.0.8/30"]


def test_allocate_keeps_previous_networks_and_skips_them_for_new_cables():
    cables = ring(3)
    previous = {cable_id(cables[1]): "10.9.0.0/30"}
    subnets = allocate(cables, "10.9.0.0/24", previous)
    assert str(subnets[cables[1]]) == "10.9.0.0/30"
    assert str(subnets[cables[0]]) == "10.9.0.4/30"
    assert str(subnets[cables[2]]) == "10.9.0.8/30"


def test_allocate_ignores_previous_networks_outside_the_pool():
    cables = ring(3)
    subnets = allocate(cables, "10.9.0.0/24", {cable_id(cables[0]): "172.16.0.0/30"})
    assert str(subnets[cables[0]]) == "10.9.0.0/30"


def test_allocate_pool_exhaustion_raises():
    with pytest.raises(TopologyError, match=r"10\.9\.0\.0/29 has no free /30 left"):
        allocate(ring(3), "10.9.0.0/29")


def test_allocate_exact_fit():
    subnets = allocate(ring(4)[:2], "10.9.0.0/29")
    assert sorted(map(str, subnets.values())) == ["10.9.0.0/30", "10.9.0.4/30"]


def test_plan_is_the_same_whatever_the_host_and_observation_order():
    hosts = names(8)
    cables = mesh(8)
    reference = build_plan(hosts, observe(cables), pool="10.20.0.0/16").as_dict()
    for seed in range(5):
        h = hosts[:]
        obs = observe(cables)
        random.Random(seed).shuffle(h)
        random.Random(seed).shuffle(obs)
        assert build_plan(h, obs, pool="10.20.0.0/16").as_dict() == reference
    assert reference["cables"][0]["network"] == "10.20.0.0/30"
    assert reference["ring"] == hosts
    assert reference["hosts"] == hosts


def test_plan_with_asymmetric_and_unknown_ports_is_order_independent():
    hosts = names(4)
    obs = [
        *observe(ring(4)),
        Observation("node1", "x", "id-node1:x", ["id-node3:x"]),
        Observation("node3", "x", "id-node3:x", []),
        Observation("node2", "x", "id-node2:x", ["id-node3:x"]),
        Observation("node4", "x", "id-node4:x", ["somebody-else"]),
        Observation("node2", "y", "id-node2:y", ["another-stranger"]),
    ]
    reference = build_plan(hosts, obs).as_dict()
    for seed in range(5):
        shuffled = obs[:]
        random.Random(seed).shuffle(shuffled)
        assert build_plan(hosts, shuffled).as_dict() == reference


def test_plan_reports_asymmetric_and_unknown():
    obs = [
        *observe([cable("node1", "a", "node2", "a")]),
        Observation("node1", "b", "id-node1:b", ["id-node2:b"]),
        Observation("node2", "b", "id-node2:b", []),
        Observation("node2", "c", "id-node2:c", ["elsewhere"]),
    ]
    d = build_plan(names(2), obs).as_dict()
    assert [[e["port"] for e in c["ends"]] for c in d["cables"]] == [["a", "a"]]
    assert d["asymmetric"] == [{"seen_by": "node1:b", "peer": "node2:b", "reason": "node2:b did not see node1:b"}]
    assert d["unknown_peers"] == [
        {"host": "node2", "port": "c", "seen": ["elsewhere"], "reason": "its peer is not a port of any inventory host"}
    ]


def test_previous_networks_are_kept_when_a_cable_is_added():
    hosts = names(3)
    before = plan_of(hosts, [cable("node2", "p0", "node3", "p1")], pool="10.30.0.0/24").as_dict()
    assert before["cables"][0]["network"] == "10.30.0.0/30"
    # node1 <-> node2 sorts first, but must not take node2 <-> node3's network away
    after = plan_of(hosts, line(3), pool="10.30.0.0/24", previous=before)
    nets = {str(c): str(n) for c, n in after.subnets.items()}
    assert nets == {"node2:p0 <-> node3:p1": "10.30.0.0/30", "node1:p0 <-> node2:p1": "10.30.0.4/30"}
    assert cabling_changes(before, after) == {"added": ["node1:p0 <-> node2:p1"], "removed": []}


def test_why_a_cable_is_gone_names_what_each_end_reports_now():
    def port(name, ident, seen=(), up=True, in_bridge=None):
        return {"port": name, "ident": ident, "seen": list(seen), "up": up, "in_bridge": in_bridge}

    discovery = {
        "node1": [port("tb0", "aa:01"), port("tb1", "aa:02", ["cc:09"])],
        "node2": [port("tb0", "bb:01", up=False), port("tb1", "bb:02", in_bridge="bridge0")],
        "node3": [port("tb0", "cc:01", ["AA:01"]), port("tb1", "cc:02")],
        "node4": [{**port("tb1", "dd:02"), "probe_error": "ping: SO_BINDTODEVICE: Operation not permitted"}],
    }
    removed = [
        "node1:tb0 <-> node3:tb0",
        "node1:tb1 <-> node2:tb0",
        "node2:tb1 <-> node3:tb1",
        "node3:tb2 <-> node4:tb0",
        "node2:tb2 <-> node4:tb1",
    ]
    assert why_removed(removed, discovery) == [
        "node1:tb0 <-> node3:tb0: node1:tb0: up, no peer answered; node3:tb0: sees node1:tb0",
        "node1:tb1 <-> node2:tb0: node1:tb1: sees cc:09 instead of node2:tb0; node2:tb0: down",
        "node2:tb1 <-> node3:tb1: node2:tb1: in bridge0, not probed; node3:tb1: up, no peer answered",
        "node3:tb2 <-> node4:tb0: node3:tb2: no such port now; node4:tb0: no such port now",
        "node2:tb2 <-> node4:tb1: node2:tb2: no such port now; "
        "node4:tb1: could not be probed (ping: SO_BINDTODEVICE: Operation not permitted)",
    ]
    assert why_removed(["node1:tb0 <-> node5:tb0"], discovery) == [
        "node1:tb0 <-> node5:tb0: node1:tb0: up, no peer answered; node5:tb0: its host was not discovered"
    ]
    assert why_removed([], discovery) == []


def test_cabling_changes_reports_removed_cables():
    hosts = names(3)
    before = plan_of(hosts, ring(3)).as_dict()
    after = plan_of(hosts, line(3), previous=before)
    assert cabling_changes(before, after) == {"added": [], "removed": ["node1:p1 <-> node3:p0"]}
    assert cabling_changes(None, after) == {"added": [], "removed": []}
    # a kept cable keeps its address
    assert after.as_dict()["cables"] == [c for c in before["cables"] if c["ends"][0]["port"] == "p0"]


def test_plan_backend_error_propagates():
    with pytest.raises(TopologyError, match="node1 <-> node3"):
        plan_of(names(3), line(3), backend="ring")


def test_host_ports_pairs_are_the_two_usable_addresses_of_one_30():
    hosts = names(4)
    plan = plan_of(hosts, [*mesh(4), cable("node1", "extra", "node2", "extra")], pool="10.40.0.0/24")
    seen_networks = set()
    for host in hosts:
        ports = plan.host_ports(host)
        assert [p["port"] for p in ports] == sorted(p["port"] for p in ports)
        for p in ports:
            net = ipaddress.IPv4Network(p["network"])
            assert net.prefixlen == p["prefix"] == 30
            assert {ipaddress.IPv4Address(p["address"]), ipaddress.IPv4Address(p["peer_address"])} == set(net.hosts())
            # the peer's view of the same cable is the mirror image
            (mirror,) = [
                q for q in plan.host_ports(p["peer_host"]) if q["port"] == p["peer_port"] and q["peer_host"] == host
            ]
            assert (mirror["address"], mirror["peer_address"]) == (p["peer_address"], p["address"])
            seen_networks.add(p["network"])
    assert len(seen_networks) == 7  # one /30 per cable, parallel cables included


def test_plan_as_dict_shape():
    obs = observe([cable("node1", "en1", "node2", "en3")])
    obs[0].speed, obs[0].rdma = "80 Gb/s", "rdma_en1"
    d = build_plan(["node2", "node1"], obs, pool="10.50.0.0/24").as_dict()
    assert d["version"] == 1
    assert d["cables"] == [
        {
            "ends": [
                {"host": "node1", "port": "en1", "address": "10.50.0.1", "speed": "80 Gb/s", "rdma": "rdma_en1"},
                {"host": "node2", "port": "en3", "address": "10.50.0.2", "speed": None, "rdma": None},
            ],
            "network": "10.50.0.0/30",
        }
    ]
    assert d["mesh"] is True
    assert d["missing_mesh"] == []
    assert d["per_host"]["node2"] == [
        {
            "port": "en3",
            "address": "10.50.0.2",
            "prefix": 30,
            "network": "10.50.0.0/30",
            "peer_host": "node1",
            "peer_port": "en1",
            "peer_address": "10.50.0.1",
        }
    ]


def test_plan_address_of_an_uncabled_port_is_a_key_error():
    plan = plan_of(names(2), [cable("node1", "a", "node2", "a")])
    with pytest.raises(KeyError):
        plan.address(PortEnd("node1", "b"))
