"""What hora adds to one synchronous collective, measured where nothing else interferes: one process.

A single rank (size 1: hora negotiates locally, Gloo still runs a real allreduce on a one-member group) times,
alternating A B C A B C (PERFORMANCE.md), ``--calls`` back-to-back calls per sample on the same 1 KB tensor:

* ``raw``:        ``dist.all_reduce(t)`` on the default group
* ``hora``:       ``hvd.allreduce_(t, op=hvd.Sum)`` (unnamed: a new sequence name each call)
* ``hora_named``: ``hvd.allreduce_(t, op=hvd.Sum, name="x")`` (the same name each call)

and reports each variant's time per call and hora's extra microseconds per call (per-pair median with
min-max). This is the Python hora runs per op (validate, negotiation round, launch, finish) without the
network round trip and the contention of a multi-rank run; ``allreduce_bench.py`` measures those.

    .venv/bin/python benchmarks/op_overhead.py [--repeats 15] [--calls 500]

Writes benchmarks/results/op_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    add_output_flags,
    alternate,
    difference_summary,
    fork_ranks,
    machine_info,
    markdown_table,
    output_dir,
    write_results,
)

VARIANTS = ("raw", "hora", "hora_named")
NBYTES = 1024  # above the 64 bytes that travel inside the round: the op takes the data-plane path


def _rank(rank: int, size: int, repeats: int, calls: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    import hora as hvd

    torch.set_num_threads(1)
    hvd.init()
    tensors = {v: torch.zeros(NBYTES // 4) for v in VARIANTS}
    ops = {
        "raw": lambda: dist.all_reduce(tensors["raw"]),
        "hora": lambda: hvd.allreduce_(tensors["hora"], op=hvd.Sum),
        "hora_named": lambda: hvd.allreduce_(tensors["hora_named"], op=hvd.Sum, name="x"),
    }

    def sampler(op: Any) -> Any:
        def sample() -> float:
            start = time.perf_counter()
            for _ in range(calls):
                op()
            return (time.perf_counter() - start) / calls

        return sample

    samples = alternate({v: sampler(ops[v]) for v in VARIANTS}, repeats, warmup=2)
    hvd.shutdown()
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15, help="alternating samples per variant")
    p.add_argument("--calls", type=int, default=500, help="calls per sample")
    add_output_flags(p, "2 samples of 20 calls")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.calls = 2, 20
    start = time.monotonic()
    samples = fork_ranks(_rank, 1, args.repeats, args.calls)[0]
    per_call = {v: statistics.median(samples[v]) * 1e6 for v in VARIANTS}
    extra = {v: difference_summary(samples[v], samples["raw"]) for v in VARIANTS[1:]}
    rows = [[v, f"{per_call[v]:.1f}",
             "" if v == "raw" else f"{extra[v]['median']:.1f} ({extra[v]['min']:.1f} to {extra[v]['max']:.1f})"]
            for v in VARIANTS]
    meta = {"repeats": args.repeats, "calls": args.calls, "nbytes": NBYTES, "machine": machine_info(),
            "wall_s": round(time.monotonic() - start, 1)}
    m = meta["machine"]
    md = (f"# What hora adds to one synchronous allreduce (1 process, {NBYTES} B float32, Gloo)\n\n"
          f"{m['utc']}, {m['cpu']} x{m['cpus']}, torch {m['torch']}, hora {m['hora']} ({m['git_commit']}); "
          f"{args.repeats} alternating samples of {args.calls} calls; extra = per-pair hora - raw, median "
          f"(min to max).\n\n"
          + markdown_table(["variant", "µs per call (median)", "extra µs per call"], rows))
    paths = write_results("op_overhead", {"meta": meta, "samples": samples, "per_call_us": per_call,
                                          "extra_us": extra}, md, out_dir=output_dir(args))
    print(md)
    print("wrote " + ", ".join(str(p) for p in paths) + f" in {meta['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
