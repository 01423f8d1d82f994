"""Building a :class:`~hora.datapath.kinds.Call` from Horovod's arguments, for the public ops (:mod:`hora.api.ops`,
:mod:`hora.api.grouped`, :mod:`hora.api.sparse`).

An argument that cannot work (an unknown op, alltoall splits that do not add up) does not raise here: the
call carries the error (``Call.rejected``) and :func:`hora.calls.submit.submit` raises it, where the call still
takes its place in the sequence of unnamed ops and the peers are told (see ``collectives.submit_many``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hora.common.process_sets import ProcessSet
from hora.datapath.compression import Compression, Compressor
from hora.datapath.kinds import Call, Kind
from hora.datapath.reduce_ops import ReduceOp, resolve_op
from hora.errors import InvalidCallError
from hora.runtime import lifecycle as runtime


def needs_grad(tensor: torch.Tensor) -> bool:
    """Only tensors that record autograd history pay for an autograd Function."""
    return torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.requires_grad


def wanted(ctx: Any, grads: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """A grouped op's input gradients, None for the inputs that need none (e.g. an integer tensor in the
    group). The backward's collective still carries every tensor, so all ranks submit the same group."""
    return [g if need else None for g, need in zip(grads, ctx.needs_input_grad[1:])]


def group_names(name: str | None, n: int) -> list[str]:
    """The names of a grouped op's members: ``name.0``, ``name.1``... (unnamed: each gets a sequence name)."""
    return [f"{name}.{i}" for i in range(n)] if name else [""] * n


def resolved_op(op: Any, average: bool | None) -> tuple[ReduceOp, Exception | None]:
    """The reduce op, or the error that rejects the call."""
    try:
        return resolve_op(op, average), None
    except (TypeError, ValueError) as e:
        return ReduceOp.SUM, e


def allreduce_call(tensor: torch.Tensor, average: bool | None, name: str | None, op: Any,
                   prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
                   compression: Compressor = Compression.none, inplace: bool = False) -> Call:
    """An allreduce; with ``op=hvd.Adasum``, the Adasum kind."""
    rop, rejected = resolved_op(op, average)
    kind = Kind.ADASUM if rop == ReduceOp.ADASUM else Kind.ALLREDUCE
    return Call(kind, tensor, name or "", process_set, op=rop, prescale=prescale_factor,
                postscale=postscale_factor, compression=compression, inplace=inplace, rejected=rejected)


def allgather_call(tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> Call:
    return Call(Kind.ALLGATHER, tensor, name or "", ps)


def broadcast_call(tensor: torch.Tensor, root_rank: int, name: str | None, ps: ProcessSet,
                   inplace: bool = False) -> Call:
    return Call(Kind.BROADCAST, tensor, name or "", ps, root=int(root_rank), inplace=inplace)


def reducescatter_call(tensor: torch.Tensor, name: str | None, compression: Compressor, op: Any,
                       ps: ProcessSet, prescale_factor: float, postscale_factor: float) -> Call:
    rop, rejected = resolved_op(op, None)
    return Call(Kind.REDUCESCATTER, tensor, name or "", ps, op=rop, prescale=prescale_factor,
                postscale=postscale_factor, compression=compression, rejected=rejected)


def reducescatter_grad_scale(op: ReduceOp, pre: float, post: float, size: int) -> float:
    """Horovod's backward of reducescatter: the allgather of the gradient times the set's size for Sum
    (1 for Average and the other ops), times both scale factors."""
    return pre * post * (size if op == ReduceOp.SUM else 1)


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


def alltoall_checked(tensor: torch.Tensor, splits: Any, name: str | None,
                     ps: ProcessSet) -> tuple[torch.Tensor, tuple[int, ...], Exception | None]:
    """The tensor to send (the rows ``splits`` covers) and the rows for each member, or the error."""
    try:
        return (*_alltoall_parts(tensor, splits, name, ps), None)
    except (TypeError, ValueError) as e:
        return tensor, (), e


def alltoall_call(tensor: torch.Tensor, parts: tuple[int, ...], name: str | None, ps: ProcessSet,
                  rejected: Exception | None = None) -> Call:
    return Call(Kind.ALLTOALL, tensor, name or "", ps, splits=parts, rejected=rejected)
