"""Thunderbolt sysfs on Linux: from a thunderbolt-net port to the peer host and link speed.

The tree is laid out as recorded on a Linux server with a Maple Ridge (TB4) card cabled to a
peer (tests/fixtures/linux_thunderbolt/sysfs_tree_bus_thunderbolt_mapleridge_xdomain_0-1.txt:
devices/domain0/0-0/0-1/0-1.0, the netdev's parent being the service device 0-1.0), with
recorded values: the link (sysfs_xdomain_0-3_lanes_speed_mapleridge.txt: rx_speed "20.0 Gb/s",
rx_lanes "2") and the local/remote UUIDs of a NUC8 pair (tblist_Av_nuc8_blue_xdomain_red.txt).
"""

from __future__ import annotations

from pathlib import Path

from ansible_collections.meshkit.cluster.plugins.module_utils.linux_net import thunderbolt_peer

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "linux_thunderbolt"
LOCAL_UUID = "d1030000-0090-8f18-23c5-b11c6cd30923"
PEER_UUID = "d7030000-0070-6d18-232c-531042752121"


def tree(root: Path, peer_attrs: dict[str, str]) -> Path:
    pci = root / "devices" / "pci0000:00" / "0000:00:01.1" / "0000:04:00.0"
    router = pci / "domain0" / "0-0"
    peer = router / "0-1"
    service = peer / "0-1.0"
    service.mkdir(parents=True)
    (router / "unique_id").write_text(LOCAL_UUID + "\n")
    for name, value in peer_attrs.items():
        (peer / name).write_text(value + "\n")
    (service / "key").write_text("network\n")
    net = service / "net" / "thunderbolt0"
    net.mkdir(parents=True)
    (root / "class" / "net").mkdir(parents=True)
    (root / "class" / "net" / "thunderbolt0").symlink_to(net)
    (net / "device").symlink_to(service)
    # a veth port has no Thunderbolt parent
    veth = root / "devices" / "virtual" / "net" / "tb0"
    veth.mkdir(parents=True)
    (root / "class" / "net" / "tb0").symlink_to(veth)
    return root


def test_recorded_values_are_what_the_tree_holds():
    tblist = (FIX / "tblist_Av_nuc8_blue_xdomain_red.txt").read_text()
    assert LOCAL_UUID in tblist and PEER_UUID in tblist
    assert "0-0/0-1/0-1.0" in (FIX / "sysfs_tree_bus_thunderbolt_mapleridge_xdomain_0-1.txt").read_text()
    lanes = (FIX / "sysfs_xdomain_0-3_lanes_speed_mapleridge.txt").read_text()
    assert "20.0 Gb/s" in lanes and "rx_lanes\n2" in lanes


def test_thunderbolt_peer_from_a_thunderbolt_net_port(tmp_path):
    root = tree(
        tmp_path,
        {
            "unique_id": PEER_UUID,
            "device_name": "nas-05",
            "vendor_name": "Intel Corp.",
            "rx_speed": "20.0 Gb/s",
            "rx_lanes": "2",
        },
    )
    info = thunderbolt_peer(str(root), "thunderbolt0")
    assert info == {
        "service": "0-1.0",
        "peer_device": "0-1",
        "peer_uuid": PEER_UUID,
        "peer_name": "nas-05",
        "peer_vendor": "Intel Corp.",
        "local_uuid": LOCAL_UUID,
        "lane_speed": "20.0 Gb/s",
        "lanes": 2,
        "speed": "40 Gb/s",
    }


def test_no_thunderbolt_parent_gives_none(tmp_path):
    root = tree(tmp_path, {"unique_id": PEER_UUID})
    assert thunderbolt_peer(str(root), "tb0") is None
    assert thunderbolt_peer(str(root), "missing0") is None


def test_missing_speed_files_give_no_speed(tmp_path):
    info = thunderbolt_peer(str(tree(tmp_path, {"unique_id": PEER_UUID})), "thunderbolt0")
    assert info is not None
    assert info["speed"] is None and info["lanes"] is None and info["peer_name"] is None
