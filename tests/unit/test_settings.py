"""Every setting written once: the launch's table (meshkit/launch_settings.py) drives `meshkit
launch`'s and `meshkit check`'s flags, launch_plan's validation and the launch action's checks, and
is checked against launch.yml's variables, the launch and launch_plan modules' documented options
and docs/launch.md's table; the inventory's table (meshkit/inventory_schema.py) drives its schema
and hints and is checked against DEFAULTS, README's table, the roles' defaults that mirror a
meshkit_* variable and the hostfiles module's. Each check is a function returning what drifted; it
is run on the repository (nothing) and on a drifted copy (named), so none of them cannot fail."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.meshkit.cluster.plugins.module_utils.defaults import DEFAULTS
from ansible_collections.meshkit.cluster.plugins.module_utils.host_steps import HOSTFILES_ARGS
from ansible_collections.meshkit.cluster.plugins.modules import hostfiles as hostfiles_module
from ansible_collections.meshkit.cluster.plugins.modules import launch as launch_module
from ansible_collections.meshkit.cluster.plugins.modules import launch_plan as launch_plan_module

from meshkit import cli, inventory_schema, launch_plan, launch_service, launch_settings
from meshkit.launch_settings import PLAN, PLAN_OPTION, SETTING, SETTINGS, START, Setting

REPO = Path(__file__).resolve().parents[2]
MISSING = object()


def shown(value: Any) -> str:
    """A default as the docs and playbooks write it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def same(a: Any, b: Any) -> bool:
    return shown(a) == shown(b)


# ---- the launch: flags ------------------------------------------------------------------------


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def flag_drift(parser: argparse.ArgumentParser, names: list[str]) -> list[str]:
    """Where the flags of ``parser`` are not the table's (names, defaults, choices, help, range)."""
    actions = {a.dest: a for a in parser._actions}
    out = []
    for name in names:
        s = SETTING[name]
        action = actions.get(launch_settings.dest(s))
        if action is None:
            out.append(f"{name}: no flag {s.flags}")
            continue
        if tuple(action.option_strings) != s.flags:
            out.append(f"{name}: flags {action.option_strings}, the table's {s.flags}")
        wanted = [] if s.type in ("list", "dict") else None if s.inventory else s.default
        if s.type == "bool":
            wanted = False
        if action.default != wanted:
            out.append(f"{name}: default {action.default!r}, the table's {wanted!r}")
        if list(action.choices or []) != list(s.choices):
            out.append(f"{name}: choices {action.choices}, the table's {s.choices}")
        if action.help != s.text(s.help):
            out.append(f"{name}: help {action.help!r}, the table's {s.text(s.help)!r}")
        if s.unit:
            for text, ok in ((f"{s.min:g}", True), (f"{s.max:g}", True), (f"{s.max + 1:g}", False), ("nan", False)):
                try:
                    action.type(text)
                    took = True
                except argparse.ArgumentTypeError as exc:
                    took = False
                    if f"from {s.min:g} to {s.max:g}" not in str(exc):
                        out.append(f"{name}: {text!r} refused without the table's range: {exc}")
                if took != ok:
                    out.append(f"{name}: {text!r} {'taken' if took else 'refused'}; the table's range {s.min}-{s.max}")
    return out


def test_meshkit_launch_and_check_flags_are_made_from_the_table() -> None:
    assert flag_drift(subparser("launch"), list(launch_settings.FLAGGED)) == []
    assert flag_drift(subparser("check"), ["host_timeout"]) == []
    # Every flagged setting, and nothing else the table has, is a flag of meshkit launch.
    options = {a.dest for a in subparser("launch")._actions if a.option_strings}
    assert {launch_settings.dest(s) for s in SETTINGS if s.flags} <= options
    assert not {s.name for s in SETTINGS if not s.flags} & options


def test_a_flag_that_drifts_from_the_table_is_named() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grace", type=float, default=5.0, help="other words")
    parser.add_argument("--host-timeout", type=float, default=20.0, metavar="SECONDS", help="x")
    drift = flag_drift(parser, ["grace", "host_timeout", "quiet"])
    assert "grace: default 5.0, the table's 3.0" in drift
    assert any(line.startswith("grace: help 'other words'") for line in drift)
    assert any(line.startswith("host_timeout: '3601' taken") for line in drift), drift
    assert "quiet: no flag ('-q', '--quiet')" in drift


# ---- the launch: validation -----------------------------------------------------------------------


def test_launch_plans_schema_and_hints_are_the_tables() -> None:
    planned = [s for s in SETTINGS if PLAN in s.where]
    assert list(launch_settings.SCHEMA) == [s.name for s in planned]
    for s in planned:
        rule = launch_settings.SCHEMA[s.name]
        assert (rule.get("min"), rule.get("max")) == (s.min, s.max), s.name
        assert tuple(rule.get("allowed") or ()) == s.choices, s.name
    assert launch_settings.HINTS["ranks_per_host"] == "use a whole number from 1 to 256"
    host_timeout = launch_settings.default("host_timeout")
    assert launch_settings.HINTS["host_timeout"].endswith(f"(1-3600; default {host_timeout:g})")
    # The inventory's ranks per host is the job's default: one range for both.
    assert inventory_schema.SCHEMA["meshkit_ranks_per_host"]["min"] == SETTING["ranks_per_host"].min
    assert inventory_schema.SCHEMA["meshkit_ranks_per_host"]["max"] == SETTING["ranks_per_host"].max
    assert SETTING["ranks_per_host"].default == DEFAULTS["meshkit_ranks_per_host"]


@pytest.mark.parametrize(("value", "ok"), [(0, False), (0.5, False), (1, True), ("20", True), (3600, True),
                                           (3601, False), ("soon", False), (float("nan"), False)])  # fmt: skip
def test_the_host_timeout_is_checked_once_the_same_way_everywhere(value: Any, ok: bool) -> None:
    """launch_plan's validation, the launch action's own check (a task's host_timeout) and the
    --host-timeout flag are one check of the table's range."""
    job = {"job_id": "j1", "world_size": 1}
    try:
        launch_plan.validate({"program": "x", "host_timeout": value})
        planned = True
    except launch_plan.LaunchError as exc:
        planned = False
        assert "launch_host_timeout = " in str(exc) and launch_settings.HINTS["host_timeout"] in str(exc)
    try:
        start = launch_service.start_of({"host_timeout": value}, job, Path("/tmp"))
        started = True
        assert start.host_timeout == float(value)
    except launch_service.NotStarted as exc:
        started = False
        assert str(exc) == (
            f"launch_host_timeout = {value!r}: give the seconds without a word from a host before it counts as lost "
            "(1-3600; default 20); no rank of job j1 was started"
        )
    try:
        subparser("launch").parse_args(["-i", "x", "--host-timeout", str(value)])
        parsed = True
    except SystemExit:
        parsed = False
    assert planned == started == parsed == ok


def test_the_start_settings_default_from_the_job_then_the_table(tmp_path: Path) -> None:
    job = {"job_id": "j1", "timeout": 7.0, "grace": 1.5, "host_timeout": 9.0}
    start = launch_service.start_of({}, job, tmp_path)
    assert (start.timeout, start.grace, start.host_timeout, start.scheduler) == (7.0, 1.5, 9.0, "meshkit")
    start = launch_service.start_of({}, {"job_id": "j1"}, tmp_path)
    assert (start.timeout, start.grace, start.host_timeout) == (None, 3.0, 20.0)
    with pytest.raises(launch_service.NotStarted) as info:
        launch_service.start_of({"scheduler": "pbs"}, job, tmp_path)
    assert str(info.value) == "launch_scheduler='pbs': use meshkit (the default) or slurm"
    with pytest.raises(launch_service.NotStarted) as info:
        launch_service.start_of({"partition": "p", "batch": True}, job, tmp_path)
    assert str(info.value) == "launch_partition, launch_batch need launch_scheduler: slurm"


# ---- the launch: launch.yml, the modules' docs, docs/launch.md --------------------------------------

DEFAULT = re.compile(r"(?<![\w.])launch_(\w+)\s*\|\s*default\(([^()]*(?:\([^()]*\))?[^()]*)\)")


def playbook_drift(text: str) -> list[str]:
    """launch.yml's launch_<name> variables against the table: each setting of launch.yml is one,
    and a default written there is the table's (or none/omit: the table's applies where it is used;
    for ranks per host the inventory's variable)."""
    out = []
    # launch_<name>, not a module's name (meshkit.cluster.launch_plan) nor a longer name's end.
    found = {m.group(1) for m in re.finditer(r"(?<![\w.])launch_(\w+)", text)} - {"prepare_to"}
    for s in SETTINGS:
        if s.playbook and s.name not in found:
            out.append(f"{s.variable}: not a variable of launch.yml")
        if not s.playbook and s.name in found:
            out.append(f"{s.variable}: in launch.yml, which the table says takes no such variable")
    for name in sorted(found - set(SETTING)):
        out.append(f"launch_{name}: in launch.yml, not in the table")
    for m in DEFAULT.finditer(text):
        name, given = m.group(1), m.group(2).strip()
        s = SETTING.get(name)
        if s is None or given in ("none", "omit"):
            continue
        if s.inventory:
            if not given.endswith(f".{s.inventory}"):
                out.append(f"{s.variable}: default({given}), not the inventory's {s.inventory}")
            continue
        value = yaml.safe_load(given)
        if not same(value, s.default):
            out.append(f"{s.variable}: default({given}), the table's {shown(s.default)}")
    return out


def test_launch_yml_variables_and_defaults_are_the_tables() -> None:
    text = (REPO / "playbooks" / "launch.yml").read_text()
    assert playbook_drift(text) == []
    drifted = text.replace("launch_grace | default(3)", "launch_grace | default(5)").replace("launch_cwd", "launch_dir")
    assert playbook_drift(drifted) == [
        "launch_cwd: not a variable of launch.yml",
        "launch_dir: in launch.yml, not in the table",
        "launch_grace: default(5), the table's 3",
    ]


def options_of(module: Any) -> dict[str, Any]:
    return yaml.safe_load(module.DOCUMENTATION)["options"]


def option_drift(where: str, options: dict[str, Any]) -> list[str]:
    """A module's documented options against the table's settings given there: type, default,
    choices, and the range where the description gives one."""
    out = []
    settings = [s for s in SETTINGS if where in s.where]
    for s in settings:
        doc = options.get(s.name)
        if doc is None:
            out.append(f"{where}: no option {s.name}")
            continue
        if doc.get("type") != s.type:
            out.append(f"{where}.{s.name}: type {doc.get('type')}, the table's {s.type}")
        default = doc.get("default", MISSING)
        overrides = PLAN in s.where and where == START  # the job's own by default
        if default is MISSING and s.default is not None and not overrides:
            out.append(f"{where}.{s.name}: no default, the table's {shown(s.default)}")
        elif default is not MISSING and not same(default, s.default):
            out.append(f"{where}.{s.name}: default {shown(default)}, the table's {shown(s.default)}")
        if tuple(doc.get("choices") or ()) != s.choices:
            out.append(f"{where}.{s.name}: choices {doc.get('choices')}, the table's {list(s.choices)}")
        said = " ".join(doc["description"]) if isinstance(doc["description"], list) else doc["description"]
        ranges = re.findall(r"\((\d+)-(\d+)\)", said)
        if ranges and ranges != [(f"{s.min:g}", f"{s.max:g}")]:
            out.append(f"{where}.{s.name}: says {ranges}, the table's range is {s.min}-{s.max}")
        if s.default is not None and re.search(r"\belse \d+\b", said) and f"else {shown(s.default)}" not in said:
            out.append(f"{where}.{s.name}: says another default than the table's {shown(s.default)}")
    if where == PLAN:
        for name in sorted(set(options) - {s.name for s in settings}):
            out.append(f"{where}: option {name} is not in the table")
    return out


def test_the_launch_and_launch_plan_modules_document_the_tables_options() -> None:
    plan_options = options_of(launch_plan_module)
    assert option_drift(PLAN, plan_options["settings"]["suboptions"]) == []
    assert option_drift(PLAN_OPTION, plan_options) == []
    assert option_drift(START, options_of(launch_module)) == []
    drifted = yaml.safe_load(launch_module.DOCUMENTATION)["options"]
    drifted["scheduler"]["choices"] = ["meshkit", "slurm", "pbs"]
    said = drifted["host_timeout"]["description"]
    said[-1] = said[-1].replace("else 20", "else 30")
    del drifted["quiet"]
    assert option_drift(START, drifted) == [
        f"launch.host_timeout: says another default than the table's {shown(SETTING['host_timeout'].default)}",
        "launch.scheduler: choices ['meshkit', 'slurm', 'pbs'], the table's ['meshkit', 'slurm']",
        "launch: no option quiet",
    ]
    suboptions = yaml.safe_load(launch_plan_module.DOCUMENTATION)["options"]["settings"]["suboptions"]
    suboptions["grace"]["description"] = "Seconds between SIGTERM and SIGKILL (0-60)."
    suboptions["ranks_per_host"]["default"] = 2
    suboptions["extra"] = {"description": "x", "type": "str"}
    assert option_drift(PLAN, suboptions) == [
        "launch_plan.settings.ranks_per_host: default 2, the table's 1",
        "launch_plan.settings.grace: says [('0', '60')], the table's range is 0-120",
        "launch_plan.settings: option extra is not in the table",
    ]


def table_rows(text: str, first: str) -> list[list[str]]:
    """The rows of the Markdown table whose header starts with ``first``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def docs_drift(text: str) -> list[str]:
    """docs/launch.md's table of variables and flags against the table."""
    out = []
    seen = set()
    for variable, flags, default, _what in table_rows(text, "launch.yml"):
        if not variable:
            continue  # a flag of meshkit launch alone (--no-stdin, --recheck)
        name = variable.strip("`").removeprefix("launch_")
        s = SETTING.get(name)
        if s is None:
            out.append(f"{variable}: not in the table")
            continue
        seen.add(name)
        # A setting without flags has none there, but the program (meshkit launch's -- PROGRAM ARGS).
        said = f"`{s.flags[0]}" in flags if s.flags else not flags or bool(s.metavar and s.metavar in flags)
        if not said:
            out.append(f"{variable}: flags {flags or 'none'}, the table's {', '.join(s.flags) or 'none'}")
        if s.inventory:
            if f"`{s.inventory}`" not in default:
                out.append(f"{variable}: default {default}, not the inventory's {s.inventory}")
        elif s.default is not None and not default.replace("`", "").startswith(shown(s.default)):
            out.append(f"{variable}: default {default}, the table's {shown(s.default)}")
    for s in SETTINGS:
        if s.playbook and s.name not in seen:
            out.append(f"{s.variable}: not in docs/launch.md's table")
    return out


def test_docs_launch_md_tables_the_settings_as_the_table_has_them() -> None:
    text = (REPO / "docs" / "launch.md").read_text()
    assert docs_drift(text) == []
    drifted = text.replace("| `launch_grace` | `--grace` | `3` |", "| `launch_grace` | `-g` | `5` |")
    drifted = drifted.replace("| `launch_batch` |", "| `launch_batches` |")
    assert docs_drift(drifted) == [
        "`launch_grace`: flags `-g`, the table's --grace",
        "`launch_grace`: default `5`, the table's 3",
        "`launch_batches`: not in the table",
        "launch_batch: not in docs/launch.md's table",
    ]


# ---- the inventory -------------------------------------------------------------------------------

MIRROR = re.compile(r"\b(meshkit_(?!cfg\b)\w+)\s*\|\s*default\(([^()]*)\)")
SAID_DEFAULT = re.compile(r"default C\((meshkit_\w+)\) or ([^.;,\s]+)")
# The roles take their defaults from the validated settings (the preflight role's fact), not from literals.
READS = re.compile(r"\bpreflight_config\.(meshkit_\w+)")
# Settings the validation derives (not set by users, so not in DEFAULTS).
DERIVED = {"meshkit_discover_ports"}


def inventory_drift(readme: str, roles: dict[str, str], hostfiles_doc: dict[str, Any]) -> list[str]:
    """DEFAULTS, the inventory's table (schema and hints), README's table, the roles' defaults and
    argument specs that mirror a meshkit_* variable, and the hostfiles module's ranks per host."""
    table = inventory_schema.VARIABLES
    users = {name for name, v in table.items() if v.user}
    out = [f"{name}: in DEFAULTS, not in the inventory's table" for name in sorted(set(DEFAULTS) - set(table))]
    out += [f"{name}: in the inventory's table without a default" for name in sorted(users - set(DEFAULTS))]
    check = inventory_schema._Validator(inventory_schema.SCHEMA)
    for name in sorted(set(DEFAULTS) & users):
        if DEFAULTS[name] is not None and not check.validate({name: DEFAULTS[name]}):
            out.append(f"{name}: its default {DEFAULTS[name]!r} breaks its own rule ({check.errors[name]})")
    rows = {row[0].strip("`"): row for row in table_rows(readme, "variable")}
    for name in sorted(users - set(rows)):
        out.append(f"{name}: not in README's table")
    for name, (_variable, default, meaning) in sorted(rows.items()):
        v = table.get(name)
        if v is None or not v.user:
            out.append(f"{name}: in README's table, not a variable users set")
            continue
        value = DEFAULTS.get(name)
        wanted = v.shown or ("unset" if value in (None, "") else f"`{shown(value)}`")
        if default != wanted:
            out.append(f"{name}: README says default {default}, the table {wanted}")
        lo, hi = v.rule.get("min"), v.rule.get("max")
        for said in re.findall(r"\((\d+)\N{EN DASH}(\d+)\)", meaning):
            if said != (str(lo), str(hi)):
                out.append(f"{name}: README says {'-'.join(said)}, the table {lo}-{hi}")
    for path, text in sorted(roles.items()):
        for name in sorted(set(READS.findall(text)) - set(DEFAULTS) - DERIVED):
            out.append(f"{path}: reads {name}, which the validated settings do not hold")
        for m in [*MIRROR.finditer(text), *SAID_DEFAULT.finditer(text)]:
            name, given = m.group(1), m.group(2).strip()
            value = None if given == "none" else yaml.safe_load(given)
            if name not in DEFAULTS:
                out.append(f"{path}: {name} is no inventory variable")
            elif not same(value, DEFAULTS[name]) and not (value is None and DEFAULTS[name] is None):
                out.append(f"{path}: {name} defaults to {given} there, {DEFAULTS[name]!r} in DEFAULTS")
    ranks = DEFAULTS["meshkit_ranks_per_host"]
    if HOSTFILES_ARGS["ranks_per_host"]["default"] != ranks or hostfiles_doc["ranks_per_host"]["default"] != ranks:
        out.append(f"module hostfiles: ranks_per_host defaults to another number than meshkit_ranks_per_host ({ranks})")
    return out


def role_files() -> dict[str, str]:
    paths = [
        *REPO.glob("roles/*/defaults/main.yml"),
        *REPO.glob("roles/*/meta/argument_specs.yml"),
        *REPO.glob("roles/*/tasks/*.yml"),
    ]
    return {str(p.relative_to(REPO)): p.read_text() for p in paths}


def test_inventory_defaults_schema_readme_and_roles_agree() -> None:
    readme = (REPO / "README.md").read_text()
    roles = role_files()
    # The roles read many settings (meshkit_bridge, meshkit_ping_count, ...): the check has something to check.
    assert sum(len(MIRROR.findall(text)) + len(READS.findall(text)) for text in roles.values()) >= 3
    assert inventory_drift(readme, roles, options_of(hostfiles_module)) == []


def test_inventory_drift_is_named() -> None:
    readme = (REPO / "README.md").read_text()
    readme = readme.replace("| `meshkit_ping_count` | `3` |", "| `meshkit_ping_count` | `4` |")
    readme = readme.replace("(1280\N{EN DASH}65520)", "(1280\N{EN DASH}9000)")
    readme = readme.replace("| `meshkit_slurm_partition` |", "| `meshkit_slurm_queue` |")
    roles = {
        "roles/x/defaults/main.yml": "x_bridge: \"{{ meshkit_bridge | default('br9') }}\"\n",
        "roles/y/defaults/main.yml": 'y_mtu: "{{ preflight_config.meshkit_mtus }}"\n',
    }
    hostfiles_doc = {"ranks_per_host": {"default": 2}}
    assert inventory_drift(readme, roles, hostfiles_doc) == [
        "meshkit_slurm_partition: not in README's table",
        "meshkit_mtu: README says 1280-9000, the table 1280-65520",
        "meshkit_ping_count: README says default `4`, the table `3`",
        "meshkit_slurm_queue: in README's table, not a variable users set",
        "roles/x/defaults/main.yml: meshkit_bridge defaults to 'br9' there, 'bridge0' in DEFAULTS",
        "roles/y/defaults/main.yml: reads meshkit_mtus, which the validated settings do not hold",
        "module hostfiles: ranks_per_host defaults to another number than meshkit_ranks_per_host (1)",
    ]


def test_the_inventory_schema_and_hints_are_made_from_its_table() -> None:
    table = inventory_schema.VARIABLES
    assert {name: v.rule for name, v in table.items()} == inventory_schema.SCHEMA
    assert {name: v.hint for name, v in table.items() if v.hint} == inventory_schema.HINTS
    # What -e gives as text is coerced by the table's types.
    normalised, problems = inventory_schema.validate_hosts(
        {"n1": {"meshkit_ping_count": "5", "meshkit_slurm": "yes", "meshkit_mtu": ""}}
    )
    assert problems == []
    assert (normalised["n1"]["meshkit_ping_count"], normalised["n1"]["meshkit_slurm"]) == (5, True)
    assert normalised["n1"]["meshkit_mtu"] is None


def test_a_setting_says_its_range_and_default_from_its_own_numbers() -> None:
    s = Setting("x", "float", "wait ({default:g})", default=2.5, min=1, max=9, hint="give {min:g}-{max:g}")
    assert (s.text(s.help), s.text(s.hint), s.variable) == ("wait (2.5)", "give 1-9", "launch_x")
