"""The management guard (module_utils/management.py, module meshkit.cluster.management) on recorded
outputs: the interface is established from ansible_host resolved on the host and from the route
back to the controller, never from the login environment alone; every way it cannot be established
is a refusal that names the host, what was tried and the variable to set; an unsafe pool is refused;
and no command any planner makes ever names the management interface."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import linux_net, port_rules
from ansible_collections.meshkit.cluster.plugins.module_utils import management as mg
from ansible_collections.meshkit.cluster.plugins.modules import management as module

LINUX = Path(__file__).resolve().parents[1] / "fixtures" / "linux"
MACOS_ROUTES = Path(__file__).resolve().parents[1] / "fixtures" / "macos_routes"
CONTROLLER = "198.20.0.1"  # the machine's address on the recorded lab's management bridge
NODE1 = "198.20.0.2"  # node1's management address (mgmt0)
NODE2 = "198.20.0.3"  # node2's, moved onto bridge0 in the mgmt_in_bridge recording
POOL = "198.18.128.0/17"


def text(name: str) -> str:
    return (LINUX / name).read_text()


def host(addr: str, routes: str, route_get: dict[str, str] | None = None):
    """A fake run() answering like the recorded host: ip addr, the route table, ip route get."""
    answers = {
        ("ip", "-j", "addr", "show"): text(addr),
        ("ip", "-j", "-4", "route", "show", "table", "all"): text(routes),
    }
    for address, name in (route_get or {}).items():
        answers[("ip", "-j", "route", "get", address)] = text(name)
    calls: list[list[str]] = []

    def run(argv: list[str]) -> tuple[int, str, str]:
        calls.append(argv)
        if tuple(argv) in answers:
            return 0, answers[tuple(argv)], ""
        if argv[:4] == ["ip", "-j", "route", "get"]:
            return 2, "", "RTNETLINK answers: Network is unreachable"
        raise AssertionError(f"unexpected command {argv}")

    run.calls = calls  # type: ignore[attr-defined]
    return run


FRESH = ("lab_node1_fresh_ip_addr.json", "lab_node1_fresh_ip_route_all.json")
CONVERGED = ("lab_node1_converged_ip_addr.json", "lab_node1_converged_ip_route_all.json")
ROUTES = {CONTROLLER: "lab_node1_ip_route_get_controller.json", NODE1: "lab_node1_ip_route_get_own.json"}


def resolver(table: dict[str, list[tuple[str, str | None]]]) -> mg.Resolve:
    """Name resolution on the host: a name in the table, else a literal address, else an error."""

    def resolve(name: str) -> list[tuple[str, str | None]]:
        if name in table:
            return table[name]
        try:
            return [(str(mg.ipaddress.ip_address(name)), None)]
        except ValueError:
            raise OSError(-2, "Name or service not known") from None

    return resolve


def establish(params: dict, run, resolve=None, environ=None) -> dict:
    return module.establish(
        {"host": "node1", "bridge": "bridge0", **params}, run, "Linux", resolve or resolver({}), environ or {}
    )


# ---- establishing it ------------------------------------------------------------------------------
def test_a_name_resolved_on_the_host_finds_the_interface_without_ssh_connection():
    result = establish(
        {"address": "node1.lab.meshkit.test"},
        host(*FRESH),
        resolver({"node1.lab.meshkit.test": [(NODE1, None)]}),
    )
    assert result.get("failed") is None, result
    assert result["interface"] == "mgmt0"
    assert result["findings"] == [
        {
            "source": "ansible_host 'node1.lab.meshkit.test' resolved on the host",
            "detail": f"{NODE1} on mgmt0",
            "interface": "mgmt0",
        }
    ]


def test_the_route_back_to_the_controller_finds_it_when_the_name_resolves_to_loopback():
    # Debian maps a host's own name to 127.0.1.1: that answer tells nothing, the route does.
    result = establish(
        {"address": "node1", "controller_addresses": [CONTROLLER]},
        host(*FRESH, route_get=ROUTES),
        resolver({"node1": [("127.0.1.1", None)]}),
    )
    assert result["interface"] == "mgmt0", result
    assert [f["interface"] for f in result["findings"]] == [None, "mgmt0"]
    assert "127.0.1.1 only (loopback" in result["findings"][0]["detail"]
    assert result["findings"][1]["detail"] == "leaves through mgmt0"


def test_a_name_that_resolves_to_loopback_with_no_other_evidence_is_refused():
    run = host(*FRESH)
    result = establish({"address": "node1"}, run, resolver({"node1": [("127.0.1.1", None)]}))
    assert result["failed"] is True
    msg = result["msg"]
    assert msg.startswith("node1: cannot tell which interface carries the management connection")
    assert "changes nothing on any host" in msg
    assert "ansible_host 'node1' resolved on the host: 127.0.1.1 only (loopback" in msg
    assert "Set meshkit_management_interface for this host" in msg
    assert result["interface"] is None
    assert all(c[:2] == ["ip", "-j"] for c in run.calls)  # read-only, nothing else ran


def test_an_unresolvable_name_and_no_ssh_connection_is_refused():
    result = establish({"address": "studio1.local"}, host(*FRESH))
    assert result["failed"] is True
    assert "ansible_host 'studio1.local' resolved on the host: does not resolve here" in result["msg"]
    assert "meshkit_management_interface" in result["msg"]


def test_ssh_connection_is_used_when_the_login_environment_still_has_it():
    environ = {"SSH_CONNECTION": f"{CONTROLLER} 51234 {NODE1} 22"}
    result = establish({"address": "studio1.local"}, host(*FRESH, route_get=ROUTES), environ=environ)
    assert result["interface"] == "mgmt0", result
    sources = [f["source"] for f in result["findings"] if f["interface"]]
    assert sources == [f"route to SSH_CONNECTION's client {CONTROLLER}", "SSH_CONNECTION's server address"]


def test_answers_that_disagree_are_refused_naming_both():
    route_via_tb0 = host(*CONVERGED, route_get={CONTROLLER: "lab_node1_ip_route_get_controller.json"})
    # ansible_host resolves to the cable address on tb0, the controller's route leaves through mgmt0.
    result = establish(
        {"address": "node1.lab", "controller_addresses": [CONTROLLER]},
        route_via_tb0,
        resolver({"node1.lab": [("198.18.128.1", None)]}),
    )
    assert result["failed"] is True
    assert "more than one interface (mgmt0, tb0)" in result["msg"]
    assert "198.18.128.1 on tb0" in result["msg"] and "leaves through mgmt0" in result["msg"]


def test_the_inventory_variable_wins_but_must_exist():
    run = host(*FRESH, route_get=ROUTES)
    ok = establish({"address": "node1", "interface": "mgmt0"}, run, resolver({"node1": [("127.0.1.1", None)]}))
    assert ok["interface"] == "mgmt0"
    typo = establish({"address": NODE1, "interface": "eth0"}, run)
    assert typo["failed"] is True
    assert "meshkit_management_interface = 'eth0', but this host has no such interface" in typo["msg"]
    assert "bridge0, lo, mgmt0, tb0" in typo["msg"]


def test_an_ipv6_management_address_and_controller():
    run = host(
        "lab_node1_converged_mgmt_ipv6_ip_addr.json",
        "lab_node1_converged_ip_route_all.json",
        route_get={"fd42:6d6b::1": "lab_node1_mgmt_ipv6_ip_route_get_controller.json"},
    )
    result = establish(
        {"address": "fd42:6d6b::2", "controller_addresses": ["fd42:6d6b::1"], "pool": POOL, "peer_ports": ["tb*"]}, run
    )
    assert result.get("failed") is None, result
    assert result["interface"] == "mgmt0"
    assert [f["interface"] for f in result["findings"]] == ["mgmt0", "mgmt0"]


MGMT0_LL = "fe80::8005:99ff:fee2:c3e5"  # mgmt0's link-local address in the fresh recording


def test_a_link_local_name_answer_names_the_interface_holding_it():
    result = establish({"address": "node1.local"}, host(*FRESH), resolver({"node1.local": [(MGMT0_LL, "mgmt0")]}))
    assert result["interface"] == "mgmt0"
    # A scope that does not hold the address is not believed.
    wrong = establish({"address": "node1.local"}, host(*FRESH), resolver({"node1.local": [("fe80::1", "tb0")]}))
    assert wrong["failed"] is True
    assert "fe80::1, which no interface of this host holds" in wrong["msg"]


def test_the_zone_of_a_literal_ansible_host_is_the_controllers_not_the_hosts():
    # fe80::...%lo on the controller: "lo" names the controller's interface; the host holds the
    # address on mgmt0.
    result = establish({"address": f"{MGMT0_LL}%lo"}, host(*FRESH))
    assert result["interface"] == "mgmt0", result


def test_a_link_local_controller_address_tells_nothing():
    run = host(*FRESH)
    result = establish({"address": "node1", "controller_addresses": ["fe80::c"]}, run, resolver({"node1": []}))
    assert result["failed"] is True
    assert "route to the controller fe80::c: link-local, no zone on this host: tells nothing" in result["msg"]
    assert not [c for c in run.calls if c[:4] == ["ip", "-j", "route", "get"]]


def test_a_name_answering_on_several_interfaces_goes_by_its_routable_answers():
    # mDNS answers a host's own name with every address it has: the management one, link-local
    # ones and, once set up, the cable addresses. The cable and link-local answers tell nothing.
    converged = host(*CONVERGED)
    answers = {"node1.local": [(MGMT0_LL, "mgmt0"), ("198.18.128.1", None), (NODE1, None)]}
    result = establish({"address": "node1.local", "peer_ports": ["tb*"]}, converged, resolver(answers))
    assert result["interface"] == "mgmt0", result
    details = [f["detail"] for f in result["findings"]]
    assert "198.18.128.1 on the peer port tb0 (a cable address): tells nothing" in details
    assert f"{NODE1} on mgmt0" in details
    # Two routable answers on two interfaces, neither a peer port: the name tells nothing.
    split = establish({"address": "node1.local", "peer_ports": ["eth*"]}, converged, resolver(answers))
    assert split["failed"] is True
    assert "but the name also answers on" in split["msg"]


def test_the_lower_device_of_the_management_interface_is_never_a_peer_port():
    # Management on a VLAN (or macvlan) of a device the peer patterns match: that device is never
    # planned, detached or persisted (its own .network file would drop the VLAN at the next boot).
    links = json.loads(text("lab_node1_fresh_ip_link.json"))
    vlan = {"ifname": "tb0.100", "link": "tb0", "flags": ["UP", "LOWER_UP"], "linkinfo": {"info_kind": "vlan"}}
    links = [*links, vlan]
    assert "tb0" not in [c["ifname"] for c in port_rules.candidate_ports(links, ["tb*"], "tb0.100")]
    plan = linux_net.plan_bridge(links, "bridge0", ["tb*"], "tb0.100")
    assert plan["commands"] == [] and "tb0" in plan["refused"]
    # The guard's first step refuses it too, while tb0 is in bridge0 (the VLAN would go with it).
    addrs = json.loads(text("lab_node1_fresh_ip_addr.json"))
    addrs.append({"ifname": "tb0.100", "link": "tb0", "addr_info": [{"local": "10.9.0.2", "prefixlen": 24}]})

    def run(argv: list[str]) -> tuple[int, str, str]:
        if argv == ["ip", "-j", "addr", "show"]:
            return 0, json.dumps(addrs), ""
        return 0, text("lab_node1_fresh_ip_route_all.json"), ""

    result = establish({"address": "10.9.0.2"}, run)
    assert result["interface"] == "tb0.100"
    assert result["failed"] is True
    assert "runs over tb0.100, which rests on tb0 (bridge0 or a member)" in result["msg"]


# ---- the pool ------------------------------------------------------------------------------------
def test_the_default_pool_is_safe_on_a_fresh_and_on_a_converged_host():
    for state in (FRESH, CONVERGED):
        result = establish({"address": NODE1, "pool": POOL, "peer_ports": ["tb*"], "controller_addresses": []},
                           host(*state))  # fmt: skip
        assert result.get("failed") is None, result


def test_a_pool_overlapping_the_management_network_is_refused():
    result = establish({"address": NODE1, "pool": "198.20.0.0/16", "peer_ports": ["tb*"]}, host(*FRESH))
    assert result["failed"] is True
    msg = result["msg"]
    assert msg.startswith("node1: the cable address pool meshkit_address_pool = '198.20.0.0/16' overlaps")
    assert "address 198.20.0.2/24 on mgmt0" in msg
    assert "route 198.20.0.0/24 dev mgmt0" in msg
    assert "route local 198.20.0.2 dev mgmt0 table local" in msg
    assert "nothing was changed on any host" in msg


def test_a_pool_holding_the_controller_or_ansible_host_is_refused():
    # A /32 over a cable to the controller would take the controller's traffic off mgmt0.
    net = mg.linux_hostnet(host(*FRESH))
    conflicts = mg.pool_conflicts("198.20.0.0/30", net, ["tb*"], "mgmt0", {"the controller's address": [CONTROLLER]})
    assert "the controller's address 198.20.0.1" in conflicts
    assert mg.pool_conflicts("10.99.0.0/16", net, ["tb*"], "mgmt0", {"ansible_host": ["10.99.1.1"]}) == [
        "ansible_host 10.99.1.1"
    ]


def test_pool_addresses_count_only_on_peer_ports_and_never_on_the_management_interface():
    net = mg.linux_hostnet(host(*CONVERGED))
    assert mg.pool_conflicts(POOL, net, ["tb*"], "mgmt0") == []
    # tb0 is not a peer port by these patterns: its pool address and routes are someone else's.
    assert mg.pool_conflicts(POOL, net, ["eth*"], "mgmt0") == [
        "address 198.18.128.1/30 on tb0",
        "route 198.18.128.0/30 dev tb0",
        "route 198.18.128.2 dev tb0",
        "route local 198.18.128.1 dev tb0 table local",
    ]
    # tb0 matches the patterns but is the management interface: it is never meshkit's own.
    assert "address 198.18.128.1/30 on tb0" in mg.pool_conflicts(POOL, net, ["tb*"], "tb0")


def test_default_routes_never_count_split_ones_included():
    net = mg.HostNet(
        routes=[
            (mg.ipaddress.IPv4Network("0.0.0.0/0"), "eth0", "default via 10.0.0.1 dev eth0"),
            # A full-tunnel VPN's split default (netstat: 0/1 and 128.0/1 through utun3).
            (mg.ipaddress.IPv4Network("0.0.0.0/1"), "utun3", "0/1 utun3"),
            (mg.ipaddress.IPv4Network("128.0.0.0/1"), "utun3", "128.0/1 utun3"),
        ]
    )
    assert mg.pool_conflicts(POOL, net, [], "eth0") == []


# ---- macOS routing tables (recorded netstat -rn) -------------------------------------------------
def test_netstat_routes_of_a_mac_with_two_defaults_and_a_vpn():
    routes = mg.parse_netstat_routes((MACOS_ROUTES / "netstat_rn_finet_two_defaults_vpn_EXCERPT.txt").read_text())
    got = {(str(net), iface) for net, iface, _ in routes}
    assert ("127.0.0.0/8", "lo0") in got
    assert ("169.254.0.0/16", "en8") in got and ("169.254.0.0/16", "en0") in got
    assert ("192.168.0.0/24", "en8") in got
    assert ("192.168.0.1/32", "en0") in got  # a host entry (H) with a MAC gateway
    assert ("192.0.2.42/32", "utun2") in got
    assert ("224.0.0.0/4", "en8") in got
    assert all(net.prefixlen > 0 for net, _, _ in routes)  # default routes are not networks here
    net = mg.HostNet(routes=routes)
    assert mg.pool_conflicts(POOL, net, [], "en0") == []
    assert mg.pool_conflicts("192.168.0.0/16", net, [], "en0")[:2] == [
        "route 192.168.0 link#17 UCS en8",
        "route 192.168.0 link#6 UCSI en0",
    ]


def test_netstat_routes_in_the_newer_layout():
    routes = mg.parse_netstat_routes((MACOS_ROUTES / "netstat_rn_finet_wifi_EXCERPT.txt").read_text())
    got = {(str(net), iface) for net, iface, _ in routes}
    assert ("192.168.88.1/32", "en0") in got and ("192.168.88.68/32", "lo0") in got
    assert ("169.254.169.254/32", "en0") in got


# ---- no planned command names the management interface -------------------------------------------
STATES = [
    ("lab_node1_fresh_ip_link.json", "lab_node1_fresh_ip_addr.json", "lab_node1_fresh_ip_route.json"),
    ("lab_node1_converged_ip_link.json", "lab_node1_converged_ip_addr.json", "lab_node1_converged_ip_route.json"),
    ("lab_node2_mgmt_in_bridge_ip_link.json", "lab_node2_mgmt_in_bridge_ip_addr.json", None),
]


@pytest.mark.parametrize("state", STATES, ids=["fresh", "converged", "mgmt-in-bridge"])
def test_no_linux_planner_command_ever_names_the_management_interface(state):
    links = json.loads(text(state[0]))
    addrs = json.loads(text(state[1]))
    routes: dict = {}
    for r in json.loads(text(state[2])) if state[2] else []:
        routes.setdefault(r.get("dev", ""), []).append(r)
    names = [link["ifname"] for link in links]
    ports = [
        {"port": name, "address": f"198.18.128.{4 * i + 1}", "prefix": 30, "peer_address": f"198.18.128.{4 * i + 2}"}
        for i, name in enumerate(names)
    ]
    for mgmt in [*names, None]:
        for patterns in ([], ["tb*"], ["*"]):
            plan = linux_net.plan_bridge(links, "bridge0", patterns, mgmt)
            if mgmt is None:
                assert plan["commands"] == [] and plan["refused"], "an unknown management interface is a refusal"
            for argv in plan["commands"]:
                assert mgmt not in argv, (mgmt, patterns, argv)
            candidates = [c["ifname"] for c in port_rules.candidate_ports(links, patterns or ["*"], mgmt)]
            assert mgmt not in candidates
            usable = [p for p in ports if p["port"] in candidates and p["port"] != "bridge0"]
            try:
                commands, _notes = linux_net.plan_peer_links(
                    links, addrs, usable, POOL, patterns or ["*"], None, mgmt, routes
                )
            except linux_net.NetError:
                continue  # refused (a port still in a bridge): nothing planned at all
            for argv in commands:
                assert mgmt not in argv, (mgmt, patterns, argv)


# ---- macOS (recorded ifconfig, netstat, route -n get, networksetup of real Macs) ----------------
MACOS = Path(__file__).resolve().parents[1] / "fixtures" / "macos"
SONOMA_IFCONFIG = "ifconfig_a_macbookpro16_apple_silicon_sonoma14.4_bridge0_3_tb_members.txt"
SONOMA_PORTS = "networksetup_listallhardwareports_macbookpro16_apple_silicon_sonoma14.4.txt"
SONOMA_EN0 = "192.168.2.46"  # Wi-Fi (en0) of that MacBook Pro; en1-en3 (Thunderbolt 1-3) are in bridge0
LAN_ROUTER = "192.168.64.1"  # the on-link neighbour of the macOS 26 capture (route -n get: en0)


def mac(netstat: str = "netstat_rn_finet_macos26vm.txt", ifconfig: str = SONOMA_IFCONFIG):
    answers = {
        ("ifconfig",): (MACOS / ifconfig).read_text(),
        ("netstat", "-rn", "-f", "inet"): (MACOS / netstat).read_text(),
        ("networksetup", "-listallhardwareports"): (MACOS / SONOMA_PORTS).read_text(),
        ("route", "-n", "get", LAN_ROUTER): (
            MACOS / "route_get_192.168.64.1_onlink_gateway_en0_macos26vm.txt"
        ).read_text(),
        ("route", "-n", "get", "127.0.0.1"): (MACOS / "route_get_127.0.0.1_lo0_macos26vm.txt").read_text(),
    }

    def run(argv: list[str]) -> tuple[int, str, str]:
        if tuple(argv) in answers:
            return 0, answers[tuple(argv)], ""
        if argv[:3] == ["route", "-n", "get"]:
            # What route(8) prints for a destination it cannot reach; it exits 0 even then.
            return 0, "", "route: writing to routing socket: not in table"
        raise AssertionError(f"unexpected command {argv}")

    return run


def establish_mac(params: dict, run=None, resolve=None) -> dict:
    return module.establish({"host": "studio1", **params}, run or mac(), "Darwin", resolve or resolver({}), {})


def test_mac_ifconfig_addresses_and_bridge_members():
    net = mg.parse_ifconfig((MACOS / SONOMA_IFCONFIG).read_text())
    assert net.interface_of(SONOMA_EN0) == "en0"
    assert net.bridge_members["bridge0"] == ["en1", "en2", "en3"]
    assert str(net.addresses["lo0"][0]) == "127.0.0.1/8"
    intel = mg.parse_ifconfig((MACOS / "ifconfig_intel_mbp_bridge0_4_tb_members_bridge100_inet.txt").read_text())
    assert intel.interface_of("192.168.64.1") == "bridge100"
    assert intel.bridge_members == {"bridge0": ["en1", "en2", "en3", "en4"], "bridge100": ["en10"]}


def test_mac_a_name_resolved_on_the_host_finds_wifi():
    result = establish_mac({"address": "studio1.local"}, resolve=resolver({"studio1.local": [(SONOMA_EN0, None)]}))
    assert result.get("failed") is None, result
    assert result["interface"] == "en0"


def test_mac_a_link_local_mdns_answer_names_its_scope():
    # mDNS often answers a .local name with the host's scoped IPv6 link-local address.
    scoped = resolver({"studio1.local": [("fe80::4444:3333:0:5555", "en0")]})
    assert establish_mac({"address": "studio1.local"}, resolve=scoped)["interface"] == "en0"


def test_mac_the_route_back_to_the_controller_when_the_name_tells_nothing():
    result = establish_mac(
        {"address": "studio1", "controller_addresses": [LAN_ROUTER]},
        resolve=resolver({"studio1": [("127.0.0.1", None)]}),
    )
    assert result["interface"] == "en0", result
    assert result["findings"][-1] == {
        "source": f"route to the controller {LAN_ROUTER}",
        "detail": "leaves through en0",
        "interface": "en0",
    }


def test_mac_nothing_to_go_on_is_refused():
    result = establish_mac({"address": "studio1.local", "controller_addresses": ["10.9.9.9"]})
    assert result["failed"] is True
    assert "studio1: cannot tell which interface carries the management connection" in result["msg"]
    assert "route to the controller 10.9.9.9: no route" in result["msg"]
    assert "meshkit_management_interface" in result["msg"]


def test_mac_the_route_to_itself_through_lo0_tells_nothing():
    iface, detail = mg.darwin_route_interface(mac(), "127.0.0.1")
    assert iface is None and "tells nothing" in detail


def test_mac_management_in_the_thunderbolt_bridge_is_refused():
    result = establish_mac({"address": SONOMA_EN0, "interface": "en2", "bridge": "bridge0"})
    assert result["failed"] is True
    assert "runs over en2, a member of bridge0" in result["msg"]


def test_mac_pool_overlapping_a_lan_address_or_a_route_is_refused():
    result = establish_mac({"address": SONOMA_EN0, "pool": "192.168.0.0/16"})
    assert result["failed"] is True
    assert "address 192.168.2.46/24 on en0" in result["msg"]
    assert "route 192.168.64 link#7 UCS en0" in result["msg"]
    ok = establish_mac({"address": SONOMA_EN0, "pool": POOL})
    assert ok.get("failed") is None, ok


# ---- the controller's side (action plugin) -------------------------------------------------------
def test_the_controllers_source_address_toward_a_host():
    from ansible_collections.meshkit.cluster.plugins.action import management as action

    assert action.source_addresses("127.0.0.1") == ["127.0.0.1"]
    assert action.source_addresses("no-such-host.invalid") == []


def test_a_jump_host_is_seen_in_sshs_effective_configuration():
    from ansible_collections.meshkit.cluster.plugins.action import management as action

    assert action.ssh_proxy("node1.example", ["-o", "ProxyJump=admin@bastion"]) == "proxyjump admin@bastion"
    assert action.ssh_proxy("node1.example", ["-o", "ProxyCommand=nc %h %p"]) == "proxycommand nc %h %p"
    assert action.ssh_proxy("node1.example", ["-F", "/dev/null"]) is None
