"""Adasum by vector halving / distance doubling (hora's ``allreduce(op=hvd.Adasum)``, as Horovod) against the
way hora combined before: one allgather of every rank's tensor, then the binary tree locally on every rank;
with a plain Sum allreduce of the same tensor as the control. Time and the extra memory each way needs.

Ranks are forked on this machine (CPU, Gloo); the variants alternate (A B C, B C A, ...), medians over the
repeats with their spread, and the load average at the start and the end.

    .venv/bin/python benchmarks/adasum_bench.py [--ranks 4] [--sizes 1MB,16MB] [--repeats 7] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import hora as hvd
from hora.datapath.kinds.adasum import adasum_tree

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_output_flags,
    alternate,
    fork_ranks,
    human_bytes,
    machine_info,
    markdown_table,
    output_dir,
    ratio_summary,
    summarize,
    write_results,
)


def _sizes(text: str) -> list[int]:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30}
    return [int(float(s[:-2]) * units[s[-2:].upper()]) for s in text.split(",")]


def _rank(rank: int, size: int, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    hvd.init()
    try:
        rows = []
        for nbytes in sizes:
            x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))

            def halving(x: torch.Tensor = x) -> float:
                start = time.perf_counter()
                hvd.allreduce(x, op=hvd.Adasum, name="halving")
                return time.perf_counter() - start

            def gathered(x: torch.Tensor = x) -> float:  # the previous way: every rank's copy, then the tree
                start = time.perf_counter()
                adasum_tree(hvd.allgather(x.unsqueeze(0), name="gathered"))
                return time.perf_counter() - start

            def plain_sum(x: torch.Tensor = x) -> float:
                start = time.perf_counter()
                hvd.allreduce(x, op=hvd.Sum, name="sum")
                return time.perf_counter() - start

            samples = alternate({"halving": halving, "gathered": gathered, "sum": plain_sum}, repeats)
            rows.append({"bytes": nbytes, "samples": samples,
                         "extra_bytes": {"halving": nbytes // 2, "gathered": size * nbytes}})
        return rows
    finally:
        hvd.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--sizes", default="1MB,16MB")
    p.add_argument("--repeats", type=int, default=7)
    add_output_flags(p, "2 ranks, 256 KB, 3 repeats")
    args = p.parse_args(argv)
    ranks, sizes, repeats = (2, [2**18], 3) if args.quick else (args.ranks, _sizes(args.sizes), args.repeats)
    load_before = os.getloadavg()
    rows = fork_ranks(_rank, ranks, sizes, repeats)[0]
    info = machine_info()
    info["load_avg_end"] = [round(v, 2) for v in os.getloadavg()]
    info["load_avg_start"] = [round(v, 2) for v in load_before]
    table = []
    for row in rows:
        s = row["samples"]
        new = ratio_summary(s["halving"], s["gathered"])
        control = ratio_summary(s["halving"], s["sum"])
        row["summary"] = {name: summarize(v) for name, v in s.items()}
        row["halving_over_gathered"], row["halving_over_sum"] = new, control
        ms = {name: f"{summary['median'] * 1e3:.1f}" for name, summary in row["summary"].items()}
        table.append([human_bytes(row["bytes"]), ms["halving"], ms["gathered"], ms["sum"],
                      f"{new['median']:.2f} ({new['spread']:.0%})", f"{control['median']:.2f}",
                      f"{human_bytes(row['extra_bytes']['halving'])} vs {human_bytes(row['extra_bytes']['gathered'])}"])
    md = (f"# Adasum: vector halving against allgather + tree ({ranks} ranks, CPU, Gloo)\n\n"
          f"load average {info['load_avg_start']} -> {info['load_avg_end']}, commit {info['git_commit']}\n\n"
          + markdown_table(["size", "halving ms", "gathered ms", "Sum ms", "halving/gathered (spread)",
                            "halving/Sum", "extra memory a rank"], table))
    out = output_dir(args)
    write_results("adasum_bench", {"machine": info, "ranks": ranks, "rows": rows}, md, out_dir=out)
    print(md)


if __name__ == "__main__":
    main()
