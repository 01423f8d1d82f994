"""Elastic training: a Horovod elastic script that survives losing and gaining hosts mid-run.

Written as a Horovod user writes one (``import horovod.torch as hvd`` works the same): the model, optimizer,
sampler and counters live in a ``TorchState``; ``@hvd.elastic.run`` restarts the training function after a
reset; ``state.commit()`` every few batches bounds the work a failure loses. Run it with a discovery script
that prints the hosts available now (see examples/elastic_discovery.sh and docs/elastic.md):

    hora run -np 2 --min-np 1 --max-np 4 --host-discovery-script examples/elastic_discovery.sh \\
        python examples/elastic_train.py --epochs 3

or with fixed hosts, where a failed host is dropped and the job goes on with the rest:

    hora run -np 4 --min-np 2 -H a:2,b:2 python examples/elastic_train.py

Without elastic flags it trains as an ordinary job.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hora as hvd

log = logging.getLogger("elastic_train")


class Dataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A synthetic 4-class problem: each sample is made from its index, so every rank and every run agree."""

    def __init__(self, size: int, features: int = 16) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, features, generator=g)
        centers = torch.randn(4, features, generator=g)
        self.y = torch.cdist(self.x, centers).argmin(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=2048, help="dataset size")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    p.add_argument("--base-lr", type=float, default=0.05, help="learning rate of one rank (scaled by size)")
    p.add_argument("--batches-per-commit", type=int, default=4, help="commit the state every N batches")
    p.add_argument("--batches-per-host-check", type=int, default=1,
                   help="between commits, look for host changes every N batches")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (demos)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hvd.init()
    torch.manual_seed(0)
    dataset = Dataset(args.samples)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.base_lr * hvd.size(),
                                                         momentum=0.9),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=42)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    def on_reset() -> None:
        # the world changed size: keep the learning rate proportional to the global batch
        for group in optimizer.param_groups:
            group["lr"] = args.base_lr * hvd.size()
        log.warning("reset: now rank %d of %d", hvd.rank(), hvd.size())

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    state.register_reset_callbacks([on_reset])

    def train_epoch(state: Any) -> float:
        model.train()
        offset = state.batch  # batches of this epoch done before the last reset
        total, count = 0.0, 0
        for idx, (x, y) in enumerate(loader):
            state.batch = offset + idx
            if args.batches_per_commit > 0 and state.batch % args.batches_per_commit == 0:
                state.commit()
            elif args.batches_per_host_check > 0 and state.batch % args.batches_per_host_check == 0:
                state.check_host_updates()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            state.sampler.record_batch(idx, args.batch_size)  # these samples are done this epoch
            total, count = total + loss.item(), count + 1
            if args.step_sleep:
                time.sleep(args.step_sleep)
        return total / max(count, 1)

    @hvd.elastic.run
    def train(state: Any) -> float:
        loss = math.nan
        while state.epoch < args.epochs:
            loss = hvd.allreduce(torch.tensor(train_epoch(state)), name="epoch_loss").item()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: loss {loss:.4f} on {hvd.size()} ranks", flush=True)
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return loss

    loss = train(state)
    x, y = dataset.x, dataset.y
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if hvd.rank() == 0:
        print(f"done: loss {loss:.4f}, accuracy {accuracy:.3f}, {hvd.size()} ranks at the end", flush=True)
    return {"loss": loss, "accuracy": accuracy, "size": hvd.size(), "rank": hvd.rank(),
            "checksum": float(params.double().sum()), "params": params.tolist()}


if __name__ == "__main__":
    main(sys.argv[1:])
