# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""meshkit's command line: the collection's playbooks run through ansible-runner, and jobs.

  meshkit lab [--down] [-e VARS]                   a local emulated cluster (meshkit.cluster.lab)
  meshkit setup -i INVENTORY [ansible options]     converge the cluster (meshkit.cluster.setup)
  meshkit launch -i INVENTORY [options] -- PROGRAM [ARGS...]
  meshkit check -i INVENTORY [--quick] [options]   measure every cable and the cluster (meshkit/check.py)
  meshkit watch enable|disable -i INVENTORY        the check on a schedule, for Prometheus (meshkit/watch.py)
  meshkit status -i INVENTORY [--html FILE]        the last checks, a table and a page (meshkit/status_page.py)

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
import os
import shlex
import stat
import sys
import tempfile
from pathlib import Path

from meshkit import check, launch_service, launch_settings, watch
from meshkit.collection import runner_env
from meshkit.launch_settings import FLAGGED, PLAN, SETTING, START, dest


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
        description="Runs meshkit.cluster.setup on the inventory (with --undo: meshkit.cluster.teardown); every "
        "other option is ansible-playbook's "
        "(--check, --diff, --tags, --limit, -e VARS, -v).",
    )
    setup.add_argument("-i", "--inventory", required=True, help="the cluster's inventory")
    setup.add_argument(
        "--undo",
        action="store_true",
        help="undo what setup did instead (meshkit.cluster.teardown): every host back as its record says",
    )
    launch = sub.add_parser(
        "launch",
        help="start a program on every host of an inventory, supervised, output streamed, stdin broadcast",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument("-i", "--inventory", required=True, help="the inventory setup.yml converged")
    launch_settings.add_flags(launch, FLAGGED)  # -r, -n, -x, --secret, -t, --grace, --host-timeout, ...
    launch.add_argument("--no-stdin", action="store_true", help="give the ranks no stdin (/dev/null)")
    launch.add_argument("--recheck", action="store_true",
                        help="run every check of launch.yml (discovery too) even when nothing seems "
                        "changed")  # fmt: skip
    launch.add_argument("-e", "--extra-vars", action="append", default=[], metavar="VARS",
                        help="more variables for launch.yml, as ansible-playbook -e takes them")  # fmt: skip
    launch.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]")
    check.add_parser(sub)
    watch.add_parser(sub)
    watch.add_status_parser(sub)
    return p


# --- meshkit launch: an adapter over launch_service (flags in, exit status and lines out) ---------


def flagged(args: argparse.Namespace, where: str) -> dict[str, object]:
    """The settings of the flags, by the table's names, of those given ``where`` (launch_settings)."""
    return {name: getattr(args, dest(SETTING[name])) for name in FLAGGED if where in SETTING[name].where}


def request(args: argparse.Namespace, program: list[str]) -> launch_service.Request:
    """The launch the flags ask for: the job's settings by the table's names (-x's values as given)."""
    settings = flagged(args, PLAN) | {"env": dict(args.env)}
    return launch_service.Request(
        args.inventory,
        {"program": program, **settings},
        recheck=args.recheck,
        extra_vars=list(args.extra_vars),
        quiet=args.quiet,
    )


def prepare(args: argparse.Namespace, program: list[str], job_file: Path, private: Path) -> tuple[int, list[str]]:
    """Run launch.yml up to the start: the plan, the checks, every host's connection."""
    return launch_service.playbook(request(args, program), job_file, private)


def quick(args: argparse.Namespace, program: list[str], problems: list[str] | None = None) -> dict | None:
    """launch_service.quick(): the remembered checks; {} for launch.yml instead; None: not started."""
    return launch_service.quick(request(args, program), problems)


def full(args: argparse.Namespace, program: list[str], problems: list[str] | None = None) -> dict | None:
    """launch_service.full(): launch.yml up to the start; None: not started."""
    return launch_service.full(request(args, program), problems)


def launch(args: argparse.Namespace) -> int:
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        print("meshkit launch: give the program to run after --, e.g. meshkit launch -i inv.yml -- python3 x.py",
              file=sys.stderr)  # fmt: skip
        return 2
    slurm = args.scheduler == "slurm"
    if args.batch and not slurm:
        print("meshkit launch: --batch submits to Slurm: give --scheduler slurm too", file=sys.stderr)
        return 2
    prepared = quick(args, program)
    if prepared is None:
        return 2
    if not prepared:
        prepared = full(args, program)
        if prepared is None:
            return 2
    job, connections = prepared["job"], prepared["connections"]
    log_dir = Path(job.get("log_dir") or Path(tempfile.gettempdir()) / "meshkit-launch" / job["job_id"])
    given = flagged(args, START) | {"timeout": None, "grace": None}  # the job's own (planned from -t, --grace)
    if not slurm:  # --submit-host and --partition mean nothing then
        given |= {name: None for name in given if SETTING[name].slurm}
    try:
        # The job token, and the values of the -x secrets the plan holds as <hidden>.
        values = launch_service.secrets(job, dict(args.env))
        start = launch_service.start_of(given, job, log_dir)
    except launch_service.NotStarted as exc:
        print(f"meshkit launch: {exc.cli}", file=sys.stderr)
        return 2
    mode = os.fstat(sys.stdin.fileno()).st_mode if not sys.stdin.closed else 0
    broadcast = (
        not args.no_stdin and not args.batch and (stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or sys.stdin.isatty())
    )

    def write(text: str, event: bool) -> None:
        # In the terminal's own thread: a paused pager blocks it, never the launcher.
        stream = sys.stderr if event else sys.stdout
        stream.write(f"meshkit launch: {text}\n" if event else f"{text}\n")
        stream.flush()

    print(f"meshkit launch: {start.headline(job, len(connections), broadcast)}", file=sys.stderr, flush=True)
    try:
        outcome = launch_service.run(
            job, connections, values, start, write, stdin=sys.stdin if broadcast else None, partial_flush=0.1
        )
    except launch_service.NotStarted as exc:
        print(f"meshkit launch: {exc.cli}", file=sys.stderr)
        return 2
    for on_stdout, text in outcome.said():
        print(text, file=sys.stdout if on_stdout else sys.stderr)
    return outcome.exit_code()


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
        name = "teardown" if args.undo else "setup"
        return playbook(name, args.inventory, [a for a in args.playbook_args if a != "--"])
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
    if args.command == "watch":
        return watch.main(args)
    if args.command == "status":
        return watch.status_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
