"""A Horovod elastic training script (``import horovod.torch as hvd``, as Horovod's elastic examples are
written) for the end-to-end tests of tests/launcher/test_elastic_training.py.

Usage: elastic_sampler_worker.py OUTDIR

It trains a linear model with SGD on 96 samples for 2 epochs, 2 samples per rank and step, with an
ElasticSampler and a TorchState committed every 2 steps (so every resize happens where the samples left
divide evenly over 2 or 4 ranks, and the exactly-once check needs no padding). Every step appends
``{"wid", "pid", "rank", "size", "gen", "step"}`` to OUTDIR/steps.jsonl. At the end each worker writes
OUTDIR/final.<wid>.json: its parameters, the global batches the state applied (rolled back with it at a
failure), and the parameters of a one-process replay of exactly those batches. OUTDIR/started.<wid> says a
worker got as far as ``hvd.init()`` (OUTDIR/slow.<wid> holding a number of seconds makes it sleep that long
first), OUTDIR/init.<wid>.json holds the rank and size ``hvd.init()`` gave it, OUTDIR/built.<wid> says that it
calls ``train(state)`` (where a worker started while the job runs joins the job's world). OUTDIR/kill.<wid>
makes that worker SIGKILL itself at its next step; OUTDIR/pace (seconds) slows every step down; while
OUTDIR/hold exists, rank 0 waits before each commit (its peers wait for it in their next collective), so a test
can change the hosts before training goes on; meanwhile it touches OUTDIR/notified.<wid> once
``state._host_messages`` (Horovod's notices of host changes) holds one. With HORA_LOG_LEVEL set, hora's log
records go to stderr (the launcher's output), so a test can wait for one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

SAMPLES, BATCH, EPOCHS, LR, COMMIT_EVERY = 96, 2, 2, 0.05, 2


def data(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    x = torch.randn(4, generator=g)
    return x, x.sum(dim=0, keepdim=True) * 0.5 + 1.0


def new_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def params(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def replay(batches: list[list[int]]) -> list[float]:
    """One process applying the same global batches with plain SGD (the mean loss over each global batch)."""
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in batches:
        xs, ys = zip(*(data(i) for i in batch), strict=True)
        opt.zero_grad()
        F.mse_loss(model(torch.stack(xs)), torch.stack(ys)).backward()
        opt.step()
    return params(model)


def main(out: Path) -> None:
    if os.environ.get("HORA_LOG_LEVEL"):
        logging.basicConfig(format="%(name)s: %(message)s")  # hora's loggers pass on what their level lets through
    wid = os.environ["HORA_WORKER_ID"]
    (out / f"started.{wid}").touch()
    slow = out / f"slow.{wid}"
    if slow.exists():  # a slow start-up (a cold container, large imports): seconds before hvd.init()
        time.sleep(float(slow.read_text()))
    hvd.init()
    # what a Horovod script reads right after init(), e.g. for a DistributedSampler: the world it trains in
    (out / f"init.{wid}.json").write_text(json.dumps({"rank": hvd.rank(), "size": hvd.size()}))
    pace = float((out / "pace").read_text()) if (out / "pace").exists() else 0.0  # seconds added to each step
    model = new_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=7)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0, applied=())

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.epoch < EPOCHS:
            mine = list(iter(state.sampler))
            offset = state.batch
            for idx in range(math.ceil(len(mine) / BATCH)):
                state.batch = offset + idx
                if state.batch % COMMIT_EVERY == 0:
                    while hvd.rank() == 0 and (out / "hold").exists():
                        if not state._host_messages.empty():  # Horovod's notice of a host change, on rank 0
                            (out / f"notified.{wid}").touch()
                        time.sleep(0.05)
                    state.commit()
                if (out / f"kill.{wid}").exists():
                    os.kill(os.getpid(), signal.SIGKILL)
                batch = mine[idx * BATCH:(idx + 1) * BATCH]
                xs, ys = zip(*(data(i) for i in batch), strict=True)
                optimizer.zero_grad()
                F.mse_loss(model(torch.stack(xs)), torch.stack(ys)).backward()
                optimizer.step()
                everyone = hvd.allgather_object(batch, name="test.batch")
                state.sampler.record_batch(idx, BATCH)
                state.applied = (*state.applied, [i for part in everyone for i in part])
                if pace:
                    time.sleep(pace)
                with (out / "steps.jsonl").open("a") as f:
                    f.write(json.dumps({"wid": wid, "pid": os.getpid(), "rank": hvd.rank(), "size": hvd.size(),
                                        "step": len(state.applied), "t": time.time()}) + "\n")
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            state.commit()

    (out / f"built.{wid}").touch()
    train(state)
    result = {"wid": wid, "rank": hvd.rank(), "size": hvd.size(), "params": params(model),
              "applied": list(state.applied), "replay": replay(list(state.applied))}
    (out / f"final.{wid}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
