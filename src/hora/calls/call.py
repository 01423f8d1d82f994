"""One collective call: the :class:`Call` record, how Horovod's arguments become one, and the line of the user's
code that made it.

A :class:`Call` is one call as the user made it, validated by :func:`hora.calls.submit.submit` and never changed
once submitted: what the kind's steps compute goes on its :class:`~hora.datapath.kinds.op.Op`. The public ops
(:mod:`hora.api.ops`, :mod:`hora.api.grouped`, :mod:`hora.api.sparse`) build theirs with the functions below. An
argument that cannot work (an unknown op, alltoall splits that do not add up) does not raise here: the call
carries the error (``Call.rejected``) and ``submit`` raises it, where the call still takes its place in the
sequence of unnamed ops and the peers are told (see ``submit_many``).

**Call sites.** Unnamed ops are matched across ranks by their place in a per-process-set sequence. A rank that
skips or adds a collective (a rank-dependent branch, an exception caught around one call) would pair its later
ops with the wrong ones; the fingerprint of the call site (:func:`current`) travels with each unnamed request,
and ranks that reach the same place in the sequence from different lines are told so
(:func:`hora.engine.scheduling.table.differing_fields`). The call site is the first frame outside hora and torch: the
user's line, also when the op is submitted by a hora helper or from inside an autograd Function. The walk is cached by
code object, and the result by (code object, instruction), so a call costs a few dictionary lookups; the
fingerprint is a CRC of the module name and line, the same on every rank whatever path the script has on each
host.

Example:
    >>> call = allreduce_call(torch.ones(3), None, "x", None, 1.0, 1.0, global_process_set)  # doctest: +SKIP
    >>> call.kind, call.reduce_op                                                            # doctest: +SKIP
    (<Kind.ALLREDUCE: 'allreduce'>, <ReduceOp.AVERAGE: 1>)
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, NamedTuple

import torch

from hora.common.process_sets import ProcessSet
from hora.datapath.kinds.op import Kind
from hora.datapath.reduce_ops import ReduceOp, resolve_op
from hora.datapath.wire import Compression, Compressor
from hora.errors import InvalidCallError
from hora.runtime import lifecycle as runtime


# --- where the user made the call ------------------------------------------------------------------------------
class Site(NamedTuple):
    """A call site: ``fingerprint`` is compared across ranks (0: unknown, never compared), ``where`` is
    ``file:line`` for messages."""

    fingerprint: int
    where: str


UNKNOWN = Site(0, "")

_HORA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/hora (this is calls/...)
_SKIP_DIRS = (_HORA_DIR + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
_skip: dict[CodeType, bool] = {}  # code object -> it belongs to hora or torch
_sites: dict[tuple[CodeType, int], Site] = {}  # (code object, last instruction) -> its site


def current() -> Site:
    """The site of the innermost frame outside hora and torch that led here (``UNKNOWN`` if none: an op
    submitted from a thread that only runs library code, such as a CUDA autograd worker)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        skip = _skip.get(code)
        if skip is None:
            skip = _skip[code] = code.co_filename.startswith(_SKIP_DIRS)
        if not skip:
            key = (code, frame.f_lasti)
            site = _sites.get(key)
            if site is None:
                site = _sites[key] = _site_of(frame)
            return site
        frame = frame.f_back
    return UNKNOWN


def _site_of(frame: FrameType) -> Site:
    line = frame.f_lineno or 0
    module = frame.f_globals.get("__name__", "?")
    fingerprint = zlib.crc32(f"{module}:{line}".encode()) or 1
    return Site(fingerprint, f"{frame.f_code.co_filename}:{line}")


# --- the call ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Call:
    """One call as the user made it, validated: its inputs, never changed once submitted (what the steps compute
    goes into its :class:`~hora.datapath.kinds.op.Op`)."""

    kind: Kind
    tensor: torch.Tensor
    name: str
    ps: ProcessSet
    reduce_op: ReduceOp = ReduceOp.SUM
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] | None = None
    compression: Compressor = Compression.none
    inplace: bool = False
    site: Site = UNKNOWN  # where the user called it (unnamed ops, when the check is on)
    rejected: Exception | None = None  # found invalid while the call was built (raised at submit)

    def given(self, name: str, site: Site) -> Call:
        """This call with the name and call site ``submit`` gives it (faster than ``dataclasses.replace``,
        which the per-op path cannot afford; every field is passed on)."""
        return Call(self.kind, self.tensor, name, self.ps, reduce_op=self.reduce_op, root=self.root,
                    prescale=self.prescale, postscale=self.postscale, splits=self.splits,
                    compression=self.compression, inplace=self.inplace, site=site, rejected=self.rejected)


# --- from Horovod's arguments --------------------------------------------------------------------------------
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
    return Call(kind, tensor, name or "", process_set, reduce_op=rop, prescale=prescale_factor,
                postscale=postscale_factor, compression=compression, inplace=inplace, rejected=rejected)


def allgather_call(tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> Call:
    return Call(Kind.ALLGATHER, tensor, name or "", ps)


def broadcast_call(tensor: torch.Tensor, root_rank: int, name: str | None, ps: ProcessSet,
                   inplace: bool = False) -> Call:
    return Call(Kind.BROADCAST, tensor, name or "", ps, root=int(root_rank), inplace=inplace)


def reducescatter_call(tensor: torch.Tensor, name: str | None, compression: Compressor, op: Any,
                       ps: ProcessSet, prescale_factor: float, postscale_factor: float) -> Call:
    rop, rejected = resolved_op(op, None)
    return Call(Kind.REDUCESCATTER, tensor, name or "", ps, reduce_op=rop, prescale=prescale_factor,
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
