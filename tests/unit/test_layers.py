"""The data path's layers import one way only: ops -> calls -> collectives (submit) -> runtime / engine ->
kinds -> hierarchical -> dataplane (the c10d calls). A module that imports a layer above its own (even inside
a function) makes the walk of one op come back up; this test names the import that does."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# top to bottom; a module may import its own layer and the layers below it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("public ops", ("hora.ops", "hora.grouped", "hora.sparse", "hora.functions", "hora.sync_batch_norm",
                    "hora.optimizer", "hora.reducer", "hora.adasum_reducer")),
    ("call building", ("hora.calls",)),
    ("submit", ("hora.collectives",)),
    ("runtime and engine", ("hora.runtime", "hora.engine", "hora.handles", "hora.fusion")),
    ("kinds", ("hora.kinds", "hora.calltypes")),
    ("hierarchical", ("hora.hierarchical", "hora.hostshm")),
    ("data plane", ("hora.dataplane",)),
]


def _layer_of(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for b in node.body for n in ast.walk(b)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def upward_imports() -> list[str]:
    bad = []
    for path in sorted((SRC / "hora").rglob("*.py")):
        module = _module_name(path)
        mine = _layer_of(module)
        if mine is None:
            continue
        for line, target in _imports(path):
            theirs = _layer_of(target)
            if theirs is not None and theirs < mine:
                bad.append(f"{path.relative_to(SRC)}:{line}: {module} ({LAYERS[mine][0]}) imports {target} "
                           f"({LAYERS[theirs][0]}, a layer above)")
    return sorted(set(bad))


def test_the_data_path_imports_downward_only() -> None:
    assert upward_imports() == []


def test_every_layer_exists() -> None:
    """The table above names real modules (a rename must update it, or the test above checks nothing)."""
    modules = {_module_name(p) for p in (SRC / "hora").rglob("*.py")}
    for _, prefixes in LAYERS:
        for prefix in prefixes:
            assert any(m == prefix or m.startswith(prefix + ".") for m in modules), prefix
