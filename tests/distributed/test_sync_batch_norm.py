"""SyncBatchNorm equals BatchNorm over the concatenated global batch, forward and backward, on CPU."""

from __future__ import annotations

import torch
from torch import nn

import hora as hvd
from tests.distributed.test_optimizer import run_tensors

ROWS = [3, 5, 2]  # a different local batch on each rank


def _global(shape_tail: tuple[int, ...], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = sum(ROWS[:size])
    x = torch.randn(n, *shape_tail, generator=g, dtype=torch.float64) * 3 + 1.5
    gy = torch.randn(n, *shape_tail, generator=g, dtype=torch.float64)
    return x, gy


def _mine(t: torch.Tensor, rank: int) -> torch.Tensor:
    start = sum(ROWS[:rank])
    return t[start:start + ROWS[rank]]


def _sync_bn(rank: int, size: int, shape_tail: tuple[int, ...]) -> dict:
    x, gy = _global(shape_tail, size)
    bn = hvd.SyncBatchNorm(shape_tail[0], momentum=0.3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 2.0, shape_tail[0]))
        bn.bias.copy_(torch.linspace(-1.0, 1.0, shape_tail[0]))
    xi = _mine(x, rank).clone().requires_grad_(True)
    y = bn(xi)
    (y * _mine(gy, rank)).sum().backward()
    dw = hvd.allreduce(bn.weight.grad, op=hvd.Sum, name="dw")  # what DistributedOptimizer(op=Sum) sees
    db = hvd.allreduce(bn.bias.grad, op=hvd.Sum, name="db")
    bn.eval()
    y_eval = bn(_mine(x, rank))
    return {"y": y.detach(), "dx": xi.grad, "dw": dw, "db": db, "running_mean": bn.running_mean.clone(),
            "running_var": bn.running_var.clone(), "y_eval": y_eval.detach()}


def _reference(shape_tail: tuple[int, ...], size: int) -> dict:
    x, gy = _global(shape_tail, size)
    cls = nn.BatchNorm1d if len(shape_tail) <= 2 else nn.BatchNorm2d
    bn = cls(shape_tail[0], momentum=0.3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 2.0, shape_tail[0]))
        bn.bias.copy_(torch.linspace(-1.0, 1.0, shape_tail[0]))
    x = x.clone().requires_grad_(True)
    y = bn(x)
    (y * gy).sum().backward()
    bn.eval()
    return {"y": y.detach(), "dx": x.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
            "running_mean": bn.running_mean, "running_var": bn.running_var, "y_eval": bn(x).detach()}


def _check(shape_tail: tuple[int, ...], size: int) -> None:
    want = _reference(shape_tail, size)
    for rank, got in enumerate(run_tensors(_sync_bn, size, shape_tail)):
        for key in ("y", "dx", "y_eval"):
            torch.testing.assert_close(got[key], _mine(want[key], rank),
                                       msg=lambda m, r=rank, k=key: f"rank {r} {k}: {m}")
        for key in ("dw", "db", "running_mean", "running_var"):
            torch.testing.assert_close(got[key], want[key], msg=lambda m, r=rank, k=key: f"rank {r} {k}: {m}")


def test_sync_batch_norm_2d_input_3_ranks_uneven_batches() -> None:
    _check((4,), 3)


def test_sync_batch_norm_4d_input_2_ranks() -> None:
    _check((3, 4, 5), 2)
