"""The suite's own pytest plugins (tests/plugins), each run on a small test file in a pytest of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SAMPLE = '''
import subprocess, sys
import pytest

def test_needs_a_tool():
    pytest.skip("needs frobnicate: run `make system-deps` as root")

@pytest.mark.gpu
def test_needs_a_gpu():
    pytest.skip("no CUDA device")

def test_fails():
    assert 1 + 1 == 3, "arithmetic broke"

def test_after_the_failure():
    pass
'''


def _pytest(tmp: Path, source: str, *args: str, ci: str | None = None,
            plugin: str = "tests.plugins.skips") -> subprocess.CompletedProcess[str]:
    (tmp / "test_sample.py").write_text(source)
    (tmp / "pytest.ini").write_text("[pytest]\nmarkers =\n  gpu: needs a GPU\n")
    if plugin.endswith("leaks"):
        (tmp / "pytest.ini").write_text("[pytest]\nleak_grace_s = 0.5\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(ROOT)
    env["COLUMNS"] = "250"  # the short summary keeps its lines whole
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", plugin, *args,
                           "test_sample.py"], cwd=tmp, env=env, capture_output=True, text=True, timeout=120)


def test_under_ci_a_skip_fails_and_names_what_is_missing(tmp_path: Path) -> None:
    out = _pytest(tmp_path, SAMPLE, "-rf", ci="true")
    assert out.returncode == 1
    assert "FAILED test_sample.py::test_needs_a_tool - skipped under CI: needs frobnicate" in out.stdout
    assert "2 failed, 1 passed, 1 skipped" in out.stdout  # the gpu test alone still skips


def test_under_ci_a_module_that_cannot_import_fails(tmp_path: Path) -> None:
    out = _pytest(tmp_path, 'import pytest\npytest.importorskip("no_such_package_hora")\ndef test_x(): pass\n',
                  ci="1")
    assert out.returncode != 0
    assert "skipped under CI: could not import 'no_such_package_hora'" in out.stdout


def test_ci_false_and_local_runs_keep_skips_and_end_with_one_line(tmp_path: Path) -> None:
    for ci in (None, "false"):
        out = _pytest(tmp_path, SAMPLE, ci=ci)
        assert out.returncode == 1 and "1 failed, 1 passed, 2 skipped" in out.stdout  # only the real failure
        lines = [line for line in out.stdout.splitlines() if line.startswith("skipped: ")]
        assert lines == ["skipped: test_sample.py (2: 1 needs frobnicate: run `make system-deps` as root; "
                         "1 no CUDA device)"]


def test_a_failure_is_named_as_it_happens(tmp_path: Path) -> None:
    out = _pytest(tmp_path, SAMPLE, "-v", plugin="tests.plugins.progress")
    lines = out.stdout.splitlines()
    named = lines.index("FAILED test_sample.py::test_fails: AssertionError: arithmetic broke")
    after = next(i for i, line in enumerate(lines) if "test_after_the_failure" in line)
    assert named < after  # before the next test runs, not only in the summary


def test_a_test_that_leaves_a_process_running_fails_naming_it(tmp_path: Path) -> None:
    source = ('import subprocess, sys\n'
              'def test_leaks():\n'
              '    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # left behind"])\n'
              'def test_waits():\n'
              '    proc = subprocess.Popen([sys.executable, "-c", "pass"])\n'
              '    proc.wait()\n')
    out = _pytest(tmp_path, source, "-rE", plugin="tests.plugins.leaks")
    assert out.returncode == 1
    assert "ERROR test_sample.py::test_leaks - Failed: this test left 1 process behind (killed now)" in out.stdout
    assert "time.sleep(600)  # left behind" in out.stdout
    assert "2 passed, 1 error" in out.stdout  # test_leaks' body passed; its teardown failed
    assert "test_waits" not in out.stdout.split("short test summary")[-1]
    leftover = subprocess.run(["pgrep", "-f", "time.sleep(600)  # left behind"], capture_output=True, text=True)
    assert leftover.stdout == ""  # and it was killed


def test_the_gpu_suite_skips_with_one_line_where_there_is_no_gpu_even_under_ci() -> None:
    env = {**os.environ, "CI": "true", "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "250"}
    env.pop("HORA_GPU_SUITE_ON_CPU", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    skipped = [line for line in out.stdout.splitlines() if line.startswith("skipped: ")]
    assert len(skipped) == 1 and skipped[0].startswith("skipped: tests/gpu (")
    assert "no CUDA device here (torch.cuda.device_count() == 0)" in skipped[0]
    assert " passed" not in out.stdout and " failed" not in out.stdout
