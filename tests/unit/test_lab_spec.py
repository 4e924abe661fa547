"""The lab's input validation and plan (meshkit/lab_spec.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from meshkit.lab_spec import (
    LabSpecError,
    cable_name,
    plan,
    plan_diff,
    plan_from_dict,
    shape_pairs,
    validate,
)


def params(**overrides):
    base = {
        "lab_name": "lab",
        "lab_state": "present",
        "lab_size": None,
        "lab_shape": "mesh",
        "lab_cables": [],
        "lab_link_rate": "",
        "lab_mgmt_subnet": "198.18.0.0/24",
    }
    base.update(overrides)
    return base


def problems(**overrides) -> list[str]:
    with pytest.raises(LabSpecError) as info:
        validate(params(**overrides))
    return info.value.problems


@pytest.mark.parametrize(
    ("shape", "size", "expected"),
    [
        ("mesh", 4, [(1, 2), (1, 3), (1, 4), (2, 3), (2, 4), (3, 4)]),
        ("ring", 4, [(1, 2), (2, 3), (3, 4), (4, 1)]),
        ("ring", 2, [(1, 2)]),
        ("line", 3, [(1, 2), (2, 3)]),
    ],
)
def test_shape_pairs(shape, size, expected):
    assert shape_pairs(shape, size) == expected


@pytest.mark.parametrize("size", range(2, 17))
def test_every_shape_at_every_size_cables_each_host_as_the_shape_says(size):
    """mesh: every pair once; ring: a cycle through every host (one cable for two hosts); line: a path."""
    everyone = set(range(1, size + 1))
    mesh = shape_pairs("mesh", size)
    assert sorted(frozenset(p) for p in mesh) == sorted(frozenset((i, j)) for i in everyone for j in everyone if i < j)
    for shape, closed in (("ring", size > 2), ("line", False)):
        pairs = shape_pairs(shape, size)
        assert len(pairs) == size - 1 + closed, (shape, pairs)
        degree = {host: sum(host in p for p in pairs) for host in everyone}
        ends = 0 if closed else 2
        assert sorted(degree.values()) == [1] * ends + [2] * (size - ends), (shape, pairs)
        assert set().union(*map(set, pairs)) == everyone


def test_mesh_of_16_has_120_cables():
    assert len(shape_pairs("mesh", 16)) == 120


def test_defaults_give_a_4_host_mesh():
    doc = validate(params())
    lab = plan(doc)
    assert lab.size == 4
    assert lab.shape == "mesh"
    assert [h.name for h in lab.hosts] == ["node1", "node2", "node3", "node4"]
    assert [h.netns for h in lab.hosts] == ["lab-node1", "lab-node2", "lab-node3", "lab-node4"]
    assert lab.controller_ip == "198.18.0.1"
    assert [h.mgmt_ip for h in lab.hosts] == ["198.18.0.2", "198.18.0.3", "198.18.0.4", "198.18.0.5"]
    # every host of a 4-mesh has three ports, numbered in cable order
    assert all(h.ports == ("tb0", "tb1", "tb2") for h in lab.hosts)


def test_strings_from_extra_vars_are_coerced():
    doc = validate(params(lab_size="6", lab_shape="ring"))
    assert doc["lab_size"] == 6


def test_explicit_cables_set_size_and_allow_parallel_cables():
    lab = plan(validate(params(lab_cables=[[1, 2], [2, 3], [1, 2]])))
    assert lab.size == 3
    assert lab.shape == "cables"
    ends = [((c.a.host, c.a.port), (c.b.host, c.b.port)) for c in lab.cables]
    assert ends == [
        (("node1", "tb0"), ("node2", "tb0")),
        (("node2", "tb1"), ("node3", "tb0")),
        (("node1", "tb1"), ("node2", "tb2")),
    ]
    assert Counter(frozenset((c.a.host, c.b.host)) for c in lab.cables)[frozenset({"node1", "node2"})] == 2


def test_explicit_size_keeps_uncabled_hosts():
    lab = plan(validate(params(lab_size=4, lab_cables=[[1, 2]])))
    assert lab.size == 4
    assert lab.hosts[3].ports == ()


def test_plan_is_deterministic():
    a = plan(validate(params(lab_size=8, lab_shape="ring"))).as_dict()
    b = plan(validate(params(lab_size="8", lab_shape="ring"))).as_dict()
    assert a == b


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"lab_size": 1}, "lab_size = 1: min value is 2"),
        ({"lab_size": 0}, "lab_size = 0: min value is 2"),
        ({"lab_size": 65}, "lab_size = 65: max value is 64"),
        ({"lab_size": "many"}, "lab_size = 'many'"),
        ({"lab_shape": "star"}, "lab_shape = 'star': unallowed value star"),
        ({"lab_cables": [[1, 5]], "lab_size": 4}, "lab_cables[0] = [1, 5]: host 5 does not exist"),
        ({"lab_cables": [[1, 2], [3, 3]]}, "lab_cables[1] = [3, 3]: a cable from host 3 to itself"),
        ({"lab_cables": [[1, 2, 3]]}, "lab_cables[0] = [1, 2, 3]: max length is 2"),
        ({"lab_cables": [[0, 2]]}, "lab_cables[0][0] = 0: min value is 1"),
        ({"lab_cables": "1-2"}, "lab_cables = '1-2': must be of list type"),
        ({"lab_name": "Bad-Name"}, "lab_name = 'Bad-Name'"),
        ({"lab_name": "waytoolongname"}, "lab_name = 'waytoolongname'"),
        ({"lab_link_rate": "fast"}, "lab_link_rate = 'fast'"),
        ({"lab_mgmt_subnet": "198.18.0.1/24"}, "lab_mgmt_subnet = '198.18.0.1/24': not an IPv4 network"),
        ({"lab_mgmt_subnet": "198.18.0.0/30"}, "controller need 5"),
    ],
)
def test_bad_input_names_field_and_value(overrides, expected):
    found = problems(**overrides)
    assert any(expected in p for p in found), found


def test_every_problem_is_listed_at_once():
    found = problems(lab_cables=[[1, 1], [2, 9]], lab_size=3)
    assert len(found) == 2
    assert "to itself" in found[0]
    assert "host 9 does not exist" in found[1]


def test_error_message_lists_problems_one_per_line():
    with pytest.raises(LabSpecError) as info:
        validate(params(lab_size=1, lab_shape="star"))
    text = str(info.value)
    assert text.startswith("invalid lab input:")
    assert "\n  - lab_size = 1" in text
    assert "\n  - lab_shape = 'star'" in text


def test_access_names_and_network_daemon_default_to_the_plain_lab():
    lab = plan(validate(params()))
    assert (lab.access, lab.names, lab.network_daemon, lab.login_user) == ("root", False, "none", "root")
    node1 = lab.hosts[0]
    assert node1.fqdn == "node1.lab.meshkit.test"
    assert lab.ssh_name(node1) == "198.18.0.2"  # by address unless lab_names


def test_sudo_and_names_from_extra_vars():
    lab = plan(validate(params(lab_access="sudo", lab_names="true", lab_network_daemon="networkd")))
    assert (lab.access, lab.names, lab.network_daemon, lab.login_user) == ("sudo", True, "networkd", "meshadmin")
    assert [lab.ssh_name(h) for h in lab.hosts][:2] == ["node1.lab.meshkit.test", "node2.lab.meshkit.test"]
    data = lab.as_dict()
    assert (data["access"], data["names"], data["domain"], data["login_user"]) == (
        "sudo",
        True,
        "lab.meshkit.test",
        "meshadmin",
    )
    assert data["hosts"][0]["ssh_name"] == "node1.lab.meshkit.test"
    # Any of them differing from a built lab's record makes the lab be built again.
    assert data != plan(validate(params(lab_access="sudo", lab_names="false"))).as_dict()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"lab_access": "admin"}, "lab_access = 'admin': unallowed value admin; use root"),
        ({"lab_names": "maybe"}, "lab_names = 'maybe': must be of boolean type"),
        ({"lab_network_daemon": "systemd"}, "lab_network_daemon = 'systemd': unallowed value systemd"),
    ],
)
def test_bad_access_names_daemon(overrides, expected):
    found = problems(**overrides)
    assert any(expected in p for p in found), found


def test_lab_head_defaults_to_false_and_changes_nothing():
    doc = validate(params())
    assert doc["lab_head"] is False
    lab = plan(doc)
    assert lab.head is None
    assert lab.nodes == lab.hosts
    data = lab.as_dict()
    # A lab without a head plans exactly what it planned before lab_head existed: the record of a
    # lab built then still matches (no rebuild), so no key about the head appears.
    assert "head" not in data
    assert all("head" not in h for h in data["hosts"])
    assert data == plan(validate(params(lab_head="false"))).as_dict()


@pytest.mark.parametrize("given", [True, "true", "yes", "on", "1", " True "])
def test_lab_head_is_coerced_from_extra_vars_strings(given):
    assert validate(params(lab_head=given))["lab_head"] is True


@pytest.mark.parametrize("given", ["maybe", 2, ["true"]])
def test_bad_lab_head_names_field_value_and_what_to_use(given):
    found = problems(lab_head=given)
    assert len(found) == 1, found
    assert found[0].startswith(f"lab_head = {given!r}: must be of boolean type; use true (one more host, head")


def test_head_is_one_more_host_after_the_nodes_with_no_ports_and_the_same_cables():
    without = plan(validate(params(lab_name="hd", lab_size=4, lab_shape="ring", lab_mgmt_subnet="198.19.91.0/24")))
    lab = plan(
        validate(
            params(lab_name="hd", lab_size="4", lab_shape="ring", lab_mgmt_subnet="198.19.91.0/24", lab_head="true")
        )
    )
    assert lab.size == 4  # lab_size keeps counting the cabled hosts
    assert [h.name for h in lab.hosts] == ["node1", "node2", "node3", "node4", "head"]
    assert lab.nodes == without.hosts
    head = lab.hosts[-1]
    assert lab.head == head
    assert (head.head, head.index, head.ports) == (True, 5, ())
    assert (head.netns, head.mgmt_root_port, head.fqdn) == ("hd-head", "hd-m5", "head.hd.meshkit.test")
    assert head.mgmt_ip == "198.19.91.6"  # the next after node4's 198.19.91.5
    assert not any(h.head for h in lab.nodes)
    # The cabling is computed over node1..node4 exactly as without a head; no cable touches it.
    assert lab.cables == without.cables
    assert lab.shape == without.shape == "ring"
    assert all("head" not in (c.a.host, c.b.host) for c in lab.cables)
    # Every address and machine-side name is distinct.
    assert len({h.mgmt_ip for h in lab.hosts} | {lab.controller_ip}) == 6
    assert len({h.netns for h in lab.hosts}) == len({h.mgmt_root_port for h in lab.hosts}) == 5


def test_head_in_the_plan_as_data():
    lab = plan(validate(params(lab_size=2, lab_head=True, lab_names=True, lab_access="sudo")))
    data = lab.as_dict()
    assert data["head"] == "head"
    assert data["size"] == 2
    assert data["hosts"][-1] == {
        "index": 3,
        "name": "head",
        "netns": "lab-head",
        "mgmt_ip": "198.18.0.4",
        "mgmt_root_port": "lab-m3",
        "ports": [],
        "fqdn": "head.lab.meshkit.test",
        "ssh_name": "head.lab.meshkit.test",
        "head": True,
    }
    assert all("head" not in h for h in data["hosts"][:-1])
    # Adding or removing the head makes a built lab differ from its plan (it is built again).
    assert data != plan(validate(params(lab_size=2, lab_names=True, lab_access="sudo"))).as_dict()


def test_head_with_explicit_cables():
    lab = plan(validate(params(lab_cables=[[1, 2], [2, 3]], lab_head="yes")))
    assert lab.size == 3
    assert [h.name for h in lab.hosts] == ["node1", "node2", "node3", "head"]
    assert lab.hosts[-1].mgmt_ip == "198.18.0.5"


def test_subnet_too_small_is_refused_counting_the_head():
    # A /29 holds 6 host addresses: 5 nodes and the controller fit; with the head they do not.
    assert plan(validate(params(lab_size=5, lab_mgmt_subnet="198.18.0.0/29"))).hosts[-1].mgmt_ip == "198.18.0.6"
    found = problems(lab_size=5, lab_mgmt_subnet="198.18.0.0/29", lab_head="true")
    assert found == [
        "lab_mgmt_subnet = '198.18.0.0/29': holds 6 host addresses, but 5 hosts, the head node and the "
        "controller need 7; use a larger network such as a /24"
    ]
    assert problems(lab_size=6, lab_mgmt_subnet="198.18.0.0/29")[0].endswith(
        "6 hosts and the controller need 7; use a larger network such as a /24"
    )


# ---- changing a running lab in place: the difference of two plans ------------------------------


def ring(size, **overrides):
    return plan(validate(params(lab_size=size, lab_shape="ring", **overrides)))


def ends(lab):
    return [cable_name(c) for c in lab.cables]


def test_a_ring_grown_by_one_keeps_every_cable_but_the_closing_one_port_for_port():
    four, five = ring(4), ring(5)
    assert ends(four) == ["node1:tb0-node2:tb0", "node2:tb1-node3:tb0", "node3:tb1-node4:tb0", "node4:tb1-node1:tb1"]
    assert ends(five)[:3] == ends(four)[:3]
    diff = plan_diff(four, five)
    assert diff.in_place and diff.blockers == ()
    assert diff.hosts_added == ("node5",) and diff.hosts_removed == ()
    assert [cable_name(c) for c in diff.cables_added] == ["node4:tb1-node5:tb0", "node5:tb1-node1:tb1"]
    assert [cable_name(c) for c in diff.cables_removed] == ["node4:tb1-node1:tb1"]
    assert [cable_name(c) for c in diff.cables_kept] == ends(four)[:3]
    assert diff.moved == ()  # one cable replaced by two through a new host: no single cable moved
    assert diff.summary() == (
        "added node5; cables added node4:tb1-node5:tb0, node5:tb1-node1:tb1; removed node4:tb1-node1:tb1"
    )
    assert diff.as_dict()["cables_kept"] == 3


def test_a_ring_shrunk_by_one_is_the_grow_undone():
    diff = plan_diff(ring(5), ring(4))
    assert diff.in_place
    assert diff.hosts_added == () and diff.hosts_removed == ("node5",)
    assert [cable_name(c) for c in diff.cables_added] == ["node4:tb1-node1:tb1"]
    assert [cable_name(c) for c in diff.cables_removed] == ["node4:tb1-node5:tb0", "node5:tb1-node1:tb1"]
    assert len(diff.cables_kept) == 3
    assert diff.summary() == (
        "removed node5; cables added node4:tb1-node1:tb1; removed node4:tb1-node5:tb0, node5:tb1-node1:tb1"
    )


def test_a_mesh_and_a_line_grown_by_one_keep_every_cable():
    for shape in ("mesh", "line"):
        small = plan(validate(params(lab_size=4, lab_shape=shape)))
        big = plan(validate(params(lab_size=5, lab_shape=shape)))
        diff = plan_diff(small, big)
        assert diff.cables_removed == () and len(diff.cables_kept) == len(small.cables), shape


def test_a_moved_cable_is_one_removed_and_one_added_sharing_an_end():
    # node4's cable to node1 re-plugged into node2 (which gets a third port).
    moved = plan(validate(params(lab_cables=[[1, 2], [2, 3], [3, 4], [4, 2]])))
    diff = plan_diff(ring(4), moved)
    assert diff.in_place  # lab_shape ring -> explicit cables: the same lab, recabled
    assert diff.hosts_added == diff.hosts_removed == ()
    assert [cable_name(c) for c in diff.cables_removed] == ["node4:tb1-node1:tb1"]
    assert [cable_name(c) for c in diff.cables_added] == ["node4:tb1-node2:tb2"]
    assert diff.moved == (("node4:tb1-node1:tb1", "node4:tb1-node2:tb2"),)
    assert diff.summary().endswith("moved node4:tb1-node1:tb1 -> node4:tb1-node2:tb2")


def test_a_cable_is_its_two_ends_whatever_their_order_or_index():
    same = plan(validate(params(lab_cables=[[1, 4], [1, 2], [2, 3], [3, 4]])))
    # Listed in another order, ports are numbered otherwise (in cable order): node1's cable to node4
    # is now on its tb0, another cable: three go and come again, one is kept.
    diff = plan_diff(ring(4), same)
    assert [cable_name(c) for c in diff.cables_added] == [
        "node1:tb0-node4:tb0",
        "node1:tb1-node2:tb0",
        "node3:tb1-node4:tb1",
    ]
    assert [cable_name(c) for c in diff.cables_kept] == ["node2:tb1-node3:tb0"]
    flipped = plan(validate(params(lab_cables=[[1, 2], [2, 3], [3, 4], [1, 4]])))
    diff = plan_diff(ring(4), flipped)
    assert not diff.hosts_or_cables and diff.in_place
    assert diff.summary() == "no host or cable changes"


@pytest.mark.parametrize(
    ("overrides", "blocker"),
    [
        ({"lab_mgmt_subnet": "198.18.1.0/24"}, "mgmt_subnet 198.18.0.0/24 -> 198.18.1.0/24"),
        ({"lab_access": "sudo"}, "access root -> sudo"),
        ({"lab_names": True}, "names False -> True"),
        ({"lab_network_daemon": "networkd"}, "network_daemon none -> networkd"),
        ({"lab_link_rate": "1gbit"}, "link_rate None -> 1gbit"),
        ({"lab_head": True}, "head node added"),
        ({"lab_name": "other"}, "name lab -> other"),
    ],
)
def test_anything_but_hosts_and_cables_is_not_changed_in_place(overrides, blocker):
    diff = plan_diff(ring(4), ring(5, **overrides))
    assert not diff.in_place
    assert blocker in diff.blockers


def test_a_head_whose_address_moves_with_lab_size_is_not_changed_in_place():
    diff = plan_diff(ring(4, lab_head=True), ring(5, lab_head=True))
    assert "head: mgmt_ip 198.18.0.6 -> 198.18.0.7" in diff.blockers
    # Recabling the same hosts of a lab with a head is.
    assert plan_diff(ring(4, lab_head=True), ring(4, lab_head=True, lab_cables=[[1, 2], [2, 3], [3, 4]])).in_place


@pytest.mark.parametrize("overrides", [{}, {"lab_head": True, "lab_names": True}, {"lab_cables": [[1, 2], [1, 2]]}])
def test_a_recorded_plan_reads_back_as_the_plan(overrides):
    lab = ring(4, **overrides)
    assert plan_from_dict(lab.as_dict()) == lab
