"""No import cycle inside src/hora: every import (at module level or inside a function, but not under
``if TYPE_CHECKING:``) must point down the layers of docs/architecture.md.

The graph has one node per module (a package's node is its ``__init__``). ``from hora.x import y`` is an
edge to ``hora.x.y`` when that is a module, else to ``hora.x``. Importing ``hora.x.y`` also runs the
packages above it, but those edges are left out: a package's ``__init__`` only re-exports its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "hora"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (SRC / ROOT).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, mods: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    todo = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                todo.extend(child.orelse)  # the else branch runs
                continue
            todo.append(child)
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package this module is in
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    package = package[: len(package) - child.level + 1]
                    base = ".".join(package + ([base] if base else []))
                for alias in child.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
    return {name for name in found if name in mods and name != module}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", mods)
            for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One cycle through the component's first module, as a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    todo = [[start]]
    seen = {start}
    while todo:
        path = todo.pop(0)
        for w in sorted(graph[path[-1]] & members):
            if w == start:
                return " -> ".join([*path, start])
            if w not in seen:
                seen.add(w)
                todo.append([*path, w])
    return ", ".join(component)


def test_the_graph_sees_imports_inside_functions_and_skips_type_checking() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hora import runtime\n"
                     "def f():\n    from hora.engine import plan\n")
    mods = {"hora.x": Path(), "hora.runtime": Path(), "hora.engine.plan": Path()}
    assert _imports(tree, "hora.x", False, mods) == {"hora.engine.plan"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_inside_hora() -> None:
    graph = import_graph()
    assert "hora.engine.negotiator" in graph and graph["hora.runtime"], "the graph is empty: wrong source root?"
    found = cycles(graph)
    assert not found, "import cycles inside src/hora (each shown as one loop through it):\n" + "\n".join(
        _path(graph, c) for c in found)


def test_the_engine_does_not_import_the_runtime() -> None:
    graph = import_graph()
    engine = {name for name in graph if name.startswith("hora.engine")}
    assert engine, "no hora.engine package"
    offenders = {name: sorted(graph[name] & {"hora.runtime", "hora.collectives", "hora.ops"}) for name in engine}
    assert not any(offenders.values()), f"the engine reaches up the layers: {offenders}"
