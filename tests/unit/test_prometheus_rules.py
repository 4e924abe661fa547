"""prometheus/meshkit.rules.yml: valid for promtool, its own unit tests pass, and it reads exactly
what `meshkit check` writes (metric names, labels, flags) and names a runbook entry for each flag."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from meshkit import check_report as cr
from meshkit import watch
from meshkit.check_drift import FLAGS as DRIFT_FLAGS

from .test_check_report import HALF, RATE, cable_record, mesh_report

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "prometheus" / "meshkit.rules.yml"
RULE_TESTS = ROOT / "prometheus" / "meshkit.rules.test.yml"
RUNBOOK = ROOT / "docs" / "runbooks" / "check.md"
# Every flag meshkit check raises: on a cable, on the cluster, and drift (check_report.py, check_drift.py).
CHECK_FLAGS = {
    "unreachable",
    "slow",
    "slow-under-load",
    "asymmetric",
    "lossy",
    "busbw-low",
    "unmeasured",
    "allreduce-missing",
    "allreduce-incorrect",
    "not-ready",
    *DRIFT_FLAGS,
}


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: `make deps` installs Debian's prometheus package, which has it"
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False)


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def flag_matcher(expr: str) -> re.Pattern[str] | None:
    """The flag label matcher of an expression (flag="x" or flag=~"re"), as an anchored pattern."""
    m = re.search(r'flag(=~?)"([^"]+)"', expr)
    if not m:
        return None
    return re.compile(f"^(?:{m.group(2) if m.group(1) == '=~' else re.escape(m.group(2))})$")


def test_promtool_checks_the_rules_and_their_unit_tests_pass() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def symptoms() -> dict[str, str]:
    """Every runbook entry's Symptom section, by the entry's heading."""
    out = {}
    for part in re.split(r"^## ", RUNBOOK.read_text(), flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        out[heading.strip()] = body.split("### Symptom", 1)[-1].split("### ", 1)[0]
    return out


# The watch's alerts (meshkit/watch.py's metrics): no flag; a refusal is an event, so no `for:`.
WATCH_ALERTS = {"MeshkitWatchNotRunning": "watch-not-running", "MeshkitJobRefusedByPreflight": "preflight-refused"}


def test_the_rules_read_only_metrics_meshkit_writes_and_every_alert_names_its_runbook() -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    headings = set(re.findall(r"^## (\S+)$", RUNBOOK.read_text(), re.M))
    entries = symptoms()
    for rule in rules():
        names = set(re.findall(r"\b[a-z_:]*meshkit_[a-z_:]+\b", rule["expr"]))
        assert names and names <= set(cr.METRICS) | set(watch.METRICS) | recorded, (rule.get("alert"), names)
        if "alert" not in rule:
            continue
        url = rule["annotations"]["runbook_url"]
        if rule["alert"] in WATCH_ALERTS:
            assert url.endswith(f"docs/runbooks/check.md#{WATCH_ALERTS[rule['alert']]}"), url
            assert f"Prometheus alert `{rule['alert']}`" in entries[WATCH_ALERTS[rule["alert"]]], rule["alert"]
            assert rule.get("for") or rule["alert"] == "MeshkitJobRefusedByPreflight", rule["alert"]
            continue
        matcher = flag_matcher(rule["expr"])
        assert matcher, rule["alert"]
        flags = {f for f in CHECK_FLAGS if matcher.match(f)}
        # Each alternative of the matcher matches a flag meshkit raises (none is a typo).
        for alternative in matcher.pattern[4:-2].split("|"):
            assert any(re.fullmatch(alternative, f) for f in CHECK_FLAGS), (rule["alert"], alternative)
        url = rule["annotations"]["runbook_url"]
        assert url.startswith("https://meshkit.invalid/cluster/blob/main/docs/runbooks/check.md#"), url
        anchor = url.rsplit("#", 1)[1]
        wanted = flags if anchor == "{{ $labels.flag }}" else {anchor}
        assert wanted <= headings, (rule["alert"], wanted - headings)
        # Each entry it links to starts its symptom with the alert's name (an operator paged by it finds it).
        for flag in wanted & set(entries):
            assert f"Prometheus alert `{rule['alert']}`" in entries[flag], (rule["alert"], flag)
        assert rule.get("for"), f"{rule['alert']}: no for:, one bad sample would page"
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_a_real_check_of_a_half_rate_cable_fires_the_slow_alert_for_that_cable_alone(tmp_path: Path) -> None:
    """What check_report writes for a 4-host mesh with one cable at half its rate, fed to the rules as
    series (one check, its file scraped for 15 minutes): MeshkitCableSlow fires for that cable's two
    flags, no other alert fires, and the recording rule reads that cable at half its rate."""
    _plan, report = mesh_report({HALF: cable_record(HALF, RATE * 0.5)})
    half = "node2:tb1 \u2194 node3:tb1"
    series = []
    for family in text_string_to_metric_families(cr.prometheus(report)):
        for sample in family.samples:
            labels = ", ".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            series.append({"series": f"{sample.name}{{{labels}}}", "values": f"{sample.value!r}x15"})
    slow = [
        s for s in series if s["series"].startswith("meshkit_check_cable_flagged{") and f'cable="{half}"' in s["series"]
    ]
    assert len(slow) == 2, series  # slow and slow-under-load
    others = {r["alert"] for r in rules() if "alert" in r} - {"MeshkitCableSlow"}
    (entry,) = [e for e in report["cables"] if e["cable"] == half]
    expected = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {
                        "eval_time": "10m",
                        "alertname": "MeshkitCableSlow",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "meshkit_cluster": "lab-x",
                                    "cable": half,
                                    "a": entry["a"],
                                    "b": entry["b"],
                                    "flag": flag,
                                },
                                "exp_annotations": {
                                    "summary": f"Cable {half} of cluster lab-x is {flag}",
                                    "description": f"meshkit check measured {half} ({entry['a']} to {entry['b']}) "
                                    f"below the rate it should carry ({flag}): every collective that crosses it "
                                    "runs at its speed.",
                                    "runbook_url": "https://meshkit.invalid/cluster/blob/main/docs/runbooks/check.md"
                                    f"#{flag}",
                                },
                            }
                            for flag in ("slow", "slow-under-load")
                        ],
                    },
                    *({"eval_time": "10m", "alertname": name, "exp_alerts": []} for name in sorted(others)),
                ],
                "promql_expr_test": [
                    {
                        "expr": "max by (cable) (cable_direction:meshkit_check_cable_bandwidth_bytes_per_second"
                        f':ratio_expected{{cable="{half}"}}) < 0.55 > 0.45',
                        "eval_time": "10m",
                        "exp_samples": [
                            {
                                "labels": f'{{cable="{half}"}}',
                                "value": max(entry["alone"].values()) / entry["expected_bps"],
                            }
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "real-check.test.yml"
    path.write_text(yaml.safe_dump(expected, sort_keys=False, allow_unicode=True))
    tested = promtool("test", "rules", str(path), cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


GRAFANA = ROOT / "prometheus" / "meshkit.grafana.json"


def test_every_query_of_the_grafana_dashboard_parses_and_reads_only_what_meshkit_writes(tmp_path: Path) -> None:
    """Each panel's query, its Grafana variables given values, becomes a recording rule that `promtool check rules`
    parses (a query Prometheus would refuse fails it); every metric it names is one meshkit writes or records."""
    dashboard = json.loads(GRAFANA.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    variables = [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(queries) >= 10 and variables == ["label_values(meshkit_check_ok, meshkit_cluster)"]
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    known = set(cr.METRICS) | set(watch.METRICS) | recorded
    for text in [*queries, *variables]:
        names = set(re.findall(r"\b[a-z_:]*meshkit_[a-z0-9_:]+\b", text)) - {"meshkit_cluster"}
        assert names and names <= known, (text, names - known)
    given = [q.replace("$cluster", "lab|other") for q in queries]
    assert not [q for q in given if "$" in q], given
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "grafana",
                        "rules": [{"record": f"grafana:panel_{i}", "expr": q} for i, q in enumerate(given)],
                    }
                ]
            }
        )
    )
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0 and f"SUCCESS: {len(given)} rules found" in checked.stdout, (
        checked.stdout + checked.stderr
    )
    # A query promtool would not parse fails the same way (the check can fail).
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "x:y", "expr": "rate(meshkit_check_ok[5m]"}]}]})
    )
    assert promtool("check", "rules", str(path)).returncode != 0
    assert all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for p in dashboard["panels"])
