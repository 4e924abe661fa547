"""module_utils is what modules ship to hosts (DESIGN.md "Layout"): every file there is imported,
directly or through another module_util, by a module that runs on a host; the controller's code
lives in the meshkit package, which uses only module_utils' public names. A module file without a
main() is documentation only: an action plugin of the same name does its work on the controller."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "plugins"
MODULE_UTILS = "ansible_collections.meshkit.cluster.plugins.module_utils"


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def module_utils_imports(path: Path) -> dict[str, set[str]]:
    """The module_utils files ``path`` imports, each with the names it takes from it."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module == MODULE_UTILS:
            for alias in node.names:
                found.setdefault(alias.name, set())
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(MODULE_UTILS + "."):
            found.setdefault(node.module[len(MODULE_UTILS) + 1 :], set()).update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(MODULE_UTILS + "."):
                    found.setdefault(alias.name[len(MODULE_UTILS) + 1 :], set())
    return found


def has_main(path: Path) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree(path).body)


def host_modules() -> list[Path]:
    """Modules that run on a host: the ones with a main() (the rest document an action plugin)."""
    return [p for p in sorted((PLUGINS / "modules").glob("*.py")) if has_main(p)]


def agent_parts() -> tuple[str, ...]:
    """The module_utils the launcher ships to every host of a job as the launch agent (agent_sources.AGENT_PARTS):
    a program that runs on the hosts without a module."""
    for node in ast.walk(tree(PLUGINS / "module_utils" / "agent_sources.py")):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "AGENT_PARTS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return ()


def used_on_hosts() -> dict[str, str]:
    """Every module_utils file the host modules (and the launch agent, which the launcher ships to the hosts)
    import, directly or through module_utils, with the host module that first reaches it."""
    reached: dict[str, str] = {}
    todo = [(name, module.stem) for module in host_modules() for name in module_utils_imports(module)]
    todo += [(name, "the launch agent") for name in ("agent_sources", *agent_parts())]
    while todo:
        name, by = todo.pop()
        if name in reached:
            continue
        reached[name] = by
        todo += [(more, by) for more in module_utils_imports(PLUGINS / "module_utils" / f"{name}.py")]
    return reached


def test_the_launch_agents_parts_are_found():
    assert {"launch_agent", "port_rules", "agent_procs"} <= set(agent_parts())


def test_the_host_modules_are_found():
    names = {p.stem for p in host_modules()}
    assert {"discover", "host_network", "meshccl_venv", "slurm_config"} <= names, names
    assert not names & {"cabling_plan", "cabling_picture", "meshccl_wheel", "lab", "plan_verify", "launch"}, names


def test_every_module_utils_file_is_used_by_a_host_module():
    reached = used_on_hosts()
    orphans = sorted(p.name for p in (PLUGINS / "module_utils").glob("*.py") if p.stem not in reached)
    assert not orphans, (
        f"plugins/module_utils/{', '.join(orphans)}: no module that runs on a host imports it; "
        "controller-only code belongs in the meshkit package (DESIGN.md, Layout)"
    )


def test_a_module_utils_file_no_host_module_uses_is_named(tmp_path, monkeypatch):
    """The check above can fail: an extra file in module_utils that nothing imports is an orphan."""
    fake = tmp_path / "plugins"
    for part in ("modules", "module_utils"):
        (fake / part).mkdir(parents=True)
        for source in (PLUGINS / part).glob("*.py"):
            (fake / part / source.name).write_text(source.read_text())
    (fake / "module_utils" / "planner.py").write_text('"""Controller-only."""\n')
    monkeypatch.setitem(globals(), "PLUGINS", fake)
    with pytest.raises(AssertionError, match=r"plugins/module_utils/planner\.py: no module that runs on a host"):
        test_every_module_utils_file_is_used_by_a_host_module()


def private_uses(path: Path) -> list[str]:
    """The underscore names of module_utils ``path`` uses: imported (``from ...hostfiles import _x``,
    ``..._private`` files), or read off a module_utils module it imported (``hostfiles._x``)."""
    found = module_utils_imports(path)
    used = {f"{module}.{name}" for module, names in found.items() for name in names if name.startswith("_")}
    used |= {module for module in found if any(part.startswith("_") for part in module.split("."))}
    modules = {name for name, names in found.items() if not names}  # from module_utils import hostfiles
    for node in ast.walk(tree(path)):
        reads = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
        if reads and node.attr.startswith("_") and not (node.attr.startswith("__") and node.attr.endswith("__")):
            used.add(f"{node.value.id}.{node.attr}")
    return sorted(used)


@pytest.mark.parametrize("path", sorted((REPO / "meshkit").glob("*.py")), ids=lambda p: p.name)
def test_meshkit_uses_only_public_names_of_module_utils(path):
    private = private_uses(path)
    assert not private, f"meshkit/{path.name} uses private names of module_utils: {', '.join(private)}"


def test_a_private_name_is_named(tmp_path):
    """The check above can fail, both ways of reaching in."""
    code = tmp_path / "x.py"
    code.write_text(
        f"from {MODULE_UTILS}.picture import DEAD, _attrs\n"
        f"from {MODULE_UTILS} import hostfiles\n"
        "print(hostfiles._render, hostfiles.fingerprint, hostfiles.__file__)\n"
    )
    assert private_uses(code) == ["hostfiles._render", "picture._attrs"]


DOC_ONLY = [p for p in sorted((PLUGINS / "modules").glob("*.py")) if not has_main(p)]


def test_the_controller_steps_are_documentation_only_modules():
    names = {p.stem for p in DOC_ONLY}
    assert {"cabling_plan", "cabling_picture", "meshccl_wheel", "lab", "plan_verify"} <= names, names


@pytest.mark.parametrize("path", DOC_ONLY, ids=lambda p: p.name)
def test_a_module_without_main_is_the_documentation_of_an_action(path):
    assert (PLUGINS / "action" / path.name).is_file(), f"{path.name} has no main() and no action plugin"
    body = [n for n in tree(path).body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    kinds = {type(n).__name__ for n in body}
    assert kinds <= {"ImportFrom", "Assign"}, f"{path.name}: documentation only, found {kinds}"
    assigned = {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert assigned == {"DOCUMENTATION", "EXAMPLES", "RETURN"}, assigned
    assert [n.module for n in body if isinstance(n, ast.ImportFrom)] == ["__future__"]
