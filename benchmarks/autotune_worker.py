"""One rank of benchmarks/autotune_bench.py (run under ``hora run``): trains a model of many small layers with
DistributedOptimizer for ``--steps`` steps and, on rank 0, writes every step's wall time to ``--out``; under
``--autotune`` also the step at which autotune ended and the settings it kept."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hora as hvd


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=96)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(ns.layers) for m in (torch.nn.Linear(ns.width, ns.width),
                                                                         torch.nn.Tanh())])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(ns.batch, ns.width, generator=torch.Generator().manual_seed(hvd.rank()))
    reducer = opt._hora_reducer
    times, tuned_at = [], None
    for step in range(ns.steps):
        began = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - began)
        if tuned_at is None and hvd.rank() == 0:
            from hora.training import autotune

            tuner = autotune.tuner_for(reducer)
            if tuner is not None and not tuner.active:
                tuned_at = step + 1
    if hvd.rank() == 0:
        first, later = reducer._caps()
        ns.out.write_text(json.dumps({
            "times": times, "tuned_at": tuned_at, "bucket_bytes": later, "first_bucket_bytes": first,
            "gradient_bytes": sum(p.numel() * 4 for p in model.parameters()), "buckets": len(reducer.buckets),
            "fusion_threshold": hvd_fusion_threshold()}))
    hvd.shutdown()


def hvd_fusion_threshold() -> int:
    from hora.runtime import lifecycle

    return int(lifecycle.state().negotiator._rounds.dispatch._fused.threshold)


if __name__ == "__main__":
    main()
