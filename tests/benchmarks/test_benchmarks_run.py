"""Every benchmark runs end to end on its smallest settings and writes its report.

Benchmarks are not tests (their figures are never asserted), but a benchmark broken by a refactor goes
unnoticed until someone needs its numbers. Each one runs here as a user runs it, in its own process, into a
temporary directory: the committed results in ``benchmarks/results`` are left alone (and a quick run without
``--out`` leaves them alone too).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

NAMES = ["allreduce_bench", "diagnostics_overhead", "large_model_start", "op_overhead", "optimizer_bench",
         "sharding_bench", "timeline_cost"]


@pytest.mark.parametrize("name", NAMES)
def test_benchmark_runs_and_writes_its_report(name: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = (tmp_path / f"{name}.md").read_text()
    assert "|---|" in report  # a Markdown table of figures
    assert (tmp_path / f"{name}.json").stat().st_size > 0


# not benchmarks with a report: helpers, workers a driver starts (shaped_worker: --out is its result file;
# elastic_worker: the training script elastic_bench.py and tests/cluster/test_elastic.py run; wire16:
# the module it imports), and
# the replica of Horovod's synthetic example, which keeps that example's flags only (runs under hora run)
NOT_REPORTING = ("common", "startup_worker", "shaped_worker", "wire16", "run_quick", "pytorch_synthetic_benchmark",
                 "elastic_worker", "autotune_worker")


def _usage(script: Path) -> str:
    return subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                          timeout=120).stdout


def test_every_benchmark_takes_quick_and_out() -> None:
    scripts = [s for s in sorted(BENCHMARKS.glob("*.py")) if s.stem not in NOT_REPORTING]
    with ThreadPoolExecutor(max_workers=4) as pool:  # each --help imports torch: seconds apiece, in parallel
        usages = dict(zip(scripts, pool.map(_usage, scripts)))
    for script, usage in usages.items():
        assert "--quick" in usage and "--out" in usage, script.name


def test_a_quick_run_leaves_the_published_results_alone(tmp_path: Path) -> None:
    """`--quick` without `--out` writes below the current directory, in out/bench-quick, not benchmarks/results."""
    results = BENCHMARKS / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "run_quick.py"), "--only", "op_overhead"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "out" / "bench-quick" / "op_overhead.md").is_file()
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before


def test_compare_commits_runs_a_benchmark_from_two_commits_and_prints_ratios(tmp_path: Path) -> None:
    """Both sides HEAD (an A/A run): each run imports hora from its own temporary worktree, the table has
    hora's figures with a ratio, and the worktrees are gone afterwards."""
    if not (BENCHMARKS.parent / ".git").exists():
        pytest.skip("not a git checkout")
    before = subprocess.run(["git", "-C", str(BENCHMARKS), "worktree", "list"], capture_output=True, text=True).stdout
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "compare_commits.py"), "--old", "HEAD", "--quick",
                           "--out", str(tmp_path), "op_overhead.py"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "new/old" in proc.stdout and "| hora us/call |" in proc.stdout
    report = json.loads((tmp_path / "compare_commits.json").read_text())
    assert report["ratios"]["hora us/call"] > 0 and len(report["runs"]["old"]) == len(report["runs"]["new"]) == 1
    after = subprocess.run(["git", "-C", str(BENCHMARKS), "worktree", "list"], capture_output=True, text=True).stdout
    assert after == before
