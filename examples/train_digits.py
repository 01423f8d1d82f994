"""Train a classifier on scikit-learn's handwritten digits with hora: the usual Horovod recipe, end to end.

The five Horovod changes to a single-process script are marked (1)-(5), numbered as in the README. The
digits dataset ships with scikit-learn, so this runs offline, in a few seconds on two CPU processes:

    hora run -np 2 python examples/train_digits.py
    hora run -np 2 python examples/train_digits.py --fp16-allreduce --epochs 20
    hora run -np 2 python examples/train_digits.py --ddp     # DDP-wrapped model + DistributedOptimizer
    hora run -np 2 python examples/train_digits.py --checkpoint-dir /checkpoints/digits   # resumes if stopped
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import hora as hvd
from hora import checkpoint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by hvd.size()")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16 on the wire")
    p.add_argument("--ddp", action="store_true", help="also wrap the model in DistributedDataParallel")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--checkpoint-dir", default="",
                   help="shared directory: rank 0 saves every epoch, a new run resumes from the latest (empty: none)")
    return p.parse_args(argv)


def datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Digits as (8x8 image flattened to 64 floats in [0, 1], label); the last 20% (fixed shuffle) for test."""
    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x = torch.tensor(x, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(y, dtype=torch.int64)[order]
    cut = int(0.8 * len(y))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Accuracy on this rank's share of the test set, averaged over ranks."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            pred = model(x.to(device)).argmax(dim=1)
            correct += int((pred == y.to(device)).sum())
            total += len(y)
    local = torch.tensor(correct / max(total, 1))
    return float(hvd.allreduce(local, name="test_accuracy", op=hvd.Average))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hvd.init()  # (1) start hora: rank, size, process groups
    device = torch.device("cpu")
    if torch.cuda.is_available():  # (2) one GPU per process, chosen by local rank
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    torch.manual_seed(args.seed)

    train_set, test_set = datasets(args.seed)
    # (3) each rank reads its own shard (and reshuffles every epoch: sampler.set_epoch below)
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = build_model().to(device)
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    # linear scaling rule: the global batch grows with the number of ranks, so does the learning rate
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    start = 0
    state = checkpoint.restore(args.checkpoint_dir) if args.checkpoint_dir else None
    if state is not None:  # every rank loads the same checkpoint, chosen by rank 0
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
        if hvd.rank() == 0:
            print(f"resumed from the checkpoint of epoch {start}", flush=True)
    # (4) gradients are averaged across ranks, overlapped with backward
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    # (5) every rank starts from rank 0's weights and optimizer state
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    loss = torch.tensor(0.0)
    for epoch in range(start, args.epochs):
        model.train()
        sampler.set_epoch(epoch)  # (3) a different shuffle each epoch, the same on every rank
        batches = tqdm(train_loader, desc=f"epoch {epoch + 1}/{args.epochs}", disable=hvd.rank() != 0, leave=False)
        for x, y in batches:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            batches.set_postfix(loss=f"{loss.item():.3f}")
        if args.checkpoint_dir:  # rank 0 writes it, atomically
            checkpoint.save(args.checkpoint_dir, epoch, {"epoch": epoch, "model": model.state_dict(),
                                                         "optimizer": optimizer.state_dict()})
    accuracy = evaluate(model, test_loader, device)
    final_loss = float(hvd.allreduce(loss.detach().cpu(), name="final_loss"))
    if hvd.rank() == 0:
        print(f"ranks: {hvd.size()}  epochs: {args.epochs}  final train loss: {final_loss:.4f}  "
              f"test accuracy (averaged over ranks): {accuracy:.4f}")
    return {"accuracy": accuracy, "loss": final_loss, "size": hvd.size(), "start": start}


if __name__ == "__main__":
    main()
