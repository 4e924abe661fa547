#!/usr/bin/env python3
"""Start-up time of a job on the lab: meshkit's launchers side by side with mpirun.

A trivial program (each rank prints the wall clock, then sleeps a second) is started on every
host of a converged lab, N ranks per host. "Start to all running" is from the moment the command
is run to the latest first line of any rank (the lab's hosts share this machine's clock). Every
variant runs --rounds times, interleaved; the table gives the median, min and max.

  .venv/bin/python bench/launch.py -i inventory/lab.yml          # the lab `make demo` left up
  .venv/bin/python bench/launch.py -i inventory/lab.yml -r 7 -n 2

Variants:
  meshkit launch      meshkit launch -r plain, as run again and again: it plans from what its
                      last full check remembered and every host checks, in one round trip, that
                      it still holds (cables, hostfiles, preflight); then the launcher. Primed by
                      one run before the rounds, in a cache of the benchmark's own.
  meshkit launch --recheck
                      the same with every check of launch.yml (discovery, staleness, preflight)
                      through ansible-runner: what a first launch, or a changed cluster, costs
  launch.yml          ansible-playbook launch.yml, those checks, then the launcher
  host checks         the hosts' check round of `meshkit launch`, as it reports it
  launcher only       the launcher stage of `meshkit launch` as it reports it (agents started to
                      every rank started), without the checks before it
  mpirun (ssh)        Open MPI 4.1 as usually run: mpirun --hostfile <management addresses> with
                      ssh and the inventory's key and known_hosts; daemons tree-spawn host to host
  mpirun (meshkit)    launch.yml's MPI path: mpirun with meshkit's remote shell agent (the
                      inventory's connection, no tree spawn), without the checks

A benchmark, not a test: it asserts nothing about time. Results: bench/results/launch.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshkit import launch_connection

REPO = Path(__file__).resolve().parents[1]

PROGRAM = ["sh", "-c", 'echo "MKSTART $(date +%s.%N)"; sleep 1']
STARTED = re.compile(r"MKSTART (\d+\.\d+)")


CACHE: Path | None = None  # the benchmark's own remembered checks (MESHKIT_LAUNCH_CACHE)


def env() -> dict[str, str]:
    out = dict(os.environ)
    if CACHE is not None:
        out["MESHKIT_LAUNCH_CACHE"] = str(CACHE)
    out["PATH"] = f"{Path(sys.executable).parent}:{out.get('PATH', '')}"
    out.setdefault("ANSIBLE_CONFIG", str(REPO / "ansible.cfg"))
    out.setdefault("ANSIBLE_HOME", str(REPO / ".cache" / "ansible-home"))
    return out


def hostvars(inventory: str) -> dict[str, dict]:
    proc = subprocess.run(
        ["ansible-inventory", "-i", inventory, "--list"], capture_output=True, text=True, check=True, env=env()
    )
    data = json.loads(proc.stdout)
    hosts = data.get("cluster", {}).get("hosts") or sorted(data["_meta"]["hostvars"])
    return {h: data["_meta"]["hostvars"][h] for h in hosts}


def timed(argv: list[str], world: int, log: Path) -> tuple[float | None, str]:
    """(seconds from start to the last rank's first line, output)."""
    t0 = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env(), stdin=subprocess.DEVNULL, check=False)
    output = proc.stdout + proc.stderr
    log.write_text(" ".join(argv) + "\n" + output)
    stamps = [float(s) for s in STARTED.findall(output)]
    if proc.returncode != 0 or len(stamps) != world:
        print(f"  failed (exit {proc.returncode}, {len(stamps)}/{world} ranks started); see {log}", file=sys.stderr)
        return None, output
    return max(stamps) - t0, output


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-i", "--inventory", required=True, help="a lab inventory that setup.yml converged")
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("-n", "--ranks-per-host", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    global CACHE  # noqa: PLW0603 - set once, before anything runs

    hv = hostvars(args.inventory)
    hosts = list(hv)
    world = len(hosts) * args.ranks_per_host
    out = Path(args.out)
    logs = out / "logs" / "launch"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="meshkit-bench-launch-"))
    os.chmod(work, 0o700)
    CACHE = work / "cache"

    # Plain mpirun: the management addresses and ssh with the inventory's key and known_hosts.
    conns = {h: launch_connection.connection_for(h, hv[h]) for h in hosts}
    (work / "hostfile-ssh").write_text(
        "".join(f"{conns[h].get('host', h)} slots={args.ranks_per_host}\n" for h in hosts)
    )
    ssh = conns[hosts[0]]
    rsh_args = []
    if ssh.get("kind") == "ssh":
        rsh_args = [*(["-i", ssh["key"]] if ssh.get("key") else []), *(["-l", ssh["user"]] if ssh.get("user") else [])]
        extra = list(ssh.get("args") or [])
        for i in range(0, len(extra) - 1, 2):  # "-o X=y" pairs; meshkit's own ControlMaster left out
            if not (extra[i] == "-o" and extra[i + 1].startswith("Control")):
                rsh_args += extra[i : i + 2]
    # mpirun with meshkit's agent: the inventory's connection per host, no tree spawn.
    (work / "hostfile-meshkit").write_text("".join(f"{h} slots={args.ranks_per_host}\n" for h in hosts))
    (work / "connections.json").write_text(json.dumps(conns))
    agent = f"{sys.executable} {Path(launch_connection.__file__).resolve()} {work / 'connections.json'}"
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    mpirun = ["mpirun", *root, "-np", str(world), "-bind-to", "none", "-map-by", "slot"]

    meshkit = [
        str(Path(sys.executable).with_name("meshkit")),
        "launch",
        "-i",
        args.inventory,
        "-r",
        "plain",
        "-n",
        str(args.ranks_per_host),
        "--no-stdin",
    ]
    variants = {
        "meshkit launch": [*meshkit, "--", *PROGRAM],
        "meshkit launch --recheck": [*meshkit, "--recheck", "--", *PROGRAM],
        "launch.yml": [
            "ansible-playbook", "-i", args.inventory, str(REPO / "launch.yml"), "-e",
            json.dumps({"launch_program": PROGRAM, "launch_runtime": "plain",
                        "launch_ranks_per_host": args.ranks_per_host}),
        ],
        "mpirun (ssh)": [
            *mpirun, "--hostfile", str(work / "hostfile-ssh"),
            "-mca", "plm_rsh_agent", "ssh", "-mca", "plm_rsh_args", " ".join(rsh_args), *PROGRAM,
        ],
        "mpirun (meshkit)": [
            *mpirun, "--hostfile", str(work / "hostfile-meshkit"),
            "-mca", "plm_rsh_agent", agent, "-mca", "plm_rsh_no_tree_spawn", "1", *PROGRAM,
        ],
    }  # fmt: skip
    samples: dict[str, list[float]] = {name: [] for name in [*variants, "host checks", "launcher only"]}
    print("priming: one meshkit launch with every check, remembered for the rounds ...", file=sys.stderr)
    took, _ = timed(variants["meshkit launch"], world, logs / "prime.log")
    if took is None:
        return 1
    for rnd in range(args.rounds):
        for name, argv in variants.items():
            print(f"round {rnd + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
            took, output = timed(argv, world, logs / f"{name.replace(' ', '_').strip('()')}-{rnd}.log")
            if took is None:
                continue
            if name == "meshkit launch" and "running every check" in output:
                print("  went through launch.yml (the remembered checks did not hold); not counted", file=sys.stderr)
                continue
            samples[name].append(took)
            print(f"  {took:.2f} s", file=sys.stderr, flush=True)
            if name == "meshkit launch":
                m = re.search(r"checked \d+ hosts .* in (\d+\.\d+) s", output)
                if m:
                    samples["host checks"].append(float(m.group(1)))
                m = re.search(r"all \d+ ranks running after (\d+\.\d+) s", output)
                if m:
                    samples["launcher only"].append(float(m.group(1)))

    lines = [
        f"# Start to all ranks running: {len(hosts)} lab hosts x {args.ranks_per_host} ranks ({world}), "
        f"{args.rounds} rounds",
        "",
        "| variant | median (s) | min (s) | max (s) | runs |",
        "|---|---|---|---|---|",
    ]
    for name, values in samples.items():
        if values:
            lines.append(
                f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} | {len(values)} |"
            )
        else:
            lines.append(f"| {name} | failed | | | 0 |")
    target = samples["meshkit launch"]
    verdict = (
        f"target (meshkit launch median <= 3 s): {'met' if statistics.median(target) <= 3 else 'NOT met'} "
        f"({statistics.median(target):.2f} s)"
        if target
        else "target: no successful meshkit launch run"
    )
    lines += ["", verdict, ""]
    text = "\n".join(lines)
    print(text)
    (out / "launch.md").write_text(text)
    (out / "launch.json").write_text(json.dumps({"hosts": hosts, "ranks_per_host": args.ranks_per_host,
                                                  "samples": samples}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
