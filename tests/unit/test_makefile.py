"""The Makefile's set-up choices, read with ``make -n`` (prints the commands without running them)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)


def test_torch_build_is_chosen_by_a_variable() -> None:
    cpu = _make("torch", "VENV=/nonexistent").stdout
    assert '"torch==2.13.0+cpu"' in cpu and "--index-url https://download.pytorch.org/whl/cpu" in cpu
    assert "a large download, once" in cpu  # said before the long silent install
    cuda = _make("torch", "TORCH=cuda", "VENV=/nonexistent").stdout
    assert '"torch==2.13.0"' in cuda and "download.pytorch.org/whl/cpu" not in cuda
    custom = _make("torch", "TORCH=cuda", "TORCH_INDEX=https://download.pytorch.org/whl/cu126").stdout
    assert "--index-url https://download.pytorch.org/whl/cu126" in custom
    wrong = _make("torch", "TORCH=gpu")
    assert wrong.returncode != 0 and "choose TORCH=cpu or TORCH=cuda" in wrong.stderr


def test_torch_is_installed_before_the_other_requirements() -> None:
    steps = _make("-B", "/nonexistent/.hora-installed", "VENV=/nonexistent").stdout
    assert steps.index("installing torch") < steps.index("-r requirements-dev.txt")
    assert not re.search(r"^torch\b", (ROOT / "requirements-dev.txt").read_text(), re.M)  # no second torch pin


def test_make_help_lists_every_target() -> None:
    proc = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0
    phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert phony is not None
    for target in set(phony.group(1).split()) - {"help", "torch", "system-deps"}:
        assert f"make {target} " in proc.stdout, target
    assert "TORCH=cpu|cuda" in proc.stdout
