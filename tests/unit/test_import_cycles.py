"""The meshkit package imports without cycles: every import of one of its modules by another,
those inside functions included (a cycle hidden in a function is a cycle all the same: cli and
check once imported each other that way), read from the sources with ast."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "meshkit"


def imports(source: str, modules: set[str]) -> set[str]:
    """The package's modules a module's source imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.ImportFrom):  # relative: from . import x, from .x import y
            base = ["meshkit", *([node.module] if node.module else [])]
            names = [".".join(base), *(".".join([*base, alias.name]) for alias in node.names)]
        else:
            continue
        out |= {name.split(".")[1] for name in names if name.startswith("meshkit.") and name.split(".")[1] in modules}
    return out


def graph(sources: dict[str, str]) -> dict[str, set[str]]:
    modules = set(sources)
    return {name: imports(text, modules) - {name} for name, text in sources.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle's first appearance in a depth-first walk, as a path a -> ... -> a."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt in path:
                cycle = [*path[path.index(nxt) :], nxt]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    found.append(cycle)
            elif len(path) < len(edges):
                walk(nxt, [*path, nxt])

    for start in sorted(edges):
        walk(start, [start])
    return found


def package_sources() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"}


def test_the_meshkit_package_has_no_import_cycle() -> None:
    found = cycles(graph(package_sources()))
    assert not found, "import cycles in meshkit/: " + "; ".join(" -> ".join(c) for c in found)


def test_the_launch_front_doors_import_the_service_not_each_other() -> None:
    edges = graph(package_sources())
    assert "launch_service" in edges["cli"] and "launch_service" in edges["check"]
    assert "cli" not in edges["check"]


def test_a_cycle_through_a_function_level_import_is_found_and_named() -> None:
    sources = {
        "cli": "from meshkit import check\n",
        "check": "def prepare():\n    from meshkit import cli\n    return cli\n",
        "a": "import meshkit.b\n",
        "b": "from meshkit.c import thing\n",
        "c": "from . import a\n",
        "leaf": "import json\n",
    }
    assert cycles(graph(sources)) == [["a", "b", "c", "a"], ["check", "cli", "check"]]
