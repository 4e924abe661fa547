"""Link rates as inventories, tc and macOS write them (meshkit/rates.py)."""

from __future__ import annotations

import pytest

from meshkit.rates import format_rate, parse_rate, rate_in


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("200mbit", 200e6),
        ("40gbit", 40e9),
        ("1.5gbit", 1.5e9),
        ("40Gb/s", 40e9),
        ("40 Gb/s", 40e9),
        ("125mbps", 1e9),  # tc: bps is bytes per second
        ("5GB/s", 40e9),
        ("100kbit", 100e3),
    ],
)
def test_parse_rate_understands_the_ways_people_write_rates(text: str, bits: float) -> None:
    assert parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("text", ["fast", "40", "0gbit", "-1gbit", "", None, "40 Gbps extra"])
def test_parse_rate_refuses_anything_else_saying_how_to_write_one(text: object) -> None:
    with pytest.raises(ValueError, match="write it as 40gbit, 200mbit or 40Gb/s"):
        parse_rate(text)


def test_rate_in_reads_negotiated_speeds_not_capabilities() -> None:
    assert rate_in("40 Gb/s") == 40e9  # system_profiler's current_speed_key of a linked port
    assert rate_in("80 Gb/s") == 80e9
    assert rate_in("2 x 20 Gb/s") == 40e9
    assert rate_in("Up to 40 Gb/s") is None  # an idle port: what it could do, not what it does
    assert rate_in(None) is None and rate_in("") is None and rate_in("unknown") is None


def test_format_rate() -> None:
    assert format_rate(40e9) == "40 Gb/s"
    assert format_rate(196.4e6) == "196 Mb/s"
    assert format_rate(None) == "?"


def test_inventory_link_rate_is_validated_naming_the_host_and_the_way_to_write_it() -> None:
    from meshkit.inventory_schema import validate_hosts

    normalised, problems = validate_hosts({"node1": {"meshkit_link_rate": "80gbit"}, "node2": {}})
    assert not problems
    assert normalised["node1"]["meshkit_link_rate"] == "80gbit" and normalised["node2"]["meshkit_link_rate"] is None
    _, problems = validate_hosts({"node1": {"meshkit_link_rate": "fast"}})
    assert len(problems) == 1 and problems[0].startswith("node1: meshkit_link_rate = 'fast'"), problems
    assert "40gbit" in problems[0], problems
