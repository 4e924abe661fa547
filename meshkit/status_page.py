# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""`meshkit status`: the cluster's health on one self-contained HTML page (it opens from disk, no server).

The page shows the cabling picture coloured by the last measured rate (meshkit check's, inline SVG:
red = flagged), a row per cable with its figures and an inline chart of its rate over the recorded
history, every flag with a link to its runbook entry, the last job on the cluster's hosts and when
the next scheduled check runs. Its inputs are what `meshkit watch` keeps in <artifacts>/watch (the
last check, history.jsonl, watch.json, state.json), or, without a watch, the last `meshkit check`'s
report in <artifacts>/check.
"""

from __future__ import annotations

import datetime
import html
import json
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshkit import job_leases, watch_history

REPOSITORY = "https://meshkit.invalid/cluster/blob/main/docs/runbooks/check.md"
RED = "#d62728"
CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .3em; }
.summary.ok { color: #2ca02c; } .summary.flagged { color: #d62728; font-weight: 600; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border-bottom: 1px solid #ddd; padding: .25em .6em; text-align: right; white-space: nowrap; }
th:first-child, td:first-child, td.flags { text-align: left; }
tr.cable.flagged td { background: #fde3e3; }
tr.cable.flagged td.name { color: #d62728; font-weight: 600; }
tr.cable.ok td.name { color: #2ca02c; }
svg.spark circle.flagged { fill: #d62728; } svg.spark circle.ok { fill: #2ca02c; }
svg.spark polyline { fill: none; stroke: #777; stroke-width: 1; }
svg.spark line.expected { stroke: #aaa; stroke-dasharray: 3 2; }
#picture svg { max-width: 100%; height: auto; }
.muted { color: #777; }
"""


def when(t: float | None) -> str:
    if not t:
        return "never"
    return datetime.datetime.fromtimestamp(float(t)).strftime("%Y-%m-%d %H:%M:%S")


def _rate(bits: float | None) -> str:
    if bits is None:
        return "-"
    return f"{bits / 1e9:.3g} Gb/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mb/s"


def runbook(flag: str, root: Path | None = None) -> str:
    """The runbook entry of a flag: the collection's own docs/runbooks/check.md when it is there, else the
    repository's."""
    from meshkit.collection import collection_root

    local = (root or collection_root()) / "docs" / "runbooks" / "check.md"
    base = local.resolve().as_uri() if local.is_file() else REPOSITORY
    return f"{base}#{flag}"


def _slowest(pair: Mapping[str, float] | None) -> float | None:
    return min(pair["ab"], pair["ba"]) if pair else None


def chart(points: list[tuple[float, float, bool]], expected: float | None, width: int = 180, height: int = 36) -> str:
    """An inline SVG of (time, rate, flagged) points: a line through them, a dot each (red when flagged), the
    expected rate dashed."""
    if not points:
        return '<span class="muted">no figures yet</span>'
    top = max([p[1] for p in points] + [expected or 0]) * 1.1 or 1.0
    t0, t1 = points[0][0], points[-1][0]
    pad = 4

    def xy(t: float, v: float) -> tuple[float, float]:
        x = pad + ((t - t0) / (t1 - t0) if t1 > t0 else 0.5) * (width - 2 * pad)
        return round(x, 1), round(height - pad - v / top * (height - 2 * pad), 1)

    parts = [f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    if expected:
        y = xy(t0, expected)[1]
        parts.append(f'<line class="expected" x1="{pad}" x2="{width - pad}" y1="{y}" y2="{y}"/>')
    parts.append('<polyline points="' + " ".join(f"{x},{y}" for x, y in (xy(t, v) for t, v, _ in points)) + '"/>')
    for t, v, bad in points:
        x, y = xy(t, v)
        parts.append(
            f'<circle class="{"flagged" if bad else "ok"}" cx="{x}" cy="{y}" r="2.5">'
            f"<title>{html.escape(when(t))}: {_rate(v)}</title></circle>"
        )
    return "".join(parts) + "</svg>"


def picture_svg(plan: Mapping[str, Any] | None, report: Mapping[str, Any]) -> str:
    """meshkit check's cabling picture as inline SVG ('' without GraphViz or a plan)."""
    from meshkit import check_report

    if not plan:
        return ""
    title = f"meshkit check {report.get('cluster_name') or ''}".strip()
    try:
        done = subprocess.run(["dot", "-Tsvg"], input=check_report.dot(plan, report, title), capture_output=True,
                              text=True, check=False, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    text = done.stdout if done.returncode == 0 else ""
    start = text.find("<svg")
    return text[start:] if start >= 0 else ""


def page(
    report: Mapping[str, Any],
    history: list[Mapping[str, Any]],
    plan: Mapping[str, Any] | None,
    config: Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
) -> str:
    """The page (see the module's text)."""
    config, state = config or {}, state or {}
    cluster = report.get("cluster_name") or config.get("cluster") or ""
    flagged = report.get("flagged") or []
    kind = "quick, with the last full check's bandwidth" if report.get("quick") else "full"
    summary = (
        f"OK: every cable and the cluster passed ({len(report.get('cables') or [])} cables)"
        if report.get("ok")
        else f"FLAGGED: {len(report.get('problems') or [])} problem(s)"
        + (f"; cables {', '.join(flagged)}" if flagged else "")
    )
    out = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>meshkit status: {html.escape(cluster)}</title><style>{CSS}</style></head><body>",
        f"<h1>meshkit status: {html.escape(cluster)}</h1>",
        f'<p class="summary {"ok" if report.get("ok") else "flagged"}">{html.escape(summary)}</p>',
        f"<p>Last check: {when(report.get('timestamp'))} ({kind}); bandwidth measured "
        f"{when(report.get('bandwidth_timestamp') or (None if report.get('quick') else report.get('timestamp')))}.",
    ]
    if config.get("scheduler"):
        last = float(state.get("last_run_at") or 0)
        runs = state.get("runs") or {}
        out.append(
            f" Next check: about {when(last + float(config['every_s'])) if last else 'at the next tick'} "
            f"({html.escape(str(config['scheduler']))}, every {int(config['every_s'])} s). Runs: "
            + ", ".join(f"{k} {runs.get(k, 0)}" for k in ("checked", "skipped", "failed"))
            + "."
        )
    elif config:
        out.append(" No check is scheduled (meshkit watch disable).")
    out.append("</p>")
    keys = set(state.get("host_keys") or [])
    running = job_leases.holding(keys) if keys else []
    ended = job_leases.last_ended(keys) if keys else None
    if running:
        job = running[-1]
        out.append(f"<p>Job running: {html.escape(str(job.get('job_id')))} ({html.escape(str(job.get('runtime')))}) "
                   f"since {when(job.get('started'))}.</p>")  # fmt: skip
    if ended:
        out.append(
            f"<p>Last job: {html.escape(str(ended.get('job_id')))} ({html.escape(str(ended.get('runtime')))}), "
            f"{html.escape(str(ended.get('outcome')))}, ended {when(ended.get('ended'))}.</p>"
        )
    elif not running:
        out.append('<p class="muted">Last job: none recorded on these hosts by this controller.</p>')
    svg = picture_svg(plan, report)
    if svg:
        out.append(f'<section id="picture">{svg}</section>')
    out.append(
        '<table id="cables"><tr><th>cable</th><th>a→b</th><th>b→a</th><th>under load (min)</th><th>expected</th>'
        "<th>RTT</th><th>loss (max)</th><th>flags</th><th>rate over time (slower direction)</th></tr>"
    )
    full_runs = [h for h in history if h.get("outcome") == "checked" and not h.get("quick")]
    for e in report.get("cables") or []:
        name = e["cable"]
        flags = [f["flag"] for f in e.get("flags") or []]
        points = []
        for h in full_runs:
            c = (h.get("cables") or {}).get(name) or {}
            v = _slowest(c.get("alone"))
            if v is not None:
                points.append((float(h["at"]), v, bool(c.get("flags"))))
        alone, load, loss = e.get("alone") or {}, e.get("load"), e.get("loss")
        rtt = "-" if e.get("rtt_us") is None else f"{e['rtt_us']:.0f} µs"
        lost = "-" if not loss else f"{max(loss['ab'], loss['ba']) * 100:.2g} %"
        links = ", ".join(f'<a href="{html.escape(runbook(f))}">{html.escape(f)}</a>' for f in dict.fromkeys(flags))
        out.append(
            f'<tr class="cable {"flagged" if flags else "ok"}" data-cable="{html.escape(name)}">'
            f'<td class="name">{html.escape(name)}</td>'
            f"<td>{_rate(alone.get('ab'))}</td><td>{_rate(alone.get('ba'))}</td>"
            f"<td>{_rate(_slowest(load))}</td><td>{_rate(e.get('reference_bps'))}</td>"
            f"<td>{rtt}</td><td>{lost}</td>"
            f'<td class="flags">{links or "-"}</td>'
            f'<td class="chart">{chart(points, e.get("reference_bps"))}</td></tr>'
        )
    out.append("</table>")
    problems = report.get("problems") or []
    if problems:
        out.append('<section id="flags"><h2>Flags</h2><ul>')
        for entry in report.get("cables") or []:
            for f in entry.get("flags") or []:
                out.append(
                    f'<li><a href="{html.escape(runbook(f["flag"]))}">{html.escape(f["flag"])}</a> on '
                    f"{html.escape(entry['cable'])}: {html.escape(str(f.get('detail', '')))}</li>"
                )
        for f in (report.get("cluster") or {}).get("flags") or []:
            out.append(f'<li><a href="{html.escape(runbook(f["flag"]))}">{html.escape(f["flag"])}</a> on the cluster: '
                       f"{html.escape(str(f.get('detail', '')))}</li>")  # fmt: skip
        for d in report.get("drift") or []:
            flag = str(d.get("flag", ""))
            where, detail = html.escape(str(d.get("where", ""))), html.escape(str(d.get("detail", "")))
            out.append(f'<li><a href="{html.escape(runbook(flag))}">{html.escape(flag)}</a> at {where}: {detail}</li>')
        out.append("</ul></section>")
    out.append(f'<p class="muted">Written {when(datetime.datetime.now().timestamp())} by meshkit.</p></body></html>')
    return "\n".join(out) + "\n"


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write(target: Path, watch_dir: Path, config: Mapping[str, Any] | None = None) -> bool:
    """The page from what the watch keeps in ``watch_dir``, written atomically; False when there is nothing to show."""
    from meshkit.check_report import _atomic_write

    report = read_json(watch_dir / "check-merged.json")
    if not report:
        return False
    config = config if config is not None else read_json(watch_dir / "watch.json")
    history = watch_history.read_history(watch_dir / "history.jsonl")
    text = page(report, history, read_json(watch_dir / "plan.json"), config, read_json(watch_dir / "state.json"))
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(Path(target), text.encode())
    return True
