# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""meshkit's command line: the collection's playbooks run through ansible-runner, and jobs.

  meshkit lab [--down] [-e VARS]                   a local emulated cluster (meshkit.cluster.lab)
  meshkit setup -i INVENTORY [ansible options]     converge the cluster (meshkit.cluster.setup)
  meshkit launch -i INVENTORY [options] -- PROGRAM [ARGS...]
  meshkit check -i INVENTORY [--quick] [options]   measure every cable and the cluster (meshkit/check.py)

The playbooks are the collection's (meshkit.cluster.setup and friends) from the same install as
this command; Ansible's configuration is the usual (ANSIBLE_CONFIG, ./ansible.cfg, ~/.ansible.cfg)
and relative paths are the current directory's, as for ansible-playbook itself.

meshkit launch:

Plans and checks the job as launch.yml does (it runs launch.yml through ansible-runner, up to and
including the preflight) and remembers what it planned from. The next launch on the same inventory
skips Ansible: it plans from what it remembered and has every host check, in one round trip, that
the cabling, hostfiles, meshccl build and preflight still hold; anything changed sends it through
launch.yml again (so does --recheck). Then it starts every rank itself: their output streams here
prefixed ``[rank|host]``, and what you type (or pipe in) reaches every rank's stdin, so a
``breakpoint()`` in every rank can be driven from one terminal. The first rank that fails stops
every rank on every host; so does a host not heard from for --host-timeout seconds (a network
partition), which the launch names. The exit status is the failed rank's exit code (1 for a lost
host, 124 on the timeout, 130 on Ctrl-C, 2 when the job never started).

Every rank gets MESHCCL_TOKEN, a fresh job token, and MESHCCL_JOB_ID. A -x variable whose name holds
TOKEN, KEY, SECRET or PASSWORD, or that --secret names, is a secret: its value goes from this
command to the ranks only (never to Ansible, a command line, job.json, the logs or the summary,
which show <hidden>).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from meshkit import check, launch_connection, launch_fast, launch_slurm
from meshkit.collection import collection_root, runner_env
from meshkit.launch_mpi import Lines, MpiError, explain, hosts_for
from meshkit.launch_plan import ENV_NAME, HIDDEN, LaunchError, is_secret, secret_values
from meshkit.launcher import Launcher, Terminal


def host_timeout(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 1 <= seconds <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds from 1 to 3600")
    return seconds


def parse_env(text: str) -> tuple[str, str]:
    """-x NAME=VALUE, or -x NAME: the value of NAME in this command's own environment (as mpirun's
    -x takes it), which keeps a secret off every command line."""
    if "=" in text:
        name, value = text.split("=", 1)
        return name, value
    if not re.match(ENV_NAME, text):
        # Not repeated: the text may be a secret given without its name.
        raise argparse.ArgumentTypeError("give NAME=VALUE, or NAME of a variable set here")
    if text not in os.environ:
        raise argparse.ArgumentTypeError(f"{text} is not set in this environment; give {text}=VALUE or export it")
    return text, os.environ[text]


def env_name(text: str) -> str:
    if not re.match(ENV_NAME, text):
        raise argparse.ArgumentTypeError(f"{text!r}: give an environment variable's name")
    return text


def public_env(args: argparse.Namespace) -> dict[str, str]:
    """The -x variables as Ansible may see them: every secret's value replaced by <hidden> (the
    name stays, so the plan lists it; this command puts the value in when the ranks start)."""
    return {name: (HIDDEN if is_secret(name, args.secret) else value) for name, value in args.env}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshkit", description="meshkit: provision and run jobs on a cabled cluster")
    sub = p.add_subparsers(dest="command", required=True)
    lab = sub.add_parser("lab", help="build (or --down: remove) a local emulated cluster (meshkit.cluster.lab; root)")
    lab.add_argument("--down", action="store_true", help="remove the lab and everything it made")
    lab.add_argument(
        "-e", "--extra-vars", action="append", default=[], metavar="VARS",
        help="lab variables (lab_size, lab_shape, lab_name, ...), as ansible-playbook -e takes them",
    )  # fmt: skip
    setup = sub.add_parser(
        "setup",
        help="converge the cluster of an inventory (meshkit.cluster.setup)",
        description="Runs meshkit.cluster.setup on the inventory; every other option is ansible-playbook's "
        "(--check, --diff, --tags, --limit, -e VARS, -v).",
    )
    setup.add_argument("-i", "--inventory", required=True, help="the cluster's inventory")
    launch = sub.add_parser(
        "launch",
        help="start a program on every host of an inventory, supervised, output streamed, stdin broadcast",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument("-i", "--inventory", required=True, help="the inventory setup.yml converged")
    launch.add_argument("-r", "--runtime", choices=["meshccl", "mlx", "torch", "mpi", "plain"], default="meshccl")
    launch.add_argument("-n", "--ranks-per-host", type=int, help="ranks on each host (default: the inventory's)")
    launch.add_argument("-x", "--env", type=parse_env, action="append", default=[], metavar="NAME[=VALUE]",
                        help="an environment variable for every rank (repeatable); NAME alone: its value here. "
                        "A name holding TOKEN, KEY, SECRET or PASSWORD makes it a secret, shown nowhere")  # fmt: skip
    launch.add_argument("--secret", type=env_name, action="append", default=[], metavar="NAME",
                        help="the -x variable NAME is a secret too, whatever its name (repeatable)")  # fmt: skip
    launch.add_argument("-t", "--timeout", type=float, default=0, help="stop every rank after this many seconds")
    launch.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL (3)")
    launch.add_argument("--host-timeout", type=host_timeout, default=launch_connection.DEFAULT_HOST_TIMEOUT,
                        metavar="SECONDS",
                        help="a host not heard from for this long (a partition) is lost: every other rank is "
                        f"stopped and the launch fails naming it; its own ranks stop when its supervisor has not "
                        f"heard from here for as long ({launch_connection.DEFAULT_HOST_TIMEOUT:g})")  # fmt: skip
    launch.add_argument("--scheduler", choices=["meshkit", "slurm"], default="meshkit",
                        help="who starts the ranks: meshkit's own supervisor on every host (default), or Slurm "
                        "(one srun on --submit-host; the cluster set up with meshkit_slurm: true)")  # fmt: skip
    launch.add_argument("--submit-host", metavar="HOST",
                        help="--scheduler slurm: the host srun runs on (default: rank 0's host)")  # fmt: skip
    launch.add_argument("--partition", help="--scheduler slurm: the Slurm partition (default: Slurm's default)")
    launch.add_argument("--batch", action="store_true",
                        help="--scheduler slurm: submit with sbatch and return once Slurm has queued the job (its "
                        "output goes to a file on rank 0's host, named here)")  # fmt: skip
    launch.add_argument("--cwd", help="the ranks' working directory (absolute, on every host)")
    launch.add_argument("--no-stdin", action="store_true", help="give the ranks no stdin (/dev/null)")
    launch.add_argument("-q", "--quiet", action="store_true", help="show only the summary (the logs keep everything)")
    launch.add_argument("--recheck", action="store_true",
                        help="run every check of launch.yml (discovery too) even when nothing seems "
                        "changed")  # fmt: skip
    launch.add_argument("-e", "--extra-vars", action="append", default=[], metavar="VARS",
                        help="more variables for launch.yml, as ansible-playbook -e takes them")  # fmt: skip
    launch.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]")
    check.add_parser(sub)
    return p


def prepare(args: argparse.Namespace, program: list[str], job_file: Path, private: Path) -> tuple[int, list[str]]:
    """Run launch.yml up to the start: the plan, the checks, every host's connection."""
    import ansible_runner

    extravars = {
        "launch_program": program,
        "launch_runtime": args.runtime,
        "launch_env": public_env(args),  # secrets' values stay here (see launch())
        "launch_secret_env": list(args.secret),
        "launch_timeout": args.timeout,
        "launch_grace": args.grace,
        "launch_host_timeout": args.host_timeout,
        "launch_prepare_to": str(job_file),
    }
    if args.ranks_per_host is not None:
        extravars["launch_ranks_per_host"] = args.ranks_per_host
    if args.cwd:
        extravars["launch_cwd"] = args.cwd
    envvars = {**runner_env(), "ANSIBLE_NOCOLOR": "1"}
    failures: list[str] = []

    def on_event(event: dict) -> bool:
        name = event.get("event")
        data = event.get("event_data", {})
        if name == "playbook_on_task_start" and not args.quiet:
            print(f"{label(args)}: {data.get('task')}", file=sys.stderr, flush=True)
        elif name in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors"):
            res = data.get("res", {})
            failures.append(f"{data.get('host')}: {res.get('msg') or res.get('stderr') or res}")
        return True

    cmdline = " ".join(f"-e {json.dumps(v) if not v.startswith('@') else v}" for v in args.extra_vars) or None
    # ansible-runner records the environment it runs Ansible with (<private>/artifacts/*/command):
    # a secret -x took from this environment (-x NAME) is not in it. Ansible has no use for it.
    with environment_without([name for name, _ in args.env if is_secret(name, args.secret)]):
        run = ansible_runner.run(
            private_data_dir=str(private),
            playbook="meshkit.cluster.launch",
            inventory=str(Path(args.inventory).resolve()),
            extravars=extravars,
            envvars=envvars,
            cmdline=cmdline,
            quiet=True,
            event_handler=on_event,
            project_dir=os.getcwd(),  # relative paths (artifacts, ansible.cfg) are the caller's
        )
    return run.rc, failures


@contextlib.contextmanager
def environment_without(names: list[str]) -> Iterator[None]:
    """This process's environment without ``names`` for the duration, then as it was."""
    kept = {name: os.environ.pop(name) for name in dict.fromkeys(names) if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(kept)


def cache_file(args: argparse.Namespace) -> tuple[Path, str]:
    """Where this inventory's remembered context is kept (~/.cache/meshkit/launch, or $MESHKIT_LAUNCH_CACHE),
    and the key it must match."""
    inventory = Path(args.inventory)
    cfg = runner_env().get("ANSIBLE_CONFIG")
    key = launch_fast.cache_key(inventory, args.runtime, collection_root(), Path(cfg) if cfg else None)
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    where = Path(os.environ.get("MESHKIT_LAUNCH_CACHE") or cache_home / "meshkit" / "launch")
    return launch_fast.cache_path(where, inventory, args.runtime), key


def label(args: argparse.Namespace) -> str:
    return getattr(args, "label", None) or "meshkit launch"


def quick(args: argparse.Namespace, program: list[str], problems: list[str] | None = None) -> dict | None:
    """The job planned from the remembered context and checked on every host; {} when the full
    launch must run instead; None when the job must not start (said why, and added to ``problems``)."""
    if args.recheck or args.extra_vars:
        return {}
    settings = {
        "program": program,
        "runtime": args.runtime,
        "ranks_per_host": args.ranks_per_host,
        "env": dict(args.env),  # planned with every secret's value hidden (launch_plan.build)
        "secret_env": list(args.secret),
        "timeout": args.timeout,
        "grace": args.grace,
        "host_timeout": args.host_timeout,
        "cwd": args.cwd,
    }
    try:
        path, key = cache_file(args)
        record = launch_fast.load(path, key)
        job, connections = launch_fast.prepare(record, settings, on_event=lambda text: say(args, text))
    except launch_fast.Stale as exc:
        print(f"{label(args)}: {exc}; running every check (launch.yml)", file=sys.stderr, flush=True)
        return {}
    except launch_fast.Refused as exc:
        print(f"{label(args)}: {exc}", file=sys.stderr)
        if problems is not None:
            problems.append(str(exc))
        return None
    except (KeyError, TypeError, ValueError, AttributeError, OSError) as exc:  # a record of another shape
        print(f"{label(args)}: the remembered checks are unusable ({exc!r}); running every check (launch.yml)",
              file=sys.stderr)  # fmt: skip
        return {}
    return {"job": job, "connections": connections, "context": record["context"]}


def full(args: argparse.Namespace, program: list[str], problems: list[str] | None = None) -> dict | None:
    """launch.yml up to the start; what it planned from is remembered for the next launch. None when
    the job must not start (said why, and added to ``problems``)."""
    try:
        path, key = cache_file(args)
    except (launch_fast.Stale, OSError):
        path = key = None  # a dynamic inventory, or files it cannot read: nothing to remember
    with tempfile.TemporaryDirectory(prefix="meshkit-launch-") as tmp:
        job_file = Path(tmp) / "job.json"
        (Path(tmp) / "runner").mkdir()
        rc, failures = prepare(args, program, job_file, Path(tmp) / "runner")
        if rc != 0 or not job_file.exists():
            print(f"{label(args)}: the job was not started:", file=sys.stderr)
            for line in failures or [f"launch.yml exited with {rc}"]:
                print(f"  {line}", file=sys.stderr)
            if problems is not None:
                problems.extend(failures or [f"launch.yml exited with {rc}"])
            return None
        prepared = json.loads(job_file.read_text())
    if path is not None and prepared.get("context") and not args.extra_vars:
        try:
            launch_fast.save(path, key, prepared["context"], prepared["connections"])
        except OSError as exc:
            print(f"{label(args)}: cannot remember the checks in {path} ({exc}); the next run checks all again",
                  file=sys.stderr)  # fmt: skip
    return prepared


def say(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        print(f"{label(args)}: {text}", file=sys.stderr, flush=True)


def launch(args: argparse.Namespace) -> int:
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        print("meshkit launch: give the program to run after --, e.g. meshkit launch -i inv.yml -- python3 x.py",
              file=sys.stderr)  # fmt: skip
        return 2
    slurm = getattr(args, "scheduler", "meshkit") == "slurm"
    if args.batch and not slurm:
        print("meshkit launch: --batch submits to Slurm: give --scheduler slurm too", file=sys.stderr)
        return 2
    if slurm and args.runtime not in launch_slurm.RUNTIMES:
        print(f"meshkit launch: --scheduler slurm runs {', '.join(launch_slurm.RUNTIMES)} jobs so far, not "
              f"{args.runtime}; launch it without --scheduler (meshkit's own launcher)", file=sys.stderr)  # fmt: skip
        return 2
    prepared = quick(args, program)
    if prepared is None:
        return 2
    if not prepared:
        prepared = full(args, program)
        if prepared is None:
            return 2
    job, connections = prepared["job"], prepared["connections"]
    try:
        # The job token, and the values of the -x secrets the plan holds as <hidden>.
        values = secret_values(job, dict(args.env))
    except LaunchError as exc:
        print(f"meshkit launch: {exc}", file=sys.stderr)
        return 2
    mode = os.fstat(sys.stdin.fileno()).st_mode if not sys.stdin.closed else 0
    broadcast = (
        not args.no_stdin
        and not getattr(args, "batch", False)
        and (stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or sys.stdin.isatty())
    )

    def write(text: str, event: bool) -> None:
        # In the terminal's own thread: a paused pager blocks it, never the launcher.
        stream = sys.stderr if event else sys.stdout
        stream.write(f"meshkit launch: {text}\n" if event else f"{text}\n")
        stream.flush()

    via = ""
    if slurm:
        submit = launch_slurm.submit_host_of(job, args.submit_host)
        via = f" through Slurm ({'sbatch' if args.batch else 'srun'} on {submit})"
    print(
        f"meshkit launch: job {job['job_id']}: {job['world_size']} ranks of {job['runtime']} on "
        f"{len(connections)} hosts{via}{'; stdin goes to every rank' if broadcast else ''}",
        file=sys.stderr,
        flush=True,
    )
    log_dir = Path(job.get("log_dir") or Path(tempfile.gettempdir()) / "meshkit-launch" / job["job_id"])
    try:
        if slurm:
            hosts = launch_slurm.hosts_for(
                job,
                connections,
                values,
                submit_host=args.submit_host,
                host_timeout=args.host_timeout,
                partition=args.partition,
                batch=args.batch,
            )
        else:
            hosts = hosts_for(job, connections, values, log_dir, args.host_timeout)
    except (MpiError, launch_slurm.SlurmError) as exc:
        print(f"meshkit launch: {exc}; the job was not started", file=sys.stderr)
        return 2
    terminal = Terminal(write, lines=not args.quiet, log=str(log_dir / "output.log"))
    try:
        result = Launcher(
            hosts,
            job["job_id"],
            log_dir,
            timeout=float(job.get("timeout") or 0) or None,
            grace=float(job.get("grace", 3.0)),
            stdin=sys.stdin if broadcast else None,
            partial_flush=0.1,
            host_timeout=args.host_timeout,
            lines=launch_slurm.Lines(job) if slurm else Lines(job),
            terminal=terminal,
        ).run()
    finally:
        terminal.close()  # what the terminal has not taken yet (this may wait for a paused pager)
    for line in result.table():
        print(f"  {line}", file=sys.stderr)
    if slurm and args.batch and result.ok:
        number, message = launch_slurm.submitted(job, result)
        print(f"meshkit launch: {message}", file=sys.stderr)
        if number is None:
            return 1
        print(number)
        return 0
    why = launch_slurm.explain if slurm else explain
    reason, failures = why(job, result) if not result.ok else (result.reason, [])
    for heading, tail in failures[:1] if not result.reason.startswith("interrupted") else []:
        print(f"meshkit launch: {heading}; last lines:", file=sys.stderr)
        for line in tail or ["(no output)"]:
            print(f"    {line}", file=sys.stderr)
    print(f"meshkit launch: {reason}; logs in {result.log_dir}", file=sys.stderr)
    if result.ok:
        return 0
    if result.reason.startswith("interrupted"):
        return 130
    failed = result.failed
    code = launch_slurm.exit_code(job, result) if slurm else None
    if code:
        return min(code, 255)
    if failed and failed[0].code:
        return min(int(failed[0].code), 255)
    if any(r.state == "timeout" for r in result.ranks):
        return 124
    return 1


def playbook(name: str, inventory: str | None, cmdline: list[str], extravars: dict | None = None) -> int:
    """Run one of the collection's playbooks, its output shown as ansible-playbook shows it."""
    import ansible_runner

    with tempfile.TemporaryDirectory(prefix=f"meshkit-{name}-") as tmp:
        run = ansible_runner.run(
            private_data_dir=tmp,
            playbook=f"meshkit.cluster.{name}",
            inventory=str(Path(inventory).resolve()) if inventory else None,
            extravars=extravars or {},
            envvars=runner_env(),
            cmdline=" ".join(shlex.quote(a) for a in cmdline) or None,
            project_dir=os.getcwd(),
        )
    return run.rc


def extra_vars(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("-e", value)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, unknown = parser().parse_known_args(argv)
    if unknown and args.command != "setup":
        parser().parse_args(argv)  # says what it does not know, and exits 2
    if args.command == "setup":
        # Whatever argparse did not take is ansible-playbook's (--check, --diff, -e VARS, --limit, ...).
        args.playbook_args = unknown
    if args.command == "lab":
        # The lab's files (.lab/<name>, inventory/<name>.yml) go under the current directory.
        state = {"lab_base": os.getcwd(), **({"lab_state": "absent"} if args.down else {})}
        return playbook("lab", None, extra_vars(args.extra_vars), state)
    if args.command == "setup":
        return playbook("setup", args.inventory, [a for a in args.playbook_args if a != "--"])
    if args.command == "launch":
        try:
            return launch(args)
        except KeyboardInterrupt:  # outside the launcher's own handling (planning, a paused terminal at the end)
            return 130
    if args.command == "check":
        try:
            return check.run(args)
        except KeyboardInterrupt:
            return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
