"""Inventory validation (meshkit/inventory_schema.py)."""

from __future__ import annotations

import os

import pytest

from meshkit import inventory_schema
from meshkit.inventory_schema import DEFAULTS, validate_hosts


def only_problem(host_vars) -> str:
    _normalised, problems = validate_hosts(host_vars)
    assert len(problems) == 1, problems
    return problems[0]


def test_defaults_are_filled_in():
    normalised, problems = validate_hosts({"node1": {}, "node2": {"ansible_host": "10.0.0.2"}})
    assert problems == []
    # meshccl's environment follows the state directory unless it is set.
    # Artifacts go under the directory ansible-playbook runs in, named after the cluster.
    expected = DEFAULTS | {
        "meshkit_meshccl_venv": "/var/lib/meshkit/meshccl",
        "meshkit_artifacts_dir": os.path.join(os.getcwd(), "artifacts", "cluster"),
        "meshkit_discover_ports": ["thunderbolt*"],  # derived: what discovery probes
    }
    assert normalised["node1"] == expected
    assert normalised["node2"] == expected  # non-meshkit variables are not validated or returned
    assert normalised["node1"]["meshkit_backend"] == ""
    assert normalised["node1"]["meshkit_address_pool"] == "198.18.128.0/17"
    assert normalised["node1"]["meshkit_bridge"] == "bridge0"
    assert normalised["node1"]["meshkit_ping_count"] == 3


def test_meshccl_install_settings():
    normalised, problems = validate_hosts(
        {
            "node1": {"meshkit_state_dir": "/srv/mk/", "meshkit_meshccl_install": "false"},
            "node2": {"meshkit_meshccl_venv": "/opt/meshccl", "meshkit_meshccl_python": "/usr/bin/python3.11"},
        }
    )
    assert problems == []
    assert normalised["node1"]["meshkit_meshccl_venv"] == "/srv/mk/meshccl"
    assert normalised["node1"]["meshkit_meshccl_install"] is False
    assert normalised["node2"]["meshkit_meshccl_venv"] == "/opt/meshccl"
    assert normalised["node2"]["meshkit_meshccl_install"] is True
    problem = only_problem({"node1": {"meshkit_meshccl_venv": "relative/venv"}})
    assert "meshkit_meshccl_venv = 'relative/venv'" in problem and "absolute path" in problem, problem


def test_given_values_override_defaults():
    normalised, problems = validate_hosts(
        {"node1": {"meshkit_backend": "ring", "meshkit_mtu": 9000, "meshkit_peer_ports": ["tb*"]}}
    )
    assert problems == []
    assert normalised["node1"]["meshkit_backend"] == "ring"
    assert normalised["node1"]["meshkit_mtu"] == 9000
    assert normalised["node1"]["meshkit_peer_ports"] == ["tb*"]
    assert normalised["node1"]["meshkit_fabric"] == "thunderbolt"


def test_typo_gets_a_did_you_mean():
    normalised, problems = validate_hosts({"node1": {"meshkit_backnd": "ring"}})
    assert problems == ["node1: meshkit_backnd is not a meshkit variable; did you mean meshkit_backend?"]
    # the typo'd value is not silently used
    assert normalised["node1"]["meshkit_backend"] == ""


def test_typo_on_several_hosts_is_one_line():
    problem = only_problem({h: {"meshkit_adress_pool": "10.0.0.0/24"} for h in ("node2", "node1", "node3")})
    assert (
        problem
        == "node1, node2, node3: meshkit_adress_pool is not a meshkit variable; did you mean meshkit_address_pool?"
    )


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("meshkit_mtu", "big", "node1: meshkit_mtu = 'big': must be of integer type"),
        ("meshkit_mtu", 100, "node1: meshkit_mtu = 100: min value is 1280"),
        ("meshkit_mtu", 70000, "node1: meshkit_mtu = 70000: max value is 65520"),
        ("meshkit_backend", "rung", "node1: meshkit_backend = 'rung': unallowed value rung"),
        ("meshkit_address_pool", "10.0.0.1/8", "node1: meshkit_address_pool = '10.0.0.1/8': not an IPv4 network"),
        ("meshkit_address_pool", "fd00::/64", "node1: meshkit_address_pool = 'fd00::/64': not an IPv4 network"),
        ("meshkit_address_pool", "10.0.0.0/30", "node1: meshkit_address_pool = '10.0.0.0/30': too small"),
        ("meshkit_fabric", "infiniband", "node1: meshkit_fabric = 'infiniband': unallowed value infiniband"),
        ("meshkit_peer_ports", "thunderbolt*", "node1: meshkit_peer_ports = 'thunderbolt*': must be of list type"),
        ("meshkit_state_dir", "var/lib", "node1: meshkit_state_dir = 'var/lib':"),
        ("meshkit_ping_count", 0, "node1: meshkit_ping_count = 0: min value is 1"),
        ("meshkit_cluster_name", "-bad", "node1: meshkit_cluster_name = '-bad':"),
        ("meshkit_bridge", "a-name-longer-than-15", "node1: meshkit_bridge = 'a-name-longer-than-15':"),
    ],
)
def test_bad_value_names_host_field_and_value(field, value, expected):
    normalised, problems = validate_hosts({"node1": {field: value}, "node2": {}})
    assert len(problems) == 1, problems
    assert problems[0].startswith(expected), problems[0]
    assert "node1" not in normalised
    assert "node2" in normalised


def test_bad_value_comes_with_a_hint():
    problem = only_problem({"node1": {"meshkit_backend": "rung"}})
    assert problem.endswith("use ring, jaccl, jaccl-ring, or leave it unset for the best the cabling allows")
    problem = only_problem({"node1": {"meshkit_address_pool": "10.0.0.0/30"}})
    assert "/29 or larger" in problem


def test_pool_of_29_is_big_enough():
    assert validate_hosts({"node1": {"meshkit_address_pool": "10.0.0.0/29"}})[1] == []


def test_group_level_bad_value_is_one_problem_line_for_all_hosts():
    hosts = {f"node{i}": {"meshkit_mtu": "big"} for i in (3, 1, 2)}
    problem = only_problem(hosts)
    assert problem.startswith("node1, node2, node3: meshkit_mtu = 'big':")


def test_different_bad_values_are_different_lines():
    _normalised, problems = validate_hosts({"node1": {"meshkit_mtu": "big"}, "node2": {"meshkit_mtu": "huge"}})
    assert len(problems) == 2
    assert any(p.startswith("node1: meshkit_mtu = 'big'") for p in problems)
    assert any(p.startswith("node2: meshkit_mtu = 'huge'") for p in problems)


def test_several_problems_on_one_host_are_all_reported():
    _normalised, problems = validate_hosts(
        {"node1": {"meshkit_mtu": "big", "meshkit_backend": "rung", "meshkit_backnd": "ring"}}
    )
    assert len(problems) == 3
    assert all(p.startswith("node1: ") for p in problems)


@pytest.mark.parametrize("key", ["meshkit_backend", "meshkit_address_pool", "meshkit_cluster_name"])
def test_cluster_wide_variable_differing_between_hosts_is_reported(key):
    values = {"meshkit_backend": ("ring", ""), "meshkit_address_pool": ("10.1.0.0/24", "10.2.0.0/24")}.get(
        key, ("alpha", "beta")
    )
    problem = only_problem({"node1": {key: values[0]}, "node2": {key: values[1]}, "node3": {key: values[0]}})
    assert problem.startswith(f"node1, node2, node3: {key} differs between hosts (")
    assert f"node1={values[0]!r}" in problem
    assert f"node2={values[1]!r}" in problem
    assert "set it once for the whole cluster" in problem


def test_cluster_wide_variable_defaulted_on_one_host_differs_too():
    problem = only_problem({"node1": {"meshkit_backend": "jaccl"}, "node2": {}})
    assert "meshkit_backend differs between hosts (node1='jaccl', node2='')" in problem


def test_host_specific_variables_may_differ():
    _normalised, problems = validate_hosts(
        {"node1": {"meshkit_mtu": 9000, "meshkit_bridge": "br0"}, "node2": {"meshkit_mtu": 1500}}
    )
    assert problems == []


def test_extra_vars_strings_are_coerced_to_int():
    normalised, problems = validate_hosts({"node1": {"meshkit_mtu": "9000", "meshkit_ping_count": " 5 "}})
    assert problems == []
    assert normalised["node1"]["meshkit_mtu"] == 9000
    assert normalised["node1"]["meshkit_ping_count"] == 5


def test_empty_mtu_from_extra_vars_means_unset():
    normalised, problems = validate_hosts({"node1": {"meshkit_mtu": ""}})
    assert problems == []
    assert normalised["node1"]["meshkit_mtu"] is None


def test_negative_mtu_string_is_coerced_then_rejected():
    assert only_problem({"node1": {"meshkit_mtu": "-1"}}).startswith("node1: meshkit_mtu = -1: min value is 1280")


def test_input_is_not_modified():
    given = {"node1": {"meshkit_mtu": "9000"}}
    validate_hosts(given)
    assert given == {"node1": {"meshkit_mtu": "9000"}}


def test_playbook_knobs_passed_with_extra_vars_are_accepted():
    # setup.yml reads meshkit_hosts and meshkit_artifacts_dir; `-e meshkit_hosts=lab` puts them in every
    # host's hostvars, which plugins/action/inventory_check.py hands to validate_hosts.
    _normalised, problems = validate_hosts({"node1": {"meshkit_hosts": "lab", "meshkit_artifacts_dir": "/tmp/a"}})
    assert problems == []


def test_lab_inventory_variables_are_accepted():
    lab_vars = {
        "meshkit_lab_name": "lab",
        "meshkit_lab_dir": "/work/.lab/lab",
        "meshkit_lab_netns": "lab-node1",
        "meshkit_lab_ports": ["tb0", "tb1"],
        "meshkit_peer_ports": ["tb*"],
    }
    assert validate_hosts({"node1": lab_vars})[1] == []


def test_non_thunderbolt_fabric_needs_peer_ports():
    problem = only_problem({"node1": {"meshkit_fabric": "ethernet"}})
    assert problem.startswith("node1: meshkit_peer_ports is empty")
    assert validate_hosts({"node1": {"meshkit_fabric": "ethernet", "meshkit_peer_ports": ["enp1s0f*"]}})[1] == []


def test_the_slurmctld_host_must_be_a_host_of_the_inventory():
    from meshkit.inventory_schema import slurm_controller_problems

    slurm = {"meshkit_slurm": True}
    # A cluster host, or a head node that is in the inventory outside the cluster's group: fine.
    for controller in ("node2", "head"):
        normalised, problems = validate_hosts(
            {h: slurm | {"meshkit_slurm_controller": controller} for h in ("node1", "node2")}
        )
        assert problems == []
        assert slurm_controller_problems(normalised, {"node1", "node2", "head"}) == []
    # Unset: the ring's first host.
    normalised, _ = validate_hosts({"node1": slurm, "node2": slurm})
    assert slurm_controller_problems(normalised, {"node1", "node2"}) == []
    # A name Ansible cannot reach is refused before anything changes, naming the field and what to do.
    normalised, _ = validate_hosts({h: slurm | {"meshkit_slurm_controller": "login1"} for h in ("node1", "node2")})
    (problem,) = slurm_controller_problems(normalised, {"node1", "node2"})
    assert problem.startswith("node1, node2: meshkit_slurm_controller = 'login1': not a host of the inventory")
    assert "in a group of its own" in problem and "localhost with ansible_connection=local" in problem
    # The controller itself as an inventory host without an address the nodes reach: each node's slurmd
    # would call itself; refused, naming the host and what to set.
    normalised, _ = validate_hosts({h: slurm | {"meshkit_slurm_controller": "localhost"} for h in ("node1", "node2")})
    for address in ("localhost", "127.0.0.1", "::1", "127.0.1.1"):
        (problem,) = slurm_controller_problems(normalised, {"node1", "node2", "localhost"}, {"localhost": address})
        assert f"its address {address!r}" in problem and "Set ansible_host (or slurm_addr) of localhost" in problem
    assert slurm_controller_problems(normalised, {"node1", "node2", "localhost"}, {"localhost": "10.0.0.9"}) == []
    # A head node reached by name is fine.
    normalised, _ = validate_hosts({h: slurm | {"meshkit_slurm_controller": "head"} for h in ("node1", "node2")})
    assert slurm_controller_problems(normalised, {"node1", "node2", "head"}, {"head": "head.example.net"}) == []
    # Without meshkit_slurm the setting is not used, so not refused.
    normalised, _ = validate_hosts({"node1": {"meshkit_slurm_controller": "login1"}})
    assert slurm_controller_problems(normalised, {"node1"}) == []


def test_what_meshkit_itself_set_in_an_earlier_play_is_no_user_setting():
    """launch.yml after setup.yml in one playbook: the hosts carry the facts setup.yml's modules set (and launch.yml's
    own registered results, when it runs twice); none of them is reported as an unknown variable."""
    earlier = {name: {"x": 1} for name in inventory_schema.SET_BY_MESHKIT}
    normalised, problems = inventory_schema.validate_hosts({"node1": {**earlier, "meshkit_backend": "ring"}})
    assert problems == []
    assert normalised["node1"]["meshkit_backend"] == "ring"
    assert not set(normalised["node1"]) & inventory_schema.SET_BY_MESHKIT
    # A user's misspelling still is one.
    _, problems = inventory_schema.validate_hosts({"node1": {**earlier, "meshkit_backnd": "ring"}})
    assert problems == ["node1: meshkit_backnd is not a meshkit variable; did you mean meshkit_backend?"]
