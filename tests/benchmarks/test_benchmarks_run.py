"""Every benchmark runs end to end on its smallest settings and writes its report.

Benchmarks are not tests (their figures are never asserted), but a benchmark broken by a refactor goes
unnoticed until someone needs its numbers. Each one runs here as a user runs it, in its own process, into a
temporary directory: the committed results in ``benchmarks/results`` are left alone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

CASES = {
    "allreduce_bench": ["--quick"],
    "optimizer_bench": ["--quick", "--variants", "ddp,hora"],
    "op_overhead": ["--repeats", "2", "--calls", "20"],
    "diagnostics_overhead": ["--repeats", "2", "--steps", "1", "--micro-calls", "100"],
    "timeline_cost": ["--repeats", "1"],
}
REPORT = {"allreduce_bench": "allreduce_bench_quick"}  # --quick writes beside the full run's report


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs_and_writes_its_report(name: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *CASES[name], "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    stem = REPORT.get(name, name)
    report = (tmp_path / f"{stem}.md").read_text()
    assert "|---|" in report  # a Markdown table of figures
    assert (tmp_path / f"{stem}.json").stat().st_size > 0
