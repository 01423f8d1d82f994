"""The training every framework test runs: a small model, 2 ranks, DistributedOptimizer, equal shards.

This file is also the script TorchDistributor runs as a file (``python training.py OUT_DIR``), and its source is
pasted into the tests' driver scripts, so its functions travel to Ray actors and Spark tasks by value: it imports
nothing at module level but the standard library.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

STEPS = 3
SAMPLES = 16


def _model_and_data() -> tuple[Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=gen)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=gen)
    return model, x, y


def _steps(model: Any, opt: Any, x: Any, y: Any) -> None:
    import torch

    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _flat(model: Any) -> list[float]:
    return [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]


def train(out_dir: str | None = None) -> dict[str, Any]:
    """One rank's share: ``hvd.init()`` finds the world the framework set up; returns (and writes to
    ``out_dir/rank<r>.json``) where the rank ran and its final parameters."""
    import torch

    import hora as hvd

    hvd.init()
    model, x, y = _model_and_data()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    _steps(model, opt, x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()])
    result = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
              "local_size": hvd.local_size(), "cross_size": hvd.cross_size(), "pid": os.getpid(),
              "secret_file": os.environ.get("HORA_SECRET_FILE"), "params": _flat(model)}
    if out_dir:
        with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as f:
            json.dump(result, f)
    return result


def reference() -> list[float]:
    """The same training in one process on the whole batch."""
    import torch

    model, x, y = _model_and_data()
    _steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), x, y)
    return _flat(model)


if __name__ == "__main__":
    train(sys.argv[1])
