# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""`meshkit watch`: `meshkit check` on a schedule, its figures kept for Prometheus and for people.

  meshkit watch enable -i INVENTORY [--every 15m] [--full-every 6h] [--textfile-dir DIR] [--scheduler S]
  meshkit watch disable -i INVENTORY
  meshkit watch run --config FILE          (what the schedule runs)

enable installs a scheduled check on this controller: a systemd timer where systemd runs, a launchd
agent on a Mac, a crontab line elsewhere (--scheduler chooses). Each run is `meshkit check --quick`
(latency, loss, drift: no job-sized traffic); a full check (every cable's bandwidth, the cluster's
all_reduce) runs every --full-every. A run never starts while a job this controller launched holds
any of the cluster's hosts (the check would steal its bandwidth): it is skipped, and counted.

Every run writes, atomically, the node_exporter textfile <textfile-dir>/meshkit-<cluster>.prom: the
last check's figures (after a quick run, the bandwidth of the last full one, with its own timestamp),
the watch's own counters and the preflight's refusals of jobs on these hosts (prometheus/meshkit.rules.yml
alerts on them). It appends a line to <artifacts>/watch/history.jsonl (rotated) and rewrites
<artifacts>/watch/status.html (meshkit status's page). disable removes the schedule and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from meshkit import job_leases, status_page, watch_history, watch_schedule

# The flags only a full check can raise (their figures are carried over quick runs).
BANDWIDTH_FLAGS = {"slow", "slow-under-load", "asymmetric", "unmeasured"}
# What the scheduled run keeps of the environment `watch enable` ran in (no secrets: names and paths).
KEPT_ENV = re.compile(r"^(ANSIBLE_\w+|MESHKIT_\w+|XDG_\w+|PATH|HOME|LANG|LC_ALL)$")

# The watch's own metrics in the textfile (beside check_report.METRICS), and their HELP text.
METRICS = {
    "meshkit_watch_interval_seconds": ("gauge", "Seconds between two scheduled checks."),
    "meshkit_watch_full_interval_seconds": ("gauge", "Seconds between two full checks (bandwidth)."),
    "meshkit_watch_runs_total": (
        "counter",
        "Scheduled runs by outcome: checked, skipped (a job held the "
        "hosts, or the last run was still going) or failed.",
    ),
    "meshkit_watch_last_run_timestamp_seconds": ("gauge", "When the watch last ran, whatever the outcome (Unix time)."),
    "meshkit_check_bandwidth_timestamp_seconds": (
        "gauge",
        "When the bandwidth figures were measured (the last full check, Unix time).",
    ),
    "meshkit_launch_preflight_refusals_total": (
        "counter",
        "Jobs on the cluster's hosts the preflight refused (as this controller recorded them).",
    ),
}


class WatchError(Exception):
    """Bad input or an unusable environment: said before anything is changed."""


# --- durations -----------------------------------------------------------------------------------


def duration(text: str) -> int:
    """'15m', '6h', '90s', '1d' or plain seconds -> seconds (argparse type)."""
    match = re.fullmatch(r"\s*(\d+)\s*([smhd]?)\s*", str(text))
    if not match or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a duration such as 90s, 15m, 6h or 1d")
    return int(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def shown(seconds: float) -> str:
    seconds = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


# --- the inventory -------------------------------------------------------------------------------


def inventory_settings(inventory: str) -> dict[str, Any]:
    """The cluster's name and artifacts directory as setup.yml sees them (ansible-inventory, then
    inventory_schema's validation and defaults); WatchError naming the problem."""
    from meshkit.collection import runner_env
    from meshkit.inventory_schema import validate_hosts

    exe = Path(sys.executable).with_name("ansible-inventory")
    argv = [str(exe) if exe.exists() else "ansible-inventory", "-i", inventory, "--list"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **runner_env()},
                              check=False, timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WatchError(f"{inventory}: ansible-inventory did not run ({exc})") from None
    if done.returncode != 0:
        raise WatchError(f"{inventory}: ansible-inventory failed: {done.stderr.strip()[-600:]}")
    data = json.loads(done.stdout or "{}")
    hostvars = (data.get("_meta") or {}).get("hostvars") or {}

    def members(group: str) -> list[str]:
        entry = data.get(group) or {}
        out = list(entry.get("hosts") or [])
        for child in entry.get("children") or []:
            out += members(child)
        return out

    hosts = sorted(set(members("cluster")))
    if not hosts:
        raise WatchError(f"{inventory}: no host in the group 'cluster' (the hosts setup.yml converges)")
    normalised, problems = validate_hosts({h: hostvars.get(h) or {} for h in hosts})
    if problems:
        raise WatchError(f"{inventory}: " + "; ".join(problems))
    first = normalised[hosts[0]]
    return {
        "hosts": hosts,
        "cluster": str(first["meshkit_cluster_name"]),
        "artifacts": str(first["meshkit_artifacts_dir"]),
    }


# --- enable / disable ----------------------------------------------------------------------------


def config_path(artifacts: str | os.PathLike[str]) -> Path:
    return Path(artifacts) / "watch" / "watch.json"


def desired(
    inventory: str, every: int, full_every: int, textfile_dir: str, scheduler_name: str, check_args: list[str]
) -> tuple[dict[str, Any], Path, Any]:
    """The watch's configuration as enable would write it, where, and its scheduler; WatchError or ScheduleError
    (bad input, a scheduler that cannot work here) before anything is written."""
    if full_every < every:
        raise WatchError(f"--full-every {shown(full_every)} is shorter than --every {shown(every)}")
    settings = inventory_settings(inventory)
    directory = Path(textfile_dir).resolve()
    if not directory.is_dir():
        raise WatchError(
            f"--textfile-dir {directory}: no such directory; give node_exporter's --collector.textfile.directory "
            "(Debian: /var/lib/prometheus/node-exporter)"
        )
    scheduler = watch_schedule.choose(scheduler_name)
    config = {
        "version": 1,
        "inventory": str(Path(inventory).resolve()),
        "cluster": settings["cluster"],
        "artifacts": settings["artifacts"],
        "every_s": every,
        "full_every_s": full_every,
        "textfile": str(directory / f"meshkit-{watch_schedule.slug(settings['cluster'])}.prom"),
        "check_args": list(check_args),
        "scheduler": scheduler.name,
        "cwd": os.getcwd(),
        "python": sys.executable,
        "env": {k: v for k, v in os.environ.items() if KEPT_ENV.match(k)},
    }
    path = config_path(settings["artifacts"])
    scheduler.check(config, path)
    return config, path, scheduler


def in_place(config: Mapping[str, Any], path: Path, scheduler: Any) -> bool:
    """This configuration is the one written, and its schedule is installed as it would install it."""
    return status_page.read_json(path) == dict(config) and scheduler.installed(config, path)


def install(config: dict[str, Any], path: Path, scheduler: Any) -> str:
    _write_json(path, config)
    return scheduler.install(config, path)


def remove(inventory: str) -> tuple[str, list[str], Any]:
    """Every schedule of this inventory's watch removed (and the configuration marked so); (the cluster, what
    was removed)."""
    settings = inventory_settings(inventory)
    path = config_path(settings["artifacts"])
    config = status_page.read_json(path)
    names = [config["scheduler"]] if config.get("scheduler") else list(watch_schedule.SCHEDULERS)
    removed = []
    for name in names:
        removed += watch_schedule.SCHEDULERS[name]().remove({**config, "cluster": settings["cluster"]}, path)
    if config.get("scheduler"):
        _write_json(path, {**config, "scheduler": None})
    return settings["cluster"], removed, path


def enable(args: argparse.Namespace) -> int:
    config, path, scheduler = desired(
        args.inventory, args.every, args.full_every, args.textfile_dir, args.scheduler, args.check_arg or []
    )
    installed = install(config, path, scheduler)
    print(f"meshkit watch: {config['cluster']}: a check every {shown(args.every)} (full every "
          f"{shown(args.full_every)}) by {scheduler.name}: {installed}")  # fmt: skip
    print(f"meshkit watch: textfile {config['textfile']}; history and status page in {path.parent}")
    return 0


def disable(args: argparse.Namespace) -> int:
    cluster, removed, _path = remove(args.inventory)
    said = "; ".join(removed) if removed else "no schedule was installed"
    print(f"meshkit watch: {cluster}: {said} (history and textfile kept)")
    return 0


# --- the task (meshkit.cluster.watch, playbooks/watch.yml; plugins/modules/watch.py documents it) --------

ARGUMENT_SPEC: dict[str, Any] = {
    "inventory": {"type": "path", "required": True},
    "state": {"type": "str", "choices": ["present", "absent"], "default": "present"},
    "every": {"type": "str", "default": "15m"},
    "full_every": {"type": "str", "default": "6h"},
    "textfile_dir": {"type": "path", "default": "/var/lib/prometheus/node-exporter"},
    "scheduler": {"type": "str", "choices": ["auto", "systemd", "launchd", "cron"], "default": "auto"},
    "check_args": {"type": "list", "elements": "str", "default": []},
}


def run_task(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    """`meshkit watch enable` (state present) or `disable` (absent) as a task: changed only when the schedule or
    its configuration differs; check mode says so and changes nothing."""
    try:
        if params["state"] == "absent":
            settings = inventory_settings(params["inventory"])
            path = config_path(settings["artifacts"])
            config = {**status_page.read_json(path), "cluster": settings["cluster"]}
            there = [n for n, kind in watch_schedule.SCHEDULERS.items() if kind().installed_any(config, path)]
            if check_mode or not there:
                return {"changed": bool(there), "removed": there}
            _cluster, removed, _ = remove(params["inventory"])
            return {"changed": True, "removed": removed}
        every, full_every = duration(params["every"]), duration(params["full_every"])
        config, path, scheduler = desired(params["inventory"], every, full_every, params["textfile_dir"],
                                          params["scheduler"], params["check_args"])  # fmt: skip
        result = {"config": str(path), "scheduler": scheduler.name, "textfile": config["textfile"]}
        if in_place(config, path, scheduler):
            return {"changed": False, **result}
        if not check_mode:
            result["installed"] = install(config, path, scheduler)
        return {"changed": True, **result}
    except (WatchError, watch_schedule.ScheduleError, argparse.ArgumentTypeError) as exc:
        return {"failed": True, "msg": str(exc)}


# --- one scheduled run ---------------------------------------------------------------------------


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    from meshkit.check_report import _atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())


@contextlib.contextmanager
def _only_run(where: Path) -> Iterator[bool]:
    """True when this is the only run of this watch (a lock held for the run), False when another is still going."""
    where.mkdir(parents=True, exist_ok=True)
    with (where / "run.lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def carried(quick: dict[str, Any], full: Mapping[str, Any] | None) -> dict[str, Any]:
    """A quick check's report with the bandwidth of the last full one carried into it (figures,
    their flags, the cluster's all_reduce), so the textfile and the page keep them between full checks."""
    if not full:
        return quick
    old = {e["key"]: e for e in full.get("cables") or []}
    for entry in quick.get("cables") or []:
        before = old.get(entry["key"])
        if before is None or entry.get("error"):
            continue
        for field in ("alone", "load", "reference_bps"):
            entry[field] = before.get(field)
        entry["flags"] += [f for f in before.get("flags") or [] if f["flag"] in BANDWIDTH_FLAGS]
    quick["cluster"] = full.get("cluster")
    quick["bandwidth_timestamp"] = full.get("timestamp")
    problems = list(quick.get("problems") or [])
    for entry in quick.get("cables") or []:
        carried_flags = [f for f in entry["flags"] if f["flag"] in BANDWIDTH_FLAGS]
        problems += [f"{entry['cable']}: {f['flag']}: {f['detail']}" for f in carried_flags]
    if quick["cluster"]:
        problems += [f"cluster: {f['flag']}: {f['detail']}" for f in quick["cluster"].get("flags") or []]
    quick["problems"] = list(dict.fromkeys(problems))
    quick["flagged"] = [e["cable"] for e in quick.get("cables") or [] if e["flags"]]
    quick["ok"] = not quick["problems"]
    return quick


def textfile(config: Mapping[str, Any], state: Mapping[str, Any], report: Mapping[str, Any] | None,
             refused: int) -> str:  # fmt: skip
    """The node_exporter textfile: the last check's metrics, then the watch's."""
    from meshkit import check_report

    text = check_report.prometheus(report) if report else ""
    name = {"meshkit_cluster": config["cluster"]}
    samples: dict[str, list[tuple[dict[str, Any], float]]] = {
        "meshkit_watch_interval_seconds": [(name, config["every_s"])],
        "meshkit_watch_full_interval_seconds": [(name, config["full_every_s"])],
        "meshkit_watch_runs_total": [
            ({**name, "outcome": o}, (state.get("runs") or {}).get(o, 0)) for o in ("checked", "skipped", "failed")
        ],
        "meshkit_watch_last_run_timestamp_seconds": [(name, state.get("last_run_at") or 0)],
        "meshkit_check_bandwidth_timestamp_seconds": [
            (name, t)
            for t in [
                (report or {}).get("bandwidth_timestamp")
                or (None if (report or {}).get("quick") else (report or {}).get("timestamp"))
            ]
            if t
        ],
        "meshkit_launch_preflight_refusals_total": [(name, refused)],
    }
    lines = []
    for metric, (kind, help_text) in METRICS.items():
        if samples[metric]:
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
            lines += [f"{metric}{check_report._labels(lb)} {check_report._value(v)}" for lb, v in samples[metric]]
    return text + "\n".join(lines) + "\n"


def check_argv(config: Mapping[str, Any], quick: bool) -> list[str]:
    """The check a run makes (check.perform: no output of its own; the run writes the reports it keeps)."""
    return ["check", "-i", config["inventory"], "--if-idle", *(["--quick"] if quick else []), *config["check_args"]]


def run_once(config_file: str) -> int:
    """One scheduled run (see the module's text): 0 when it checked or skipped, 1 when the check failed to run."""
    from meshkit import check

    path = Path(config_file)
    config = status_page.read_json(path)
    if not config.get("inventory"):
        print(f"meshkit watch run: {path}: no watch configuration here; run meshkit watch enable", file=sys.stderr)
        return 2
    os.environ.update(config.get("env") or {})
    if config.get("cwd"):
        with contextlib.suppress(OSError):
            os.chdir(config["cwd"])
    where = path.parent
    now = time.time()
    with _only_run(where) as alone:
        state = status_page.read_json(where / "state.json")
        runs = state.setdefault("runs", {})
        last_full = status_page.read_json(where / "check-full.json")
        report: dict[str, Any] | None = status_page.read_json(where / "check-merged.json") or None
        outcome, reason = "checked", ""
        keys: set[str] = set(state.get("host_keys") or [])
        if not alone:
            outcome, reason = "skipped", "the previous run is still going"
        else:
            due = now - float(state.get("last_full_at") or 0) >= config["full_every_s"] - config["every_s"] / 2
            # A full check every run when --full-every is --every; else once it is due (within half an interval).
            quick = bool(last_full) and config["full_every_s"] > config["every_s"] and not due
            args = check.parse(check_argv(config, quick))
            try:
                fresh, plan, context = check.perform(args)
            except check.Busy as exc:
                outcome, reason = "skipped", str(exc)
                keys |= {k for lease in exc.holders for k in (lease.get("hosts") or {}).values()}
            except Exception as exc:  # the run is counted and said; the next one tries again
                outcome, reason = "failed", f"{type(exc).__name__}: {exc}"
            else:
                if context.get("host_keys"):
                    keys = set(context["host_keys"])
                if not fresh.get("quick"):
                    _write_json(where / "check-full.json", fresh)
                    state["last_full_at"] = now
                report = carried(fresh, last_full if fresh.get("quick") else None)
                _write_json(where / "check-merged.json", report)
                if plan:
                    _write_json(where / "plan.json", plan)
                if not fresh.get("cables") and fresh.get("problems"):
                    outcome, reason = "failed", "; ".join(fresh["problems"])[:500]
        runs[outcome] = int(runs.get(outcome, 0)) + 1
        state.update(last_run_at=now, last_outcome=outcome, last_reason=reason, host_keys=sorted(keys))
        _write_json(where / "state.json", state)
        line = watch_history.history_line(now, outcome, report if outcome == "checked" else None, reason)
        watch_history.append_history(where / "history.jsonl", line)
        from meshkit.check_report import write_prometheus

        write_prometheus(config["textfile"], textfile(config, state, report, len(job_leases.refusals(keys))))
        try:
            status_page.write(where / "status.html", where, config)
        except Exception as exc:  # the page is for people; a run never fails for it, but says so
            print(f"meshkit watch run: status page not written: {type(exc).__name__}: {exc}", file=sys.stderr)
    flagged = ", ".join((report or {}).get("flagged") or []) if outcome == "checked" else ""
    print(f"meshkit watch run: {datetime.datetime.now().isoformat(timespec='seconds')} {outcome}"
          + (f": {reason}" if reason else "") + (f"; flagged {flagged}" if flagged else ""))  # fmt: skip
    return 1 if outcome == "failed" else 0


# --- the command line ----------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    watch = sub.add_parser("watch", help="meshkit check on a schedule, for Prometheus and a status page",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    verbs = watch.add_subparsers(dest="verb", required=True)
    on = verbs.add_parser("enable", help="install the scheduled check on this controller")
    on.add_argument("-i", "--inventory", required=True, help="the inventory setup.yml converged")
    on.add_argument("--every", type=duration, default=duration("15m"), help="between two checks (15m)")
    on.add_argument("--full-every", type=duration, default=duration("6h"),
                    help="between two full checks, every cable's bandwidth (6h); the others are --quick")  # fmt: skip
    on.add_argument(
        "--textfile-dir",
        default="/var/lib/prometheus/node-exporter",
        help="node_exporter's --collector.textfile.directory (Debian's: /var/lib/prometheus/node-exporter)",
    )
    on.add_argument("--scheduler", choices=["auto", *watch_schedule.SCHEDULERS], default="auto",
                    help="systemd (a timer), launchd (macOS) or cron; auto: the first that runs here")  # fmt: skip
    on.add_argument("--check-arg", action="append", metavar="ARG",
                    help="one more argument for each meshkit check (--check-arg=--threshold=0.7)")  # fmt: skip
    off = verbs.add_parser("disable", help="remove the scheduled check (history and textfile stay)")
    off.add_argument("-i", "--inventory", required=True)
    once = verbs.add_parser("run", help="one scheduled run (what the schedule starts)")
    once.add_argument("--config", required=True, help="<artifacts>/watch/watch.json")


def main(args: argparse.Namespace) -> int:
    try:
        if args.verb == "enable":
            return enable(args)
        if args.verb == "disable":
            return disable(args)
        return run_once(args.config)
    except (WatchError, watch_schedule.ScheduleError) as exc:
        print(f"meshkit watch: {exc}", file=sys.stderr)
        return 2


def add_status_parser(sub: Any) -> None:
    status = sub.add_parser("status", help="the cluster's health from the last checks: a summary, and --html FILE",
                            description=status_page.__doc__)  # fmt: skip
    status.add_argument("-i", "--inventory", required=True, help="the inventory setup.yml converged")
    status.add_argument("--html", metavar="FILE", help="write the page here (it opens from disk)")


def status_main(args: Any) -> int:
    """`meshkit status`: the last check's table, the schedule, and the page with --html."""
    from meshkit import check_report

    try:
        settings = inventory_settings(args.inventory)
    except WatchError as exc:
        print(f"meshkit status: {exc}", file=sys.stderr)
        return 2
    artifacts = Path(settings["artifacts"])
    where = artifacts / "watch"
    config, state = status_page.read_json(where / "watch.json"), status_page.read_json(where / "state.json")
    report, history, plan = (
        status_page.read_json(where / "check-merged.json"),
        watch_history.read_history(where / "history.jsonl"),
        None,
    )
    if report:
        plan = status_page.read_json(where / "plan.json")
    else:  # no watch: the last meshkit check
        report, plan = (
            status_page.read_json(artifacts / "check" / "check.json"),
            status_page.read_json(artifacts / "plan.json"),
        )
        history = [watch_history.history_line(float(report.get("timestamp") or 0), "checked", report)] if report else []
    if not report:
        print(f"meshkit status: {settings['cluster']}: no check yet in {artifacts} (meshkit check, or meshkit watch "
              "enable)", file=sys.stderr)  # fmt: skip
        return 1
    print(check_report.table(report), end="")
    if config.get("scheduler"):
        print(f"watch: {config['scheduler']}, every {shown(config['every_s'])}, full every "
              f"{shown(config['full_every_s'])}; last run {status_page.when(state.get('last_run_at'))} "
              f"({state.get('last_outcome', '-')}); runs {state.get('runs', {})}")  # fmt: skip
    else:
        print("watch: no scheduled check (meshkit watch enable)")
    if args.html:
        target = Path(args.html)
        from meshkit.check_report import _atomic_write

        target.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(target, status_page.page(report, history, plan, config, state).encode())
        print(f"meshkit status: page {target}", file=sys.stderr)
    return 0 if report.get("ok") else 1
