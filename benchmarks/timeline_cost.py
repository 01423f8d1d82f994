"""Timeline cost (not a test): what the core pays per collective for the timeline, off and on.

Cases, alternated A B C D within each repetition (PERFORMANCE.md), each sample the mean over many calls:
  * ``off``      ``tl = active(); if tl is not None: ...`` with no timeline running (the core's check)
  * ``span``     one ``Timeline.span`` with kind/bytes/dtype/shape args, including its share of the flushes
                 (every 512 events and every 0.5 s) and of the final close
  * ``op``       the four slices a typical collective records (copy_in, negotiate, communicate, copy_out)
  * ``unnamed``  the same for an unnamed op (generated name: a pooled row is taken and given back)

The per-op cost is also given as a fraction of the cheapest collective measured here (a 1-element Gloo
allreduce, ~0.4 ms with 2 ranks, PERFORMANCE.md) and of a 25 MB bucket's allreduce (~50 ms at ~1 GB/s).

    .venv/bin/python benchmarks/timeline_cost.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    add_output_flags,
    alternate,
    machine_info,
    markdown_table,
    output_dir,
    summarize,
    write_results,
)

from hora.diagnostics import timeline as T

CALLS = 20_000
TINY_ALLREDUCE_S = 0.4e-3  # PERFORMANCE.md: 1-element Gloo allreduce, 2 ranks, this machine
BUCKET_ALLREDUCE_S = 50e-3  # 25 MB at ~1 GB/s bus bandwidth on loopback
OP_PHASES = ("copy_in", "negotiate", "communicate", "copy_out")
ARGS = {"kind": "allreduce", "bytes": 4096, "dtype": "float32", "shape": [1024]}


def off() -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS):
        tl = T.active()
        if tl is not None:
            raise AssertionError("timeline should be off")
    return (time.perf_counter() - t0) / CALLS


def calib() -> float:
    """A fixed piece of pure-Python work (~9 µs on an idle core here): the yardstick for a loaded machine."""
    t0 = time.perf_counter()
    for _ in range(CALLS // 20):
        sum(range(1000))
    return (time.perf_counter() - t0) / (CALLS // 20)


def _on(n: int, names: Callable[[int], str], phases: tuple[str, ...]) -> float:
    with tempfile.TemporaryDirectory() as d:
        T.start_timeline(str(Path(d) / "t.json"), rank=0, size=1)
        s = time.perf_counter()
        t0 = time.perf_counter()
        for i in range(n):
            tl = T.active()
            if tl is not None:
                name = names(i)
                for ph in phases:
                    tl.span(name, ph, s, s, **ARGS)
        T.stop_timeline()
        return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    add_output_flags(ap, "1 sample of each case")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = 1
    cases: dict[str, Callable[[], float]] = {
        "calib": calib,
        "off": off,
        "span": lambda: _on(CALLS, lambda i: "grad.bucket.3", ("communicate",)),
        "op": lambda: _on(CALLS // 4, lambda i: "grad.bucket.3", OP_PHASES),
        "unnamed": lambda: _on(CALLS // 4, lambda i: f"noname.ps0.{i}", OP_PHASES),
    }
    samples = alternate(cases, args.repeats)
    rows = []
    for k, v in samples.items():
        s = summarize(v)
        ratio = summarize([a / c for a, c in zip(v, samples["calib"])])["median"]  # pair by pair
        rows.append([k, f"{s['median'] * 1e6:.2f}", f"{s['min'] * 1e6:.2f}-{s['max'] * 1e6:.2f}", f"{ratio:.3f}",
                     f"{s['median'] / TINY_ALLREDUCE_S * 100:.2f}%", f"{s['median'] / BUCKET_ALLREDUCE_S * 100:.3f}%"])
    md = markdown_table(["case", "median µs per call/op", "min-max µs", "in calib units",
                         "vs 0.4 ms allreduce", "vs 50 ms bucket"], rows)
    md += ("\ncalib = one sum(range(1000)) in the same run (~9 µs on an idle core here): multiply the "
           "calib-unit column by 9 µs for the idle-machine cost.\n")
    sys.stdout.write(md)
    write_results("timeline_cost", {"machine": machine_info(), "samples_s": samples, "calls": CALLS}, md,
                  out_dir=output_dir(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
