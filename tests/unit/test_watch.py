"""meshkit watch without a lab: its schedules as systemd, launchd and crontab(1) take them, one scheduled run's
outcomes (checked, quick with the last full check's bandwidth carried, skipped for a job or an overlapping run,
failed), the textfile as Prometheus's parser reads it, the job leases, and meshkit status's page.

The live path (a real check of a lab, a real Prometheus, a real browser) is tests/integration/test_launch.py's
test_watch_feeds_a_live_prometheus_that_alerts_on_the_one_throttled_cable_and_a_browser_shows_it."""

from __future__ import annotations

import argparse
import copy
import json
import os
import plistlib
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshkit import check, check_report, cli, job_leases, status_page, watch, watch_history, watch_schedule

CABLES = ["node1:tb0 <-> node2:tb0", "node1:tb1 <-> node3:tb0", "node2:tb1 <-> node3:tb1"]


def cable(key: str, alone: float | None, flags: list[str] = (), rtt: float = 40.0) -> dict[str, Any]:
    a, b = key.split(" <-> ")
    return {
        "cable": key.replace(" <-> ", " \u2194 "),
        "key": key,
        "a": a,
        "b": b,
        "expected_bps": 1e8,
        "expected_from": check_report.FROM_CLI,
        "reference_bps": 1e8,
        "alone": None if alone is None else {"ab": alone, "ba": alone},
        "load": None if alone is None else {"ab": alone * 0.9, "ba": alone * 0.9},
        "rtt_us": rtt,
        "rtt_p99_us": rtt * 2,
        "loss": {"ab": 0.0, "ba": 0.0, "probes": 200},
        "mtu": None,
        "flags": [{"flag": f, "detail": f"{f} detail"} for f in flags],
        "error": None,
    }


def report(quick: bool, slow: str | None = None, at: float = 1.0e9) -> dict[str, Any]:
    cables = [
        cable(k, None if quick else (2.5e7 if k == slow else 9.5e7), [] if quick or k != slow else ["slow"])
        for k in CABLES
    ]
    problems = [f"{c['cable']}: {f['flag']}: {f['detail']}" for c in cables for f in c["flags"]]
    return {
        "version": 1,
        "cluster_name": "tiny",
        "quick": quick,
        "threshold": 0.8,
        "timestamp": at,
        "ok": not problems,
        "hosts": ["node1", "node2", "node3"],
        "cables": cables,
        "cluster": None,  # no all_reduce figures (check_report.build makes them; not what these tests are about)
        "drift": [],
        "errors": [],
        "flagged": [c["cable"] for c in cables if c["flags"]],
        "problems": problems,
    }


# --- durations and schedules -------------------------------------------------------------------------


def test_durations_and_what_each_scheduler_can_express() -> None:
    assert [watch.duration(t) for t in ("90s", "15m", "6h", "1d", "45")] == [90, 900, 21600, 86400, 45]
    for bad in ("0m", "fast", "-5m", "1w"):
        with pytest.raises(argparse.ArgumentTypeError, match="give a duration"):
            watch.duration(bad)
    when = watch_schedule.Cron.when
    assert [when(s) for s in (60, 900, 1800, 3600, 21600, 86400)] == [
        "* * * * *", "*/15 * * * *", "*/30 * * * *", "0 * * * *", "0 */6 * * *", "0 0 * * *",
    ]  # fmt: skip
    for bad in (420, 90, 5 * 3600):
        with pytest.raises(watch_schedule.ScheduleError, match="cron runs whole minutes that divide an hour"):
            when(bad)


def config_for(tmp_path: Path, every: int = 900) -> tuple[dict[str, Any], Path]:
    path = tmp_path / "artifacts" / "watch" / "watch.json"
    path.parent.mkdir(parents=True)
    config = {
        "cluster": "tiny lab",
        "every_s": every,
        "full_every_s": 6 * 3600,
        "cwd": str(tmp_path),
        "python": sys.executable,
        "env": {"ANSIBLE_CONFIG": "/etc/x/ansible.cfg", "PATH": "/usr/bin:/bin"},
    }
    return config, path


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_systemd_units_are_ones_systemd_analyze_verifies(tmp_path: Path) -> None:
    config, path = config_for(tmp_path)
    units = watch_schedule.Systemd(str(tmp_path / "units")).units(config, path)
    assert sorted(units) == ["meshkit-watch-tiny_lab.service", "meshkit-watch-tiny_lab.timer"]
    for name, text in units.items():
        (tmp_path / name).write_text(text)
    service = units["meshkit-watch-tiny_lab.service"]
    assert f"ExecStart={sys.executable} -m meshkit watch run --config {path}" in service, service
    assert "Environment=ANSIBLE_CONFIG=/etc/x/ansible.cfg" in service and "Type=oneshot" in service
    assert "OnUnitActiveSec=900s" in units["meshkit-watch-tiny_lab.timer"]
    done = subprocess.run(["systemd-analyze", "verify", *(str(tmp_path / n) for n in units)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    problems = [line for line in done.stderr.splitlines() if "meshkit-watch" in line]
    assert done.returncode == 0 or not problems, done.stderr


def test_systemd_refuses_where_it_does_not_run_and_removes_only_its_own_units(tmp_path: Path) -> None:
    config, path = config_for(tmp_path)
    unit_dir = tmp_path / "units"
    scheduler = watch_schedule.Systemd(str(unit_dir))
    if not scheduler.running():
        with pytest.raises(watch_schedule.ScheduleError, match="systemd does not run on this machine"):
            scheduler.check(config, path)
    unit_dir.mkdir()
    for name, text in scheduler.units(config, path).items():
        (unit_dir / name).write_text(text)
    (unit_dir / "someone-else.timer").write_text("[Timer]\n")
    if scheduler.running():
        pytest.skip("systemd runs here: removing would talk to it")
    assert scheduler.remove({"cluster": "tiny lab"}, path) == [
        f"removed meshkit-watch-tiny_lab.service, meshkit-watch-tiny_lab.timer from {unit_dir}"
    ]
    assert sorted(p.name for p in unit_dir.iterdir()) == ["someone-else.timer"]
    assert scheduler.remove({"cluster": "tiny lab"}, path) == []


def test_the_launchd_agent_is_a_plist_launchd_reads(tmp_path: Path) -> None:
    config, path = config_for(tmp_path, every=600)
    agent = plistlib.loads(watch_schedule.Launchd(str(tmp_path)).plist(config, path))
    assert agent["Label"] == "org.meshkit.watch.tiny_lab" and agent["StartInterval"] == 600
    assert agent["ProgramArguments"] == [sys.executable, "-m", "meshkit", "watch", "run", "--config", str(path)]
    assert agent["StandardOutPath"] == str(path.parent / "watch.log") and agent["RunAtLoad"] is True
    if sys.platform != "darwin":
        with pytest.raises(watch_schedule.ScheduleError, match="launchd is macOS's"):
            watch_schedule.Launchd(str(tmp_path)).check(config, path)


@pytest.mark.skipif(shutil.which("crontab") is None or os.geteuid() != 0, reason="needs crontab(1) and root")
def test_cron_adds_one_line_replaces_it_and_removes_it_leaving_every_other_line() -> None:
    """On the real crontab of the user `nobody` (root may edit another's; root's own is the lab test's)."""
    cron = watch_schedule.Cron(user="nobody")
    before = cron.current()
    config = {"cluster": "tiny lab", "every_s": 300, "cwd": "/tmp/a dir", "python": sys.executable, "env": {}}
    path = Path("/tmp/a dir/artifacts/watch/watch.json")
    try:
        cron.store([*before, "# someone else's", "0 3 * * * /bin/true"])
        cron.install(config, path)
        cron.install({**config, "every_s": 600}, path)  # again: replaced, not doubled
        lines = cron.current()
        ours = [line for line in lines if line.endswith("# meshkit-watch tiny_lab")]
        assert len(ours) == 1, lines
        assert ours[0] == (
            f"*/10 * * * * cd '/tmp/a dir' && {sys.executable} -m meshkit watch run --config "
            "'/tmp/a dir/artifacts/watch/watch.json' >> '/tmp/a dir/artifacts/watch/watch.log' 2>&1 "
            "# meshkit-watch tiny_lab"
        )
        assert cron.remove({"cluster": "tiny lab"}, path) == ["removed 1 line(s) from this user's crontab"]
        assert cron.current() == [*before, "# someone else's", "0 3 * * * /bin/true"]
        assert cron.remove({"cluster": "tiny lab"}, path) == []
    finally:
        cron.store(before)


# --- one scheduled run -------------------------------------------------------------------------------


@pytest.fixture
def watched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A watch configuration as enable writes it, a state directory of its own, and a fake check: each call of
    check.perform takes the next of ``results`` (a report, or an exception to raise)."""
    monkeypatch.setenv("MESHKIT_STATE_DIR", str(tmp_path / "state"))
    where = tmp_path / "artifacts" / "watch"
    where.mkdir(parents=True)
    (tmp_path / "textfile").mkdir()
    config = {
        "version": 1, "inventory": str(tmp_path / "inv.yml"), "cluster": "tiny",
        "artifacts": str(tmp_path / "artifacts"),
        "every_s": 60, "full_every_s": 600, "textfile": str(tmp_path / "textfile" / "meshkit-tiny.prom"),
        "check_args": [], "scheduler": "cron", "cwd": str(tmp_path), "python": sys.executable, "env": {},
    }  # fmt: skip
    (where / "watch.json").write_text(json.dumps(config))
    calls: list[list[str]] = []
    results: list[Any] = []

    def perform(args: argparse.Namespace) -> tuple[dict, dict, dict]:
        calls.append(["--quick"] if args.quick else [])
        assert args.if_idle and args.json is None and args.picture is None, args  # the run writes what it keeps
        result = results.pop(0)
        if isinstance(result, BaseException):
            raise result
        return copy.deepcopy(result), {"hosts": [], "cables": []}, {"host_keys": ["netns:tiny-node1"]}

    monkeypatch.setattr(check, "perform", perform)
    return {"where": where, "config": config, "calls": calls, "results": results, "tmp": tmp_path}


def series(path: str | Path) -> dict[tuple[str, tuple], float]:
    text = Path(path).read_text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_full_check_then_quick_ones_carry_its_bandwidth_and_a_due_full_one_replaces_it(watched) -> None:
    where, config = watched["where"], watched["config"]
    full_slow = report(False, slow=CABLES[1], at=1000.0)
    watched["results"] += [full_slow, report(True, at=1060.0)]
    assert watch.run_once(str(where / "watch.json")) == 0
    assert watch.run_once(str(where / "watch.json")) == 0
    assert watched["calls"] == [[], ["--quick"]]  # the first is full (no full one yet), the next quick
    values = series(config["textfile"])
    slow_key = CABLES[1].replace(" <-> ", " \u2194 ")
    # The quick run's textfile still says the cable is slow, with the full check's figure and time.
    flag = ("meshkit_check_cable_flagged", tuple(sorted({"meshkit_cluster": "tiny", "cable": slow_key,
            "a": "node1:tb1", "b": "node3:tb0", "flag": "slow"}.items())))  # fmt: skip
    assert values[flag] == 1.0, values
    assert values[("meshkit_check_bandwidth_timestamp_seconds", (("meshkit_cluster", "tiny"),))] == 1000.0
    assert values[("meshkit_check_timestamp_seconds", (("meshkit_cluster", "tiny"),))] == 1060.0
    assert values[("meshkit_check_ok", (("meshkit_cluster", "tiny"),))] == 0.0
    runs = {dict(k[1])["outcome"]: v for k, v in values.items() if k[0] == "meshkit_watch_runs_total"}
    assert runs == {"checked": 2.0, "skipped": 0.0, "failed": 0.0}
    assert values[("meshkit_watch_interval_seconds", (("meshkit_cluster", "tiny"),))] == 60.0
    # Every metric is one meshkit documents (check's or the watch's), each family typed.
    families = {f.name: f.type for f in text_string_to_metric_families(Path(config["textfile"]).read_text())}
    assert families["meshkit_watch_runs"] == "counter"
    known = {n.removesuffix("_total") for n in [*check_report.METRICS, *watch.METRICS]}
    assert set(families) <= known, set(families) - known
    history = [json.loads(line) for line in (where / "history.jsonl").read_text().splitlines()]
    assert [(h["outcome"], h["quick"]) for h in history] == [("checked", False), ("checked", True)]
    assert history[0]["cables"][slow_key]["alone"] == {"ab": 2.5e7, "ba": 2.5e7}
    assert history[1]["cables"][slow_key]["alone"] is None  # a quick run measured no rate: the chart has no point
    # The full check is due again (full_every 600 s after the first): a full run, whose report replaces it.
    state = json.loads((where / "state.json").read_text())
    state["last_full_at"] -= 600
    (where / "state.json").write_text(json.dumps(state))
    watched["results"].append(report(False, at=1700.0))
    assert watch.run_once(str(where / "watch.json")) == 0
    assert watched["calls"][-1] == []
    assert series(config["textfile"])[("meshkit_check_ok", (("meshkit_cluster", "tiny"),))] == 1.0


def test_a_run_while_a_job_holds_the_hosts_or_while_the_last_run_goes_on_is_skipped_and_counted(watched) -> None:
    where, config = watched["where"], watched["config"]
    watched["results"] += [report(False, at=1000.0)]
    assert watch.run_once(str(where / "watch.json")) == 0
    lease = {"job_id": "j42", "runtime": "torch", "started": 1500.0, "hosts": {"node1": "netns:tiny-node1"}}
    watched["results"].append(check.Busy([lease], {"node1": "netns:tiny-node1"}))
    assert watch.run_once(str(where / "watch.json")) == 0
    # A run that finds the lock of another still going measures nothing.
    release, held = threading.Event(), threading.Event()

    def hold() -> None:
        with watch._only_run(where) as alone:
            assert alone
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    try:
        assert watch.run_once(str(where / "watch.json")) == 0
    finally:
        release.set()
        holder.join()
    history = [json.loads(line) for line in (where / "history.jsonl").read_text().splitlines()]
    assert [h["outcome"] for h in history] == ["checked", "skipped", "skipped"]
    assert history[1]["reason"].startswith("job j42 (torch) holds node1 since"), history[1]
    assert history[2]["reason"] == "the previous run is still going"
    values = series(config["textfile"])
    runs = {dict(k[1])["outcome"]: v for k, v in values.items() if k[0] == "meshkit_watch_runs_total"}
    assert runs == {"checked": 1.0, "skipped": 2.0, "failed": 0.0}
    assert values[("meshkit_check_ok", (("meshkit_cluster", "tiny"),))] == 1.0  # the last check's figures stay
    assert len(watched["calls"]) == 2  # the overlapping run did not check


def test_a_check_that_fails_is_counted_failed_and_the_run_exits_1(watched, capsys) -> None:
    where, config = watched["where"], watched["config"]
    watched["results"].append(RuntimeError("launch.yml exited with 4"))
    assert watch.run_once(str(where / "watch.json")) == 1
    assert "failed: RuntimeError: launch.yml exited with 4" in capsys.readouterr().out
    values = series(config["textfile"])
    runs = {dict(k[1])["outcome"]: v for k, v in values.items() if k[0] == "meshkit_watch_runs_total"}
    assert runs == {"checked": 0.0, "skipped": 0.0, "failed": 1.0}
    assert not [k for k in values if k[0] == "meshkit_check_ok"]  # no check ever ran: no figures


def test_the_history_rotates_and_is_read_across_both_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch_history, "HISTORY_KEEP", 5)
    path = tmp_path / "history.jsonl"
    for i in range(12):
        watch_history.append_history(path, {"at": i, "outcome": "checked"})
    assert [h["at"] for h in watch_history.read_history(path)] == [5, 6, 7, 8, 9, 10, 11]
    assert len(path.read_text().splitlines()) == 2


def test_enable_refuses_bad_input_before_anything_is_written(tmp_path: Path, capsys) -> None:
    inventory = tmp_path / "inv.yml"
    inventory.write_text(
        "all:\n  children:\n    cluster:\n      hosts:\n        node1: {ansible_connection: local}\n"
        f"      vars:\n        meshkit_cluster_name: tiny\n        meshkit_artifacts_dir: {tmp_path / 'artifacts'}\n"
    )
    argv = ["watch", "enable", "-i", str(inventory), "--scheduler", "cron"]
    assert cli.main([*argv, "--every", "1h", "--full-every", "15m"]) == 2
    assert "--full-every 15m is shorter than --every 1h" in capsys.readouterr().err
    assert cli.main([*argv, "--textfile-dir", str(tmp_path / "nowhere")]) == 2
    assert f"--textfile-dir {tmp_path / 'nowhere'}: no such directory" in capsys.readouterr().err
    if shutil.which("crontab"):
        assert cli.main([*argv, "--every", "7m", "--textfile-dir", str(tmp_path)]) == 2
        assert "cron runs whole minutes that divide an hour" in capsys.readouterr().err
    assert not (tmp_path / "artifacts" / "watch" / "watch.json").exists()
    bad = tmp_path / "bad.yml"
    bad.write_text("all:\n  children:\n    cluster:\n      hosts:\n        node1:\n          meshkit_mtuu: 9000\n")
    assert cli.main(["watch", "enable", "-i", str(bad), "--textfile-dir", str(tmp_path)]) == 2
    assert "meshkit_mtuu is not a meshkit variable" in capsys.readouterr().err


# --- job leases ----------------------------------------------------------------------------------------


def test_a_job_holds_its_hosts_by_how_they_are_reached_until_it_ends(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MESHKIT_STATE_DIR", str(tmp_path))
    job = {"job_id": "j1", "runtime": "plain"}
    lab_a = {"node1": {"kind": "nsenter", "netns": "laba-node1"}, "node2": {"kind": "nsenter", "netns": "laba-node2"}}
    lab_b = {"node1": {"kind": "nsenter", "netns": "labb-node1"}}
    ssh = {"kind": "ssh", "host": "10.0.0.5", "port": None, "user": "ops"}
    assert job_leases.host_key(ssh) == "ssh:ops@10.0.0.5:22"
    with job_leases.held(job, lab_a) as lease:
        assert [x["job_id"] for x in job_leases.holding({"netns:laba-node2"})] == ["j1"]
        assert job_leases.holding({"netns:labb-node1"}) == []  # the same name in another cluster
        lease["outcome"] = "ok"
    assert job_leases.holding({"netns:laba-node2"}) == []
    with job_leases.held({"job_id": "c1", "runtime": "meshccl"}, lab_a, "check"):  # meshkit check's own job
        assert [x["job_id"] for x in job_leases.holding({"netns:laba-node1"})] == ["c1"]
    assert job_leases.last_ended({"netns:laba-node1"})["job_id"] == "j1"  # the last job, not the last check
    assert job_leases.last_ended({"netns:laba-node1"})["outcome"] == "ok"
    assert job_leases.last_ended(set(job_leases.host_keys(lab_b).values())) is None
    # The lease of a process that is gone (a controller killed mid-job) holds nothing, and is removed.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    stale = tmp_path / "jobs" / "running" / "j2.json"
    stale.write_text(json.dumps({"job_id": "j2", "pid": int(dead.stdout), "hosts": {"node1": "netns:laba-node1"}}))
    assert job_leases.holding({"netns:laba-node1"}) == [] and not stale.exists()
    job_leases.record_refusal({"job_id": "j3"}, lab_a, ["node1: port 29500 in use"])
    assert [r["job_id"] for r in job_leases.refusals({"netns:laba-node1"})] == ["j3"]
    assert job_leases.refusals({"netns:labb-node1"}) == []


# --- the status page -----------------------------------------------------------------------------------


def test_the_status_page_marks_the_flagged_cable_and_charts_every_full_check(tmp_path: Path) -> None:
    reports = [report(False, at=1000.0), report(False, at=2000.0), report(False, slow=CABLES[2], at=3000.0)]
    history = [watch_history.history_line(r["timestamp"], "checked", r) for r in reports]
    history.insert(1, watch_history.history_line(1500.0, "checked", report(True, at=1500.0)))
    history.insert(2, watch_history.history_line(1600.0, "skipped", None, "job j1 holds node1"))
    text = status_page.page(reports[-1], history, None, {"scheduler": "cron", "every_s": 60},
                            {"last_run_at": 3000.0, "runs": {"checked": 4, "skipped": 1}})  # fmt: skip
    slow = CABLES[2].replace(" <-> ", " \u2194 ")
    row = text.split(f'data-cable="{slow}"', 1)[1].split("</tr>", 1)[0]
    assert text.count('<tr class="cable flagged"') == 1 and f'<tr class="cable flagged" data-cable="{slow}"' in text
    assert row.count("<circle") == 3 and row.count('class="flagged"') == 1, row  # the 3 full checks
    assert "25 Mb/s" in row and "#slow" in row, row
    assert "Runs: checked 4, skipped 1, failed 0" in text and "FLAGGED: 1 problem(s)" in text


def test_meshkit_status_without_a_watch_shows_the_last_check_and_writes_the_page(tmp_path: Path, capsys) -> None:
    artifacts = tmp_path / "artifacts"
    inventory = tmp_path / "inv.yml"
    inventory.write_text(
        "all:\n  children:\n    cluster:\n      hosts:\n        node1: {ansible_connection: local}\n"
        f"      vars:\n        meshkit_cluster_name: tiny\n        meshkit_artifacts_dir: {artifacts}\n"
    )
    assert cli.main(["status", "-i", str(inventory)]) == 1
    assert f"tiny: no check yet in {artifacts}" in capsys.readouterr().err
    (artifacts / "check").mkdir(parents=True)
    (artifacts / "check" / "check.json").write_text(json.dumps(report(False, slow=CABLES[0], at=5000.0)))
    page = tmp_path / "out" / "status.html"
    assert cli.main(["status", "-i", str(inventory), "--html", str(page)]) == 1  # flagged: exit 1, as meshkit check
    out = capsys.readouterr().out
    assert "FLAGGED" in out and "watch: no scheduled check (meshkit watch enable)" in out, out
    text = page.read_text()
    assert text.count('<tr class="cable flagged"') == 1 and text.count("<circle") == 3, text


def test_the_watch_task_fails_on_bad_input_and_absent_with_nothing_installed_changes_nothing(tmp_path: Path) -> None:
    inventory = tmp_path / "inv.yml"
    inventory.write_text(
        "all:\n  children:\n    cluster:\n      hosts:\n        node1: {ansible_connection: local}\n"
        f"      vars:\n        meshkit_cluster_name: tiny\n        meshkit_artifacts_dir: {tmp_path / 'artifacts'}\n"
    )
    params = {"inventory": str(inventory), "state": "present", "every": "15m", "full_every": "6h",
              "textfile_dir": str(tmp_path), "scheduler": "cron", "check_args": []}  # fmt: skip
    assert watch.run_task({**params, "every": "soon"}, check_mode=False) == {
        "failed": True,
        "msg": "'soon': give a duration such as 90s, 15m, 6h or 1d",
    }
    failed = watch.run_task({**params, "textfile_dir": str(tmp_path / "none")}, check_mode=True)
    assert failed["failed"] and "no such directory" in failed["msg"], failed
    assert not (tmp_path / "artifacts").exists()
    # Nothing installed for this cluster under its own name (another cluster's schedule is not touched).
    assert watch.run_task({**params, "state": "absent"}, check_mode=False) == {"changed": False, "removed": []}
