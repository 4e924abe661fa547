# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""`meshkit check`'s report: the worker's measurements, the drift items and the plan turned into
flags, then into a terminal table, JSON, a Prometheus textfile and the cabling picture.

Inputs: the plan (plan.json), the worker's ``MESHKIT-CHECK`` records (meshccl.linkcheck: rates in
BYTES per second), the drift items (meshkit.check_drift) and every host's facts (module_utils
host_facts: per port ``mtu`` and ``speed_mbps``). The report's rates are bits per second; the
Prometheus textfile's are bytes per second (Prometheus' base unit). Nothing here touches a host.

A cable is named by its plan key ``"A:pa <-> B:pb"`` (a = the plan cable's ends[0]) and shown as
``"A:pa ↔ B:pb"``; direction "ab" is a → b.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from meshkit import check_drift
from meshkit.check_drift import display
from meshkit.picture import DEAD, MISSING, PLAIN, attr_list, header, quote
from meshkit.rates import parse_rate, rate_in

VERSION = 1

FROM_CLI = "from --link-rate"
FROM_INVENTORY = "inventory meshkit_link_rate"
FROM_PLAN = "link speed (plan)"
FROM_SYSFS = "link speed (sysfs)"
FROM_UNKNOWN = "unknown: compared with the other cables' median"
SHORT_SOURCE = {FROM_CLI: "--link-rate", FROM_INVENTORY: "inventory", FROM_PLAN: "plan", FROM_SYSFS: "sysfs"}

GREEN = "#2ca02c"
YELLOW_GREEN = "#9acd32"
ORANGE = "#ff7f0e"
RED = DEAD

WIDTH = 120  # the table's prose lines are folded here
TIMES = "\u00d7"  # the multiplication sign
SHAPES = {
    "mesh": "full mesh of {n} hosts: {f} " + TIMES + " the slowest cable",
    "ring": "ring through all {n} hosts, both directions: {f} " + TIMES + " the slowest cable",
    "pair": "2 hosts over {f} cable(s): {f} " + TIMES + " the slowest cable",
    "line": "no ring through every host: 1 " + TIMES + " the slowest cable",
    "partial": "no ring through every host: 1 " + TIMES + " the slowest cable",
    "single": "1 host: no cable",
}


class RenderError(RuntimeError):
    """The picture could not be written (GraphViz missing or failing, a file name it cannot make)."""


# --- figures -------------------------------------------------------------------------------------


def sig(value: float | None, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits in plain decimal notation ("0.098", "41.2",
    "1234"); "-" for None."""
    if value is None:
        return "-"
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def gbps(bits: float | None) -> str:
    """Bits per second as Gb/s, three significant digits (no unit)."""
    return "-" if bits is None else sig(bits / 1e9)


def percent(ratio: float, near: float | None = None) -> str:
    """A ratio as a percentage: whole numbers, one decimal where rounding would reach ``near``
    (so 79.6 % is never shown as the 80 % threshold it is below)."""
    value = ratio * 100
    if value < 10:
        return sig(value, 2)
    if near is not None and round(value) == round(near * 100) and value != near * 100:
        return f"{value:.1f}"
    return f"{value:.0f}"


def cable_key(cable: Mapping[str, Any]) -> str:
    a, b = cable["ends"]
    return check_drift.cable_key(a, b)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _pair(value: Any, scale: float) -> dict[str, float] | None:
    """{"ab", "ba"} of a record's figures times ``scale``; None when either is missing."""
    if not isinstance(value, Mapping):
        return None
    ab, ba = _number(value.get("ab")), _number(value.get("ba"))
    if ab is None or ba is None:
        return None
    return {"ab": ab * scale, "ba": ba * scale}


def _swapped(record: Mapping[str, Any]) -> dict[str, Any]:
    """A cable record written from the other end: directions swapped."""
    out = dict(record)
    out["a"], out["b"] = record.get("b"), record.get("a")
    for mode in ("alone", "load", "loss"):
        value = record.get(mode)
        if isinstance(value, Mapping):
            out[mode] = {**value, "ab": value.get("ba"), "ba": value.get("ab")}
    return out


# --- expected rate -------------------------------------------------------------------------------


def _port_facts(facts: Mapping[str, Any], end: Mapping[str, Any]) -> Mapping[str, Any]:
    """A cable end's port facts; ``facts`` maps a host to its host_facts or to the agent's answer
    {"preflight", "facts"} (as check_drift takes them)."""
    host = facts.get(end["host"])
    if isinstance(host, Mapping) and "facts" in host and "platform" not in host:
        host = host.get("facts")
    ports = host.get("ports") if isinstance(host, Mapping) else None
    port = ports.get(end["port"]) if isinstance(ports, Mapping) else None
    return port if isinstance(port, Mapping) else {}


def _bits(rate: Any, what: str) -> float | None:
    """A rate in bits/s from a number or a text such as "200mbit" or "40Gb/s"; None when unset."""
    if rate is None or rate == "":
        return None
    number = _number(rate)
    if number is not None:
        if number <= 0:
            raise ValueError(f"{what}: {rate!r} is not a link rate; give a positive rate such as 40gbit")
        return number
    try:
        return parse_rate(rate)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def expected_rate(
    cable: Mapping[str, Any],
    facts: Mapping[str, Any],
    link_rate_bps: float | None,
    inventory_rates: Mapping[str, float | None],
) -> tuple[float | None, str]:
    """The rate (bits/s) a cable should carry and where that comes from, first that exists: the
    command line, the lower of both ends' inventory meshkit_link_rate, the lower of the plan's
    link speeds ("40 Gb/s" on macOS), the lower of both ends' negotiated speed in sysfs now."""
    ends = cable["ends"]
    if link_rate_bps:
        return _bits(link_rate_bps, "--link-rate"), FROM_CLI
    inventory = [
        r for e in ends if (r := _bits(inventory_rates.get(e["host"]), f"{e['host']}'s meshkit_link_rate")) is not None
    ]
    if inventory:
        return min(inventory), FROM_INVENTORY
    planned = [r for r in (rate_in(e.get("speed")) for e in ends) if r]
    if planned:
        return min(planned), FROM_PLAN
    sysfs = [s * 1e6 for s in (_number(_port_facts(facts, e).get("speed_mbps")) for e in ends) if s and s > 0]
    if sysfs:
        return min(sysfs), FROM_SYSFS
    return None, FROM_UNKNOWN


# --- flags ---------------------------------------------------------------------------------------


def _figures(pair: Mapping[str, float]) -> str:
    return f"a\u2192b {gbps(pair['ab'])} Gb/s, b\u2192a {gbps(pair['ba'])} Gb/s"


def _rate_flag(
    flag: str, pair: Mapping[str, float] | None, reference: float | None, source: str, threshold: float, what: str
) -> dict[str, str] | None:
    if pair is None or not reference:
        return None
    low = min(pair["ab"], pair["ba"])
    if low >= threshold * reference:
        return None
    against = (
        f"the other cables' median {gbps(reference)} Gb/s (no expected rate known: set meshkit_link_rate or "
        "--link-rate)"
        if source == FROM_UNKNOWN
        else f"the expected {gbps(reference)} Gb/s ({source})"
    )
    return {
        "flag": flag,
        "detail": f"{what}{_figures(pair)}: {percent(low / reference, threshold)} % of {against}, "
        f"below {percent(threshold)} %",
    }


def _median_of_others(entries: list[dict[str, Any]], mode: str, me: Mapping[str, Any]) -> float | None:
    values = [v for e in entries if e is not me and e[mode] for v in (e[mode]["ab"], e[mode]["ba"])]
    return statistics.median(values) if values else None


def _cable_flags(
    entry: dict[str, Any], entries: list[dict[str, Any]], threshold: float, max_loss: float, asymmetry: float
) -> list[dict[str, str]]:
    if entry["error"] is not None:
        return [{"flag": "unreachable", "detail": entry["error"]}]
    flags = []
    references = {}
    for mode in ("alone", "load"):
        references[mode] = entry["expected_bps"] or _median_of_others(entries, mode, entry)
    entry["reference_bps"] = references["alone"] or references["load"]
    source = entry["expected_from"]
    slow = _rate_flag("slow", entry["alone"], references["alone"], source, threshold, "")
    if slow:
        flags.append(slow)
    loaded = _rate_flag(
        "slow-under-load",
        entry["load"],
        references["load"],
        source,
        threshold,
        "all cables at once, both directions: ",
    )
    if loaded:
        flags.append(loaded)
    alone = entry["alone"]
    if alone:
        high, low = max(alone["ab"], alone["ba"]), min(alone["ab"], alone["ba"])
        if high > 0 and (high - low) / high > asymmetry:
            flags.append(
                {
                    "flag": "asymmetric",
                    "detail": f"{_figures(alone)}: the slower direction is {percent((high - low) / high)} % below "
                    f"the faster, more than {percent(asymmetry)} %",
                }
            )
    loss = entry["loss"]
    if loss and max(loss["ab"], loss["ba"]) > max_loss:
        probes = loss.get("probes")

        def lost(ratio: float) -> str:
            count = f" ({round(ratio * probes)} of {probes} probes)" if probes else ""
            return f"{sig(ratio * 100)} %{count}"

        flags.append(
            {
                "flag": "lossy",
                "detail": f"a\u2192b lost {lost(loss['ab'])}, b\u2192a lost {lost(loss['ba'])}: more than "
                f"{sig(max_loss * 100)} %",
            }
        )
    return flags


# --- the cluster ---------------------------------------------------------------------------------


def cluster_shape(plan: Mapping[str, Any]) -> tuple[str, int]:
    """What the cabling allows an all_reduce, as a multiple of the slowest cable: a full mesh of n
    hosts n - 1, a ring through every host (both directions) 2, two hosts the number of cables
    between them, anything else 1."""
    hosts = plan.get("hosts") or []
    cables = plan.get("cables") or []
    n = len(hosts)
    if n < 2:
        return "single", 1
    if n == 2:
        return "pair", max(1, len(cables))
    if plan.get("mesh"):
        return "mesh", n - 1
    ring = plan.get("ring") or []
    if ring and set(ring) == set(hosts):
        return "ring", 2
    degree = dict.fromkeys(hosts, 0)
    for cable in cables:
        for end in cable["ends"]:
            degree[end["host"]] = degree.get(end["host"], 0) + 1
    if len(cables) == n - 1 and max(degree.values()) <= 2:
        return "line", 1
    return "partial", 1


def _cluster(
    plan: Mapping[str, Any],
    entries: list[dict[str, Any]],
    allreduce: Mapping[str, Any] | None,
    threshold: float,
) -> dict[str, Any]:
    shape, factor = cluster_shape(plan)
    measured = [min(f["ab"], f["ba"]) for e in entries if (f := e["load"] or e["alone"])]
    expected = [e["expected_bps"] for e in entries if e["expected_bps"]]
    allowed = factor * min(measured) if measured else None
    nominal = factor * min(expected) if expected else None
    rows = []
    for row in (allreduce or {}).get("rows") or []:
        rows.append(
            {
                "bytes": row.get("bytes"),
                "count": row.get("count"),
                "dtype": row.get("dtype", "float32"),
                "time_us": row.get("time_us"),
                "algbw_bps": (_number(row.get("algbw")) or 0.0) * 8,
                "busbw_bps": (_number(row.get("busbw")) or 0.0) * 8,
                "correct": bool(row.get("correct")),
            }
        )
    busbw = max((r["busbw_bps"] for r in rows), default=None)
    ratio = busbw / allowed if busbw is not None and allowed else None
    flags = []
    if allreduce is None:
        flags.append(
            {
                "flag": "allreduce-missing",
                "detail": "the check has no all_reduce figures: the worker printed none (see its output above)",
            }
        )
    wrong = [r for r in rows if not r["correct"]]
    if wrong:
        flags.append(
            {
                "flag": "allreduce-incorrect",
                "detail": "all_reduce gave a wrong result at " + ", ".join(f"{r['bytes']} bytes" for r in wrong),
            }
        )
    if ratio is not None and ratio < threshold:
        flagged = [e["cable"] for e in entries if e["flags"]]
        cause = (
            "likely cause: " + ", ".join(flagged)
            if flagged
            else "no cable is flagged: look at the hosts' CPU load and meshccl's algorithm choice"
        )
        flags.append(
            {
                "flag": "busbw-low",
                "detail": f"best busbw {gbps(busbw)} Gb/s is {percent(ratio, threshold)} % of the {gbps(allowed)} Gb/s "
                f"the cabling allows as measured ({SHAPES[shape].format(n=len(plan.get('hosts') or []), f=factor)}), "
                f"below {percent(threshold)} %; {cause}",
            }
        )
    return {
        "world_size": (allreduce or {}).get("world_size", len(plan.get("hosts") or [])),
        "shape": shape,
        "factor": factor,
        "allowed_bps": allowed,
        "nominal_bps": nominal,
        "rows": rows,
        "busbw_bps": busbw,
        "ratio": ratio,
        "nominal_ratio": busbw / nominal if busbw is not None and nominal else None,
        "flags": flags,
    }


# --- build ---------------------------------------------------------------------------------------


def build(
    plan: Mapping[str, Any],
    records: Iterable[Mapping[str, Any]],
    drift_items: Iterable[Mapping[str, Any]],
    facts: Mapping[str, Any] | None,
    *,
    threshold: float = 0.8,
    max_loss: float = 0.01,
    asymmetry: float = 0.2,
    link_rate_bps: float | None = None,
    inventory_rates: Mapping[str, float | None] | None = None,
    quick: bool = False,
    cluster: str = "",
    seconds: float = 0.0,
) -> dict[str, Any]:
    """The report (JSON, version 1) of one check. ``records``: the worker's MESHKIT-CHECK objects
    (any "t"; progress and done are ignored), ``drift_items``: check_drift's items, ``facts``:
    host → module_utils host_facts.host_facts()."""
    facts = facts or {}
    inventory_rates = inventory_rates or {}
    records = list(records)
    by_key: dict[str, Mapping[str, Any]] = {}
    allreduce = None
    errors = []
    for record in records:
        kind = record.get("t")
        if kind == "cable" and isinstance(record.get("cable"), str):
            by_key[record["cable"]] = record
        elif kind == "allreduce":
            allreduce = record
        elif kind == "error":
            errors.append(str(record.get("msg") or record))

    entries: list[dict[str, Any]] = []
    for cable in plan.get("cables") or []:
        a, b = cable["ends"]
        key = cable_key(cable)
        record = by_key.get(key)
        if record is None and check_drift.cable_key(b, a) in by_key:
            record = _swapped(by_key[check_drift.cable_key(b, a)])
        expected, source = expected_rate(cable, facts, link_rate_bps, inventory_rates)
        mtu_a, mtu_b = (_port_facts(facts, end).get("mtu") for end in (a, b))
        error = None
        if record is None:
            error = "no measurement: the check printed no record for this cable (see the worker's output above)"
        elif record.get("error"):
            error = f"no connection over this cable: {record['error']}"
        loss = None
        if record is not None and isinstance(record.get("loss"), Mapping):
            loss = _pair(record["loss"], 1.0)
            if loss is not None:
                loss["probes"] = record["loss"].get("probes")
        entries.append(
            {
                "cable": display(key),
                "key": key,
                "a": f"{a['host']}:{a['port']}",
                "b": f"{b['host']}:{b['port']}",
                "expected_bps": expected,
                "expected_from": source,
                "reference_bps": expected,
                "alone": _pair(record.get("alone"), 8.0) if record and not error else None,
                "load": _pair(record.get("load"), 8.0) if record and not error else None,
                "rtt_us": _number(record.get("rtt_us")) if record and not error else None,
                "rtt_p99_us": _number(record.get("rtt_p99_us")) if record and not error else None,
                "loss": loss if not error else None,
                "mtu": {"a": mtu_a, "b": mtu_b} if mtu_a is not None or mtu_b is not None else None,
                "flags": [],
                "error": error,
            }
        )
    for entry in entries:
        entry["flags"] = _cable_flags(entry, entries, threshold, max_loss, asymmetry)
        if not quick and entry["error"] is None and entry["alone"] is None:
            entry["flags"].append(
                {
                    "flag": "unmeasured",
                    "detail": "the worker's record has no bandwidth figures for this cable (alone: null)",
                }
            )

    by_entry = {e["key"]: e for e in entries}
    drift = []
    for item in drift_items:
        entry = by_entry.get(item.get("cable") or "")
        if entry is not None:
            entry["flags"].append({"flag": item["flag"], "detail": item.get("detail", "")})
        else:
            drift.append(dict(item))

    cluster_report = None if quick else _cluster(plan, entries, allreduce, threshold)

    problems = [f"check: error: {msg}" for msg in errors]
    for entry in entries:
        problems += [f"{entry['cable']}: {f['flag']}: {f['detail']}" for f in entry["flags"]]
    if cluster_report:
        problems += [f"cluster: {f['flag']}: {f['detail']}" for f in cluster_report["flags"]]
    problems += [f"{item.get('where', '?')}: {item.get('flag')}: {item.get('detail', '')}" for item in drift]
    return {
        "version": VERSION,
        "cluster_name": cluster,
        "quick": quick,
        "threshold": threshold,
        "max_loss": max_loss,
        "asymmetry": asymmetry,
        "seconds": seconds,
        "timestamp": time.time(),
        "ok": not problems,
        "hosts": list(plan.get("hosts") or []),
        "cables": entries,
        "cluster": cluster_report,
        "drift": drift,
        "errors": errors,
        "flagged": [e["cable"] for e in entries if e["flags"]],
        "problems": problems,
    }


def exit_status(report: Mapping[str, Any]) -> int:
    """0 when nothing is flagged, 1 otherwise."""
    return 0 if report.get("ok") else 1


# --- the terminal table --------------------------------------------------------------------------


def _loss_text(loss: Mapping[str, Any] | None, direction: str) -> str:
    return "-" if not loss else f"{sig(loss[direction] * 100, 2)} %"


def _expected_text(entry: Mapping[str, Any]) -> str:
    if entry["expected_bps"]:
        return f"{gbps(entry['expected_bps'])} {SHORT_SOURCE.get(entry['expected_from'], '')}".rstrip()
    if entry.get("reference_bps"):
        return f"median {gbps(entry['reference_bps'])}"
    return "?"


def _columns(rows: list[list[str]], align: str) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [cell.ljust(w) if a == "<" else cell.rjust(w) for cell, w, a in zip(row, widths, align, strict=True)]
        out.append("  ".join(cells).rstrip())
    return out


def _wrap(text: str) -> list[str]:
    """A line of prose folded at WIDTH columns, continuation lines indented."""
    return textwrap.wrap(text, WIDTH, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)


def table(report: Mapping[str, Any]) -> str:
    """Plain text (no terminal escapes) for a terminal or a pipe; fits 120 columns for the usual
    names."""
    name = report.get("cluster_name") or "cluster"
    cables = report.get("cables") or []
    mode = "quick: latency and loss only" if report.get("quick") else "alone: one cable at a time; load: all at once"
    lines = [f"meshkit check {name}: {len(report.get('hosts') or [])} hosts, {len(cables)} cables ({mode})", ""]
    header = [
        ["", "expected", "alone Gb/s", "", "load Gb/s", "", "RTT \u00b5s", "", "loss", "", ""],
        [
            "cable",
            "Gb/s",
            "a\u2192b",
            "b\u2192a",
            "a\u2192b",
            "b\u2192a",
            "median",
            "p99",
            "a\u2192b",
            "b\u2192a",
            "verdict",
        ],
    ]
    rows = []
    for e in cables:
        alone, load = e.get("alone") or {}, e.get("load") or {}
        rows.append(
            [
                e["cable"],
                _expected_text(e),
                gbps(alone.get("ab")),
                gbps(alone.get("ba")),
                gbps(load.get("ab")),
                gbps(load.get("ba")),
                sig(e.get("rtt_us")),
                sig(e.get("rtt_p99_us")),
                _loss_text(e.get("loss"), "ab"),
                _loss_text(e.get("loss"), "ba"),
                ", ".join(f["flag"].upper() for f in e["flags"]) or "ok",
            ]
        )
    if rows:
        lines += _columns([*header, *rows], "<<>>>>>>>><")
    lines.append("")
    for e in cables:
        for f in e["flags"]:
            lines += _wrap(f"FLAG {e['cable']}: {f['flag']}: {f['detail']}")
    cluster = report.get("cluster")
    if cluster:
        lines += ["", f"all_reduce (float32, sum) over {cluster['world_size']} hosts"]
        arows = [["size (B)", "count", "type", "time (\u00b5s)", "algbw (Gb/s)", "busbw (Gb/s)", "correct"]]
        for r in cluster["rows"]:
            arows.append(
                [
                    str(r["bytes"]),
                    str(r["count"]),
                    str(r.get("dtype", "float32")),
                    sig(_number(r["time_us"]), 4),
                    gbps(r["algbw_bps"]),
                    gbps(r["busbw_bps"]),
                    "yes" if r["correct"] else "NO",
                ]
            )
        if len(arows) > 1:
            lines += _columns(arows, ">>>>>>>")
        shape = SHAPES[cluster["shape"]].format(n=cluster["world_size"], f=cluster["factor"])
        if cluster["busbw_bps"] is not None and cluster["allowed_bps"]:
            verdict = (
                f"busbw {gbps(cluster['busbw_bps'])} Gb/s: {percent(cluster['ratio'], report['threshold'])} % of the "
                f"{gbps(cluster['allowed_bps'])} Gb/s the cabling allows as measured ({shape})"
            )
            if cluster.get("nominal_bps"):
                verdict += (
                    f"; {percent(cluster['nominal_ratio'])} % of the nominal {gbps(cluster['nominal_bps'])} Gb/s"
                    f" ({cluster['factor']} {TIMES} the lowest expected rate)"
                )
        else:
            verdict = f"busbw: no figure to compare ({shape})"
        bad = [f["flag"] for f in cluster["flags"]]
        lines += _wrap(("FLAGGED " + ", ".join(bad) if bad else "ok") + ": " + verdict)
        for f in cluster["flags"]:
            lines += _wrap(f"FLAG cluster: {f['flag']}: {f['detail']}")
    drift = report.get("drift") or []
    if drift:
        lines += ["", "configuration drift:"]
        for d in drift:
            lines += _wrap(f"FLAG {d.get('where', '?')}: {d.get('flag')}: {d.get('detail', '')}")
    for msg in report.get("errors") or []:
        lines += _wrap(f"FLAG check: error: {msg}")
    lines.append("")
    if report.get("ok"):
        lines.append(f"OK: every cable and the cluster passed ({len(cables)} cables)")
    else:
        flagged = report.get("flagged") or []
        lines += _wrap(
            f"FLAGGED: {len(report.get('problems') or [])} problem(s)"
            + (f"; cables: {', '.join(flagged)}" if flagged else "")
        )
    return "\n".join(lines) + "\n"


# --- Prometheus textfile -------------------------------------------------------------------------


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, Any]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _value(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


# Every metric of the textfile (all gauges) and its HELP text.
METRICS = {
    "meshkit_check_cable_bandwidth_bytes_per_second": "Bandwidth measured on a cable, one direction, "
    "alone (one cable at a time) or under load (all cables at once).",
    "meshkit_check_cable_expected_bytes_per_second": "The rate the cable should carry.",
    "meshkit_check_cable_rtt_seconds": "Median round-trip time of 8 bytes over the cable.",
    "meshkit_check_cable_rtt_p99_seconds": "99th percentile round-trip time of 8 bytes over the cable.",
    "meshkit_check_cable_loss_ratio": "Share of UDP probes lost over the cable, one direction.",
    "meshkit_check_cable_flagged": "1 for each flag raised on the cable.",
    "meshkit_check_cable_ok": "1 when the cable has no flag, else 0.",
    "meshkit_check_allreduce_busbw_bytes_per_second": "all_reduce bus bandwidth over the cluster per size.",
    "meshkit_check_flagged": "1 for each flag raised outside a cable (cluster, configuration drift).",
    "meshkit_check_ok": "1 when nothing is flagged, else 0.",
    "meshkit_check_timestamp_seconds": "When the check ran (Unix time).",
}


def prometheus(report: Mapping[str, Any]) -> str:
    """node_exporter textfile collector format (text exposition 0.0.4), rates in bytes/s."""
    name = report.get("cluster_name") or ""
    samples: dict[str, list[tuple[dict[str, Any], float]]] = {metric: [] for metric in METRICS}

    def add(metric: str, labels: dict[str, Any], value: float | None) -> None:
        if value is not None:
            samples[metric].append(({"meshkit_cluster": name, **labels}, value))

    for e in report.get("cables") or []:
        base = {"cable": e["cable"], "a": e["a"], "b": e["b"]}
        for mode in ("alone", "load"):
            figures = e.get(mode)
            if figures:
                for direction, d in (("ab", "a_to_b"), ("ba", "b_to_a")):
                    add(
                        "meshkit_check_cable_bandwidth_bytes_per_second",
                        {**base, "direction": d, "mode": mode},
                        figures[direction] / 8,
                    )
        if e.get("expected_bps"):
            add("meshkit_check_cable_expected_bytes_per_second", base, e["expected_bps"] / 8)
        if e.get("rtt_us") is not None:
            add("meshkit_check_cable_rtt_seconds", base, e["rtt_us"] / 1e6)
        if e.get("rtt_p99_us") is not None:
            add("meshkit_check_cable_rtt_p99_seconds", base, e["rtt_p99_us"] / 1e6)
        if e.get("loss"):
            for direction, d in (("ab", "a_to_b"), ("ba", "b_to_a")):
                add("meshkit_check_cable_loss_ratio", {**base, "direction": d}, e["loss"][direction])
        for f in e["flags"]:
            add("meshkit_check_cable_flagged", {**base, "flag": f["flag"]}, 1)
        add("meshkit_check_cable_ok", base, 0 if e["flags"] else 1)
    cluster = report.get("cluster")
    if cluster:
        for r in cluster["rows"]:
            add("meshkit_check_allreduce_busbw_bytes_per_second", {"bytes": r["bytes"]}, r["busbw_bps"] / 8)
        for f in cluster["flags"]:
            add("meshkit_check_flagged", {"where": "cluster", "flag": f["flag"]}, 1)
    for d in report.get("drift") or []:
        add("meshkit_check_flagged", {"where": d.get("where", ""), "flag": d.get("flag", "")}, 1)
    add("meshkit_check_ok", {}, 1 if report.get("ok") else 0)
    add("meshkit_check_timestamp_seconds", {}, float(report.get("timestamp") or time.time()))
    lines = []
    for metric, help_text in METRICS.items():
        if samples[metric]:
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
            lines += [f"{metric}{_labels(labels)} {_value(value)}" for labels, value in samples[metric]]
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_prometheus(path: str | os.PathLike[str], text: str) -> None:
    """Write the textfile atomically (a temporary file in the same directory, then a rename), so
    node_exporter never reads half a file; readable by all (node_exporter runs as its own user)."""
    _atomic_write(Path(path), text.encode())


# --- the picture ---------------------------------------------------------------------------------


def _ratio(figures: Mapping[str, float] | None, reference: float | None) -> float | None:
    return min(figures["ab"], figures["ba"]) / reference if figures and reference else None


def _colour(entry: Mapping[str, Any], threshold: float) -> str:
    """Red when flagged, else by measured ÷ reference, the lower direction, alone or under load."""
    ratios = [r for f in (entry.get("alone"), entry.get("load")) if (r := _ratio(f, entry.get("reference_bps")))]
    if entry["flags"]:
        return RED
    if not ratios:
        return PLAIN
    if min(ratios) >= 0.9:
        return GREEN
    return YELLOW_GREEN if min(ratios) >= threshold else ORANGE


def _edge_figure(entry: Mapping[str, Any]) -> str:
    """The cable's figure: alone (else under load) a→b / b→a and its share of the reference; with
    --quick the RTT and loss."""
    figures = entry.get("alone") or entry.get("load")
    if figures:
        text = f"{gbps(figures['ab'])} / {gbps(figures['ba'])} Gb/s"
        ratio = _ratio(figures, entry.get("reference_bps"))
        if ratio is not None:
            text += f" ({percent(ratio)} % of {gbps(entry['reference_bps'])})"
        return text + ("" if entry.get("alone") else " under load")
    if entry.get("rtt_us") is not None:
        loss = entry.get("loss")
        return f"RTT {sig(entry['rtt_us'])} \u00b5s" + (
            f", loss {sig(max(loss['ab'], loss['ba']) * 100, 2)} %" if loss else ""
        )
    return ""


def dot(plan: Mapping[str, Any], report: Mapping[str, Any], title: str) -> str:
    """The cabling picture (the look of setup.yml's, meshkit/picture.py) with every
    cable coloured by measured ÷ expected: green ≥ 90 %, yellow-green ≥ the threshold, orange
    below, red flagged (labelled with its flags and figure); edge width grows with the rate."""
    threshold = float(report.get("threshold") or 0.8)
    by_key = {e["key"]: e for e in report.get("cables") or []}
    rates = [
        min(f["ab"], f["ba"]) for e in by_key.values() for f in (e.get("alone") or e.get("load"),) if f is not None
    ]
    top = max(rates, default=0.0)
    hosts = plan.get("hosts") or []
    cluster = report.get("cluster")
    summary = [
        f"{title}: {len(hosts)} hosts, {len(plan.get('cables') or [])} cables"
        + (", full mesh" if plan.get("mesh") else ""),
        "check: OK"
        if report.get("ok")
        else f"check: {len(report.get('problems') or [])} problem(s)"
        + (f"; flagged: {', '.join(report.get('flagged') or [])}" if report.get("flagged") else ""),
    ]
    if cluster and cluster.get("busbw_bps") is not None and cluster.get("allowed_bps"):
        summary.append(
            f"all_reduce busbw {gbps(cluster['busbw_bps'])} Gb/s = {percent(cluster['ratio'])} % of the "
            f"{gbps(cluster['allowed_bps'])} Gb/s the cabling allows ({cluster['factor']} {TIMES} slowest cable)"
        )
    legend = (
        f"edge: a→b / b→a Gb/s (% of expected)   green ≥ 90 %   yellow-green ≥ {percent(threshold)} %   "
        "orange below   red = flagged   width = rate   grey dashed = no cable"
    )
    # Wider apart than setup.yml's: the figures on every edge need the room.
    lines = header("check", hosts, "\n".join([*summary, legend]), mindist=2.4)
    for host in hosts:
        lines.append(f"  {quote(host)} {attr_list(label=host)}")
    for cable in plan.get("cables") or []:
        a, b = cable["ends"]
        key = cable_key(cable)
        entry = by_key.get(key)
        attrs: dict[str, Any] = {
            # Ports only (the addresses are setup.yml's picture's): the figures need the room.
            "taillabel": a["port"],
            "headlabel": b["port"],
            "tooltip": f"{display(key)} ({a['address']} / {b['address']})",
            "id": edge_id(key),  # the SVG element of the cable (meshkit status's page finds it by this)
        }
        if entry is None:
            attrs.update(color=PLAIN, penwidth=1.5, style="dashed", label="not checked")
        else:
            colour = _colour(entry, threshold)
            figure = _edge_figure(entry)
            measured = entry.get("alone") or entry.get("load")
            rate = min(measured["ab"], measured["ba"]) if measured else None
            width = round(1.5 + 3.5 * (rate / top), 2) if rate is not None and top > 0 else 1.5
            if entry["flags"]:
                names = ", ".join(dict.fromkeys(f["flag"].upper() for f in entry["flags"]))
                if entry.get("error"):
                    figure = "\n".join(textwrap.wrap(entry["error"], 44, max_lines=4, placeholder=" …"))
                label = f"{names}\n{figure}" if figure else names
                attrs.update(color=colour, fontcolor=colour, penwidth=max(width, 2.5), style="bold", label=label)
            else:
                attrs.update(color=colour, penwidth=width, label=figure)
        lines.append(f"  {quote(a['host'])} -- {quote(b['host'])} {attr_list(**attrs)}")
    for pair in plan.get("missing_mesh") or []:
        lines.append(
            f"  {quote(pair[0])} -- {quote(pair[1])} "
            + attr_list(style="dashed", color=MISSING, fontcolor=MISSING, label="no cable", constraint="false")
        )
    lines.append("}")
    return "\n".join(lines) + "\n"


def edge_id(key: str) -> str:
    """The cable's id in the picture's SVG: ``cable-`` and its key with every other character than
    a letter, a digit or ``-`` made ``_`` (``cable-node1_tb0_-__node2_tb0``)."""
    return "cable-" + "".join(c if c.isascii() and (c.isalnum() or c == "-") else "_" for c in key)


def render(dot_text: str, path: str | os.PathLike[str]) -> Path:
    """Write the picture by the file name's suffix: .dot (the text), .svg or .png (GraphViz `dot`)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".dot":
        _atomic_write(path, dot_text.encode())
        return path
    if suffix not in (".svg", ".png"):
        raise RenderError(f"{path}: the picture's file name must end in .svg, .png or .dot")
    exe = shutil.which("dot")
    if exe is None:
        raise RenderError(
            f"cannot draw {path}: GraphViz's `dot` is not installed (apt install graphviz, brew install graphviz); "
            "or write the picture as .dot"
        )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        done = subprocess.run(
            [exe, f"-T{suffix[1:]}", "-o", tmp],
            input=dot_text.encode(),
            capture_output=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise RenderError(f"cannot draw {path}: dot -T{suffix[1:]} exited {done.returncode}: "
                              f"{done.stderr.decode(errors='replace').strip()}")  # fmt: skip
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
