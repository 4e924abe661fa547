# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Every setting of a launch, written once: name, type, range or choices, default, one line of help.

A setting is launch.yml's variable ``launch_<name>``, the launch or launch_plan module's option of
that name and, where it has flags, `meshkit launch`'s flag. From this table come:

- launch_plan's validation (SCHEMA: Cerberus rules; HINTS: what to do about a bad value), and
  check(), the same check of one value (the launch action's host timeout, a range-checked flag);
- the flags of `meshkit launch` and `meshkit check` (add_flags());
- the range of the inventory's meshkit_ranks_per_host (inventory_schema.py): the job's default.

launch.yml's variables and their defaults, the launch and launch_plan modules' documented options
and docs/launch.md's table are checked against it by tests/unit/test_settings.py, which names what
drifted.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meshkit.cluster.plugins.module_utils.defaults import DEFAULTS as INVENTORY
from ansible_collections.meshkit.cluster.plugins.module_utils.defaults import MLX_STARTING_PORT
from cerberus import Validator

# The number itself stays beside the ssh keepalives it bounds: launch_connection.py also runs as a
# program of its own (mpirun's remote shell), which imports nothing of meshkit.
from meshkit.launch_connection import DEFAULT_HOST_TIMEOUT

RUNTIMES = ("meshccl", "mlx", "torch", "mpi", "plain")
SCHEDULERS = ("meshkit", "slurm")
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"

# Where a setting is given: a key of launch_plan's ``settings`` (what the job is), an option of
# launch_plan of its own, or an option of the launch action (how the job starts).
PLAN = "launch_plan.settings"
PLAN_OPTION = "launch_plan"
START = "launch"

# Cerberus's types for the table's (Ansible's names).
_TYPES: dict[str, dict[str, Any]] = {
    "str": {"type": "string"},
    "int": {"type": "integer", "coerce": int},
    "float": {"type": ["integer", "float"], "coerce": float, "check_with": "finite"},
    "bool": {"type": "boolean"},
    "list": {"type": "list"},
    "dict": {"type": "dict"},
    "raw": {},
}


@dataclass(frozen=True)
class Setting:
    name: str
    type: str  # Ansible's type name: str, int, float, bool, list, dict, raw
    help: str  # one line; {default}, {min}, {max} and {choices} are filled in
    default: Any = None  # None: none (a default that depends on the job is said in the help)
    choices: tuple[str, ...] = ()
    min: float | None = None
    max: float | None = None
    hint: str = ""  # what to do about a bad value; placeholders as in help
    flags: tuple[str, ...] = ()  # `meshkit launch`'s
    metavar: str | None = None
    unit: str = ""  # a flag with a unit is range-checked as it is parsed: "give <unit> from <min> to <max>"
    where: tuple[str, ...] = (PLAN,)
    inventory: str | None = None  # the default is this inventory variable's (whose own default is ``default``)
    slurm: bool = False  # given only with scheduler slurm
    playbook: bool = True  # a variable of launch.yml (launch_<name>)
    rule: Mapping[str, Any] = field(default_factory=dict)  # more Cerberus rules (regex, nullable, ...)

    def text(self, template: str) -> str:
        return template.format(default=self.default, min=self.min, max=self.max, choices=", ".join(self.choices))

    @property
    def variable(self) -> str:
        return f"launch_{self.name}"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "program", "raw", "the command every rank runs: a string, split as a shell would, or a list",
        metavar="PROGRAM",  # meshkit launch's -- PROGRAM [ARGS...]
        hint='give the command to run on every rank, e.g. "python3 /shared/train.py --epochs 1" or a list',
        rule={
            "type": ["string", "list"], "required": True, "empty": False,
            "schema": {"type": "string", "empty": False},
        },
    ),
    Setting(
        "runtime", "str", "the environment every rank gets: {choices}", default="meshccl", choices=RUNTIMES,
        hint="use one of {choices}", flags=("-r", "--runtime"),
    ),
    Setting(
        "ranks_per_host", "int", "ranks on each host (default: the inventory's)",
        default=INVENTORY["meshkit_ranks_per_host"], min=1, max=256, inventory="meshkit_ranks_per_host",
        hint="use a whole number from {min} to {max}", flags=("-n", "--ranks-per-host"),
    ),
    Setting(
        "env", "dict", "an environment variable for every rank (repeatable); NAME alone: its value here. "
        "A name holding TOKEN, KEY, SECRET or PASSWORD makes it a secret, shown nowhere",
        default={}, hint="give a mapping of environment variable names to values", flags=("-x", "--env"),
        metavar="NAME[=VALUE]",
        rule={
            "keysrules": {"type": "string", "regex": ENV_NAME},
            "valuesrules": {"type": ["string", "integer", "float", "boolean"]},
        },
    ),
    Setting(
        "secret_env", "list", "the -x variable NAME is a secret too, whatever its name (repeatable)", default=[],
        hint="give a list of environment variable names whose values are secrets", flags=("--secret",),
        metavar="NAME", rule={"schema": {"type": "string", "regex": ENV_NAME}},
    ),
    Setting(
        "timeout", "float", "stop every rank after this many seconds", default=0, min=0,
        hint="give seconds (0: no limit)", flags=("-t", "--timeout"), where=(PLAN, START),
    ),
    Setting(
        "grace", "float", "seconds between SIGTERM and SIGKILL ({default:g})", default=3.0, min=0, max=120,
        hint="give the seconds a stopped rank gets between SIGTERM and SIGKILL ({min:g}-{max:g})",
        flags=("--grace",), where=(PLAN, START),
    ),
    Setting(
        "host_timeout", "float", "a host not heard from for this long (a partition) is lost: every other rank is "
        "stopped and the launch fails naming it; its own ranks stop when its supervisor has not heard from here "
        "for as long ({default:g})",
        default=DEFAULT_HOST_TIMEOUT, min=1, max=3600,
        hint="give the seconds without a word from a host before it counts as lost ({min:g}-{max:g}; default "
        "{default:g})",
        flags=("--host-timeout",), metavar="SECONDS", unit="seconds", where=(PLAN, START),
    ),
    Setting(
        "scheduler", "str", "who starts the ranks: meshkit's own supervisor on every host (default), or Slurm "
        "(one srun on --submit-host; the cluster set up with meshkit_slurm: true)",
        default="meshkit", choices=SCHEDULERS, flags=("--scheduler",), where=(START,),
    ),
    Setting(
        "submit_host", "str", "--scheduler slurm: the host srun runs on (default: rank 0's host)",
        flags=("--submit-host",), metavar="HOST", where=(START,), slurm=True,
    ),
    Setting(
        "partition", "str", "--scheduler slurm: the Slurm partition (default: Slurm's default)",
        flags=("--partition",), where=(START,), slurm=True,
    ),
    Setting(
        "batch", "bool", "--scheduler slurm: submit with sbatch and return once Slurm has queued the job (its "
        "output goes to a file on rank 0's host, named here)",
        default=False, flags=("--batch",), where=(START,), slurm=True,
    ),
    Setting(
        "cwd", "str", "the ranks' working directory (absolute, on every host)",
        hint="give an absolute directory that exists on every host", flags=("--cwd",),
        rule={"nullable": True, "regex": r"^/.*"},
    ),
    Setting(
        "quiet", "bool", "show only the summary (the logs keep everything)", default=False, flags=("-q", "--quiet"),
        where=(START,),
    ),
    Setting(
        "mlx_port", "int", "the first port MLX ring ranks listen on", default=MLX_STARTING_PORT, min=1024, max=65000,
        hint="use a free TCP port from {min}; MLX ring ranks listen from here upwards", playbook=False,
    ),
    Setting("job_id", "str", "names the job's directories (default: a time stamp and a random suffix)",
            where=(PLAN_OPTION,)),
)  # fmt: skip

SETTING: dict[str, Setting] = {s.name: s for s in SETTINGS}


def default(name: str) -> Any:
    """A setting's default (for ranks_per_host, the inventory's own default)."""
    return SETTING[name].default


def _rule(setting: Setting) -> dict[str, Any]:
    rule = dict(_TYPES[setting.type])
    if setting.choices:
        rule["allowed"] = list(setting.choices)
    if setting.min is not None:
        rule["min"] = setting.min
    if setting.max is not None:
        rule["max"] = setting.max
    return rule | dict(setting.rule)


# launch_plan's settings (launch.yml's launch_<name>), validated before anything starts.
SCHEMA: dict[str, dict[str, Any]] = {s.name: _rule(s) for s in SETTINGS if PLAN in s.where}
HINTS: dict[str, str] = {s.name: s.text(s.hint) for s in SETTINGS if s.hint}


class _Validator(Validator):
    def _check_with_finite(self, field: str, value: Any) -> None:
        if isinstance(value, float) and math.isnan(value):
            self._error(field, "not a number")


def validator() -> Validator:
    return _Validator(SCHEMA)


def plain(errors: list[Any]) -> list[str]:
    """Cerberus's words for a value that is not a number ("field 'x' cannot be coerced: could not
    convert string to float: 'soon'", then "must be of ['integer', 'float'] type") said once, plainly."""
    out: list[str] = []
    for given in map(str, errors):
        said = given
        if "cannot be coerced" in given or given.startswith("must be of ['integer', 'float'] type"):
            said = "not a number"
        elif given == "must be of integer type":
            said = "not a whole number"
        if said not in out:
            out.append(said)
    if "not a number" in out and "not a whole number" in out:
        out.remove("not a number")
    return out


def check(name: str, value: Any) -> tuple[Any, list[str]]:
    """One setting's value checked as launch_plan's validation checks it: (the value, coerced;
    what is wrong with it, in plain words: empty when nothing)."""
    one = _Validator({name: SCHEMA[name]})
    if one.validate({name: value}):
        return one.document[name], []
    return value, plain(one.errors.get(name) or [])


# --- `meshkit launch`'s and `meshkit check`'s flags -----------------------------------------------


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


# How the text of a repeatable flag becomes one item of its setting.
ITEMS = {"env": parse_env, "secret_env": env_name}


def ranged(setting: Setting) -> Any:
    """argparse's type for a flag range-checked as it is parsed (check(), in the flag's words)."""

    def parse(text: str) -> Any:
        value, problems = check(setting.name, text)
        if problems:
            raise argparse.ArgumentTypeError(f"{text!r}: give {setting.unit} from {setting.min:g} to {setting.max:g}")
        return value

    parse.__name__ = setting.name
    return parse


def flag_options(setting: Setting) -> dict[str, Any]:
    """The keyword arguments of argparse's add_argument() for a setting's flags."""
    out: dict[str, Any] = {"help": setting.text(setting.help)}
    if setting.metavar:
        out["metavar"] = setting.metavar
    if setting.type == "bool":
        return out | {"action": "store_true"}
    if setting.type in ("list", "dict"):
        return out | {"action": "append", "default": [], "type": ITEMS[setting.name]}
    out["default"] = None if setting.inventory else setting.default
    if setting.choices:
        out["choices"] = list(setting.choices)
    if setting.unit:
        out["type"] = ranged(setting)
    elif setting.type in ("int", "float"):
        out["type"] = int if setting.type == "int" else float
    return out


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """Add these settings' flags to ``parser`` (in the order given)."""
    for name in names:
        setting = SETTING[name]
        parser.add_argument(*setting.flags, **flag_options(setting))


def dest(setting: Setting) -> str:
    """The attribute argparse keeps a setting's flag in (``--secret``: secret)."""
    return setting.flags[-1].lstrip("-").replace("-", "_")


FLAGGED = tuple(s.name for s in SETTINGS if s.flags)
