"""What users read speaks of their world: no project-internal words in docs, examples, benchmark reports."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INTERNAL = re.compile(r"\bissues? ?#?\d+\b|\bseed article\b|\bthe seed'?s?\b|\bgoals?\b", re.IGNORECASE)


def _user_facing() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*.ipynb")), *sorted((ROOT / "benchmarks").glob("*.py")),
             *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
    return [f for f in files if f.is_file()]


def test_no_project_internal_words_in_user_facing_text() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {text.strip()[:100]}"
             for path in _user_facing()
             for n, text in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if INTERNAL.search(text)]
    assert not found, "project-internal words in user-facing text:\n" + "\n".join(found)
