"""The layer contracts in pyproject.toml ([tool.importlinter]) hold: the worker side's packages import downwards
only, the launcher imports no worker-side layer, the agent no torch, and no import cycle (function-level imports
included). `make lint` runs lint-imports itself; this test runs it too, so `pytest tests` sees a broken contract."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lint_imports() -> str:
    found = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if found is None:
        pytest.fail("lint-imports is missing: pip install -r requirements-dev.txt (import-linter)")
    return found


def test_every_layer_contract_is_kept() -> None:
    done = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 6 kept, 0 broken." in done.stdout, done.stdout[-2000:]


def test_a_cycle_breaks_the_contracts(tmp_path: Path) -> None:
    """The contracts see function-level imports: a copy of the source with one added cycle fails."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "hora", copy / "hora", ignore=shutil.ignore_patterns("__pycache__"))
    timers = copy / "hora" / "engine" / "scheduling" / "timers.py"
    cycle = "\n\ndef _cycle() -> None:\n    from hora.engine.scheduling import negotiator  # noqa\n"
    timers.write_text(timers.read_text() + cycle)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    done = subprocess.run([_lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False, env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0, done.stdout[-2000:]
    assert ".timers -> .negotiator" in done.stdout, done.stdout[-2000:]
