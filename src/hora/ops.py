"""Horovod's collectives: sync, ``_async`` (a handle), in-place ``_`` and ``grouped_`` variants.

Every function here is a thin wrapper over one private core (:mod:`hora.collectives`). Ops are matched
across ranks by ``name``; leave it out and a per-process-set sequence name is used, so ordinary SPMD code
needs none (a call rejected on one rank still takes its number, and ranks that reach a number from different
lines of code are told so: see :mod:`hora.callsite`). Signatures and defaults are Horovod's (see COMPAT.md).

Example:
    >>> avg = hvd.allreduce(torch.tensor([float(hvd.rank())]))          # doctest: +SKIP
    >>> h = hvd.allgather_async(torch.ones(hvd.rank() + 1, 2), name="g") # doctest: +SKIP
    >>> hvd.synchronize(h).shape                                         # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hora import callsite, runtime
from hora.collectives import Call, submit
from hora.compression import Compression, Compressor
from hora.errors import InvalidCallError
from hora.handles import GroupHandle, Handle
from hora.process_sets import ProcessSet, global_process_set
from hora.reduce_ops import ReduceOp, resolve_op


def _needs_grad(tensor: torch.Tensor) -> bool:
    """Only tensors that record autograd history pay for an autograd Function."""
    return torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.requires_grad


def _wanted(ctx: Any, grads: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """A grouped op's input gradients, None for the inputs that need none (e.g. an integer tensor in the
    group). The backward's collective still carries every tensor, so all ranks submit the same group."""
    return [g if need else None for g, need in zip(grads, ctx.needs_input_grad[1:])]


def _resolved(op: Any, average: bool | None) -> tuple[ReduceOp, Exception | None]:
    """The reduce op, or the error that rejects the call (raised at submit, where the call still takes its
    place in the sequence: see ``collectives.submit_many``)."""
    try:
        return resolve_op(op, average), None
    except (TypeError, ValueError) as e:
        return ReduceOp.SUM, e


def _allreduce_call(tensor: torch.Tensor, average: bool | None, name: str | None, op: Any,
                    prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
                    compression: Compressor = Compression.none, inplace: bool = False) -> Call:
    rop, rejected = _resolved(op, average)
    return Call("allreduce", tensor, name or "", process_set, op=rop, prescale=prescale_factor,
                postscale=postscale_factor, compression=compression, inplace=inplace, rejected=rejected)


def _allreduce_submit(call: Call, waiting: bool = False) -> Any:
    if call.op == ReduceOp.ADASUM:
        from hora.handles import DoneHandle

        return DoneHandle(_adasum(call))
    return submit(call, waiting)


def _adasum(call: Call) -> torch.Tensor:
    try:
        from hora.adasum import adasum_allreduce
    except ImportError:
        raise NotImplementedError("op=hvd.Adasum needs hora.adasum, which this build lacks") from None
    tensor = call.tensor if call.prescale == 1.0 else call.tensor * call.prescale
    out = adasum_allreduce(tensor, name=call.name or None, process_set=call.ps)
    if call.postscale != 1.0:
        out.mul_(call.postscale)
    if call.inplace:
        call.tensor.copy_(out)
        return call.tensor
    return out


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce; ``synchronize(handle)`` returns a new tensor with the result."""
    return _allreduce_submit(_allreduce_call(tensor, average, name, op, prescale_factor, postscale_factor,
                                             process_set))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place allreduce; ``synchronize(handle)`` returns ``tensor`` holding the result."""
    return _allreduce_submit(_allreduce_call(tensor, average, name, op, prescale_factor, postscale_factor,
                                             process_set, inplace=True))


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, call: Call) -> torch.Tensor:  # type: ignore[override]
        ctx.call = call
        return _allreduce_submit(call, waiting=True).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        c = ctx.call
        return allreduce(grad.contiguous(), op=c.op, prescale_factor=c.prescale, postscale_factor=c.postscale,
                         process_set=c.ps), None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Compressor = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the process set (Average by default) and return the result as a new tensor.

    Differentiable: the gradient is the allreduce of the gradient with the same op and factors.
    """
    call = _allreduce_call(tensor, average, name, op, prescale_factor, postscale_factor, process_set, compression)
    if not _needs_grad(tensor):
        return _allreduce_submit(call, waiting=True).wait()
    return _AllreduceFn.apply(tensor, call)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce: ``tensor`` holds the result afterwards (and is returned)."""
    return _allreduce_submit(_allreduce_call(tensor, average, name, op, prescale_factor, postscale_factor,
                                             process_set, inplace=True), waiting=True).wait()


def _grouped(calls: list[Call], waiting: bool = False) -> GroupHandle:
    from hora.collectives import submit_many

    return GroupHandle(submit_many(calls, waiting))


def _group_names(name: str | None, n: int) -> list[str]:
    return [f"{name}.{i}" for i in range(n)] if name else [""] * n


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, _inplace: bool = False) -> GroupHandle:
    """Start allreduces of a list of tensors as one group (submitted together, fused where small)."""
    calls = [_allreduce_call(t, average, n, op, prescale_factor, postscale_factor, process_set, inplace=_inplace)
             for t, n in zip(tensors, _group_names(name, len(tensors)))]
    if calls and calls[0].op == ReduceOp.ADASUM:
        from hora.handles import DoneHandle

        return GroupHandle([DoneHandle(_adasum(c)) for c in calls])
    return _grouped(calls)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> GroupHandle:
    """In-place variant of :func:`grouped_allreduce_async`."""
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set,
                                   _inplace=True)


def _run_grouped_allreduce(calls: list[Call]) -> list[torch.Tensor]:
    if calls and calls[0].op == ReduceOp.ADASUM:
        return [_adasum(c) for c in calls]
    return _grouped(calls, waiting=True).wait()


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, calls: list[Call], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        first = calls[0]
        ctx.op, ctx.pre, ctx.post, ctx.ps = first.op, first.prescale, first.postscale, first.ps
        return tuple(_run_grouped_allreduce(calls))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=ctx.op, prescale_factor=ctx.pre,
                                    postscale_factor=ctx.post, process_set=ctx.ps)
        return (None, *_wanted(ctx, reduced))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Compressor = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors as one group; returns the list of results.

    Differentiable like :func:`allreduce`: each gradient is the grouped allreduce of the gradients with the
    same op and factors (Horovod's definition).
    """
    calls = [_allreduce_call(t, average, n, op, prescale_factor, postscale_factor, process_set, compression)
             for t, n in zip(tensors, _group_names(name, len(tensors)))]
    if not any(_needs_grad(t) for t in tensors):
        return _run_grouped_allreduce(calls)
    return list(_GroupedAllreduceFn.apply(calls, *tensors))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place grouped allreduce."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()


# --- allgather ---------------------------------------------------------------------------------------------
def _allgather_call(tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> Call:
    return Call("allgather", tensor, name or "", ps)


def _grouped_allgather_calls(tensors: Sequence[torch.Tensor], name: str | None, ps: ProcessSet) -> list[Call]:
    return [_allgather_call(t, n, ps) for t, n in zip(tensors, _group_names(name, len(tensors)))]


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allgather (concatenation along dim 0; dim 0 may differ per rank)."""
    return submit(_allgather_call(tensor, name, process_set))


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:  # type: ignore[override]
        call = _allgather_call(tensor, name, ps)
        out = submit(call, waiting=True).wait()
        ctx.rows, ctx.index, ctx.ps = call.meta, ps.rank(), ps
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        reduced = allreduce(grad.contiguous(), op=ReduceOp.AVERAGE, process_set=ctx.ps)
        start = sum(ctx.rows[: ctx.index])
        return reduced.narrow(0, start, ctx.rows[ctx.index]), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every member's ``tensor`` along dim 0. Differentiable."""
    if not _needs_grad(tensor):
        return submit(_allgather_call(tensor, name, process_set), waiting=True).wait()
    return _AllgatherFn.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start allgathers of a list of tensors as one group."""
    return _grouped(_grouped_allgather_calls(tensors, name, process_set))


class _GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, calls: list[Call], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        outs = _grouped(calls, waiting=True).wait()
        ps = calls[0].ps
        ctx.rows, ctx.index, ctx.ps = [c.meta for c in calls], ps.rank(), ps
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=ReduceOp.AVERAGE, process_set=ctx.ps)
        mine = [r.narrow(0, sum(rows[: ctx.index]), rows[ctx.index]) for r, rows in zip(reduced, ctx.rows)]
        return (None, *_wanted(ctx, mine))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather a list of tensors as one group. Differentiable like :func:`allgather`."""
    calls = _grouped_allgather_calls(tensors, name, process_set)
    if not any(_needs_grad(t) for t in tensors):
        return _grouped(calls, waiting=True).wait()
    return list(_GroupedAllgatherFn.apply(calls, *tensors))


# --- broadcast ---------------------------------------------------------------------------------------------
def _broadcast_call(tensor: torch.Tensor, root_rank: int, name: str | None, ps: ProcessSet,
                    inplace: bool = False) -> Call:
    return Call("broadcast", tensor, name or "", ps, root=int(root_rank), inplace=inplace)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start a broadcast from the global rank ``root_rank``; the result is a new tensor."""
    return submit(_broadcast_call(tensor, root_rank, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place broadcast."""
    return submit(_broadcast_call(tensor, root_rank, name, process_set, inplace=True))


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: str | None, ps: ProcessSet) -> torch.Tensor:  # type: ignore[override]
        ctx.root, ctx.ps = root, ps
        return submit(_broadcast_call(tensor, root, name, ps), waiting=True).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        reduced = allreduce(grad.contiguous(), op=ReduceOp.AVERAGE, process_set=ctx.ps)
        if runtime.rank() != ctx.root:
            reduced.zero_()
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s tensor on every member. Differentiable."""
    if not _needs_grad(tensor):
        return submit(_broadcast_call(tensor, root_rank, name, process_set), waiting=True).wait()
    return _BroadcastFn.apply(tensor, int(root_rank), name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast: ``tensor`` holds root's value afterwards."""
    return submit(_broadcast_call(tensor, root_rank, name, process_set, inplace=True), waiting=True).wait()


# --- alltoall ----------------------------------------------------------------------------------------------
def _alltoall_parts(tensor: torch.Tensor, splits: Any, name: str | None,
                    ps: ProcessSet) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Rows to send to each member, as Horovod checks them: without ``splits`` dim 0 must divide evenly;
    with them, they may sum to less than dim 0 (the rows after their sum are not sent)."""
    n = ps.size() if ps.process_set_id is not None else runtime.size()
    where = f"alltoall {name or '(unnamed)'!r} on rank {runtime.rank()}"
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise InvalidCallError(f"{where}: needs a tensor with at least one dimension (dim 0 is split)")
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise InvalidCallError(f"{where}: without splits, dim 0 ({rows}) must be a multiple of the process "
                                   f"set's size ({n}); pass splits= (rows for each member) to send uneven parts")
        return tensor, (rows // n,) * n
    if isinstance(splits, torch.Tensor):
        if splits.is_floating_point() or splits.is_complex() or splits.dim() > 1:
            raise InvalidCallError(f"{where}: splits must be a 1-D tensor or list of integers, got {splits!r}")
        splits = splits.tolist()
    parts = tuple(int(s) for s in splits)
    if len(parts) != n or any(s < 0 for s in parts) or sum(parts) > rows:
        raise InvalidCallError(f"{where}: splits {list(parts)} must be {n} non-negative row counts (one per "
                               f"member) summing to at most dim 0 ({rows})")
    if sum(parts) < rows:
        tensor = tensor.narrow(0, 0, sum(parts))
    return tensor, parts


def _alltoall_checked(tensor: torch.Tensor, splits: Any, name: str | None,
                      ps: ProcessSet) -> tuple[torch.Tensor, tuple[int, ...], Exception | None]:
    """``_alltoall_parts``, with its error returned: raised at submit, where the call still takes its place."""
    try:
        return (*_alltoall_parts(tensor, splits, name, ps), None)
    except (TypeError, ValueError) as e:
        return tensor, (), e


def _alltoall_call(tensor: torch.Tensor, parts: tuple[int, ...], name: str | None, ps: ProcessSet,
                   rejected: Exception | None = None) -> Call:
    return Call("alltoall", tensor, name or "", ps, splits=parts, rejected=rejected)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    tensor, parts, rejected = _alltoall_checked(tensor, splits, name, process_set)
    return submit(_alltoall_call(tensor, parts, name, process_set, rejected))


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, parts: tuple[int, ...], name: str | None, ps: ProcessSet) -> Any:  # type: ignore[override]
        out, received = submit(_alltoall_call(tensor, parts, name, ps), waiting=True).wait()
        ctx.received, ctx.ps = tuple(int(r) for r in received), ps
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> Any:  # type: ignore[override]
        back, _ = submit(_alltoall_call(grad.contiguous(), ctx.received, None, ctx.ps), waiting=True).wait()
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows to member i and receive theirs. Returns ``(output, received_splits)`` when
    ``splits`` is given, else the output (dim 0 must then divide evenly by the set's size). Differentiable:
    the gradient is the alltoall of the gradient with the received splits."""
    tensor, parts, rejected = _alltoall_checked(tensor, splits, name, process_set)
    if rejected is not None:
        submit(_alltoall_call(tensor, parts, name, process_set, rejected))  # raises it, once announced
    out, received = _AlltoallFn.apply(tensor, parts, name, process_set)
    return (out, received) if splits is not None else out


# --- reducescatter -----------------------------------------------------------------------------------------
def _reducescatter_call(tensor: torch.Tensor, name: str | None, compression: Compressor, op: Any,
                        ps: ProcessSet, prescale_factor: float, postscale_factor: float) -> Call:
    rop, rejected = _resolved(op, None)
    return Call("reducescatter", tensor, name or "", ps, op=rop, prescale=prescale_factor,
                postscale=postscale_factor, compression=compression, rejected=rejected)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = ReduceOp.AVERAGE,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, compression: Compressor = Compression.none) -> Handle:
    """Start a reduce-scatter along dim 0 (the first ``dim0 % size`` members get one extra row).

    Arguments in Horovod's order (its ``_async`` form has no ``compression``; hora takes it last)."""
    return submit(_reducescatter_call(tensor, name, compression, op, process_set, prescale_factor, postscale_factor))


def _reducescatter_grad_scale(op: ReduceOp, pre: float, post: float, size: int) -> float:
    """Horovod's backward of reducescatter: the allgather of the gradient times the set's size for Sum
    (1 for Average and the other ops), times both scale factors."""
    return pre * post * (size if op == ReduceOp.SUM else 1)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, call: Call) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = _reducescatter_grad_scale(call.op, call.prescale, call.postscale, call.ps.size())
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
    call = _reducescatter_call(tensor, name, compression, op, process_set, prescale_factor, postscale_factor)
    if not _needs_grad(tensor):
        return submit(call, waiting=True).wait()
    return _ReducescatterFn.apply(tensor, call)


def _grouped_reducescatter_calls(tensors: Sequence[torch.Tensor], name: str | None, compression: Compressor,
                                 op: Any, ps: ProcessSet, pre: float, post: float) -> list[Call]:
    return [_reducescatter_call(t, n, compression, op, ps, pre, post)
            for t, n in zip(tensors, _group_names(name, len(tensors)))]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = ReduceOp.AVERAGE, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                compression: Compressor = Compression.none) -> GroupHandle:
    """Start reduce-scatters of a list of tensors as one group (Horovod's argument order, ``compression`` last)."""
    return _grouped(_grouped_reducescatter_calls(tensors, name, compression, op, process_set, prescale_factor,
                                                 postscale_factor))


class _GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, calls: list[Call], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        first = calls[0]
        ctx.scale = _reducescatter_grad_scale(first.op, first.prescale, first.postscale, first.ps.size())
        ctx.ps = first.ps
        return tuple(_grouped(calls, waiting=True).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        scaled = [g.contiguous() if ctx.scale == 1.0 else g * ctx.scale for g in grads]
        return (None, *_wanted(ctx, grouped_allgather(scaled, process_set=ctx.ps)))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Compressor = Compression.none, op: Any = ReduceOp.AVERAGE,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter a list of tensors as one group. Differentiable like :func:`reducescatter`."""
    calls = _grouped_reducescatter_calls(tensors, name, compression, op, process_set, prescale_factor,
                                         postscale_factor)
    if not any(_needs_grad(t) for t in tensors):
        return _grouped(calls, waiting=True).wait()
    return list(_GroupedReducescatterFn.apply(calls, *tensors))


# --- sparse, barrier, join ---------------------------------------------------------------------------------
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = ReduceOp.AVERAGE,
                           process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Allreduce a sparse COO tensor by allgathering its indices and values; ``synchronize`` returns a
    coalesced sparse tensor. Average divides the values by the set's size."""
    neg = runtime.state("hvd.sparse_allreduce_async()").negotiator
    site = callsite.current() if neg.site_check and not name else callsite.UNKNOWN
    rop, rejected = _resolved(op, None)
    if rejected is None and rop not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        rejected = InvalidCallError(f"sparse allreduce supports Average and Sum, not {rop.name.capitalize()}")
    indices = values = torch.empty(0)
    try:
        t = tensor.coalesce()
        indices, values = t.indices().t().contiguous(), t.values().contiguous()
    except (AttributeError, RuntimeError, TypeError) as e:
        rejected = rejected or TypeError(f"sparse_allreduce_async needs a sparse COO tensor: {e}")
    # both allgathers are named after one sequence number, which a rejected call takes too (submit_many)
    member = process_set.process_set_id is not None and process_set.included()
    base = name or (neg.unnamed(process_set.process_set_id) if member else "")
    calls = [Call("allgather", part, f"{base}.{what}" if base else "", process_set, site=site, rejected=rejected)
             for part, what in ((indices, "indices"), (values, "values"))]
    handles = _grouped(calls).handles
    n, shape = process_set.size(), tensor.shape

    def combine(results: list[torch.Tensor]) -> torch.Tensor:
        indices, values = results
        if rop == ReduceOp.AVERAGE:
            values = values / n
        return torch.sparse_coo_tensor(indices.t(), values, shape).coalesce()

    return GroupHandle(handles, combine)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every member of the set reaches the barrier."""
    submit(Call("barrier", torch.empty(0), "", process_set), waiting=True).wait()


def join(device: int = -1) -> int:
    """Say this rank has no more data: until every rank joins, its negotiator contributes zeros to the
    others' allreduces (Average still divides by the full size). Returns the rank that joined last."""
    return int(submit(Call("join", torch.empty(0), "__join__", global_process_set), waiting=True).wait())

