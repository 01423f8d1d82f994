"""The suite's own layout rules (docs/testing.md, "How the suite is laid out"), checked so they cannot erode:
every folder of Python files under tests/ is a package, and no test imports a helper through conftest."""

from __future__ import annotations

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
