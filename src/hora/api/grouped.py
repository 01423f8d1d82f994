"""Horovod's grouped collectives: a list of tensors submitted together, in one negotiation round, and fused
where small. The members are named ``name.0``, ``name.1``... (or take one sequence number each when unnamed).

Example:
    >>> outs = hvd.grouped_allreduce([torch.ones(2), torch.zeros(3)], name="g")   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hora.calls.call import (
    Call,
    allgather_call,
    allreduce_call,
    group_names,
    needs_grad,
    reducescatter_call,
    reducescatter_grad_scale,
    wanted,
)
from hora.calls.submit import submit_many
from hora.common.process_sets import ProcessSet, global_process_set
from hora.datapath.reduce_ops import ReduceOp
from hora.datapath.wire import Compression, Compressor
from hora.engine.scheduling.handles import GroupHandle


def _grouped(calls: list[Call], waiting: bool = False) -> GroupHandle:
    return GroupHandle(submit_many(calls, waiting))


# --- allreduce ---------------------------------------------------------------------------------------------
def _allreduce_calls(tensors: Sequence[torch.Tensor], average: bool | None, name: str | None, op: Any,
                     pre: float, post: float, ps: ProcessSet, compression: Compressor = Compression.none,
                     inplace: bool = False) -> list[Call]:
    return [allreduce_call(t, average, n, op, pre, post, ps, compression, inplace=inplace)
            for t, n in zip(tensors, group_names(name, len(tensors)))]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, _inplace: bool = False) -> GroupHandle:
    """Start allreduces of a list of tensors as one group (submitted together, fused where small)."""
    return _grouped(_allreduce_calls(tensors, average, name, op, prescale_factor, postscale_factor, process_set,
                                     inplace=_inplace))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> GroupHandle:
    """In-place variant of :func:`grouped_allreduce_async`."""
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set,
                                   _inplace=True)


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, calls: list[Call], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        first = calls[0]
        ctx.op, ctx.pre, ctx.post, ctx.ps = first.reduce_op, first.prescale, first.postscale, first.ps
        return tuple(_grouped(calls, waiting=True).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=ctx.op, prescale_factor=ctx.pre,
                                    postscale_factor=ctx.post, process_set=ctx.ps)
        return (None, *wanted(ctx, reduced))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Compressor = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors as one group; returns the list of results.

    Differentiable like :func:`hora.allreduce`: each gradient is the grouped allreduce of the gradients with
    the same op and factors (Horovod's definition).
    """
    calls = _allreduce_calls(tensors, average, name, op, prescale_factor, postscale_factor, process_set,
                             compression)
    if not any(needs_grad(t) for t in tensors):
        return _grouped(calls, waiting=True).wait()
    return list(_GroupedAllreduceFn.apply(calls, *tensors))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place grouped allreduce."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()


# --- allgather ---------------------------------------------------------------------------------------------
def _allgather_calls(tensors: Sequence[torch.Tensor], name: str | None, ps: ProcessSet) -> list[Call]:
    return [allgather_call(t, n, ps) for t, n in zip(tensors, group_names(name, len(tensors)))]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start allgathers of a list of tensors as one group."""
    return _grouped(_allgather_calls(tensors, name, process_set))


class _GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, calls: list[Call], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        group = _grouped(calls, waiting=True)
        outs = group.wait()
        ps = calls[0].ps
        ctx.rows, ctx.index, ctx.ps = [h.op.rows for h in group.handles], ps.rank(), ps
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=ReduceOp.AVERAGE, process_set=ctx.ps)
        mine = [r.narrow(0, sum(rows[: ctx.index]), rows[ctx.index]) for r, rows in zip(reduced, ctx.rows)]
        return (None, *wanted(ctx, mine))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather a list of tensors as one group. Differentiable like :func:`hora.allgather`."""
    calls = _allgather_calls(tensors, name, process_set)
    if not any(needs_grad(t) for t in tensors):
        return _grouped(calls, waiting=True).wait()
    return list(_GroupedAllgatherFn.apply(calls, *tensors))


# --- reducescatter -----------------------------------------------------------------------------------------
def _reducescatter_calls(tensors: Sequence[torch.Tensor], name: str | None, compression: Compressor, op: Any,
                         ps: ProcessSet, pre: float, post: float) -> list[Call]:
    return [reducescatter_call(t, n, compression, op, ps, pre, post)
            for t, n in zip(tensors, group_names(name, len(tensors)))]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = ReduceOp.AVERAGE, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                compression: Compressor = Compression.none) -> GroupHandle:
    """Start reduce-scatters of a list of tensors as one group (Horovod's argument order, ``compression`` last)."""
    return _grouped(_reducescatter_calls(tensors, name, compression, op, process_set, prescale_factor,
                                         postscale_factor))


class _GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, calls: list[Call], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        first = calls[0]
        ctx.scale = reducescatter_grad_scale(first.reduce_op, first.prescale, first.postscale, first.ps.size())
        ctx.ps = first.ps
        return tuple(_grouped(calls, waiting=True).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        scaled = [g.contiguous() if ctx.scale == 1.0 else g * ctx.scale for g in grads]
        return (None, *wanted(ctx, grouped_allgather(scaled, process_set=ctx.ps)))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Compressor = Compression.none, op: Any = ReduceOp.AVERAGE,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter a list of tensors as one group. Differentiable like :func:`hora.reducescatter`."""
    calls = _reducescatter_calls(tensors, name, compression, op, process_set, prescale_factor, postscale_factor)
    if not any(needs_grad(t) for t in tensors):
        return _grouped(calls, waiting=True).wait()
    return list(_GroupedReducescatterFn.apply(calls, *tensors))
