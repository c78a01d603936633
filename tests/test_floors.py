"""The floors of the package (docs/architecture.md), read from every import of every module.

Imports inside functions count; imports under ``if TYPE_CHECKING:`` do not. Each rule reports
every violation with its file and line.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "transmuter_jax"

# Each floor imports only from itself and the floors below it (lowest first).
FLOORS = (
    ("runtime", ("runtime", "hub", "default")),
    ("onnx and kernels", ("onnx", "kernels")),
    ("parallel", ("parallel",)),
    ("generation", ("generation",)),
    ("tasks", ("tasks", "text", "audio", "vision", "testing")),
    ("front ends", ("cli", "serving", "__main__", "")),  # "": the package's own __init__
)


@dataclass(frozen=True)
class Import:
    """One import statement's target, as a module of the package, and the name it takes."""

    module: str  # the importing module
    file: str  # its path, relative to the repository
    line: int
    target: str  # the imported module
    name: str | None  # the name taken from ``target`` that is not a module, if any


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST):
    """Every import statement of ``tree``, at any depth, except under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.orelse:
                yield from _statements(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _statements(node)


def imports(known: dict[str, pathlib.Path]) -> list[Import]:
    """Every import of a module of the package by a module of the package (a module imported
    by one statement once, with the first name it takes)."""
    found: dict[tuple, Import] = {}
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        file = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), filename=file)
        for node in _statements(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == PACKAGE:
                        imp = Import(module, file, node.lineno, alias.name, None)
                        found.setdefault((file, node.lineno, imp.target, None), imp)
                continue
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:  # ``from package import module``
                    imp = Import(module, file, node.lineno, sub, None)
                else:
                    imp = Import(module, file, node.lineno, source, alias.name)
                private = imp.name if imp.name and _private(imp.name) else None
                found.setdefault((file, node.lineno, imp.target, private), imp)
    return list(found.values())


def floor_of(module: str) -> int | None:
    """The index in :data:`FLOORS` of a module of the package, None when it has none."""
    first = module.split(".")[1] if "." in module else ""
    for index, (_, heads) in enumerate(FLOORS):
        if first in heads:
            return index
    return None


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def floor_violations(known, found) -> list[str]:
    out = []
    for module in known:
        if floor_of(module) is None:
            out.append(f"{known[module].relative_to(ROOT)}: {module} is on no floor (FLOORS)")
    for imp in found:
        mine, theirs = floor_of(imp.module), floor_of(imp.target)
        if mine is not None and theirs is not None and theirs > mine:
            out.append(
                f"{imp.file}:{imp.line}: {imp.module} ({FLOORS[mine][0]}) imports "
                f"{imp.target} ({FLOORS[theirs][0]}, a floor above)"
            )
    return out


def private_violations(known, found) -> list[str]:
    out = []
    for imp in found:
        here = known[imp.module].parent
        parts = imp.target.split(".")
        for i, part in enumerate(parts):
            if _private(part) and (ROOT / pathlib.Path(*parts[:i])) != here:
                out.append(
                    f"{imp.file}:{imp.line}: {imp.module} imports the private module "
                    f"{'.'.join(parts[: i + 1])} of another folder"
                )
                break
        else:
            if imp.name and _private(imp.name) and known[imp.target].parent != here:
                out.append(
                    f"{imp.file}:{imp.line}: {imp.module} takes the private name {imp.name} "
                    f"from {imp.target}, of another folder"
                )
    return out


def implied(imp: Import) -> list[str]:
    """The modules an import runs: its target, and the packages above it (their ``__init__``)
    that are not above the importing module (those are running already)."""
    parts = imp.target.split(".")
    mine = imp.module.split(".")
    above = [".".join(parts[:i]) for i in range(1, len(parts)) if parts[:i] != mine[:i]]
    return [*above, imp.target]


def cycles(known, found) -> list[list[str]]:
    """The import cycles: each strongly connected component of more than one module."""
    graph: dict[str, set[str]] = {m: set() for m in known}
    for imp in found:
        for target in implied(imp):
            if target in graph and target != imp.module:
                graph[imp.module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def cycle_violations(known, found) -> list[str]:
    out = []
    for component in cycles(known, found):
        members = set(component)
        edges = [
            f"{imp.file}:{imp.line}: {imp.module} -> {target}"
            for imp in found
            if imp.module in members
            for target in implied(imp)
            if target in members and target != imp.module
        ]
        out.append(f"import cycle among {', '.join(component)}:\n    " + "\n    ".join(edges))
    return out


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return known, imports(known)


def _report(violations: list[str]) -> str:
    return f"{len(violations)} violation(s):\n" + "\n".join(violations)


def test_each_floor_imports_only_the_floors_below(graph):
    violations = floor_violations(*graph)
    assert not violations, _report(violations)


def test_no_private_names_across_folders(graph):
    violations = private_violations(*graph)
    assert not violations, _report(violations)


def test_no_import_cycles(graph):
    violations = cycle_violations(*graph)
    assert not violations, _report(violations)


def _checked(tmp_path: pathlib.Path, files: dict[str, str], monkeypatch) -> list[str]:
    """The violations of a made-up package laid out as ``files``."""
    for name, text in files.items():
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    known = modules()
    found = imports(known)
    return (
        floor_violations(known, found)
        + private_violations(known, found)
        + cycle_violations(known, found)
    )


def test_the_rules_find_what_they_forbid(tmp_path, monkeypatch):
    """Each rule fires on a made-up package: a floor crossed inside a function, a private name
    and a private module taken from another folder, a circle of three modules; a
    ``TYPE_CHECKING`` import and a private module of the same folder pass."""
    found = _checked(
        tmp_path,
        {
            "__init__.py": "",
            "onnx/__init__.py": "",
            "onnx/model.py": "def f():\n    from ..generation import loop\n",
            "onnx/_util.py": "",
            "onnx/ops.py": "from . import _util\n",
            "generation/__init__.py": "",
            "generation/loop.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from ..text import pipe\n"
                "from ..onnx import _util\nfrom ..onnx.ops import _hidden\n"
            ),
            "text/__init__.py": "",
            "text/pipe.py": "from . import a\n",
            "text/a.py": "from . import b\n",
            "text/b.py": "from .pipe import x\n",
            "mystery.py": "",
        },
        monkeypatch,
    )
    text = "\n".join(found)
    assert "transmuter_jax/onnx/model.py:2: transmuter_jax.onnx.model (onnx and kernels)" in text
    assert "private module transmuter_jax.onnx._util" in text
    assert "private name _hidden from transmuter_jax.onnx.ops" in text
    assert "import cycle among transmuter_jax.text.a, transmuter_jax.text.b" in text
    assert "transmuter_jax.mystery is on no floor" in text
    assert "text.pipe (tasks, a floor above)" not in text  # TYPE_CHECKING only
    assert "onnx/ops.py" not in text  # its own folder's private module
    assert len(found) == 5, text
