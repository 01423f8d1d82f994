"""``hvd.SyncBatchNorm``: batch normalisation over the global batch, on CPU and GPU.

In training, each rank computes its local count, mean and sum of squared deviations per channel; one
allgather shares them and every rank combines them (Chan's parallel formula, numerically stable) into the
global mean and variance. Backward needs the global sums of ``dy`` and ``dy * x_hat``: one allreduce.
The result equals ``BatchNorm`` applied to the concatenation of every rank's batch, forward and backward.
Horovod's version is GPU-only (it needs ``torch.batch_norm_stats``); this one is plain tensor arithmetic.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8))  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hora.api import ops
from hora.common.process_sets import ProcessSet, global_process_set
from hora.datapath.reduce_ops import Sum

log = logging.getLogger(__name__)
_layer_ids = itertools.count()


def _shape(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """Reduction dims (all but channels) and the broadcast shape of a per-channel vector."""
    dims = [0] + list(range(2, x.dim()))
    return dims, [1, x.shape[1]] + [1] * (x.dim() - 2)


def _global_stats(x: torch.Tensor, name: str, ps: ProcessSet) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global (count, mean, biased var) per channel of the union of every rank's ``x``."""
    dims, _ = _shape(x)
    count = x.numel() // x.shape[1]
    if count:
        var, mean = torch.var_mean(x, dim=dims, unbiased=False)
    else:
        var = mean = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
    # the count made on x's device: torch.tensor([count], device=cuda) would copy from the host and wait for
    # the GPU in every layer's forward
    local = torch.cat([x.new_full((1,), float(count)), mean, var * count])
    table = ops.allgather(local.unsqueeze(0), name=name, process_set=ps)  # (W, 1 + 2C)
    c = x.shape[1]
    counts, means, m2s = table[:, :1], table[:, 1:1 + c], table[:, 1 + c:]
    total = counts.sum()
    g_mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - g_mean) ** 2).sum(0)
    return total, g_mean, m2 / total


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float, name: str, ps: ProcessSet) -> tuple[torch.Tensor, ...]:
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        total, mean, var = _global_stats(work, f"{name}.stats", ps)
        _, shape = _shape(x)
        invstd = torch.rsqrt(var + eps)
        xhat = (work - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape).to(y.dtype) + bias.view(shape).to(y.dtype)  # type: ignore[union-attr]
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total, ctx.name, ctx.ps = total, name, ps
        ctx.mark_non_differentiable(mean, var, total)
        return y.to(x.dtype), mean, var, total

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        dims, shape = _shape(xhat)
        gy32 = gy.to(xhat.dtype)
        sum_dy = gy32.sum(dims)
        sum_dy_xhat = (gy32 * xhat).sum(dims)
        both = ops.allreduce(torch.cat([sum_dy, sum_dy_xhat]), name=f"{ctx.name}.grad", op=Sum, process_set=ctx.ps)
        c = xhat.shape[1]
        g_dy, g_dy_xhat = both[:c] / ctx.total, both[c:] / ctx.total
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        dx = scale.view(shape) * (gy32 - g_dy.view(shape) - xhat * g_dy_xhat.view(shape))
        grad_w = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        return dx.to(gy.dtype), grad_w, grad_b, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation whose statistics cover every rank's batch (Horovod's ``hvd.SyncBatchNorm``).

    Args:
        num_features: channels ``C`` of an input of shape ``(N, C, ...)``.
        eps: added to the variance.
        momentum: running-statistics update factor (None: cumulative average).
        affine: learn a per-channel scale and shift.
        track_running_stats: keep running mean/variance for evaluation.
        process_set: the ranks whose batches are normalised together (hora's addition).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set
        # named at its first synchronized forward, in the order every rank's forward runs the layers: the name
        # does not depend on how many layers a process built before (one built and never run claims nothing)
        self._hora_name: str | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, ...), got {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or self.process_set.size() == 1:
            return super().forward(input)
        if self._hora_name is None:
            self._hora_name = f"hora.training.sync_batch_norm.{next(_layer_ids)}"
        y, mean, var, total = _SyncBatchNormFn.apply(
            input, self.weight, self.bias, self.eps, self._hora_name, self.process_set
        )
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), total.detach())
        return y

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, total: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)  # type: ignore[union-attr, operator]
        if self.momentum is None:  # cumulative moving average (reads the counter: a GPU sync, as in torch)
            factor = 1.0 / int(self.num_batches_tracked)  # type: ignore[arg-type]
        else:
            factor = self.momentum
        unbiased = var * (total / (total - 1.0).clamp(min=1.0))  # tensors: no GPU sync
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)  # type: ignore[union-attr]
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)  # type: ignore[union-attr]

