"""`meshkit check`'s own parts that need no lab: its options, the worker's records in a job's logs,
the cables a job's error names (meshkit/check.py); the lab tests are in tests/integration/test_launch.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshkit import check, cli
from tests.unit.test_hostfiles import plan_of


def test_options_are_checked_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    for bad, said in (
        (["--threshold", "1.5"], "give a fraction above 0 and at most 1"),
        (["--link-rate", "fast"], "write it as 40gbit, 200mbit or 40Gb/s"),
        (["--seconds", "0"], "give seconds from 0.01 to 10"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(["check", "-i", "inventory.yml", *bad])
        assert exc.value.code == 2
        assert said in capsys.readouterr().err
    args = cli.parser().parse_args(["check", "-i", "inv.yml", "--link-rate", "40Gb/s", "--quick"])
    assert args.link_rate == 40e9 and args.quick and args.threshold == 0.8 and args.max_loss == 0.01


def test_records_come_from_the_rank_logs_in_rank_order(tmp_path: Path) -> None:
    cable = {"t": "cable", "cable": "node1:tb0 <-> node2:tb0", "rtt_us": 40.0}
    (tmp_path / "rank-10.log").write_text(f"{check.MARK}{json.dumps({'t': 'done', 'rank': 10})}\n")
    (tmp_path / "rank-2.log").write_text(
        "a warning\n"
        f"{check.MARK}{json.dumps(cable)}\n"
        f"{check.MARK}not json\n"
        f"{check.MARK}[1, 2]\n"
        f"x {check.MARK}{json.dumps({'t': 'done'})}\n"  # not at the start of the line: the rank's own text
    )
    records = check.records_in(tmp_path)
    assert records == [cable | {"from_rank": 2}, {"t": "done", "rank": 10, "from_rank": 10}]


def test_a_job_error_names_the_cables_of_the_addresses_it_names() -> None:
    plan = plan_of([(1, 2), (2, 3), (1, 3)], 3)
    [a, b] = plan["cables"][1]["ends"]
    named = check.cables_named(f"rank 2 could not reach rank 0 at {a['address']}:29600: refused", plan)
    assert named.endswith(f"(cable {a['host']}:{a['port']} \u2194 {b['host']}:{b['port']})"), named
    # An address that only starts like a cable's is not that cable's.
    assert check.cables_named(f"at {a['address']}0:29600", plan) == f"at {a['address']}0:29600"


def test_progress_steps_match_the_workers_phases() -> None:
    # connect + latency per cable + loss; full: + alone per cable + load + three all_reduce sizes
    assert check.steps_of(6, quick=True) == 8
    assert check.steps_of(6, quick=False) == 18


def test_a_check_the_preflight_refuses_is_reported_and_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Mac whose Thunderbolt Bridge is back (or whose Local Network Privacy blocks the ranks'
    Python): launch.yml's preflight refuses the job; the check reports it as not-ready, in the
    table, the JSON and the Prometheus file, and exits 1 (never 0 for a check that did not run)."""
    refusal = (
        "studio2: preflight failed; no rank of job j1 was started: cable port en3 is a member of bridge0 "
        "(the Thunderbolt Bridge is active again: JACCL fails with errno 22); docs/runbooks/thunderbolt-bridge.md"
    )
    monkeypatch.setattr(check, "prepare", lambda args, program, display: (None, [refusal]))
    args = cli.parser().parse_args(
        ["check", "-i", "inv.yml", "--json", str(tmp_path / "r.json"), "--prometheus", str(tmp_path / "m.prom")]
    )
    assert check.run(args) == 1
    out = capsys.readouterr().out
    assert "not-ready" in out and "bridge0" in out, out
    report = json.loads((tmp_path / "r.json").read_text())
    assert not report["ok"] and any("bridge0" in line for line in report["problems"]), report
    prom = (tmp_path / "m.prom").read_text()
    assert "meshkit_check_ok" in prom and 'flag="not-ready"' in prom, prom
