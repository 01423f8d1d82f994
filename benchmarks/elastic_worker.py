"""An elastic training script written as a Horovod user writes one (hvd.elastic.run, TorchState), for the
multi-host elastic tests (tests/cluster/test_elastic.py) and benchmarks/elastic_bench.py (also under torchrun).

Usage: elastic_worker.py OUTDIR [--steps N] [--sleep S] [--digest]

Every completed step appends ``{"pid", "wid", "host", "start_rank", "rank", "size", "step", "t"}`` to
OUTDIR/steps.jsonl (``t``: wall-clock time the step ended; with ``--digest`` also ``gen``, the world, and
``digest``, a hash of the parameters after the step: equal on every rank of a world at the same step). The
state (a linear model, SGD, the step counter) is committed every step. It stops at ``--steps`` (or when
OUTDIR/stop exists: then at the next step multiple of 10, the same on every rank), and writes
OUTDIR/final.<rank> with the parameters. Fault injection: OUTDIR/raise.<wid> makes that worker raise,
OUTDIR/slow.<wid> makes it sleep that many seconds (the file's text) before its next step's allreduce (its
peers sit in the collective meanwhile).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch

import hora as hvd
from hora.runtime.lifecycle import world_generation

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--steps", type=int, default=1_000_000)
p.add_argument("--sleep", type=float, default=0.05)
p.add_argument("--digest", action="store_true", help="record a hash of the parameters with every step")
args = p.parse_args()
out = Path(args.out)
wid = os.environ.get("HORA_WORKER_ID", f"fixed:{os.environ.get('RANK', '0')}")
host = os.environ.get("HOROVOD_HOSTNAME", "")
start_rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0")))

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, step=0)


def consume(name: str) -> str | None:
    path = out / f"{name}.{wid}"
    try:
        text = path.read_text()
        path.unlink()
        return text
    except FileNotFoundError:
        return None


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    while state.step < args.steps:
        if consume("raise") is not None:
            raise RuntimeError(f"{wid}: injected failure")
        slow = consume("slow")
        if slow:
            time.sleep(float(slow))
        g = torch.Generator().manual_seed(state.step)  # the same global batch whatever the world's size
        x = torch.randn(64, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        mine = x.chunk(hvd.size())[hvd.rank()], y.chunk(hvd.size())[hvd.rank()]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(mine[0]), mine[1]).backward()
        optimizer.step()
        state.step += 1
        record = {"pid": os.getpid(), "wid": wid, "host": host, "start_rank": start_rank, "rank": hvd.rank(),
                  "size": hvd.size(), "step": state.step, "t": time.time()}
        if args.digest:
            record["gen"] = world_generation()
            flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
            record["digest"] = hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16]
        with open(out / "steps.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if state.step % 10 == 0:
            stop = hvd.allreduce(torch.tensor(float((out / "stop").exists())), name="stop", op=hvd.Max)
            if stop.item():
                break
        state.commit()
        time.sleep(args.sleep)


train(state)
params = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
(out / f"final.{hvd.rank()}").write_text(json.dumps({"size": hvd.size(), "step": state.step,
                                                      "params": params.tolist()}))
