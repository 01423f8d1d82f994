"""The Makefile's set-up choices, read with ``make -n`` (prints the commands without running them)."""

from __future__ import annotations

import os
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


def _system_deps(tmp: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    """`make system-deps` with one tool that cannot be there and an apt-get that fails (``false``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MAKEFLAGS", "MAKELEVEL")}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(["make", "--no-print-directory", "system-deps", "SYSTEM_TOOLS=/nonexistent/hora-tool",
                           "APT_GET=false", f"SYSTEM_DEPS_LOG={tmp / 'apt.log'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_system_deps_under_ci_fails_naming_the_missing_tool(tmp_path: Path) -> None:
    out = _system_deps(tmp_path, "true")
    assert out.returncode != 0
    assert "error: CI is set and these tools are missing: /nonexistent/hora-tool" in out.stderr


def test_system_deps_locally_warns_and_goes_on(tmp_path: Path) -> None:
    for ci in (None, "false"):
        out = _system_deps(tmp_path, ci)
        assert out.returncode == 0, out.stderr
        assert "warning: missing /nonexistent/hora-tool; the tests needing them skip" in out.stdout


def _ci_run(tmp: Path, lint_exit: int, test_exit: int) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """.ci/run with a stand-in `make` on PATH that records its targets and exits as told."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp / "make.log"
    log.write_text("")
    fake = bin_dir / "make"
    fake.write_text(f'#!/bin/sh\necho "$1 CI=$CI" >> {log}\n'
                    f'[ "$1" = lint ] && exit {lint_exit}\n[ "$1" = test ] && exit {test_exit}\nexit 0\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    out = subprocess.run(["bash", str(ROOT / ".ci/run")], env=env, capture_output=True, text=True, timeout=60)
    return out, log.read_text().splitlines()


def test_ci_runs_lint_and_tests_under_ci_and_fails_on_either(tmp_path: Path) -> None:
    out, calls = _ci_run(tmp_path, 0, 0)
    assert out.returncode == 0 and calls == ["lint CI=true", "test CI=true"]
    out, calls = _ci_run(tmp_path, 1, 0)
    assert out.returncode != 0 and calls == ["lint CI=true", "test CI=true"]  # the tests still ran
    assert "make lint exit 1, make test exit 0" in out.stdout
    out, calls = _ci_run(tmp_path, 0, 2)
    assert out.returncode != 0 and "make lint exit 0, make test exit 2" in out.stdout
