"""Shared benchmark helpers: start ranks, time alternately, summarise, write JSON + Markdown + PNG.

Absolute times on shared machines drift 30-50% between runs, so every figure is a ratio of two things
measured in the same run, alternating A B A B, as a median of several samples with the spread shown
(PERFORMANCE.md).

Example:
    >>> samples = alternate({"a": lambda: 1.0, "b": lambda: 2.0}, repeats=5)
    >>> summarize(samples["b"])["median"]
    2.0
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

import hora
from hora.bench.report import human_bytes, markdown_table
from hora.bench.timing import alternate, difference_summary, ratio_summary, summarize
from hora.testing import run_ranks

__all__ = ["RESULTS", "alternate", "alternate_steps", "difference_summary", "fork_ranks", "human_bytes",
           "machine_info", "markdown_table", "ratio_summary", "summarize", "write_results"]

RESULTS = Path(__file__).resolve().parent / "results"
QUICK_OUT = Path("out") / "bench-quick"  # where --quick reports go (below the current directory), never RESULTS


def add_output_flags(parser: argparse.ArgumentParser, quick_help: str) -> None:
    """Every benchmark's ``--quick`` (smallest settings, seconds) and ``--out DIR``."""
    parser.add_argument("--quick", action="store_true", help=f"{quick_help}; reports go to {QUICK_OUT}/ "
                        "unless --out is given (the published results are never overwritten by a quick run)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"directory for the reports (default {RESULTS.relative_to(RESULTS.parents[1])}/, "
                             f"or {QUICK_OUT}/ with --quick)")


def output_dir(args: argparse.Namespace) -> Path:
    """``--out``, else ``out/bench-quick`` for a quick run, else ``benchmarks/results``."""
    if args.out is not None:
        return Path(args.out)
    return QUICK_OUT if args.quick else RESULTS


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the numbers: host, CPU, memory, versions, commit."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = 0.0
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem_gib = round(pages / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": mem_gib,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "hora": hora.__version__,
        "git_commit": _git_commit(),
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],  # other work on the machine skews timings
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_results(name: str, data: Mapping[str, Any], markdown: str,
                  plot: Callable[[Any], None] | None = None, out_dir: Path = RESULTS) -> list[Path]:
    """Write ``<name>.json`` (data), ``<name>.md`` and, with ``plot(figure)``, ``<name>.png``. Returns paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(data, indent=1, default=str) + "\n")
    paths[1].write_text(markdown)
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return paths
        fig = plt.figure(figsize=(8, 5))
        plot(fig)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=110)
        plt.close(fig)
        paths.append(out_dir / f"{name}.png")
    return paths


def alternate_steps(step_of: Mapping[str, Callable[[], None]], repeats: int, steps: int,
                    barrier: Callable[[], None]) -> dict[str, dict[str, list[float]]]:
    """Training steps of several variants, alternating (:func:`alternate`): each sample is ``steps`` calls of a
    variant's step after a ``barrier`` (so no variant pays for another's stragglers), as seconds per step of
    wall time (``"wall"``) and of this process's CPU time, every thread's (``"cpu"``), per variant."""
    import time

    cpu: dict[str, list[float]] = {v: [] for v in step_of}

    def timed(variant: str) -> Callable[[], float]:
        step = step_of[variant]

        def run() -> float:
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step()
            cpu[variant].append((time.process_time() - c0) / steps)
            return (time.perf_counter() - t0) / steps
        return run

    wall = alternate({v: timed(v) for v in step_of}, repeats=repeats, warmup=1)
    return {"wall": wall, "cpu": {v: c[-repeats:] for v, c in cpu.items()}}


def fork_ranks(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 600.0,
               env: Mapping[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, size, *args)`` on ``nprocs`` fork-started ranks with hora's launcher variables.

    The tests' fork harness (:func:`hora.testing.run_ranks`), with torch's default threads and no
    ``hora.init()`` around ``fn`` (the benchmark's ranks init themselves). Returns the values in rank order
    and raises RuntimeError with every failed rank's traceback.
    """
    try:
        return run_ranks(fn, nprocs, *args, timeout=timeout, env=env, init=False, threads=None)
    except AssertionError as exc:
        raise RuntimeError(f"benchmark ranks failed:\n{exc}") from None
