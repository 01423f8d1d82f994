"""Step-time cost of the stall inspector (on by default) and of the timeline, 2 ranks, loopback Gloo.

In the same two processes, alternating A B C A B C (PERFORMANCE.md), each sample the mean of ``--steps``
training steps of a small MLP with ``DistributedOptimizer`` (short steps, so a per-step cost would show)
and of a loop of 1-element allreduces (the cheapest collective, where a per-op cost shows most):

* ``stall_off``: the stall inspector disabled (``--no-stall-check``)
* ``stall_on``:  the default (warning after 60 s; no stall happens)
* ``timeline``:  stall inspector on and a timeline being written

Ratios are per pair (samples measured back to back), median with min-max.

    .venv/bin/python benchmarks/diagnostics_overhead.py [--repeats 31] [--steps 10]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    add_output_flags,
    alternate,
    fork_ranks,
    machine_info,
    markdown_table,
    output_dir,
    ratio_summary,
    summarize,
    write_results,
)

VARIANTS = ("stall_off", "stall_on", "timeline")


def _rank(rank: int, size: int, repeats: int, steps: int, tmp: str) -> dict[str, Any]:
    import torch

    import hora as hvd
    from hora.diagnostics import stall_report as stall
    from hora.diagnostics import timeline
    from hora.runtime import lifecycle as runtime

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    one = torch.ones(1)
    neg = runtime.state().negotiator

    def setup(variant: str) -> None:
        neg._rounds.stall.policy = stall.StallPolicy(enabled=variant != "stall_off")  # read each round
        if variant == "timeline":
            timeline.start_timeline(f"{tmp}/t.json", rank=rank, size=size)
        else:
            timeline.stop_timeline()

    def train(variant: str) -> float:
        setup(variant)
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - t0) / steps

    def tiny(variant: str) -> float:
        setup(variant)
        t0 = time.perf_counter()
        for _ in range(steps * 5):
            hvd.allreduce(one, op=hvd.Sum)
        return (time.perf_counter() - t0) / (steps * 5)

    out = {"step": alternate({v: (lambda v=v: train(v)) for v in VARIANTS}, repeats),
           "tiny_allreduce": alternate({v: (lambda v=v: tiny(v)) for v in VARIANTS}, repeats)}
    timeline.stop_timeline()
    hvd.shutdown()
    return out


def _micro(rank: int, size: int, pending: int, calls: int) -> dict[str, float]:
    """CPU cost of what the stall inspector does each time the negotiator goes idle with ops pending:
    compute the next deadline over the pending names, arm the watchdog, disarm it (single process)."""
    import time

    import hora as hvd
    from hora.engine.scheduling.table import Entry, Request
    from hora.runtime import lifecycle as runtime

    hvd.init()
    neg = runtime.state().negotiator
    now = time.monotonic()
    for i in range(pending):  # fake pending names, as if peers had not submitted them yet
        neg.table.entries[f"p{i}"] = Entry(f"p{i}", {0: Request(f"p{i}", "allreduce", "float32", (1,))}, 0, now)
    t0 = time.perf_counter()
    for _ in range(calls):
        delay = neg._rounds.stall.check_in()
        neg._stall_timer.arm(delay if delay is not None else 60.0, 0)
        neg._stall_timer.disarm()
    per_call = (time.perf_counter() - t0) / calls
    neg.table.entries.clear()
    hvd.shutdown()
    return {"pending": pending, "us_per_idle_transition": per_call * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--micro-calls", type=int, default=20_000, help="idle transitions timed per pending count")
    add_output_flags(ap, "2 samples of 1 step, 100 idle transitions")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.micro_calls = 2, 1, 100
    with tempfile.TemporaryDirectory() as tmp:
        results = fork_ranks(_rank, 2, args.repeats, args.steps, tmp)
    r0 = results[0]
    rows = []
    for what, samples in r0.items():
        for v in VARIANTS:
            s = summarize(samples[v])
            rows.append([what, v, f"{s['median'] * 1e3:.3f}", f"{s['min'] * 1e3:.3f}-{s['max'] * 1e3:.3f}", ""])
        for num, den in (("stall_on", "stall_off"), ("timeline", "stall_on")):
            r = ratio_summary(samples[num], samples[den])
            pairs = sorted(a / b for a, b in zip(samples[num], samples[den]))
            q1, q3 = pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]
            rows.append([what, f"{num}/{den}", "", "", f"{r['median']:.3f} (IQR {q1:.3f}-{q3:.3f})"])
    md = markdown_table(["measure", "variant", "median ms", "min-max ms", "pair ratio median (IQR)"], rows)
    micro = [fork_ranks(_micro, 1, n, args.micro_calls)[0] for n in (1, 8, 64)]
    md += "\n" + markdown_table(["pending names", "stall inspector µs per idle transition (no stall)"],
                                [[m["pending"], f"{m['us_per_idle_transition']:.2f}"] for m in micro])
    sys.stdout.write(md)
    write_results("diagnostics_overhead", {"machine": machine_info(), "args": vars(args), "rank0": r0,
                                           "micro": micro}, md, out_dir=output_dir(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
