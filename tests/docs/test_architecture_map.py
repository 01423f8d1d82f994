"""docs/architecture.md's map is the folder listing of src/hora: every module is named under its package, and
every module named there exists; every class and function the map says lives in a module is defined there."""

from __future__ import annotations

import ast
import functools
import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "hora"


def _map_block() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Layers: the folder listing"):]
    block = section[section.index("```\nsrc/hora/\n") + 4:]
    return block[: block.index("```")].splitlines()[1:]


def _module_lines() -> Iterator[tuple[str, str]]:
    """(package path, line) for every line of the listing that names modules (a ``dir/`` line opens a package
    for the lines indented under it)."""
    dirs: list[tuple[int, str]] = []  # (indent, path) of the open packages
    for line in _map_block():
        if not line.strip() or line.strip().startswith("──"):
            continue
        indent = len(line) - len(line.lstrip())
        while dirs and dirs[-1][0] >= indent:
            dirs.pop()
        base = dirs[-1][1] if dirs else ""
        first = line.split()[0]
        if first.endswith("/"):
            dirs.append((indent, base + first))
            continue
        yield base, line


def listed_modules() -> set[str]:
    """Paths relative to src/hora of every ``*.py`` the map names."""
    return {base + name for base, line in _module_lines() for name in re.findall(r"(?<![\w.])([\w/]+\.py)\b", line)}


def test_every_module_is_on_the_map_and_every_entry_exists() -> None:
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if (p.name != "__init__.py" or p.parent == PACKAGE) and "_compat" not in p.parts}
    listed = listed_modules()
    assert sorted(modules - listed) == [], "modules docs/architecture.md's map does not name"
    assert sorted(listed - modules) == [], "names on the map that are not modules of src/hora"


def test_the_parser_reads_nested_packages() -> None:
    assert "launcher/remote/agent.py" in listed_modules()
    assert "launcher/fixed/driver.py" in listed_modules()
    assert "engine/codec.py" in listed_modules()  # the second name on a "frames.py, codec.py" line


# --- the names the map gives: each class and function it says lives in a module is defined there ------------

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
CAMEL = r"[A-Z][a-z0-9]+[A-Z]\w*"  # a class's name, never an English word: GradientReducer, LocalOp
OUTSIDE = {"DistributedDataParallel"}  # torch's classes the listing names


def _module_path(rel: str) -> Path:
    return PACKAGE / rel


@functools.cache
def _defined(rel: str) -> frozenset[str]:
    """Names defined at the top of the module ``rel`` (a path under src/hora): classes, functions, assignments."""
    tree = ast.parse(_module_path(rel).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


@functools.cache
def _hora_defs() -> dict[str, frozenset[str]]:
    """Every class and function defined at the top of a module of src/hora: name -> the modules defining it."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if "_compat" in path.parts:
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, set()).add(rel)
    return {name: frozenset(mods) for name, mods in found.items()}


def _import(rel: str) -> Any:
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return importlib.import_module(".".join(["hora", *parts]))


def listed_names() -> list[tuple[str, str]]:
    """(module, name) for every hora class or function a line of the folder listing names in its description: the
    text after ``x.py`` up to the next module on the line belongs to ``x.py``. A claim is a class (a capital) or a
    function with an underscore that some module of hora defines, or any CamelCase name (so a renamed class
    still on the map fails); names after a dot, plain lowercase words (English: "run", "store", "rank") and
    torch's classes (``OUTSIDE``) are not read as claims."""
    defs = _hora_defs()
    claims: list[tuple[str, str]] = []
    for base, line in _module_lines():
        pieces = re.split(r"(?<![\w.])([\w/]+\.py)\b", line)  # text, module, text, module, text ...
        for module, text in zip(pieces[1::2], pieces[2::2]):
            for name in re.findall(rf"(?<![\w.\-]){IDENT}", text):
                if name in OUTSIDE or name.startswith("__"):
                    continue
                if (name in defs and (name[0].isupper() or "_" in name)) or re.fullmatch(CAMEL, name):
                    claims.append((base + module, name))
    return claims


def prose_names() -> list[tuple[str, str]]:
    """(module, name) for every ```path.py: Name``` and ```path.py`: `Name``` in the map's prose."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    pattern = rf"`([\w/]+\.py)(?::\s*|`:?\s*`)({IDENT}(?:\.{IDENT})*)`"
    return [(module, name) for module, name in re.findall(pattern, text)]


def dotted_names() -> list[str]:
    """Every ```Class.attr``` (a class hora defines) and ```hora.x.y``` the map's prose names."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    defs = _hora_defs()
    found = [m for m in re.findall(rf"`({IDENT}\.{IDENT})(?:\(\))?`", text)
             if m.split(".")[0] in defs and m.split(".")[0][0].isupper()]
    return found + re.findall(rf"(?<![\w.])(hora(?:\.{IDENT})+)(?!\w|\.<)", text)  # hora.opt.<...>: a name


def _resolve(dotted: str) -> bool:
    """Whether ``hora.a.b.c`` names something: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _instance_attributes(rel: str, cls: str) -> set[str]:
    """The ``self.x = ...`` attributes the methods of class ``cls`` in module ``rel`` set."""
    tree = ast.parse(_module_path(rel).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {t.attr for sub in ast.walk(node) if isinstance(sub, (ast.Assign, ast.AnnAssign))
            for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_every_name_the_folder_listing_gives_a_module_is_defined_there() -> None:
    claims = listed_names()
    missing = sorted(f"{module}: {name}" for module, name in claims if name not in _defined(module))
    assert missing == [], "the map's listing names these in a module that does not define them"


def test_every_module_and_name_the_prose_gives_exists() -> None:
    missing = []
    for module, name in prose_names():
        if not _module_path(module).exists():
            missing.append(f"{module} (no such module)")
            continue
        obj: Any = _import(module)
        for attr in name.split("."):
            if not hasattr(obj, attr):
                missing.append(f"{module}: {name}")
                break
            obj = getattr(obj, attr)
    assert missing == [], "the map's prose names these where they are not"


def test_every_class_attribute_and_hora_path_the_prose_gives_exists() -> None:
    defs = _hora_defs()
    missing = []
    for dotted in dotted_names():
        if dotted.startswith("hora."):
            if not _resolve(dotted):
                missing.append(dotted)
            continue
        cls, attr = dotted.split(".")
        classes = [getattr(_import(m), cls) for m in defs[cls]]
        if not any(hasattr(c, attr) or attr in getattr(c, "__annotations__", {}) for c in classes) \
                and not any(attr in _instance_attributes(m, cls) for m in defs[cls]):
            missing.append(dotted)
    assert missing == [], "the map's prose names these attributes and paths, which do not exist"


def test_the_name_readers_read_what_the_map_says() -> None:
    assert ("calls/call.py", "Call") in listed_names()
    assert ("engine/scheduling/table.py", "Request") in listed_names()
    assert ("launcher/config.py", "RunConfig") in listed_names()
    assert ("engine/scheduling/table.py", "Request") in prose_names()
    assert "Negotiator._ring_if_parked" in dotted_names()
