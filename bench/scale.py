#!/usr/bin/env python3
"""Where the time goes as the cluster grows: setup.yml and launch.yml on lab rings of several sizes.

For each size (hosts in a ring, reached as `make demo` reaches its lab: root over SSH, host key
checking on) a fresh lab is built (timed apart, not part of the figures), then:

  setup first run   ansible-playbook -i <inventory> playbooks/setup.yml     (meshccl installed too)
  no-change run     the same again: should report changed=0 (reported, not asserted)
  launch.yml        ansible-playbook -i <inventory> playbooks/launch.yml, every check, a trivial
                    program (`true`), 2 ranks per host, launch_runtime plain

Each run: wall seconds, the ansible-playbook process's CPU time (user + sys of it and of the
processes it waited for: its workers, their ssh clients; not the ssh ControlPersist masters, which
detach, nor anything on the hosts), the recap per host, the exit status, and per task and per
host the times a timing callback (bench/callback_plugins/meshkit_timing.py) records. The lab is
then removed (always: also on a failure, Ctrl-C or SIGTERM) with its artifacts directory.

  .venv/bin/python bench/scale.py                              # 4, 8, 16, 32 hosts (root)
  .venv/bin/python bench/scale.py --sizes 4,8 --label before --reference
  .venv/bin/python bench/scale.py report                       # md + png again from bench/results/scale.json
  .venv/bin/python bench/scale.py report --json bench/reference/scale-after.json

Output (--out, default bench/results/): scale.json (everything), scale.md (the tables, also
printed), scale.png (time against hosts, fitted lines) and logs/scale-<label>/ (every playbook's
output and its timing JSON). --reference also copies the three to bench/reference/scale-<label>.*.
--tree DIR measures another checkout's setup.yml and launch.yml (its own package and collection,
bench/ab.py's base revision), on labs this checkout builds: the lab is the fixture, held equal.
A benchmark, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from allreduce import say, terminate_as_interrupt
from lab import REPO, Lab, LabError, ansible_env

from meshkit import lab_claims

BENCH = Path(__file__).resolve().parent
CALLBACKS = BENCH / "callback_plugins"
# Test labs and the bench claim their 198.19.x.0/24 the same way (meshkit/lab_claims.py), so a test run
# beside the bench never picks the same one.
CLAIMS = lab_claims.CLAIMS
OCTETS = range(248, 201, -1)  # tests take theirs from 1 upwards; bench/allreduce.py 200, bench/ddp.py 201

STEPS = ("setup_first", "setup_again", "launch")
STEP_TITLES = {"setup_first": "setup.yml first run", "setup_again": "no-change run", "launch": "launch.yml"}
RECAP = re.compile(
    r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)\s+skipped=(\d+)"
    r"\s+rescued=(\d+)\s+ignored=(\d+)",
    re.MULTILINE,
)
RECAP_KEYS = ("ok", "changed", "unreachable", "failed", "skipped", "rescued", "ignored")


class ScaleError(Exception):
    pass


# --- the lab: a name and a subnet nothing else uses ---------------------------------------------------


def _ip_json(*args: str) -> list[dict[str, Any]]:
    proc = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=False)
    return json.loads(proc.stdout or "[]") if proc.returncode == 0 else []


def name_in_use(name: str) -> list[str]:
    """What on this machine already carries the lab name (empty: free)."""
    found = [f"namespace {ns['name']}" for ns in _ip_json("netns", "list") if ns["name"].startswith(f"{name}-")]
    found += [f"link {ln['ifname']}" for ln in _ip_json("link", "show") if ln.get("ifname", "").startswith(f"{name}-")]
    for path in (REPO / ".lab" / name, REPO / "inventory" / f"{name}.yml"):
        if path.exists():
            found.append(str(path))
    try:
        if f"# BEGIN meshkit lab {name}\n" in Path("/etc/hosts").read_text():
            found.append(f"its block in /etc/hosts (# BEGIN meshkit lab {name})")
    except OSError:
        pass
    return found


routes_in = lab_claims.routes_in


def release(subnet: str) -> None:
    lab_claims.release(subnet, CLAIMS)


def claim_subnet(forced: str | None) -> str:
    """A /24 no route of this machine touches and no test lab (or other bench) has claimed."""
    if forced:
        net = ipaddress.ip_network(forced)
        if routes := routes_in(forced):
            raise ScaleError(f"subnet {forced} is in use on this machine (routes: {', '.join(routes)}); pick another")
        in_test_range = net.prefixlen == 24 and net.subnet_of(ipaddress.ip_network("198.19.0.0/16"))
        if in_test_range and not lab_claims.claim(net.network_address.packed[2], CLAIMS):
            raise ScaleError(f"subnet {forced} is claimed by another lab user ({CLAIMS}); pick another")
        return str(net)
    subnet = lab_claims.first_free(OCTETS, CLAIMS, routes_in)
    if subnet:
        return subnet
    raise ScaleError(f"no free 198.19.x.0/24 in 198.19.{OCTETS[-1]}-{OCTETS[0]} (claims in {CLAIMS}); give --subnet")


class ScaleLab(Lab):
    """bench/lab.py's lab, built without converging it (setup.yml is what is measured here)."""

    tree: Path = REPO  # the measured checkout: where its setup.yml writes the artifacts

    def build(self, timeout: float) -> Run:
        """playbooks/lab.yml, run as the measured playbooks are (an interrupt stops all of it)."""
        self.built = True  # from here on, down() runs even if the build fails half-way
        argv = ["ansible-playbook", "playbooks/lab.yml", *self._lab_vars()]
        run = run_playbook(Run("lab", argv, self.log, self.log.with_suffix(".timing.json")), timeout)
        if run.rc != 0:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-15:]
            raise LabError(f"building lab {self.name} failed (rc {run.rc}); log {self.log}:\n  " + "\n  ".join(tail))
        return run

    def cluster_hosts(self) -> list[str]:
        inv = yaml.safe_load(self.inventory.read_text())
        return list(inv["all"]["children"]["cluster"]["hosts"])

    def artifacts_dir(self) -> Path:
        """Where setup.yml writes (the inventory's meshkit_artifacts_dir, or artifacts/<cluster name>)."""
        inv = yaml.safe_load(self.inventory.read_text())
        variables = inv["all"].get("vars") or {}
        path = variables.get("meshkit_artifacts_dir") or Path("artifacts") / variables["meshkit_cluster_name"]
        return (self.tree / path).resolve()


# --- one playbook run, timed ------------------------------------------------------------------------


@dataclass
class Run:
    step: str
    argv: list[str]
    log: Path
    timing: Path
    wall_s: float = 0.0
    cpu_user_s: float = 0.0
    cpu_sys_s: float = 0.0
    rc: int | None = None
    timed_out: bool = False
    load_before: list[float] = field(default_factory=list)
    tree: Path = REPO  # whose playbooks and code run (the lab's own playbook: always this checkout's)

    def to_json(self) -> dict[str, Any]:
        timing = load_timing(self.timing)
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        recap = recap_from_timing(timing) or parse_recap(text)
        tasks = task_summaries(timing)
        return {
            "step": self.step,
            "argv": self.argv,
            "rc": self.rc,
            "failed": self.rc != 0,
            "timed_out": self.timed_out,
            "wall_s": round(self.wall_s, 3),
            "cpu_user_s": round(self.cpu_user_s, 3),
            "cpu_sys_s": round(self.cpu_sys_s, 3),
            "cpu_s": round(self.cpu_user_s + self.cpu_sys_s, 3),
            "load_before": self.load_before,
            "log": _rel(self.log),
            "recap": recap,
            "changed_total": sum(r["changed"] for r in recap.values()),
            "ok_total": sum(r["ok"] for r in recap.values()),
            "tasks_run": len(tasks) if timing else len(re.findall(r"^(?:TASK|RUNNING HANDLER) \[", text, re.M)),
            "host_results": sum(len(t["hosts"]) for t in tasks),
            "in_tasks_s": round(sum(t["seconds"] for t in tasks), 3),
            "timing": bool(timing),
            "tasks": tasks,
        }


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def bench_env(timing: Path, tree: Path = REPO) -> dict[str, str]:
    env = ansible_env(tree)
    env["ANSIBLE_CALLBACK_PLUGINS"] = str(CALLBACKS)
    env["ANSIBLE_CALLBACKS_ENABLED"] = "meshkit_timing"
    env["MESHKIT_TIMING_JSON"] = str(timing)
    return env


def run_playbook(run: Run, timeout: float) -> Run:
    """Runs one ansible-playbook (own session, output to run.log); wall time and CPU from os.wait4."""
    run.timing.unlink(missing_ok=True)
    run.load_before = [round(x, 2) for x in os.getloadavg()]
    with open(run.log, "w", encoding="utf-8") as out:
        out.write(f"$ {' '.join(run.argv)}\n")
        out.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            run.argv,
            cwd=run.tree,
            env=bench_env(run.timing, run.tree),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches this driver only; it stops the playbook itself
        )

        def expire() -> None:
            run.timed_out = True
            kill_tree(process_tree(proc.pid))

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except KeyboardInterrupt:
            _stop(proc)
            raise
        finally:
            timer.cancel()
        run.wall_s = time.monotonic() - t0
        proc.returncode = run.rc = os.waitstatus_to_exitcode(status)
        run.cpu_user_s, run.cpu_sys_s = usage.ru_utime, usage.ru_stime
    return run


def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, process group, start time) from /proc/<pid>/stat; None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rpartition(")")[2].split()  # after "pid (comm)": state, ppid, pgrp, ..., starttime (19th)
    return int(fields[1]), int(fields[2]), int(fields[19])


def process_tree(root: int) -> list[tuple[int, int, int]]:
    """(pid, process group, start time) of root and all its descendants.

    Ansible's workers call setsid(): each is its own session and process group, with what it runs (ssh,
    a local module) in its group, so a signal to the playbook's group alone does not reach them.
    """
    stats = {int(e.name): st for e in Path("/proc").iterdir() if e.name.isdigit() and (st := _proc_stat(int(e.name)))}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out.append((pid, stats[pid][1], stats[pid][2]))
            todo += children.get(pid, [])
    return out


def kill_tree(tree: list[tuple[int, int, int]]) -> None:
    """SIGKILL to every process of a process_tree() snapshot still there (same start time) and its group."""
    own = os.getpgrp()
    for pid, group, start in tree:
        stat = _proc_stat(pid)
        if stat is None or stat[2] != start:
            continue  # gone (or its pid reused)
        with contextlib.suppress(ProcessLookupError):
            if group != own:
                os.killpg(group, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Interrupted: SIGINT to the playbook (Ansible stops its workers and says so), then SIGKILL to whatever of
    its processes is left, at once or after 20 s."""
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:  # a second Ctrl-C does not cut this short
        tree = process_tree(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        kill_tree(tree)
        proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# --- what the callback and the recap say ------------------------------------------------------------


def load_timing(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def recap_from_timing(timing: dict[str, Any]) -> dict[str, dict[str, int]]:
    out = {}
    for host, s in (timing.get("stats") or {}).items():
        out[host] = {k: int(s.get("failures" if k == "failed" else k, 0)) for k in RECAP_KEYS}
    return out


def parse_recap(text: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP lines of a log (when the callback wrote nothing, e.g. the run was killed)."""
    _, _, tail = text.rpartition("PLAY RECAP")
    return {m[0]: dict(zip(RECAP_KEYS, map(int, m[1:]), strict=True)) for m in RECAP.findall(tail)}


def task_summaries(timing: dict[str, Any]) -> list[dict[str, Any]]:
    """Every task started: its span (start to the last host's result) and each host's own time."""
    out = []
    for t in timing.get("tasks") or []:
        hosts = {}
        for host, h in t["hosts"].items():
            seconds = None
            if h.get("done") is not None and h.get("queued") is not None:
                seconds = round(h["done"] - h["queued"], 4)
            hosts[host] = {**h, "seconds": seconds}
        end = t["end"] if t.get("end") is not None else t["start"]
        out.append({**{k: t[k] for k in ("play", "role", "name", "action", "path", "handler", "start")},
                    "end": end, "seconds": round(end - t["start"], 4), "hosts": hosts})  # fmt: skip
    return out


def slowest(run: dict[str, Any], top: int = 15) -> list[dict[str, Any]]:
    """The slowest tasks of a run, with how their time spreads over hosts."""
    rows = []
    for t in sorted(run.get("tasks") or [], key=lambda t: -t["seconds"])[:top]:
        per_host = [h["seconds"] for h in t["hosts"].values() if h["seconds"] is not None]
        statuses = Counter(h["status"] or "?" for h in t["hosts"].values())
        rows.append(
            {
                "name": t["name"],
                "role": t["role"] or "",
                "where": where(t["path"]),
                "play": t["play"],
                "seconds": t["seconds"],
                "hosts": len(t["hosts"]),
                "host_max_s": max(per_host) if per_host else None,
                "host_median_s": statistics.median(per_host) if per_host else None,
                "statuses": dict(statuses),
            }
        )
    return rows


def where(path: str) -> str:
    """A task's file:line in the collection (or the checkout) when it is in it."""
    _, found, inside = path.partition("ansible_collections/meshkit/cluster/")
    if found:
        return inside
    prefix = f"{REPO}/"
    return path[len(prefix) :] if path.startswith(prefix) else path


def wheel_builds(run: dict[str, Any]) -> float | None:
    """Seconds of a controller meshccl wheel build in this run (a cold wheel cache), None if there was none."""
    built = [
        t["seconds"]
        for t in run.get("tasks") or []
        if t["action"].endswith("meshccl_wheel") and any(h.get("status") == "changed" for h in t["hosts"].values())
    ]
    return sum(built) if built else None


def changed_tasks(run: dict[str, Any]) -> list[str]:
    """'task: host, host' for every task that changed something (for the no-change run)."""
    out = []
    for t in run.get("tasks") or []:
        hosts = sorted(h for h, r in t["hosts"].items() if r.get("status") == "changed")
        if hosts:
            out.append(f"{t['name']}: {', '.join(hosts)}")
    return out


# --- fits, tables, plot -------------------------------------------------------------------------------

MEASURES = [(step, "wall_s") for step in STEPS] + [(step, "cpu_s") for step in STEPS]


def measure_title(step: str, what: str) -> str:
    return STEP_TITLES[step] + (" (wall)" if what == "wall_s" else ", controller CPU")


def points(data: dict[str, Any], step: str, what: str) -> list[tuple[int, float]]:
    """(hosts, value) of every size whose run of that step succeeded."""
    out = []
    for size in data.get("sizes_run") or []:
        run = (size.get("runs") or {}).get(step)
        if run and not run["failed"]:
            out.append((size["hosts"], run[what]))
    return out


def fit_line(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """Least-squares line y = slope * x + intercept (numpy.polyfit), with R²; None below two distinct x."""
    if len(set(xs)) < 2:
        return None
    import numpy as np

    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    pred = slope * np.asarray(xs, float) + intercept
    total = float(np.sum((np.asarray(ys, float) - np.mean(ys)) ** 2))
    r2 = 1.0 - float(np.sum((np.asarray(ys, float) - pred) ** 2)) / total if total > 0 else 1.0
    return {"slope": float(slope), "intercept": float(intercept), "r2": r2, "n": len(xs)}


def fits(data: dict[str, Any]) -> dict[str, dict[str, float] | None]:
    out = {}
    for step, what in MEASURES:
        pts = points(data, step, what)
        out[f"{step}.{what}"] = fit_line([x for x, _ in pts], [y for _, y in pts])
    return out


def _table(head: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """A markdown table; the columns in `left` are text (left-aligned), the others figures."""
    out = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(":---" if i in left else "---:" for i in range(len(head))) + "|",
    ]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _cell(run: dict[str, Any] | None, what: str, spec: str = ".1f") -> str:
    if run is None:
        return "not run"
    if run["failed"]:
        return f"FAILED (rc {run['rc']}{', timed out' if run.get('timed_out') else ''})"
    return format(run[what], spec)


def _num(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown(data: dict[str, Any], compare: tuple[dict[str, Any], dict[str, Any]] | None = None) -> str:
    p = data.get("params") or {}
    m = data.get("machine") or {}
    sizes = data.get("sizes_run") or []
    label = data.get("label") or "unlabelled"
    lines = [
        f"# setup.yml and launch.yml against cluster size ({label})",
        "",
        f"Lab rings of {', '.join(str(s['hosts']) for s in sizes) or 'no'} hosts, reached as `make demo` reaches its "
        f"lab (root over SSH, host key checking on), forks {p.get('forks', '?')}. Each size: a fresh lab, "
        "`playbooks/setup.yml` (first run, meshccl installed too), the same again (no-change run), then "
        f"`playbooks/launch.yml` with every check starting `true` with {p.get('ranks_per_host', 2)} ranks per host "
        "(runtime plain). Wall time of `ansible-playbook`; controller CPU = user + sys of it and the processes "
        "it waited for (workers, ssh clients; not the detached ssh ControlPersist masters, nor the hosts' side).",
        "",
        f"Machine: {m.get('cpus', '?')} CPUs; load average {m.get('load_start', '?')} at the start, "
        f"{m.get('load_end', '?')} at the end; ansible-core {m.get('ansible_core', '?')}; commit "
        f"{m.get('commit', '?')}{' (with local changes)' if m.get('dirty') else ''}; {data.get('date', '')}. "
        "The lab's hosts share this machine's CPUs: what else runs here slows every figure.",
        "",
    ]
    if data.get("interrupted"):
        lines += ["**Interrupted**: the sizes below are the ones finished.", ""]
    head = [
        "hosts",
        "setup first run (s)",
        "CPU (s)",
        "no-change run (s)",
        "CPU (s)",
        "changed in no-change run",
        "launch.yml (s)",
        "CPU (s)",
        "tasks run (first / no-change / launch)",
        "lab build (s)",
    ]
    rows = []
    for s in sizes:
        runs = s.get("runs") or {}
        first, again, launch = (runs.get(k) for k in STEPS)
        tasks = " / ".join(str(r["tasks_run"]) if r else "—" for r in (first, again, launch))
        changed = "—" if again is None else str(again["changed_total"])
        rows.append(
            [
                str(s["hosts"]),
                _cell(first, "wall_s"),
                _cell(first, "cpu_s"),
                _cell(again, "wall_s"),
                _cell(again, "cpu_s"),
                changed,
                _cell(launch, "wall_s", ".2f"),
                _cell(launch, "cpu_s", ".2f"),
                tasks,
                _num(s.get("build_s"), ".1f"),
            ]
        )
    lines += [*_table(head, rows), ""]
    for s in sizes:
        if s.get("error"):
            lines.append(f"- {s['hosts']} hosts: {s['error']}")
        for step, run in (s.get("runs") or {}).items():
            if run["failed"]:
                lines.append(f"- {s['hosts']} hosts, {STEP_TITLES[step]}: failed (rc {run['rc']}); log {run['log']}")
        for step, run in (s.get("runs") or {}).items():
            if (built := wheel_builds(run)) is not None:
                lines.append(
                    f"- {s['hosts']} hosts, {STEP_TITLES[step]}: the controller built meshccl's wheel ({built:.1f} s; "
                    "its cache was cold): this figure includes a build the other sizes may not"
                )
        again = (s.get("runs") or {}).get("setup_again")
        if again and again["changed_total"]:
            lines.append(
                f"- {s['hosts']} hosts, no-change run changed {again['changed_total']}: "
                + "; ".join(changed_tasks(again))
            )
    lines.append("")

    f = fits(data)
    lines += [
        "## Growth per added host",
        "",
        "Least-squares line over the sizes whose run succeeded: time = slope * hosts + intercept.",
        "",
    ]
    rows = []
    for step, what in MEASURES:
        fit = f[f"{step}.{what}"]
        rows.append(
            [
                measure_title(step, what),
                _num(fit and fit["slope"], ".3f"),
                _num(fit and fit["intercept"], ".2f"),
                _num(fit and fit["r2"], ".3f"),
                str(fit["n"]) if fit else "0",
            ]
        )
    lines += [*_table(["measure", "s per added host", "intercept (s)", "R²", "sizes"], rows), ""]

    if sizes:
        big = max(sizes, key=lambda s: s["hosts"])
        lines += [f"## The 15 slowest tasks at {big['hosts']} hosts", ""]
        lines += [
            "Time = from the task's start to the last host's result; per host = from the host's worker being "
            "queued to its result (max and median over the hosts that ran it).",
            "",
        ]
        for step in STEPS:
            run = (big.get("runs") or {}).get(step)
            if not run:
                continue
            if not run.get("timing"):
                lines += [f"### {STEP_TITLES[step]}: no per-task timing (the run wrote none; log {run['log']})", ""]
                continue
            between = run["wall_s"] - run["in_tasks_s"]
            lines += [
                f"### {STEP_TITLES[step]}: {run['wall_s']:.1f} s, {run['tasks_run']} tasks, "
                f"{run['host_results']} host results; {run['in_tasks_s']:.1f} s inside tasks, {between:.1f} s "
                "outside them (start-up, between tasks, the recap)",
                "",
            ]
            rows = [
                [
                    r["name"].replace("|", "\\|"),
                    f"`{r['where']}`",
                    f"{r['seconds']:.2f}",
                    str(r["hosts"]),
                    _num(r["host_max_s"], ".2f"),
                    _num(r["host_median_s"], ".2f"),
                    ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items())),
                ]
                for r in slowest(run)
            ]
            head = ["task", "where", "time (s)", "hosts", "per host max (s)", "per host median (s)", "results"]
            lines += [*_table(head, rows, left=(0, 1, 6)), ""]
    if compare:
        lines += compare_section(*compare)
    return "\n".join(lines) + "\n"


def compare_section(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """bench/reference/scale-before.json and scale-after.json side by side."""
    out = [
        f"## Reference runs side by side: {before.get('label')} ({before.get('date', '')}) and "
        f"{after.get('label')} ({after.get('date', '')})",
        "",
    ]
    common = sorted(
        {s["hosts"] for s in before.get("sizes_run") or []} & {s["hosts"] for s in after.get("sizes_run") or []}
    )
    rows = []
    for step, what in MEASURES:
        b = dict(points(before, step, what))
        a = dict(points(after, step, what))
        for n in common:
            if n in b and n in a:
                rows.append([measure_title(step, what), str(n), f"{b[n]:.2f}", f"{a[n]:.2f}", f"{a[n] / b[n]:.2f}"])
    head = ["measure", "hosts", f"{before.get('label')} (s)", f"{after.get('label')} (s)", "after ÷ before"]
    out += [*_table(head, rows), ""]
    fb, fa = fits(before), fits(after)
    rows = []
    for step, what in MEASURES:
        key = f"{step}.{what}"
        sb = fb[key]["slope"] if fb[key] else None
        sa = fa[key]["slope"] if fa[key] else None
        ratio = _num(sa / sb, ".2f") if sa is not None and sb else "—"
        rows.append([measure_title(step, what), _num(sb, ".3f"), _num(sa, ".3f"), ratio])
    out += ["Growth per added host (s per host):", ""]
    out += [*_table(["measure", str(before.get("label")), str(after.get("label")), "after ÷ before"], rows), ""]
    return out


def plot(data: dict[str, Any], path: Path) -> str:
    """Time against hosts, wall (left) and controller CPU (right), with the fitted lines; '' or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e}); pip install -r bench/requirements.txt"
    f = fits(data)
    if not any(points(data, step, what) for step, what in MEASURES):
        return "nothing to plot"
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    colours = dict(zip(STEPS, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    for ax, what, title in zip(
        axes, ("wall_s", "cpu_s"), ("wall time", "controller CPU (ansible-playbook, user + sys)"), strict=True
    ):
        for step in STEPS:
            pts = points(data, step, what)
            if not pts:
                continue
            label = STEP_TITLES[step]
            fit = f[f"{step}.{what}"]
            if fit:
                label += f" ({fit['slope']:+.2f} s/host)"
                xs = [min(x for x, _ in pts), max(x for x, _ in pts)]
                ax.plot(xs, [fit["slope"] * x + fit["intercept"] for x in xs], color=colours[step], linestyle="--")
            ax.plot(
                [x for x, _ in pts], [y for _, y in pts], marker="o", linestyle="", color=colours[step], label=label
            )
        ax.set_xlabel("hosts (lab ring)")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.set_xticks(sorted({s["hosts"] for s in data.get("sizes_run") or []}))
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"meshkit setup.yml and launch.yml against cluster size ({data.get('label')}); dashed: least squares")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""


def reference_pair() -> tuple[dict[str, Any], dict[str, Any]] | None:
    ref = BENCH / "reference"
    before, after = ref / "scale-before.json", ref / "scale-after.json"
    if before.exists() and after.exists():
        return json.loads(before.read_text()), json.loads(after.read_text())
    return None


def write_report(data: dict[str, Any], json_path: Path, *, write_data: bool = True, echo: bool = False) -> list[Path]:
    """<stem>.json (unless only rebuilding), <stem>.md and <stem>.png beside each other."""
    data["fits"] = fits(data)
    md, png = json_path.with_suffix(".md"), json_path.with_suffix(".png")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    if write_data:
        # Compact: every task of every host of every run (about 1 MB for 4-32 hosts); scale.md is the readable view.
        json_path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    text = markdown(data, reference_pair())
    md.write_text(text)
    if echo:
        print(text)
    why = plot(data, png)
    if why:
        say(f"no plot: {why}")
        return [json_path, md]
    return [json_path, md, png]


# --- the run ------------------------------------------------------------------------------------------


def machine(tree: Path = REPO) -> dict[str, Any]:
    """This machine and the measured checkout (its commit)."""
    from ansible.release import __version__ as ansible_core

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=False).stdout

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return {
        "cpus": os.cpu_count(),
        "load_start": load,
        "ansible_core": ansible_core,
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip()),
        "kernel": os.uname().release,
    }


def forks(tree: Path = REPO) -> str:
    proc = subprocess.run(
        ["ansible-config", "dump", "--only-changed", "--format", "json"],
        capture_output=True,
        text=True,
        env=ansible_env(tree),
        cwd=tree,
        check=False,
    )
    try:
        for entry in json.loads(proc.stdout):
            if entry.get("name") == "DEFAULT_FORKS":
                return str(entry.get("value"))
    except ValueError:
        pass
    return "5 (ansible's default)"


def measure_size(n: int, args: argparse.Namespace, logs: Path, keep: bool) -> dict[str, Any]:
    name = f"{args.name_prefix}{n}"
    record: dict[str, Any] = {"hosts": n, "lab": name, "runs": {}}
    if used := name_in_use(name):
        raise ScaleError(
            f"lab name {name} is in use here ({'; '.join(used)}): remove that lab (ansible-playbook playbooks/lab.yml "
            f"-e lab_name={name} -e lab_mgmt_subnet=<its subnet> -e lab_state=absent) or pick --name-prefix"
        )
    subnet = claim_subnet(args.subnet)
    record["subnet"] = subnet
    lab = ScaleLab(name, "ring", n, "", subnet, logs / f"{n}hosts-lab.log", args.tree / "artifacts" / f"lab-{name}")
    lab.tree = args.tree
    artifacts: Path | None = None
    try:
        say(f"[{n} hosts] building lab {name} (ring, subnet {subnet}; log {_rel(lab.log)}) ...")
        record["build_s"] = round(lab.build(args.timeout).wall_s, 2)
        say(f"[{n} hosts]   built in {record['build_s']:.1f} s")
        hosts = lab.cluster_hosts()
        if len(hosts) != n:
            raise ScaleError(f"lab {name} has {len(hosts)} cluster hosts, not {n}: {lab.inventory}")
        artifacts = lab.artifacts_dir()
        inv = str(lab.inventory)
        launch_vars = {
            "launch_program": ["true"],
            "launch_runtime": "plain",
            "launch_ranks_per_host": args.ranks_per_host,
            "launch_timeout": 300,
        }
        commands = {
            "setup_first": ["ansible-playbook", "-i", inv, "playbooks/setup.yml"],
            "setup_again": ["ansible-playbook", "-i", inv, "playbooks/setup.yml"],
            "launch": ["ansible-playbook", "-i", inv, "playbooks/launch.yml", "-e", json.dumps(launch_vars)],
        }
        for step, argv in commands.items():
            if step != "setup_first" and record["runs"]["setup_first"]["failed"]:
                say(f"[{n} hosts] {STEP_TITLES[step]}: not run (the first setup.yml run failed)")
                continue
            say(f"[{n} hosts] {STEP_TITLES[step]} ...")
            run = run_playbook(Run(step, argv, logs / f"{n}hosts-{step}.log", logs / f"{n}hosts-{step}.timing.json",
                                   tree=args.tree), args.timeout)  # fmt: skip
            result = record["runs"][step] = run.to_json()
            state = "ok" if not result["failed"] else f"FAILED rc {result['rc']} (log {result['log']})"
            say(
                f"[{n} hosts]   {result['wall_s']:.1f} s, controller CPU {result['cpu_s']:.1f} s, "
                f"{result['tasks_run']} tasks, changed={result['changed_total']}: {state}"
            )
    except (LabError, ScaleError, OSError, subprocess.SubprocessError, KeyError, ValueError) as e:
        record["error"] = str(e)
        say(f"[{n} hosts] failed: {e}")
    finally:
        if keep and lab.built:
            say(
                f"[{n} hosts] lab {name} left up (--keep-lab): "
                f"ansible -i {_rel(lab.inventory)} all -m ansible.builtin.ping; "
                f"remove it with: ansible-playbook playbooks/lab.yml -e lab_name={name} -e lab_mgmt_subnet={subnet} "
                "-e lab_state=absent"
            )
        else:
            teardown(lab, record, artifacts)
        release(subnet)
    return record


def teardown(lab: ScaleLab, record: dict[str, Any], artifacts: Path | None) -> None:
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        if lab.built:
            say(f"[{lab.size} hosts] removing lab {lab.name} ...")
            t0 = time.monotonic()
            try:
                lab.down()
                record["teardown_s"] = round(time.monotonic() - t0, 2)
                say(f"[{lab.size} hosts]   removed in {record['teardown_s']:.1f} s")
            except LabError as e:
                record["teardown_error"] = str(e)
                say(
                    f"REMOVING THE LAB FAILED: {e}\n  remove it with: ansible-playbook playbooks/lab.yml "
                    f"-e lab_name={lab.name} -e lab_mgmt_subnet={lab.subnet} -e lab_state=absent"
                )
        if artifacts is not None and artifacts.is_dir() and artifacts.is_relative_to(lab.tree / "artifacts"):
            shutil.rmtree(artifacts, ignore_errors=True)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma list of host counts like 4,8,16,32") from None
    if not sizes or any(not 2 <= n <= 64 for n in sizes):
        raise argparse.ArgumentTypeError(f"host counts must be 2-64 (the lab's range), not '{text}'")
    return sorted(set(sizes))


def run_bench(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        say("the lab needs root (network namespaces, one sshd per host)")
        return 2
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", args.name_prefix):
        say(f"--name-prefix {args.name_prefix!r}: 1-8 lowercase letters and digits, a letter first")
        return 2
    out: Path = args.out
    logs = out / "logs" / f"scale-{args.label}"
    logs.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "label": args.label,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "sizes": args.sizes,
        "params": {
            "shape": "ring",
            "ranks_per_host": args.ranks_per_host,
            "forks": forks(args.tree),
            "timeout": args.timeout,
        },
        "machine": machine(args.tree),
        "sizes_run": [],
    }
    json_path = out / "scale.json"
    started = time.monotonic()
    rc = 0
    try:
        with terminate_as_interrupt():
            for i, n in enumerate(args.sizes):
                keep = args.keep_lab and i == len(args.sizes) - 1
                record = measure_size(n, args, logs, keep)
                data["sizes_run"].append(record)
                if record.get("error") or any(r["failed"] for r in record["runs"].values()):
                    rc = 1
                data["machine"]["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
                write_report(data, json_path)  # what is finished so far, in case a later size dies
    except KeyboardInterrupt:
        say("interrupted: the lab is removed and the sizes finished so far are written")
        data["interrupted"] = True
        rc = 130
    except ScaleError as e:
        say(f"refused: {e}")
        data["error"] = str(e)
        rc = 2
    data["duration_s"] = round(time.monotonic() - started, 1)
    data["machine"]["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    written = write_report(data, json_path, echo=True)
    if args.reference:
        ref = BENCH / "reference"
        ref.mkdir(exist_ok=True)
        for path in list(written):
            target = ref / f"scale-{args.label}{path.suffix}"
            shutil.copyfile(path, target)
            written.append(target)
    say(f"wrote {', '.join(_rel(p) for p in written)}; logs in {_rel(logs)}; took {data['duration_s']:.0f} s")
    return rc


def run_report(args: argparse.Namespace) -> int:
    path: Path = args.json
    if not path.exists():
        say(f"{path}: no such file (run bench/scale.py first, or give --json)")
        return 2
    data = json.loads(path.read_text())
    written = write_report(data, path, write_data=False, echo=True)
    say(f"wrote {', '.join(_rel(p) for p in written[1:])} from {_rel(path)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        rp = argparse.ArgumentParser(prog="scale.py report", description="md and png again from a scale JSON")
        rp.add_argument(
            "--json", type=Path, default=BENCH / "results" / "scale.json", help="(bench/results/scale.json)"
        )
        return run_report(rp.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=parse_sizes, default=[4, 8, 16, 32], help="hosts per lab ring (4,8,16,32)")
    ap.add_argument("--label", default="run", help="names the run in the JSON, the table title and --reference")
    ap.add_argument("--reference", action="store_true", help="also copy the results to bench/reference/scale-<label>.*")
    ap.add_argument("--keep-lab", action="store_true", help="leave the last size's lab up for a look")
    ap.add_argument("--ranks-per-host", type=int, default=2, help="launch.yml's ranks per host (2)")
    ap.add_argument("--name-prefix", default="sc", help="labs are named <prefix><hosts> (sc: sc4, sc8, ...)")
    ap.add_argument("--subnet", help="management /24 for every lab (default: a free one of 198.19.202-248.0/24)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before a playbook run is killed (3600)")
    ap.add_argument("--out", type=Path, default=BENCH / "results", help="output directory (bench/results)")
    ap.add_argument(
        "--tree",
        type=Path,
        default=REPO,
        help="the checkout whose setup.yml and launch.yml are measured (this one); labs: this one's",
    )
    args = ap.parse_args(argv)
    args.tree = args.tree.resolve()
    if not (args.tree / "playbooks" / "setup.yml").is_file():
        ap.error(f"--tree {args.tree}: no playbooks/setup.yml there (a meshkit checkout or worktree)")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", args.label):
        ap.error(f"--label {args.label!r}: letters, digits, '.', '_' or '-' (it names files)")
    args.out = args.out.resolve()
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
