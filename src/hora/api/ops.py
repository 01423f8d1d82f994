"""Horovod's collectives on one tensor: sync, ``_async`` (a handle) and in-place ``_`` variants.

Every function here builds a :class:`~hora.calls.call.Call` (:mod:`hora.calls.call`) and submits it
(:func:`hora.calls.submit.submit`); the sync forms of ops on tensors that record autograd history go through
an autograd Function whose backward is again a collective. Grouped variants are in :mod:`hora.api.grouped`,
``sparse_allreduce_async`` in :mod:`hora.api.sparse`. Ops are matched across ranks by ``name``; leave it out
and a per-process-set sequence name is used, so ordinary SPMD code needs none (a call rejected on one rank
still takes its number, and ranks that reach a number from different lines of code are told so: see
:mod:`hora.calls.call`). Signatures and defaults are Horovod's (docs/horovod-differences.md lists what differs).

Example:
    >>> avg = hvd.allreduce(torch.tensor([float(hvd.rank())]))          # doctest: +SKIP
    >>> h = hvd.allgather_async(torch.ones(hvd.rank() + 1, 2), name="g") # doctest: +SKIP
    >>> hvd.synchronize(h).shape                                         # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from hora.calls.call import (
    Call,
    allgather_call,
    allreduce_call,
    alltoall_call,
    alltoall_checked,
    broadcast_call,
    needs_grad,
    reducescatter_call,
    reducescatter_grad_scale,
)
from hora.calls.submit import submit
from hora.common.names import JOIN_NAME
from hora.common.process_sets import ProcessSet, global_process_set
from hora.datapath.kinds.op import Kind
from hora.datapath.reduce_ops import ReduceOp
from hora.datapath.wire import Compression, Compressor
from hora.engine.scheduling.handles import Handle
from hora.runtime import lifecycle as runtime


# --- allreduce ---------------------------------------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce; ``synchronize(handle)`` returns a new tensor with the result."""
    return submit(allreduce_call(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place allreduce; ``synchronize(handle)`` returns ``tensor`` holding the result."""
    return submit(allreduce_call(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                                 inplace=True))


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, call: Call) -> torch.Tensor:  # type: ignore[override]
        ctx.call = call
        return submit(call, waiting=True).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        c = ctx.call
        return allreduce(grad.contiguous(), op=c.reduce_op, prescale_factor=c.prescale, postscale_factor=c.postscale,
                         process_set=c.ps), None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Compressor = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the process set (Average by default) and return the result as a new tensor.

    Differentiable: the gradient is the allreduce of the gradient with the same op and factors.
    """
    call = allreduce_call(tensor, average, name, op, prescale_factor, postscale_factor, process_set, compression)
    if not needs_grad(tensor):
        return submit(call, waiting=True).wait()
    return _AllreduceFn.apply(tensor, call)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce: ``tensor`` holds the result afterwards (and is returned)."""
    return submit(allreduce_call(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                                 inplace=True), waiting=True).wait()


# --- allgather ---------------------------------------------------------------------------------------------
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allgather (concatenation along dim 0; dim 0 may differ per rank)."""
    return submit(allgather_call(tensor, name, process_set))


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:  # type: ignore[override]
        handle = submit(allgather_call(tensor, name, ps), waiting=True)
        out = handle.wait()
        ctx.rows, ctx.index, ctx.ps = handle.op.rows, ps.rank(), ps  # type: ignore[union-attr]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        reduced = allreduce(grad.contiguous(), op=ReduceOp.AVERAGE, process_set=ctx.ps)
        start = sum(ctx.rows[: ctx.index])
        return reduced.narrow(0, start, ctx.rows[ctx.index]), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every member's ``tensor`` along dim 0. Differentiable."""
    if not needs_grad(tensor):
        return submit(allgather_call(tensor, name, process_set), waiting=True).wait()
    return _AllgatherFn.apply(tensor, name, process_set)


# --- broadcast ---------------------------------------------------------------------------------------------
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start a broadcast from the global rank ``root_rank``; the result is a new tensor."""
    return submit(broadcast_call(tensor, root_rank, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place broadcast."""
    return submit(broadcast_call(tensor, root_rank, name, process_set, inplace=True))


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: str | None, ps: ProcessSet) -> torch.Tensor:  # type: ignore[override]
        ctx.root, ctx.ps = root, ps
        return submit(broadcast_call(tensor, root, name, ps), waiting=True).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        reduced = allreduce(grad.contiguous(), op=ReduceOp.AVERAGE, process_set=ctx.ps)
        if runtime.rank() != ctx.root:
            reduced.zero_()
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s tensor on every member. Differentiable."""
    if not needs_grad(tensor):
        return submit(broadcast_call(tensor, root_rank, name, process_set), waiting=True).wait()
    return _BroadcastFn.apply(tensor, int(root_rank), name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast: ``tensor`` holds root's value afterwards."""
    return submit(broadcast_call(tensor, root_rank, name, process_set, inplace=True), waiting=True).wait()


# --- alltoall ----------------------------------------------------------------------------------------------
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    tensor, parts, rejected = alltoall_checked(tensor, splits, name, process_set)
    return submit(alltoall_call(tensor, parts, name, process_set, rejected))


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, parts: tuple[int, ...], name: str | None, ps: ProcessSet) -> Any:  # type: ignore[override]
        out, received = submit(alltoall_call(tensor, parts, name, ps), waiting=True).wait()
        ctx.received, ctx.ps = tuple(int(r) for r in received), ps
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> Any:  # type: ignore[override]
        back, _ = submit(alltoall_call(grad.contiguous(), ctx.received, None, ctx.ps), waiting=True).wait()
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows to member i and receive theirs. Returns ``(output, received_splits)`` when
    ``splits`` is given, else the output (dim 0 must then divide evenly by the set's size). Differentiable:
    the gradient is the alltoall of the gradient with the received splits."""
    tensor, parts, rejected = alltoall_checked(tensor, splits, name, process_set)
    if rejected is not None:
        submit(alltoall_call(tensor, parts, name, process_set, rejected))  # raises it, once announced
    out, received = _AlltoallFn.apply(tensor, parts, name, process_set)
    return (out, received) if splits is not None else out


# --- reducescatter -----------------------------------------------------------------------------------------
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = ReduceOp.AVERAGE,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, compression: Compressor = Compression.none) -> Handle:
    """Start a reduce-scatter along dim 0 (the first ``dim0 % size`` members get one extra row).

    Arguments in Horovod's order (its ``_async`` form has no ``compression``; hora takes it last)."""
    return submit(reducescatter_call(tensor, name, compression, op, process_set, prescale_factor, postscale_factor))


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, call: Call) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = reducescatter_grad_scale(call.reduce_op, call.prescale, call.postscale, call.ps.size())
        ctx.ps = call.ps
        return submit(call, waiting=True).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        grad = grad.contiguous() if ctx.scale == 1.0 else grad * ctx.scale
        return allgather(grad, process_set=ctx.ps), None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Compressor = Compression.none,
                  op: Any = ReduceOp.AVERAGE, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over the set, then give each member its slice of dim 0.

    Differentiable with Horovod's definition: the gradient is the allgather of the upstream gradients,
    times the set's size for Sum, times the scale factors.
    """
    call = reducescatter_call(tensor, name, compression, op, process_set, prescale_factor, postscale_factor)
    if not needs_grad(tensor):
        return submit(call, waiting=True).wait()
    return _ReducescatterFn.apply(tensor, call)


# --- barrier, join -----------------------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every member of the set reaches the barrier."""
    submit(Call(Kind.BARRIER, torch.empty(0), "", process_set), waiting=True).wait()


def join(device: int = -1) -> int:
    """Say this rank has no more data: until every rank joins, its negotiator contributes zeros to the
    others' allreduces (Average still divides by the full size). Returns the rank that joined last."""
    return int(submit(Call(Kind.JOIN, torch.empty(0), JOIN_NAME, global_process_set), waiting=True).wait())

