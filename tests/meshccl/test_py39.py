"""meshccl's Python package supports Python 3.9 (stock macOS has it). collective/ruff.toml makes
ruff parse it as 3.9 code, which catches new syntax (match, except*); this test catches what a
parser cannot: library calls and names added after 3.9, which would only fail when the line
runs on a 3.9 interpreter. It reads every module of the package (the source, not the build)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "collective" / "python" / "meshccl"
MODULES = sorted(PACKAGE.rglob("*.py"))

# name -> the version that added it, for names imported from a module or used as module.name.
NEWER_NAMES = {
    "typing": {
        "TypeAlias": "3.10",
        "ParamSpec": "3.10",
        "Concatenate": "3.10",
        "TypeGuard": "3.10",
        "is_typeddict": "3.10",
        "Self": "3.11",
        "Never": "3.11",
        "LiteralString": "3.11",
        "Required": "3.11",
        "NotRequired": "3.11",
        "Unpack": "3.11",
        "TypeVarTuple": "3.11",
        "assert_never": "3.11",
        "assert_type": "3.11",
        "reveal_type": "3.11",
        "dataclass_transform": "3.11",
        "override": "3.12",
        "TypeIs": "3.13",
    },
    "itertools": {"pairwise": "3.10", "batched": "3.12"},
    "contextlib": {"aclosing": "3.10", "chdir": "3.11"},
    "enum": {"StrEnum": "3.11", "verify": "3.11"},
    "datetime": {"UTC": "3.11"},
    "asyncio": {"TaskGroup": "3.11", "timeout": "3.11", "Runner": "3.11"},
    "hashlib": {"file_digest": "3.11"},
    "inspect": {"get_annotations": "3.10"},
    "operator": {"call": "3.11"},
}
NEWER_MODULES = {"tomllib": "3.11"}
NEWER_BUILTINS = {
    "anext": "3.10",
    "aiter": "3.10",
    "EncodingWarning": "3.10",
    "ExceptionGroup": "3.11",
    "BaseExceptionGroup": "3.11",
}
NEWER_METHODS = {"bit_count": "int.bit_count, 3.10"}
# f(..., keyword=...) -> what added the keyword.
NEWER_KEYWORDS = {
    ("zip", "strict"): "3.10",
    ("map", "strict"): "3.14",
    ("dataclass", "slots"): "3.10",
    ("dataclass", "kw_only"): "3.10",
    ("dataclass", "match_args"): "3.10",
    ("bisect", "key"): "3.10",
    ("bisect_left", "key"): "3.10",
    ("bisect_right", "key"): "3.10",
    ("insort", "key"): "3.10",
    ("insort_left", "key"): "3.10",
    ("insort_right", "key"): "3.10",
}
TYPES = {"int", "str", "bytes", "float", "bool", "list", "dict", "tuple", "set", "frozenset", "type", "object"}


def callee(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def is_type_union(node: ast.AST) -> bool:
    """`int | None`, `str | bytes`: a union written with | (an object only from 3.10)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr)):
        return False
    sides = (node.left, node.right)
    return any(
        (isinstance(s, ast.Name) and s.id in TYPES)
        or (isinstance(s, ast.Constant) and s.value is None)
        or isinstance(s, ast.Subscript)
        or is_type_union(s)
        for s in sides
    )


def annotation_nodes(tree: ast.AST) -> set[int]:
    """ids of every node inside an annotation (strings under `from __future__ import annotations`)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        roots: list[ast.AST | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            roots += [a.annotation for a in every if a is not None] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        for root in roots:
            if root is not None:
                inside.update(id(n) for n in ast.walk(root))
    return inside


def findings(path: Path) -> list[str]:
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path), feature_version=(3, 9))
    out: list[str] = []
    where = lambda node: f"{path.name}:{getattr(node, 'lineno', '?')}"  # noqa: E731
    has_future = any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    )
    annotations = annotation_nodes(tree)
    if annotations and not has_future:
        out.append(f"{path.name}: annotations without `from __future__ import annotations` (X | Y needs 3.10)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Match):
            out.append(f"{where(node)}: match (3.10)")
        elif type(node).__name__ == "TryStar":
            out.append(f"{where(node)}: except* (3.11)")
        elif isinstance(node, ast.ImportFrom) and node.module in NEWER_NAMES:
            for alias in node.names:
                if alias.name in NEWER_NAMES[node.module]:
                    out.append(f"{where(node)}: {node.module}.{alias.name} ({NEWER_NAMES[node.module][alias.name]})")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out += [f"{where(node)}: module {n} ({NEWER_MODULES[n]})" for n in names if n in NEWER_MODULES]
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.attr in NEWER_NAMES.get(node.value.id, {}):
                out.append(f"{where(node)}: {node.value.id}.{node.attr} ({NEWER_NAMES[node.value.id][node.attr]})")
            if node.attr in NEWER_METHODS:
                out.append(f"{where(node)}: {NEWER_METHODS[node.attr]}")
        elif isinstance(node, ast.Name) and node.id in NEWER_BUILTINS:
            out.append(f"{where(node)}: {node.id} ({NEWER_BUILTINS[node.id]})")
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                added = NEWER_KEYWORDS.get((callee(node), kw.arg or ""))
                if added:
                    out.append(f"{where(node)}: {callee(node)}({kw.arg}=...) ({added})")
        if is_type_union(node) and id(node) not in annotations:
            out.append(f"{where(node)}: a type union with | evaluated at run time (3.10)")
    return out


def test_the_package_has_modules():
    names = {p.relative_to(PACKAGE).as_posix() for p in MODULES}
    assert names >= {"__init__.py", "bootstrap/__init__.py", "bootstrap/rendezvous.py", "bench.py"}


@pytest.mark.parametrize("path", MODULES, ids=[p.relative_to(PACKAGE).as_posix() for p in MODULES])
def test_module_uses_nothing_newer_than_python_3_9(path):
    assert findings(path) == []


def test_the_check_finds_what_3_9_lacks(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import itertools\n"
        "from typing import TypeAlias\n"
        "from dataclasses import dataclass\n\n\n"
        "@dataclass(slots=True)\n"
        "class A:\n"
        "    x: int\n\n\n"
        "def f(a: int | None) -> int:\n"
        "    if isinstance(a, int | str):\n"
        "        return a.bit_count()\n"
        "    return len(list(zip([1], [2], strict=True))) + len(list(itertools.pairwise([1, 2])))\n",
        encoding="utf-8",
    )
    found = "\n".join(findings(bad))
    for what in (
        "typing.TypeAlias",
        "dataclass(slots=...)",
        "a type union with |",
        "int.bit_count",
        "zip(strict=...)",
        "itertools.pairwise",
        "without `from __future__ import annotations`",
    ):
        assert what in found, found
    assert "bad.py:11: a type union" not in found  # the annotation `int | None` is only a string
