"""Run every benchmark on its smallest settings (``--quick``), one after the other: ``make bench-quick``.

A smoke run: it shows each benchmark works on this machine and what its report looks like, in about a
minute or two on 2 cores. The reports go to ``--out`` (default ``out/bench-quick``); the published results in
``benchmarks/results`` are never touched. Figures from a quick run are too few samples to quote.

    python benchmarks/run_quick.py [--out DIR] [--only allreduce_bench,op_overhead]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from common import QUICK_OUT

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["allreduce_bench", "op_overhead", "optimizer_bench", "sharding_bench", "diagnostics_overhead",
              "timeline_cost", "startup_bench"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=QUICK_OUT, help=f"directory for the reports (default {QUICK_OUT})")
    p.add_argument("--only", help="comma-separated benchmark names (default: all)")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else BENCHMARKS
    failed = []
    for name in names:
        start = time.monotonic()
        proc = subprocess.run([sys.executable, str(HERE / f"{name}.py"), "--quick", "--out", str(args.out)],
                              capture_output=True, text=True, check=False)
        took = time.monotonic() - start
        if proc.returncode == 0:
            print(f"{name:22s} ok      {took:5.1f} s  {args.out / (name + '.md')}", flush=True)
        else:
            failed.append(name)
            print(f"{name:22s} FAILED  {took:5.1f} s  (exit {proc.returncode})\n{proc.stderr[-2000:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
