"""RDMA facts on recorded sysfs trees and recorded macOS / Linux command outputs
(tests/fixtures/rdma, tests/fixtures/macos; provenance in their SOURCES.md)."""

from __future__ import annotations

import platform
import stat
from pathlib import Path

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import rdma
from ansible_collections.meshkit.cluster.plugins.modules import rdma_facts

from .module_harness import patch_exits, run_module

FIX = Path(__file__).resolve().parents[1] / "fixtures"
SYSFS = FIX / "rdma" / "sysfs"
REC = FIX / "rdma" / "recordings"
MAC = FIX / "macos"


def ports_of(case: str) -> dict[str, rdma.RdmaPort]:
    return {f"{p.device}:{p.port}": p for p in rdma.read_sysfs(str(SYSFS / case))}


def transcript(path: Path, commands: list[str]) -> dict[str, str]:
    """Split a recorded terminal transcript into {command: output} (prompts '%', '$' optional)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in path.read_text().splitlines():
        bare = line.lstrip("%$ ").strip()
        if bare in commands:
            current = bare
            out[current] = []
        elif current is not None and line.strip() not in ("$", "%"):
            out[current].append(line)
    return {k: "\n".join(v) + "\n" for k, v in out.items()}


# ---- Linux sysfs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "port", "netdev", "index", "ipv4"),
    [
        ("roce_v2_ipv4_ipv6", "rxe0:1", "enp0s3", 2, "10.0.0.151"),
        ("roce_v1v2_ipv4_index5_cx5", "rocep0s6:1", None, 5, "10.0.3.1"),
        ("roce_two_devices_index3", "mlx5_0:1", "ens3np0", 3, "11.0.0.72"),
        ("roce_two_devices_index3", "mlx5_1:1", "ens2np0", 3, "11.0.0.73"),
        ("roce_sparse_gid_table_pod", "mlx5_0:1", "net1", 7, "10.152.0.12"),
        ("roce_sparse_gid_table_pod", "mlx5_1:1", "net2", 7, "10.152.4.12"),
    ],
)
def test_roce_v2_ipv4_gid_index(case, port, netdev, index, ipv4):
    p = ports_of(case)[port]
    assert p.netdev == netdev
    assert p.link_layer == "Ethernet"
    gid = p.ipv4_gid()
    assert (gid.index, gid.ipv4, gid.type) == (index, ipv4, "RoCE v2")


def test_link_local_v2_and_v1_ipv4_are_not_the_nccl_gid():
    # Index 3 of this ConnectX-5 is a link-local RoCE v2 GID, index 4 the IPv4 one as RoCE v1.
    p = ports_of("roce_v1v2_ipv4_index5_cx5")["rocep0s6:1"]
    by_index = {g.index: g for g in p.gids}
    assert by_index[3].type == "RoCE v2" and by_index[3].ipv4 is None
    assert by_index[4].type == "IB/RoCE v1" and by_index[4].ipv4 == "10.0.3.1"
    assert p.ipv4_gid().index == 5


def test_unused_slots_are_skipped_and_ipv6_globals_kept():
    pod = ports_of("roce_sparse_gid_table_pod")["mlx5_0:1"]
    assert [g.index for g in pod.gids] == [4, 5, 6, 7]
    rxe = ports_of("roce_v2_ipv4_ipv6")["rxe0:1"]
    assert [g.gid[:4] for g in rxe.gids if g.index >= 3] == ["2601", "2601", "2601"]


def test_nccl_env_of_an_active_roce_port():
    ports = list(ports_of("roce_v1v2_ipv4_index5_cx5").values())
    facts = rdma.host_facts("Linux", ports, ["eth1"])
    assert facts["status"] == "enabled"
    assert facts["nccl_env"] == {
        "NCCL_IB_HCA": "=rocep0s6:1",
        "NCCL_IB_GID_INDEX": "5",
        "NCCL_SOCKET_IFNAME": "=eth1",
    }


def test_nccl_env_of_infiniband_has_no_gid_index_and_names_ib0():
    ports = list(ports_of("infiniband").values())
    facts = rdma.host_facts("Linux", ports, ["ib0"])
    assert facts["nccl_env"] == {
        "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1",
        "NCCL_SOCKET_IFNAME": "=ib0",
    }
    assert facts["ports"]["ib0"]["device"] == "mlx5_0"
    assert facts["ports"]["ib0"]["usable"] is True
    assert facts["ports"]["ib0"]["rate"] == "100 Gb/sec (4X EDR)"
    assert facts["usable"] is True


def test_ports_down_are_left_out_of_nccl_ib_hca_and_named():
    ports = ports_of("port_down")
    facts = rdma.host_facts("Linux", list(ports.values()), ["net1"])
    assert facts["nccl_env"]["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1,mlx5_7:1"
    assert "NCCL_IB_GID_INDEX" not in facts["nccl_env"]  # no IPv4 GID recorded on any port
    assert ports["mlx5_2:1"].problem() == "mlx5_2 port 1 is DOWN (Disabled)"
    # net1 is ACTIVE but its recorded GID table has no IPv4 entry.
    assert facts["ports"]["net1"]["usable"] is False
    assert "no RoCE v2 IPv4 GID yet" in facts["ports"]["net1"]["problem"]
    assert facts["usable"] is False
    assert facts["runbook"] == rdma.RUNBOOK_ROCE


def test_active_roce_without_ipv4_and_ib_down():
    ports = ports_of("roce_active_no_ipv4_ib_down")
    assert ports["mlx5_0:1"].netdev == "ens11f0"
    assert ports["mlx5_0:1"].problem().endswith("has no RoCE v2 IPv4 GID yet (its interface needs an IPv4 address)")
    assert ports["mlx5_1:1"].link_layer == "InfiniBand"
    assert ports["mlx5_1:1"].problem() == "mlx5_1 port 1 is DOWN (Disabled)"
    env = rdma.host_facts("Linux", list(ports.values()), ["ens11f0"])["nccl_env"]
    assert env == {"NCCL_IB_HCA": "=mlx5_0:1", "NCCL_SOCKET_IFNAME": "=ens11f0"}


def test_devices_disagreeing_on_the_index_let_nccl_pick_per_device():
    a = ports_of("roce_v1v2_ipv4_index5_cx5")["rocep0s6:1"]
    b = ports_of("roce_two_devices_index3")["mlx5_0:1"]
    b.state = "ACTIVE"  # the show_gids recording has no port state
    env = rdma.nccl_env([a, b], [])
    assert "NCCL_IB_GID_INDEX" not in env
    assert env["NCCL_IB_ROCE_VERSION_NUM"] == "2" and env["NCCL_IB_ADDR_FAMILY"] == "AF_INET"
    assert env["NCCL_SOCKET_IFNAME"] == "=ens3np0"  # no plan ports: the ACTIVE ports' netdevs


def test_socket_ifname_never_names_lo_or_docker0():
    env = rdma.nccl_env([], ["lo", "docker0", "tb0", "tb1"])
    assert env == {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "=tb0,tb1"}
    assert "NCCL_SOCKET_IFNAME" not in rdma.nccl_env([], ["lo", "docker0"])


def test_no_sysfs_tree_is_no_rdma(tmp_path):
    assert rdma.read_sysfs(str(tmp_path)) == []
    facts = rdma.host_facts("Linux", [], ["tb0", "tb1"])
    assert facts["status"] == "none"
    assert facts["message"] == "no RDMA devices (/sys/class/infiniband is empty or absent)"
    assert facts["problems"] == [f"tb{i}: no RDMA devices (/sys/class/infiniband is empty or absent)" for i in (0, 1)]
    assert facts["nccl_env"] == {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "=tb0,tb1"}


# ---- ibv_devinfo -v (Linux recordings) ----------------------------------------------------


def test_ibv_devinfo_v_connectx5_blog_copy():
    ports = rdma.parse_ibv_devinfo((REC / "linux_ibv_devinfo_v_connectx5_rocep0s6_martins3.txt").read_text())
    assert [(p.device, p.port, p.state, p.link_layer) for p in ports] == [("rocep0s6", 1, "ACTIVE", "Ethernet")]
    assert ports[0].ipv4_gid().index == 5
    assert ports[0].ipv4_gid().ipv4 == "10.0.3.1"
    # The same GIDs as the sysfs tree reconstructed from this recording.
    tree = ports_of("roce_v1v2_ipv4_index5_cx5")["rocep0s6:1"]
    assert [(g.index, g.gid, g.type) for g in ports[0].gids] == [(g.index, g.gid, g.type) for g in tree.gids]


def test_ibv_devinfo_v_raw_tabs_both_gid_forms():
    text = (REC / "linux_ibv_devinfo_v_gid_lines_mlx5_bond_0_nccl769_EXCERPT.txt").read_text()
    text = (
        "hca_id:\tmlx5_bond_0\n\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tlink_layer:\t\tEthernet\n" + text
    )
    (port,) = rdma.parse_ibv_devinfo(text)
    assert port.ipv4_gid().index == 3
    assert port.ipv4_gid().ipv4 == "200.0.209.6"
    # index 2 (v1, full hex) and 3 (v2, inet_ntop form) are the same address
    by_index = {g.index: g for g in port.gids}
    assert by_index[2].gid == by_index[3].gid


def test_ibv_devinfo_v_mail_wrapped_rxe():
    ports = rdma.parse_ibv_devinfo(
        (REC / "linux_rxe0_ibv_devinfo_v_and_ip_addr_linux-rdma_2022-02-03_EXCERPT.txt").read_text()
    )
    rxe = [p for p in ports if p.device == "rxe0"]
    assert rxe and rxe[0].ipv4_gid().index == 2


# ---- macOS --------------------------------------------------------------------------------


def test_macos_enabled_three_tb5_ports():
    rec = transcript(
        REC / "macos_rdma_ctl_status_enabled_and_ibv_devices_macmini_m4pro_mlx2944_REDACTED_BY_AUTHOR.txt",
        ["rdma_ctl status", "ibv_devices"],
    )
    assert rdma.parse_rdma_ctl(rec["rdma_ctl status"]) is True
    assert rdma.parse_ibv_devices(rec["ibv_devices"]) == ["rdma_en2", "rdma_en3", "rdma_en4"]
    tn = transcript(REC / "macos_ibv_devinfo_v_rdma_en2_gid_table_tn3205_ABRIDGED.txt", ["ibv_devinfo -d rdma_en2 -v"])
    ports = rdma.parse_ibv_devinfo(tn["ibv_devinfo -d rdma_en2 -v"])
    (en2,) = ports
    assert (en2.device, en2.netdev, en2.state, en2.link_layer) == ("rdma_en2", "en2", "ACTIVE", "Thunderbolt")
    assert en2.rate == "10.0 Gbps (8X)"
    gid = en2.ipv4_gid()
    assert (gid.index, gid.ipv4, gid.type) == (1, "169.254.205.255", None)
    facts = rdma.host_facts("Darwin", ports, ["en2", "en3"], True, ["rdma_en2", "rdma_en3", "rdma_en4"])
    assert facts["status"] == "enabled"
    assert facts["ports"]["en2"]["usable"] is True and facts["ports"]["en2"]["gid_index"] == 1
    # en3 has a device but the abridged -v output shows only rdma_en2's table
    assert facts["ports"]["en3"]["usable"] is False
    assert facts["nccl_env"] == {}


def test_macos_osaurus_ports_down():
    ports = rdma.parse_ibv_devinfo((MAC / "ibv_devinfo_macbookpro_m5max_anonymized.txt").read_text())
    assert [(p.device, p.state, p.link_layer) for p in ports] == [
        ("rdma_en1", "DOWN", "Thunderbolt"),
        ("rdma_en6", "DOWN", "Thunderbolt"),
        ("rdma_en2", "DOWN", "Thunderbolt"),
    ]
    facts = rdma.host_facts("Darwin", ports, ["en1"], True, ["rdma_en1", "rdma_en6", "rdma_en2"])
    assert facts["problems"] == ["en1: rdma_en1 port 1 is DOWN"]
    assert facts["runbook"] == rdma.RUNBOOK_MACOS


def test_macos_tb4_enabled_without_devices_is_not_capable():
    rec = transcript(
        REC / "macos_rdma_ctl_enabled_ibv_devices_empty_tb4_omlx3037_QUOTED.txt", ["rdma_ctl status", "ibv_devices"]
    )
    assert rdma.parse_rdma_ctl(rec["rdma_ctl status"]) is True
    assert rdma.parse_ibv_devices(rec["ibv_devices"]) == []
    facts = rdma.host_facts("Darwin", [], ["en2"], True, [], generations={"en2": "tb4"})
    assert facts["status"] == "not_capable"
    assert "Thunderbolt 5" in facts["message"]
    assert facts["runbook"] == rdma.RUNBOOK_TB


def test_macos_disabled():
    # The header-only ibv_devices is a real recording of a Mac with RDMA disabled; no capture of
    # `rdma_ctl status` printing "disabled" exists publicly, so that word is assumed here.
    assert rdma.parse_ibv_devices((MAC / "ibv_devices_macbookpro_m5max_rdma_disabled.txt").read_text()) == []
    assert rdma.parse_rdma_ctl("disabled\n") is False
    assert rdma.parse_rdma_ctl("something else\n") is None
    facts = rdma.host_facts("Darwin", [], ["en2"], False, [])
    assert facts["status"] == "disabled"
    assert "only be enabled from macOS Recovery" in facts["message"]
    assert facts["runbook"] == rdma.RUNBOOK_MACOS


def test_macos_without_rdma_ctl():
    facts = rdma.host_facts("Darwin", [], ["en2"], tool_missing="rdma_ctl")
    assert facts["status"] == "none" and "macOS 26.2" in facts["message"]


# ---- the module on recorded trees and outputs ----------------------------------------------


@pytest.fixture
def module(monkeypatch):
    patch_exits(monkeypatch)
    return lambda **args: run_module(rdma_facts, args)


def test_module_reads_a_recorded_tree_and_sets_the_fact(module, monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    ok, out = module(sysfs_root=str(SYSFS / "roce_v1v2_ipv4_index5_cx5"), ports=["eth1"])
    assert ok and out["changed"] is False
    assert out["ansible_facts"]["meshkit_rdma"]["nccl_env"]["NCCL_IB_GID_INDEX"] == "5"


def test_module_require_fails_naming_the_port_and_runbook(module, tmp_path):
    ok, out = module(system="Linux", sysfs_root=str(tmp_path), ports=["tb0"], require=True, backend="jaccl")
    assert not ok
    assert out["msg"] == (
        "backend jaccl needs RDMA on every cable, and this host cannot: tb0: no RDMA devices "
        "(/sys/class/infiniband is empty or absent). Fix: see docs/runbooks/roce-nccl.md"
    )


# The commands the macOS path also reads (link speeds, bridge members), absent here: tests/unit/test_macos_facts.py.
NOT_HERE = {"system_profiler": "/nonexistent/system_profiler", "networksetup": "/nonexistent/networksetup",
            "ifconfig": "/nonexistent/ifconfig"}  # fmt: skip


def script(path: Path, text: str) -> str:
    path.write_text("#!/bin/sh\ncat <<'EOF'\n" + text + "EOF\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_module_macos_path_with_recorded_outputs(module, tmp_path):
    rec = transcript(
        REC / "macos_rdma_ctl_status_enabled_and_ibv_devices_macmini_m4pro_mlx2944_REDACTED_BY_AUTHOR.txt",
        ["rdma_ctl status", "ibv_devices"],
    )
    tn = transcript(REC / "macos_ibv_devinfo_v_rdma_en2_gid_table_tn3205_ABRIDGED.txt", ["ibv_devinfo -d rdma_en2 -v"])
    ok, out = module(
        system="Darwin",
        ports=["en2"],
        require=True,
        rdma_ctl=script(tmp_path / "rdma_ctl", rec["rdma_ctl status"]),
        ibv_devices=script(tmp_path / "ibv_devices", rec["ibv_devices"]),
        ibv_devinfo=script(tmp_path / "ibv_devinfo", tn["ibv_devinfo -d rdma_en2 -v"]),
        **NOT_HERE,
    )
    assert ok, out
    facts = out["rdma"]
    assert facts["status"] == "enabled" and facts["usable"] is True
    assert facts["ports"]["en2"]["gid_ipv4"] == "169.254.205.255"
    assert facts["notes"] == [
        "system_profiler or networksetup not found: link speeds not read",
        "ifconfig not found: bridge members not checked",
    ]


def test_module_macos_tb4_require_fails_with_the_tb_runbook(module, tmp_path):
    rec = transcript(
        REC / "macos_rdma_ctl_enabled_ibv_devices_empty_tb4_omlx3037_QUOTED.txt", ["rdma_ctl status", "ibv_devices"]
    )
    ok, out = module(
        system="Darwin",
        ports=["en2"],
        generations={"en2": "tb4"},
        require=True,
        backend="jaccl",
        rdma_ctl=script(tmp_path / "rdma_ctl", rec["rdma_ctl status"]),
        ibv_devices=script(tmp_path / "ibv_devices", rec["ibv_devices"]),
        ibv_devinfo=script(tmp_path / "ibv_devinfo", ""),
        **NOT_HERE,
    )
    assert not ok
    assert "Thunderbolt 5" in out["msg"] and out["msg"].endswith("Fix: see docs/runbooks/tb4-vs-tb5.md")
