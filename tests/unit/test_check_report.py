"""meshkit check's report from synthetic worker records: flags per cable (only the bad one), the
expected rate's precedence, the cluster's all_reduce verdict, --quick, and every renderer: the
table, the Prometheus textfile (read back with prometheus_client's parser), the coloured picture
(drawn by GraphViz)."""

from __future__ import annotations

import os
import shutil
import stat
import xml.etree.ElementTree as ET

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshkit import check_report as cr
from meshkit.check_drift import drift

from .test_hostfiles import plan_of

MESH4 = [(1, 2), (1, 3), (1, 4), (2, 3), (2, 4), (3, 4)]
RATE = 0.2e9  # bits/s: the lab's 200mbit
HALF = "node2:tb1 <-> node3:tb1"


def key_of(cable: dict) -> str:
    a, b = cable["ends"]
    return f"{a['host']}:{a['port']} <-> {b['host']}:{b['port']}"


def cable_record(key: str, bits: float = RATE * 0.97, *, ba: float | None = None, loss=(0.0, 0.0), quick=False):
    """What meshccl.linkcheck prints for a cable: rates in BYTES per second."""
    ab_bytes, ba_bytes = bits / 8, (ba if ba is not None else bits * 0.99) / 8
    return {
        "t": "cable",
        "cable": key,
        "a": key.partition(" <-> ")[0],
        "b": key.partition(" <-> ")[2],
        "rtt_us": 52.4,
        "rtt_p99_us": 91.0,
        "alone": None if quick else {"ab": ab_bytes, "ba": ba_bytes},
        "load": None if quick else {"ab": ab_bytes * 0.98, "ba": ba_bytes * 0.98},
        "loss": {"ab": loss[0], "ba": loss[1], "probes": 400},
        "error": None,
    }


def allreduce_record(busbw_bits: float, world: int = 4, correct: bool = True) -> dict:
    rows = []
    for size in (1 << 20, 4 << 20, 16 << 20):
        busbw = busbw_bits / 8 * (0.9 if size == 1 << 20 else 1.0)
        algbw = busbw * world / (2 * (world - 1))
        rows.append(
            {
                "bytes": size,
                "count": size // 4,
                "dtype": "float32",
                "time_us": size / algbw * 1e6,
                "algbw": algbw,
                "busbw": busbw,
                "correct": correct,
            }
        )
    return {"t": "allreduce", "world_size": world, "rows": rows}


def records(plan: dict, special: dict | None = None, busbw: float | None = None, quick: bool = False) -> list[dict]:
    special = special or {}
    out: list[dict] = [{"t": "progress", "phase": "connect", "step": 1, "steps": 1, "what": ""}]
    for cable in plan["cables"]:
        key = key_of(cable)
        if key in special:
            if special[key] is not None:
                out.append(special[key])
        else:
            out.append(cable_record(key, quick=quick))
    if not quick:
        n = len(plan["hosts"])
        out.append(allreduce_record(busbw if busbw is not None else 0.9 * 3 * RATE * 0.95, world=n))
    out += [{"t": "done", "rank": r} for r in range(len(plan["hosts"]))]
    return out


def mesh_report(special: dict | None = None, **kw) -> tuple[dict, dict]:
    plan = plan_of(MESH4, 4)
    kw.setdefault("inventory_rates", dict.fromkeys(plan["hosts"], RATE))
    quick = kw.get("quick", False)
    recs = records(plan, special, busbw=kw.pop("busbw", None), quick=quick)
    return plan, cr.build(plan, recs, kw.pop("drift", []), kw.pop("facts", {}), cluster="lab-x", seconds=0.25, **kw)


def edge_of(text: str, a: str, b: str) -> str:
    (line,) = [line for line in text.splitlines() if line.strip().startswith(f'"{a}" -- "{b}" [')]
    return line


def flat(text: str) -> str:
    """The table's text with its folded lines joined again."""
    return " ".join(text.split())


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_healthy_mesh_passes_with_every_figure():
    plan, report = mesh_report()
    assert report["ok"] is True and cr.exit_status(report) == 0
    assert report["version"] == 1 and report["cluster_name"] == "lab-x" and report["quick"] is False
    assert report["flagged"] == [] and report["problems"] == [] and report["drift"] == []
    assert len(report["cables"]) == 6
    first = report["cables"][0]
    assert first["cable"] == "node1:tb0 \u2194 node2:tb0" and first["key"] == "node1:tb0 <-> node2:tb0"
    assert (first["a"], first["b"]) == ("node1:tb0", "node2:tb0")
    # bytes/s in, bits/s out
    assert first["alone"]["ab"] == pytest.approx(RATE * 0.97)
    assert first["expected_bps"] == RATE and first["expected_from"] == "inventory meshkit_link_rate"
    assert first["rtt_us"] == 52.4 and first["loss"] == {"ab": 0.0, "ba": 0.0, "probes": 400}
    cluster = report["cluster"]
    assert (cluster["shape"], cluster["factor"], cluster["world_size"]) == ("mesh", 3, 4)
    assert cluster["allowed_bps"] == pytest.approx(3 * RATE * 0.97 * 0.99 * 0.98)
    assert cluster["nominal_bps"] == pytest.approx(3 * RATE)
    assert cluster["flags"] == [] and len(cluster["rows"]) == 3
    text = cr.table(report)
    assert "\x1b" not in text
    assert text.rstrip().endswith("OK: every cable and the cluster passed (6 cables)")
    assert "FLAG" not in text
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "busbw 0.513 Gb/s" in flat(text)  # 0.9 * 3 * 0.2 * 0.95
    prom = families(cr.prometheus(report))
    assert [s.value for s in prom["meshkit_check_ok"].samples] == [1]
    assert "meshkit_check_cable_flagged" not in prom
    assert {s.value for s in prom["meshkit_check_cable_ok"].samples} == {1}
    picture = cr.dot(plan, report, "lab-x")
    assert cr.RED not in picture and picture.count(cr.GREEN) == 6


def test_a_half_rate_cable_and_only_it_is_flagged_everywhere():
    plan, report = mesh_report({HALF: cable_record(HALF, RATE * 0.5)})
    half = "node2:tb1 \u2194 node3:tb1"
    assert report["ok"] is False and cr.exit_status(report) == 1
    assert report["flagged"] == [half]
    (entry,) = [e for e in report["cables"] if e["cable"] == half]
    assert [f["flag"] for f in entry["flags"]] == ["slow", "slow-under-load"]
    assert entry["flags"][0]["detail"] == (
        "a\u2192b 0.1 Gb/s, b\u2192a 0.099 Gb/s: 50 % of the expected 0.2 Gb/s (inventory meshkit_link_rate), "
        "below 80 %"
    )
    assert all(not e["flags"] for e in report["cables"] if e["cable"] != half)
    assert all(line.startswith(half + ": slow") for line in report["problems"])

    text = cr.table(report)
    flag_lines = [line for line in text.splitlines() if "SLOW" in line or line.startswith("FLAG")]
    assert flag_lines and all(half in line for line in flag_lines)
    (row,) = [line for line in text.splitlines() if line.startswith(half)]
    assert row.endswith("SLOW, SLOW-UNDER-LOAD") and "0.1" in row
    assert text.rstrip().endswith(f"FLAGGED: 2 problem(s); cables: {half}")
    assert max(len(line) for line in text.splitlines()) <= 120

    prom = families(cr.prometheus(report))
    flagged = prom["meshkit_check_cable_flagged"].samples
    assert {(s.labels["cable"], s.labels["flag"]) for s in flagged} == {(half, "slow"), (half, "slow-under-load")}
    assert all(s.labels["a"] == "node2:tb1" and s.labels["b"] == "node3:tb1" for s in flagged)
    oks = {s.labels["cable"]: s.value for s in prom["meshkit_check_cable_ok"].samples}
    assert oks[half] == 0 and sum(oks.values()) == 5
    assert [s.value for s in prom["meshkit_check_ok"].samples] == [0]
    bw = {
        (s.labels["direction"], s.labels["mode"]): s.value
        for s in prom["meshkit_check_cable_bandwidth_bytes_per_second"].samples
        if s.labels["cable"] == half
    }
    assert bw[("a_to_b", "alone")] == pytest.approx(RATE * 0.5 / 8)

    picture = cr.dot(plan, report, "lab-x")
    red = edge_of(picture, "node2", "node3")
    assert f'color="{cr.RED}"' in red and "SLOW" in red and "0.1 / 0.099 Gb/s (50 % of 0.2)" in red
    others = [line for line in picture.splitlines() if " -- " in line and line != red]
    assert len(others) == 5 and not any(cr.RED in line for line in others)
    assert all(f'color="{cr.GREEN}"' in line for line in others)


def test_lossy_asymmetric_and_unreachable_cables():
    lossy, asym, gone, failed = (
        "node1:tb0 <-> node2:tb0",
        "node1:tb1 <-> node3:tb0",
        "node3:tb2 <-> node4:tb2",
        "node2:tb2 <-> node4:tb1",
    )
    broken = {**cable_record(failed), "error": "connect to 10.50.0.18:29601 timed out after 10 s"}
    broken.update(alone=None, load=None, loss=None)
    plan, report = mesh_report(
        {
            lossy: cable_record(lossy, loss=(0.03, 0.0)),
            asym: cable_record(asym, RATE * 0.97, ba=RATE * 0.6),
            gone: None,
            failed: broken,
        }
    )
    flags = {e["key"]: [f["flag"] for f in e["flags"]] for e in report["cables"]}
    assert flags[lossy] == ["lossy"]
    assert flags[asym] == ["slow", "slow-under-load", "asymmetric"]
    assert flags[gone] == ["unreachable"] and flags[failed] == ["unreachable"]
    assert sum(1 for f in flags.values() if f) == 4
    by = {e["key"]: e for e in report["cables"]}
    assert by[lossy]["flags"][0]["detail"] == (
        "a\u2192b lost 3 % (12 of 400 probes), b\u2192a lost 0 % (0 of 400 probes): more than 1 %"
    )
    assert "the slower direction is 38 % below the faster, more than 20 %" in by[asym]["flags"][2]["detail"]
    assert (
        by[failed]["flags"][0]["detail"]
        == "no connection over this cable: connect to 10.50.0.18:29601 timed out after 10 s"
    )
    assert by[failed]["error"] == by[failed]["flags"][0]["detail"]
    assert "no measurement" in by[gone]["flags"][0]["detail"] and by[gone]["alone"] is None
    # Unreachable cables carry no figures and do not set what the cabling allows.
    assert report["cluster"]["allowed_bps"] == pytest.approx(3 * RATE * 0.6 * 0.98)
    text = cr.table(report)
    assert "UNREACHABLE" in text and "LOSSY" in text and "ASYMMETRIC" in text
    picture = cr.dot(plan, report, "x")
    assert "timed out after 10 s" in edge_of(picture, "node2", "node4").replace("\\n", " ")


def test_asymmetry_threshold():
    key = "node1:tb0 <-> node2:tb0"
    rec = cable_record(key, RATE * 0.99, ba=RATE * 0.82)
    _plan, report = mesh_report({key: rec})
    assert report["ok"] is True  # 17 % apart: within the default 20 %
    _plan, report = mesh_report({key: rec}, asymmetry=0.1)
    assert report["flagged"] == ["node1:tb0 \u2194 node2:tb0"]
    assert [f["flag"] for f in report["cables"][0]["flags"]] == ["asymmetric"]


def test_expected_rate_precedence():
    plan = plan_of([(1, 2)], 2)
    cable = plan["cables"][0]
    cable["ends"][0]["speed"] = "80 Gb/s"
    cable["ends"][1]["speed"] = "40 Gb/s"
    facts = {
        "node1": {"ports": {"tb0": {"speed_mbps": 25000, "mtu": 1500}}},
        "node2": {"ports": {"tb0": {"speed_mbps": 10000, "mtu": 9000}}},
    }
    inventory = {"node1": 2e9, "node2": 1e9}
    assert cr.expected_rate(cable, facts, 5e9, inventory) == (5e9, "from --link-rate")
    assert cr.expected_rate(cable, facts, None, inventory) == (1e9, "inventory meshkit_link_rate")
    assert cr.expected_rate(cable, facts, None, {"node1": 3e9}) == (3e9, "inventory meshkit_link_rate")
    assert cr.expected_rate(cable, facts, None, {}) == (40e9, "link speed (plan)")
    cable["ends"][1]["speed"] = "Up to 40 Gb/s"  # an idle port's capability, not a negotiated speed
    assert cr.expected_rate(cable, facts, None, {}) == (80e9, "link speed (plan)")
    for end in cable["ends"]:
        end["speed"] = None
    assert cr.expected_rate(cable, facts, None, {}) == (10e9, "link speed (sysfs)")
    facts["node2"]["ports"]["tb0"]["speed_mbps"] = None
    assert cr.expected_rate(cable, facts, None, {}) == (25e9, "link speed (sysfs)")
    assert cr.expected_rate(cable, {}, None, {}) == (None, "unknown: compared with the other cables' median")
    # Rates as the inventory and the command line write them are understood; nonsense is refused by name.
    assert cr.expected_rate(cable, {}, "2gbit", {}) == (2e9, "from --link-rate")
    assert cr.expected_rate(cable, {}, None, {"node2": "200mbit", "node1": None}) == (
        0.2e9,
        "inventory meshkit_link_rate",
    )
    with pytest.raises(ValueError, match="node1's meshkit_link_rate: 'fast' is not a link rate"):
        cr.expected_rate(cable, {}, None, {"node1": "fast"})
    report = cr.build(plan, records(plan, busbw=0.19e9), [], facts, link_rate_bps=0.2e9)
    assert report["cables"][0]["expected_from"] == "from --link-rate"
    assert report["cables"][0]["mtu"] == {"a": 1500, "b": 9000}
    # Facts as the launch agent answers them ({"preflight", "facts"}), as check_drift also takes them.
    answers = {host: {"preflight": {}, "facts": {"platform": "linux", **f}} for host, f in facts.items()}
    assert cr.build(plan, [], [], answers)["cables"][0]["mtu"] == {"a": 1500, "b": 9000}


def test_unknown_rate_compares_with_the_other_cables_median():
    plan = plan_of(MESH4, 4)
    recs = records(plan, {HALF: cable_record(HALF, RATE * 0.5)})
    report = cr.build(plan, recs, [], {})
    assert report["flagged"] == ["node2:tb1 \u2194 node3:tb1"]
    (entry,) = [e for e in report["cables"] if e["flags"]]
    assert entry["expected_bps"] is None
    assert "of the other cables' median 0.193 Gb/s (no expected rate known" in entry["flags"][0]["detail"]
    assert "median 0.193" in cr.table(report)
    assert report["cluster"]["nominal_bps"] is None


@pytest.mark.parametrize(
    ("pairs", "n", "shape", "factor"),
    [
        (MESH4, 4, "mesh", 3),
        ([(1, 2), (2, 3), (3, 4), (4, 1)], 4, "ring", 2),
        ([(1, 2), (1, 2)], 2, "pair", 2),
        ([(1, 2)], 2, "pair", 1),
        ([(1, 2), (2, 3), (3, 4)], 4, "line", 1),
        ([(1, 2), (1, 3), (1, 4)], 4, "partial", 1),
    ],
)
def test_cluster_factor(pairs, n, shape, factor):
    plan = plan_of(pairs, n)
    assert cr.cluster_shape(plan) == (shape, factor)
    slowest = RATE * 0.97 * 0.99 * 0.98  # b→a under load
    healthy = cr.build(plan, records(plan, busbw=0.95 * factor * slowest), [], {}, link_rate_bps=RATE)
    assert healthy["ok"] is True
    assert healthy["cluster"]["allowed_bps"] == pytest.approx(factor * slowest)
    assert healthy["cluster"]["ratio"] == pytest.approx(0.95)
    low = cr.build(plan, records(plan, busbw=0.5 * factor * slowest), [], {}, link_rate_bps=RATE)
    assert low["ok"] is False and low["flagged"] == []
    (flag,) = low["cluster"]["flags"]
    assert flag["flag"] == "busbw-low"
    assert "50 % of the" in flag["detail"] and "no cable is flagged" in flag["detail"]
    assert low["problems"] == [f"cluster: busbw-low: {flag['detail']}"]


def test_busbw_low_names_the_flagged_cables():
    _plan, report = mesh_report({HALF: cable_record(HALF, RATE * 0.5)}, busbw=0.1e9)
    (flag,) = report["cluster"]["flags"]
    assert flag["flag"] == "busbw-low" and flag["detail"].endswith("likely cause: node2:tb1 \u2194 node3:tb1")
    assert "FLAGGED busbw-low" in cr.table(report)
    prom = families(cr.prometheus(report))
    assert {(s.labels["where"], s.labels["flag"]) for s in prom["meshkit_check_flagged"].samples} == {
        ("cluster", "busbw-low")
    }


def test_a_wrong_or_missing_all_reduce_is_flagged():
    plan = plan_of(MESH4, 4)
    recs = [r for r in records(plan) if r["t"] != "allreduce"] + [allreduce_record(0.5e9, correct=False)]
    report = cr.build(plan, recs, [], {}, link_rate_bps=RATE)
    assert [f["flag"] for f in report["cluster"]["flags"]] == ["allreduce-incorrect"]
    recs = [r for r in records(plan) if r["t"] != "allreduce"]
    report = cr.build(plan, recs, [], {}, link_rate_bps=RATE)
    assert [f["flag"] for f in report["cluster"]["flags"]] == ["allreduce-missing"] and not report["ok"]


def test_quick_reports_latency_and_loss_only_without_false_flags():
    plan, report = mesh_report(quick=True)
    assert report["ok"] is True and report["quick"] is True and report["cluster"] is None
    assert all(e["alone"] is None and e["load"] is None and e["rtt_us"] == 52.4 for e in report["cables"])
    text = cr.table(report)
    assert "quick: latency and loss only" in text and "all_reduce" not in text and "FLAG" not in text
    prom = families(cr.prometheus(report))
    assert "meshkit_check_cable_bandwidth_bytes_per_second" not in prom
    assert len(prom["meshkit_check_cable_rtt_seconds"].samples) == 6
    assert prom["meshkit_check_cable_rtt_seconds"].samples[0].value == pytest.approx(52.4e-6)
    assert prom["meshkit_check_cable_rtt_p99_seconds"].samples[0].value == pytest.approx(91e-6)
    assert {s.labels["direction"] for s in prom["meshkit_check_cable_loss_ratio"].samples} == {"a_to_b", "b_to_a"}
    picture = cr.dot(plan, report, "x")
    assert cr.RED not in picture and "RTT 52.4 \u00b5s, loss 0 %" in picture
    key = "node1:tb0 <-> node2:tb0"
    _plan, lossy = mesh_report({key: cable_record(key, loss=(0.0, 0.05), quick=True)}, quick=True)
    assert lossy["flagged"] == ["node1:tb0 \u2194 node2:tb0"]


def test_drift_items_attach_to_their_cable_or_the_report():
    items = [
        {"flag": "mtu-mismatch", "where": "node1:tb0 \u2194 node2:tb0", "cable": "node1:tb0 <-> node2:tb0",
         "detail": "node1:tb0 MTU 1500, node2:tb0 MTU 9000"},
        {"flag": "port-unplanned", "where": "node3:tb7", "cable": None, "detail": "up, not in the plan"},
    ]  # fmt: skip
    plan, report = mesh_report(drift=items)
    assert report["flagged"] == ["node1:tb0 \u2194 node2:tb0"]
    assert report["cables"][0]["flags"] == [
        {"flag": "mtu-mismatch", "detail": "node1:tb0 MTU 1500, node2:tb0 MTU 9000"}
    ]
    assert report["drift"] == [items[1]]
    assert "node3:tb7: port-unplanned: up, not in the plan" in report["problems"]
    text = cr.table(report)
    assert "configuration drift:" in text and "FLAG node3:tb7: port-unplanned" in text
    assert f'color="{cr.RED}"' in edge_of(cr.dot(plan, report, "x"), "node1", "node2")


def test_prometheus_label_values_are_escaped():
    plan = plan_of([(1, 2)], 2)
    plan["hosts"] = ['no"de1', "node2"]
    a = plan["cables"][0]["ends"][0]
    a["host"], a["port"] = 'no"de1', "t\\b\n0"
    key = key_of(plan["cables"][0])
    recs = [cable_record(key, RATE * 0.4), allreduce_record(0.1e9, world=2)]
    report = cr.build(plan, recs, [], {}, link_rate_bps=RATE, cluster='lab "x"')
    text = cr.prometheus(report)
    assert 'a="no\\"de1:t\\\\b\\n0"' in text
    prom = families(text)
    (sample,) = [s for s in prom["meshkit_check_cable_flagged"].samples if s.labels["flag"] == "slow"]
    assert sample.labels["a"] == 'no"de1:t\\b\n0' and sample.labels["meshkit_cluster"] == 'lab "x"'
    assert sample.labels["cable"] == 'no"de1:t\\b\n0 \u2194 node2:tb0'


def test_write_prometheus_replaces_the_file_atomically(tmp_path):
    target = tmp_path / "meshkit_check.prom"
    target.write_text("old\n")
    old_inode = target.stat().st_ino
    _plan, report = mesh_report()
    text = cr.prometheus(report)
    cr.write_prometheus(target, text)
    assert target.read_text() == text
    assert target.stat().st_ino != old_inode  # a new file renamed over the old one, not rewritten in place
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(os.listdir(tmp_path)) == ["meshkit_check.prom"]
    with pytest.raises(FileNotFoundError):
        cr.write_prometheus(tmp_path / "no-such-dir" / "x.prom", text)
    assert sorted(os.listdir(tmp_path)) == ["meshkit_check.prom"]


def test_render_runs_graphviz(tmp_path, monkeypatch):
    assert shutil.which("dot"), "GraphViz is a system dependency of make test (scripts/system-deps)"
    plan, report = mesh_report({HALF: cable_record(HALF, RATE * 0.5)})
    picture = cr.dot(plan, report, "lab-x")
    svg = cr.render(picture, tmp_path / "check.svg")
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    drawn = ET.tostring(root, encoding="unicode")
    assert cr.RED in drawn and "SLOW" in drawn and "0.1 / 0.099 Gb/s" in drawn
    png = cr.render(picture, tmp_path / "check.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cr.render(picture, tmp_path / "check.dot").read_text() == picture
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check.dot", "check.png", "check.svg"]
    with pytest.raises(cr.RenderError, match=r"\.svg, \.png or \.dot"):
        cr.render(picture, tmp_path / "check.jpg")
    with pytest.raises(cr.RenderError, match="syntax error"):
        cr.render("graph {", tmp_path / "bad.svg")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(cr.RenderError, match=r"GraphViz's `dot` is not installed \(apt install graphviz"):
        cr.render(picture, tmp_path / "again.svg")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check.dot", "check.png", "check.svg"]


def test_records_from_the_other_end_are_read_the_right_way_round():
    plan = plan_of([(1, 2)], 2)
    rec = cable_record("node2:tb0 <-> node1:tb0", RATE * 0.5, ba=RATE * 0.98)
    report = cr.build(plan, [rec, allreduce_record(0.19e9, world=2)], [], {}, link_rate_bps=RATE)
    entry = report["cables"][0]
    assert entry["alone"]["ab"] == pytest.approx(RATE * 0.98) and entry["alone"]["ba"] == pytest.approx(RATE * 0.5)


def test_figures_three_significant_digits():
    assert [cr.gbps(x) for x in (0.098e9, 0.0995e9, 0.2e9, 41.26e9, 123.4e9, 1234e9, 0)] == [
        "0.098",
        "0.0995",
        "0.2",
        "41.3",
        "123",
        "1234",
        "0",
    ]
    assert cr.percent(0.796, 0.8) == "79.6" and cr.percent(0.49) == "49" and cr.percent(0.031) == "3.1"


def test_drift_from_check_drift_flags_only_the_mismatched_cable():
    plan = plan_of(MESH4, 4)
    facts: dict = {host: {"platform": "linux", "ports": {}} for host in plan["hosts"]}
    for host, links in plan["per_host"].items():
        for link in links:
            facts[host]["ports"][link["port"]] = {
                "exists": True,
                "up": True,
                "addresses": [f"{link['address']}/{link['prefix']}"],
                "route": link["port"],
                "routes": [],
                "mtu": 9000 if (host, link["port"]) == ("node3", "tb1") else 1500,
                "speed_mbps": 10000,
            }
    items = drift(plan, facts)
    assert [i["flag"] for i in items] == ["mtu-mismatch"]
    report = cr.build(plan, records(plan), items, facts, inventory_rates=dict.fromkeys(plan["hosts"], RATE))
    assert report["flagged"] == ["node2:tb1 \u2194 node3:tb1"] and report["drift"] == []
    (entry,) = [e for e in report["cables"] if e["flags"]]
    assert entry["mtu"] == {"a": 1500, "b": 9000} and [f["flag"] for f in entry["flags"]] == ["mtu-mismatch"]
    assert "MTU-MISMATCH" in cr.table(report)
