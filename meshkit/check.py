# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""`meshkit check`: every cable and the whole cluster measured, drift found, nothing changed.

  meshkit check -i INVENTORY [--quick] [--json F] [--prometheus F] [--picture F] [--link-rate RATE]

The check is a meshccl job of one rank per host, prepared exactly as `meshkit launch -r meshccl`
prepares one (launch.yml's checks, or the remembered plan checked on every host in one round
trip): the cabling is the plan's, every hostfile current, meshccl installed, the preflight passed.
Then every host reports what may have drifted since setup.yml (MTU of both ends of every cable,
addresses and routes on the cable ports, RDMA state against the hostfiles), and the job
(``python3 -m meshccl.linkcheck``) measures every cable over a meshccl pair bound to that cable's
two addresses: latency one cable at a time; bandwidth one cable at a time in each direction, then
every cable both ways at once; packet loss; then a meshccl all_reduce over the whole cluster.

A cable below --threshold (80 %) of the rate it should carry, asymmetric, or losing packets is
flagged by name (``node2:tb1 ↔ node3:tb0``) with its figures; so is an all_reduce busbw below
what the cabling allows, and every drift. The rate a cable should carry: --link-rate, else the
inventory's meshkit_link_rate, else the link's negotiated speed (a Mac's Thunderbolt link speed,
Linux's sysfs speed), else the median of the cables measured. --quick measures latency and loss
only (no job-sized traffic). Nothing is configured or changed, on any host.

Output: a live progress display, a table, the report as JSON, a Prometheus textfile
(node_exporter's textfile collector) and the cabling picture coloured by measured bandwidth
(<artifacts>/check/ by default). Exit status: 0 when nothing is flagged, 1 when anything is, 2 when
the check could not run at all (bad options, an unreadable inventory), 3 when --if-idle found a job
holding a host and measured nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshkit import check_drift, job_leases, launch_fast, launch_service, launch_settings
from meshkit.launch_settings import default
from meshkit.rates import parse_rate

MARK = "MESHKIT-CHECK "
PROGRAM = ["python3", "-m", "meshccl.linkcheck"]


def parse_record(line: str) -> dict[str, Any] | None:
    """The worker's record on one line of a rank's output, or None for any other line."""
    if not line.startswith(MARK):
        return None
    try:
        record = json.loads(line[len(MARK) :])
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def records_in(log_dir: Path) -> list[dict[str, Any]]:
    """Every record in a finished job's rank logs (rank-N.log), rank by rank."""
    out = []
    for path in sorted(log_dir.glob("rank-*.log"), key=lambda p: int(p.stem.split("-")[1])):
        for line in path.read_text(errors="replace").splitlines():
            record = parse_record(line)
            if record is not None:
                out.append(record | {"from_rank": int(path.stem.split("-")[1])})
    return out


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a fraction above 0 and at most 1, e.g. 0.8")
    return value


def rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.01 <= value <= 10:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds from 0.01 to 10")
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` (``check -i ...``) as `meshkit check` parses it (for meshkit watch's runs)."""
    parser = argparse.ArgumentParser(prog="meshkit")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def add_parser(sub: Any) -> None:
    check = sub.add_parser(
        "check",
        help="measure every cable and the whole cluster, find configuration drift; changes nothing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("-i", "--inventory", required=True, help="the inventory setup.yml converged")
    check.add_argument("--quick", action="store_true", help="latency, loss and drift only: no job-sized traffic")
    check.add_argument("--threshold", type=fraction, default=0.8, metavar="FRACTION",
                       help="flag a cable below this share of the rate it should carry (0.8)")  # fmt: skip
    check.add_argument("--max-loss", type=fraction, default=0.01, metavar="FRACTION",
                       help="flag a cable losing more than this share of its probes (0.01)")  # fmt: skip
    check.add_argument("--asymmetry", type=fraction, default=0.2, metavar="FRACTION",
                       help="flag a cable whose two directions differ by more than this share (0.2)")  # fmt: skip
    check.add_argument("--link-rate", type=rate, metavar="RATE",
                       help="the rate every cable should carry (80gbit, 40Gb/s); default: the inventory's "
                       "meshkit_link_rate, else the negotiated link speed")  # fmt: skip
    check.add_argument("--seconds", type=seconds, default=0.25,
                       help="length of each timed transfer (0.25)")  # fmt: skip
    check.add_argument("--json", metavar="FILE", help="the report as JSON (- for stdout); default <artifacts>/check/")
    check.add_argument("--prometheus", metavar="FILE",
                       help="a Prometheus textfile (node_exporter --collector.textfile.directory), written "
                       "atomically")  # fmt: skip
    check.add_argument("--picture", metavar="FILE",
                       help="the cabling picture coloured by bandwidth (.svg, .png or .dot); default "
                       "<artifacts>/check/cabling-check.svg")  # fmt: skip
    check.add_argument("-t", "--timeout", type=float, default=300.0,
                       help="stop the measurement after this many seconds (300)")  # fmt: skip
    launch_settings.add_flags(check, ["host_timeout"])  # as meshkit launch's
    check.add_argument("--if-idle", action="store_true",
                       help="measure nothing when a job this controller started, or any Slurm job, holds a host "
                       "(exit 3): a check would steal its bandwidth")  # fmt: skip
    check.add_argument("--recheck", action="store_true", help="run every check of launch.yml (discovery too)")
    check.add_argument("-v", "--verbose", action="store_true", help="show the preparation and the ranks' output")
    check.add_argument("-e", "--extra-vars", action="append", default=[], metavar="VARS",
                       help="more variables for launch.yml, as ansible-playbook -e takes them")  # fmt: skip


class Display:
    """Progress while the check runs: a live bar on a terminal, one line per phase elsewhere."""

    def __init__(self, live: bool) -> None:
        self.live = live
        self.progress: Any = None
        self.task: Any = None
        self.phase = ""

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(f"meshkit check: {text}", highlight=False)
        else:
            print(f"meshkit check: {text}", file=sys.stderr, flush=True)

    def start(self, total: int) -> None:
        if not self.live:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self.progress.start()
        self.task = self.progress.add_task("starting", total=total)

    def step(self, record: dict[str, Any]) -> None:
        phase, what = str(record.get("phase", "")), str(record.get("what", ""))
        text = f"{phase} {record.get('step', '?')}/{record.get('steps', '?')}" + (f": {what}" if what else "")
        if self.progress is not None:
            self.progress.update(self.task, description=text, advance=1)
        elif phase != self.phase:
            self.say(f"{phase}: {record.get('steps', '?')} step(s)")
        self.phase = phase

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def steps_of(cables: int, quick: bool) -> int:
    """The worker's progress records: connect, latency per cable, loss (+ alone per cable, load,
    three all_reduce sizes)."""
    return 2 + cables if quick else 2 + 2 * cables + 1 + 3


def artifacts_dir(context: dict[str, Any]) -> Path | None:
    for cfg in (context.get("config") or {}).values():
        if isinstance(cfg, dict) and cfg.get("meshkit_artifacts_dir"):
            return Path(cfg["meshkit_artifacts_dir"]) / "check"
    return None


def inventory_rates(context: dict[str, Any]) -> dict[str, float]:
    out = {}
    for host, cfg in (context.get("config") or {}).items():
        given = (cfg or {}).get("meshkit_link_rate")
        if given:
            out[host] = parse_rate(given)
    return out


def prepare(args: argparse.Namespace, program: list[str], display: Display) -> tuple[dict | None, list[str]]:
    """The check's job as `meshkit launch -r meshccl -n 1` prepares one; (None, problems) when it
    cannot start."""
    request = launch_service.Request(
        args.inventory,
        {
            "program": program,
            "runtime": "meshccl",
            "ranks_per_host": 1,
            "env": {},
            "secret_env": [],
            "timeout": args.timeout,
            "grace": default("grace"),
            "host_timeout": args.host_timeout,
            "cwd": None,
        },
        recheck=args.recheck,
        extra_vars=args.extra_vars,
        quiet=False,  # launch.yml's tasks, or the hosts' one round trip, as progress
        label="meshkit check",
    )
    problems: list[str] = []
    prepared = launch_service.quick(request, problems)
    if prepared == {}:
        display.say("checking the cluster against its plan (launch.yml)")
        prepared = launch_service.full(request, problems)
    return prepared, problems


def host_drift(job: dict, connections: dict, context: dict) -> tuple[dict[str, dict], list[dict[str, Any]]]:
    """Every host's facts (over its launch connection, all at once) and the drift they show."""
    specs = launch_fast.check_specs(job, context)
    for spec in specs.values():
        spec["rdma"] = True
        spec["slurm_jobs"] = True
    answers = launch_fast.run_checks(connections, specs)
    facts = {host: answer.get("facts") or {} for host, answer in answers.items()}
    items = check_drift.drift(context["plan"], facts)
    for host, answer in answers.items():
        if "error" in answer:
            items.append({"flag": "not-ready", "where": host, "cable": None, "detail": answer["error"]})
    return facts, items


def cables_named(text: str, plan: dict[str, Any]) -> str:
    """``text`` (a job's error, which names addresses) followed by the cables those addresses are on."""
    found = []
    for cable in plan.get("cables") or []:
        ends = cable.get("ends") or []
        if any(re.search(rf"(?<![0-9.]){re.escape(str(e.get('address')))}(?![0-9])", text) for e in ends):
            found.append(check_drift.display(check_drift.cable_key(*ends)))
    return f"{text} (cable {', '.join(found)})" if found else text


def measure(
    args: argparse.Namespace, job: dict, connections: dict, display: Display, plan: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the worker on every host; (its records, problems of the job itself)."""
    records: list[dict[str, Any]] = []
    log_dir = Path(job.get("log_dir") or Path(tempfile.gettempdir()) / "meshkit-launch" / job["job_id"])

    def on_line(rank: Any, line: str) -> None:
        record = parse_record(line)
        if record is None:
            return
        record["from_rank"] = rank.rank
        records.append(record)
        if record.get("t") == "progress":
            display.step(record)

    def write(text: str, _event: bool) -> None:
        display.say(text)

    given = {"host_timeout": args.host_timeout, "timeout": args.timeout, "grace": default("grace")}
    start = launch_service.start_of(given, job, log_dir)
    values = launch_service.secrets(job, {})
    outcome = launch_service.run(job, connections, values, start, write if args.verbose else None, on_line=on_line,
                                 purpose="check")  # fmt: skip
    result = outcome.result
    problems: list[dict[str, Any]] = []
    if not result.ok:
        detail = result.reason
        errors = [str(r.get("msg")) for r in records if r.get("t") == "error"]
        if errors:
            detail += ": " + "; ".join(dict.fromkeys(errors))
        detail = cables_named(detail, plan)
        problems.append({"flag": "not-ready", "where": "job", "cable": None, "detail": f"{detail} (logs: {log_dir})"})
    return records, problems


def write_outputs(args: argparse.Namespace, report: dict, plan: dict | None, where: Path | None) -> list[str]:
    """The JSON, the Prometheus file and the picture; lines saying where they went."""
    from meshkit import check_report

    said = []
    json_path = args.json or (str(where / "check.json") if where else None)
    if json_path == "-":
        print(json.dumps(report, indent=2))
    elif json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        said.append(f"report: {path}")
    if args.prometheus:
        check_report.write_prometheus(args.prometheus, check_report.prometheus(report))
        said.append(f"Prometheus textfile: {args.prometheus}")
    picture = args.picture or (str(where / "cabling-check.svg") if where else None)
    if picture and plan is not None:
        title = f"meshkit check {report.get('cluster_name') or ''}".strip()
        try:
            check_report.render(check_report.dot(plan, report, title), picture)
            said.append(f"picture: {picture}")
        except (OSError, RuntimeError) as exc:
            said.append(f"picture not drawn: {exc}")
    return said


@contextlib.contextmanager
def displayed(display: Display, total: int) -> Iterator[None]:
    display.start(total)
    try:
        yield
    finally:
        display.stop()


class Busy(Exception):
    """--if-idle, and a job holds some of the hosts: nothing was measured."""

    def __init__(
        self, holders: list[dict[str, Any]], hosts: dict[str, str], slurm: dict[str, list[str]] | None = None
    ) -> None:
        names = {key: host for host, key in hosts.items()}
        said = []
        for lease in holders:
            held = sorted({names[k] for k in (lease.get("hosts") or {}).values() if k in names})
            since = datetime.datetime.fromtimestamp(float(lease.get("started") or 0)).strftime("%H:%M:%S")
            said.append(f"job {lease.get('job_id')} ({lease.get('runtime')}) holds {', '.join(held)} since {since}")
        by_job: dict[str, list[str]] = {}
        for host, jobs in sorted((slurm or {}).items()):
            for number in jobs:
                by_job.setdefault(number, []).append(host)
        said += [f"Slurm job {number} runs on {', '.join(on)}" for number, on in by_job.items()]
        super().__init__("; ".join(said))
        self.holders = holders
        self.slurm = slurm or {}


def run(args: argparse.Namespace) -> int:
    from meshkit import check_report

    try:
        report, plan, context = perform(args)
    except Busy as exc:
        print(f"meshkit check: skipped (--if-idle): {exc}", file=sys.stderr)
        return 3
    print(check_report.table(report))
    for line in write_outputs(args, report, plan, artifacts_dir(context)):
        print(f"meshkit check: {line}", file=sys.stderr)
    verdict = "nothing flagged" if report["ok"] else f"{len(report.get('problems') or [])} problem(s) flagged"
    print(f"meshkit check: {verdict} in {report['seconds']:.1f} s", file=sys.stderr)
    return 0 if report["ok"] else 1


def perform(args: argparse.Namespace) -> tuple[dict[str, Any], dict | None, dict[str, Any]]:
    """The check: (its report, the plan, the launch context); Busy when --if-idle and a job holds a host."""
    from meshkit import check_report

    started = time.monotonic()
    display = Display(live=sys.stderr.isatty() and not args.verbose)
    program = [*PROGRAM, "--seconds", f"{args.seconds:g}", *(["--quick"] if args.quick else [])]
    prepared, refusals = prepare(args, program, display)
    plan: dict | None = None
    context: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    facts: dict[str, dict] = {}
    items = [{"flag": "not-ready", "where": "cluster", "cable": None, "detail": text} for text in refusals]
    if prepared:
        job, connections, context = prepared["job"], prepared["connections"], prepared.get("context") or {}
        plan = context.get("plan")
        keys = job_leases.host_keys(connections)
        context = {**context, "host_keys": sorted(keys.values())}
        if getattr(args, "if_idle", False):
            holders = job_leases.holding(set(keys.values()))
            if holders:
                raise Busy(holders, keys)
        display.say(f"job {job['job_id']}: {len(connections)} hosts; reading every host's configuration")
        facts, drift_items = host_drift(job, connections, context)
        slurm = {host: f["slurm_jobs"] for host, f in facts.items() if f.get("slurm_jobs")}
        if getattr(args, "if_idle", False) and slurm:
            raise Busy([], keys, slurm)  # a job Slurm started (not through meshkit) holds these hosts
        items += drift_items
        cables = len((plan or {}).get("cables") or [])
        with displayed(display, steps_of(cables, args.quick)):
            records, problems = measure(args, job, connections, display, plan or {})
        items += problems
    elif not refusals:
        items.append({"flag": "not-ready", "where": "cluster", "cable": None, "detail": "the check did not start"})
    report = check_report.build(
        plan or {"hosts": [], "cables": []},
        records,
        items,
        facts,
        threshold=args.threshold,
        max_loss=args.max_loss,
        asymmetry=args.asymmetry,
        link_rate_bps=args.link_rate,
        inventory_rates=inventory_rates(context),
        quick=args.quick,
        cluster=str(next(iter((context.get("config") or {}).values()), {}).get("meshkit_cluster_name", "")),
        seconds=time.monotonic() - started,
    )
    report["checked_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return report, plan, context
