"""Timeline cost (not a test): what the core pays per collective for the timeline, off and on.

Cases, alternated A B A B within each repetition so drift hits all alike:
  * ``off``   ``tl = active(); if tl is not None: ...`` with no timeline running (the core's check)
  * ``span``  one ``Timeline.span`` with name/bytes/dtype/shape args, including its share of the flushes
              (every 512 events and every 0.5 s) and of the final close
  * ``phases`` the six phases of one collective (negotiate ... decompress): what one op costs when on

Reports per-call medians of ``--reps`` (>= 5) with min and max, and the per-collective cost as a fraction
of the cheapest collective measured here (a 1-element Gloo allreduce, ~0.4 ms with 2 ranks, PERFORMANCE.md).

    .venv/bin/python benchmarks/timeline_cost.py --reps 7 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hora.diagnostics import timeline as T

N = 20_000
TINY_ALLREDUCE_S = 0.4e-3  # PERFORMANCE.md: 1-element Gloo allreduce, 2 ranks, this machine


def off(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        tl = T.active()
        if tl is not None:
            raise AssertionError("timeline should be off")
    return (time.perf_counter() - t0) / n


def _on(n: int, phases: tuple[str, ...]) -> float:
    with tempfile.TemporaryDirectory() as d:
        tl = T.start_timeline(str(Path(d) / "t.json"), rank=0, size=1)
        s = time.perf_counter()
        t0 = time.perf_counter()
        for i in range(n):
            tl = T.active()
            if tl is not None:
                for ph in phases:
                    tl.span("grad.bucket.3", ph, s, s, bytes=4096, dtype="float32", shape=[1024])
        T.stop_timeline()
        return (time.perf_counter() - t0) / n


def span(n: int) -> float:
    return _on(n, ("communicate",))


def phases(n: int) -> float:
    return _on(n // 6, T.PHASES)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="write raw samples and machine info here")
    args = ap.parse_args()
    cases: dict[str, Callable[[int], float]] = {"off": off, "span": span, "phases": phases}
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(args.reps):
        order = list(cases) if rep % 2 == 0 else list(reversed(cases))
        for k in order:
            samples[k].append(cases[k](N))
    rows = ["| case | median µs/call | min | max | per collective vs 0.4 ms allreduce |", "|---|---|---|---|---|"]
    for k, v in samples.items():
        med = statistics.median(v)
        per_op = med if k != "span" else med * len(T.PHASES)
        rows.append(f"| {k} | {med * 1e6:.2f} | {min(v) * 1e6:.2f} | {max(v) * 1e6:.2f} | "
                    f"{per_op / TINY_ALLREDUCE_S * 100:.2f}% |")
    table = "\n".join(rows)
    sys.stdout.write(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "samples_s": samples, "calls_per_sample": N, "python": platform.python_version(),
            "machine": platform.platform(), "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
