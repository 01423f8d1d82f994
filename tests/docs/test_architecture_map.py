"""docs/architecture.md's map is the folder listing of src/hora: every module is named under its package, and
every module named there exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "hora"


def _map_block() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Layers: the folder listing"):]
    block = section[section.index("```\nsrc/hora/\n") + 4:]
    return block[: block.index("```")].splitlines()[1:]


def listed_modules() -> set[str]:
    """Paths relative to src/hora of every ``*.py`` the map names (a ``dir/`` line opens a package for the lines
    indented under it)."""
    found: set[str] = set()
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
        for name in re.findall(r"(?<![\w.])([\w/]+\.py)\b", line):
            found.add(base + name)
    return found


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
