"""The suite's own layout rules (docs/testing.md, "How the suite is laid out"), checked so they cannot erode:
every folder of Python files under tests/ is a package, and no test imports a helper through conftest."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_folder_of_python_files_is_a_package() -> None:
    folders = {p.parent for p in _python_files()}
    missing = sorted(str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").exists())
    assert missing == [], f"add an __init__.py to: {', '.join(missing)}"


def test_no_helper_is_imported_through_conftest() -> None:
    offenders = [str(p.relative_to(TESTS.parent)) for p in _python_files()
                 if re.search(r"^\s*(from conftest import|import conftest)", p.read_text(), re.M)]
    assert offenders == [], f"import helpers by their full name (tests.<folder>.<module>): {offenders}"


# Files whose loops may sleep: scripts that run in a process of their own (on a namespace host, under hora run
# or in a container) with only their own folder on sys.path, so tests.polling is out of their reach, and the
# polling helper itself.
_LOOPS_OF_THEIR_OWN = {
    "tests/polling.py",
    "tests/cluster/attacked_worker.py", "tests/cluster/attacker.py", "tests/cluster/mesh_attack.py",
    "tests/cluster/mesh_attack_worker.py", "tests/cluster/up.py", "tests/cluster/worker.py",
    "tests/launcher/elastic_protocol_worker.py", "tests/launcher/elastic_sampler_worker.py",
}


def _uses(node: ast.AST, module: str, names: tuple[str, ...]) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in names and isinstance(n.value, ast.Name)
               and n.value.id == module for n in ast.walk(node))


def _hand_written_waits(path: Path) -> list[int]:
    """Lines of ``while`` loops that sleep or read the clock: a wait written by hand. A loop that reads a
    stream with ``select`` until a deadline waits on an event, and is no poll."""
    tree = ast.parse(path.read_text())
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.While)
            and _uses(node, "time", ("sleep", "monotonic")) and not _uses(node, "select", ("select",))]


def test_waits_go_through_the_one_polling_helper() -> None:
    offenders = [f"{rel}:{line}" for p in _python_files()
                 if (rel := str(p.relative_to(TESTS.parent))) not in _LOOPS_OF_THEIR_OWN
                 for line in _hand_written_waits(p)]
    assert offenders == [], f"wait with tests.polling.wait_until (or an event), not a loop of your own: {offenders}"
