"""Submitting collectives: validate -> prepare -> hand to the engine. The layer between :mod:`hora.api.ops` (the
public API) and the negotiation engine.

``submit()`` validates a :class:`~hora.calls.call.Call` on this rank, gives an unnamed call its sequence name,
runs its kind's *prepare* on the caller's thread (:mod:`hora.datapath.kinds`) and hands the engine its
:class:`~hora.engine.scheduling.table.Request` (what the peers must agree on) with the prepared
:class:`~hora.datapath.kinds.op.Op`; the engine gives back its handle. Once every member has submitted the name,
the engine runs the kind's *launch* (the c10d call); ``synchronize()`` runs its *finish*.

Example:
    >>> call = Call(Kind.ALLREDUCE, torch.ones(3), "", global_process_set, op=ReduceOp.AVERAGE)  # doctest: +SKIP
    >>> submit(call, waiting=True).wait()                                                       # doctest: +SKIP
    tensor([1., 1., 1.])
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hora.calls.call import UNKNOWN, Call, Site, current
from hora.datapath.kinds import KINDS, adasum
from hora.datapath.kinds.op import REDUCTIONS, Kind, Op
from hora.datapath.reduce_ops import ReduceOp
from hora.datapath.wire import Compression, WireBuffers, dtype_name
from hora.diagnostics import timeline
from hora.engine.scheduling.handles import Handle
from hora.engine.scheduling.table import Request
from hora.errors import InvalidCallError, UnsupportedCallError, UnsupportedDtypeError
from hora.runtime import lifecycle as runtime
from hora.runtime import newcomer

_SUPPORTED = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                        torch.bfloat16, torch.float32, torch.float64, torch.bool})
_ARITHMETIC_OPS = frozenset({ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.PRODUCT})
_GATHERS = frozenset({Kind.ALLGATHER, Kind.ALLTOALL, Kind.REDUCESCATTER})  # dim 0 is split or gathered


def _validate(call: Call, rank: int) -> None:
    """Refuse a call that cannot work, on this rank, before anything is submitted.

    Every refusal is an :class:`InvalidCallError` (a ``ValueError`` and a ``RuntimeError``, so a Horovod
    script's ``except`` catches it whichever of the two Horovod raised); a bad dtype is also a ``TypeError``.
    """
    t = call.tensor
    where = f"{call.kind.tag} {call.name or '(unnamed)'!r} on rank {rank}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _SUPPORTED:
        raise UnsupportedDtypeError(f"{where}: dtype {t.dtype} is not supported; use one of "
                                    f"{sorted(dtype_name(d) for d in _SUPPORTED)}")
    if not t.is_contiguous():
        raise InvalidCallError(f"{where}: the tensor is not contiguous; call .contiguous() on it first")
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidCallError(f"{where}: tensors on {t.device} are not supported (CPU and CUDA are)")
    if t.is_cuda:
        _validate_device(t.device, runtime.state().device, where)
    if call.ps.process_set_id is None:
        raise InvalidCallError(f"{where}: {call.ps!r} is not registered; use hvd.add_process_set() first")
    if rank not in call.ps.ranks:
        raise InvalidCallError(f"{where}: rank {rank} is not a member of {call.ps!r}")
    if call.kind in REDUCTIONS:
        _validate_reduction(call, where)
    elif call.kind is Kind.ADASUM:
        _validate_adasum(call, where)
    if call.kind is Kind.BROADCAST and call.root not in call.ps.ranks:
        raise InvalidCallError(f"{where}: root rank {call.root} is not in {call.ps.ranks} "
                               f"(world size {runtime.size()}); root_rank is a global rank")
    if call.kind in _GATHERS and t.dim() == 0:
        raise InvalidCallError(f"{where}: needs a tensor with at least one dimension (dim 0 is split or gathered)")


def _validate_device(device: torch.device, hora: torch.device | None, where: str) -> None:
    """A CUDA tensor must be on the device hora bound this rank to: NCCL runs every collective of a rank on
    its one device, and a tensor elsewhere would be read from the wrong GPU."""
    if hora is None:
        raise InvalidCallError(f"{where}: a CUDA tensor, but hora was initialised without CUDA (at hvd.init() "
                               "torch saw no CUDA device or no NCCL); move the tensor to the CPU, or make CUDA "
                               "visible before hvd.init()")
    if device != hora:
        raise InvalidCallError(f"{where}: the tensor is on {device}, but this rank's collectives run on {hora} "
                               "(hvd.init() binds each rank to GPU local_rank % visible GPUs); move the tensor "
                               f"there (tensor.to('{hora}')), or give each rank its own GPU with "
                               "CUDA_VISIBLE_DEVICES before it starts")


def _validate_reduction(call: Call, where: str) -> None:
    t = call.tensor
    if call.reduce_op == ReduceOp.ADASUM:
        raise InvalidCallError(f"{where}: op=hvd.Adasum is defined for allreduce only; use op=hvd.Sum or hvd.Average")
    if t.dtype == torch.bool and call.reduce_op in _ARITHMETIC_OPS:
        raise UnsupportedDtypeError(f"{where}: {call.reduce_op.name.capitalize()} of bool tensors is not defined; "
                                    "use Min or Max")
    if (call.prescale != 1.0 or call.postscale != 1.0) and t.dtype == torch.bool:
        raise UnsupportedDtypeError(f"{where}: prescale/postscale factors cannot scale a bool tensor")


def _validate_adasum(call: Call, where: str) -> None:
    size = len(call.ps.ranks)
    if size & (size - 1):  # Horovod: NotImplementedError
        raise UnsupportedCallError(f"{where}: op=hvd.Adasum needs a power-of-two number of ranks, got {size}: run "
                                   "with 2, 4, 8... ranks or use op=hvd.Average")
    try:
        adasum.summed_levels(call.ps.ranks, call.tensor.is_cuda)  # GPU Adasum's layout, refused here if unfit
    except UnsupportedCallError as e:
        raise UnsupportedCallError(f"{where}: {e}") from None


def request_of(call: Call, wire: torch.Tensor) -> Request:
    """What this rank tells its peers about ``call``, whose kind prepared ``wire``."""
    return Request(call.name, call.kind.tag, dtype_name(wire.dtype), tuple(call.tensor.shape), int(call.reduce_op),
                   call.root, float(call.prescale), float(call.postscale), tuple(call.ps.ranks), wire.device.type,
                   call.splits, call.site.fingerprint, call.site.where)


def submit(call: Call, waiting: bool = False) -> Handle:
    """Validate, prepare the wire buffer, and hand the op to the negotiator. ``waiting``: the caller
    synchronizes the handle at once (a synchronous op), so its own thread may run the negotiation round."""
    return submit_many([call], waiting)[0]


def submit_many(calls: list[Call], waiting: bool = False) -> list[Handle]:
    """Submit several calls in one negotiation round; nothing is submitted if any call is invalid.

    An invalid call raises here, on this rank, but still takes its place: an unnamed call its sequence
    number, and every call is announced to the peers (``Negotiator.reject``), whose matching ops fail with
    the reason instead of pairing with this rank's next op, or waiting for it."""
    if not calls:
        return []
    what = f"hvd.{calls[0].kind.tag}()"
    rt = runtime.state(what)
    if rt.alone:  # a new elastic worker, still in a world of its own, joins the job's world here
        rt = newcomer.join(what)
    neg = rt.negotiator
    site = None
    if neg.site_check and not calls[0].name and calls[0].site is UNKNOWN and calls[0].kind is not Kind.BARRIER:
        site = current()  # a barrier carries no data to mix up, and has no name= to opt out with
    try:
        for call in calls:
            if call.rejected is not None:
                raise call.rejected
            if call.name and not isinstance(call.name, str):
                raise TypeError(f"collective names are strings, got {call.name!r}")
            _validate(call, rt.topo.rank)
        calls = [_named(call, neg, site) for call in calls]
        ops = [_prepared(call, rt.wire_buffers) for call in calls]
    except Exception as e:
        _announce(calls, rt, e)
        raise
    return neg.submit_many(ops, waiting)


def _named(call: Call, neg: Any, site: Site | None) -> Call:
    """``call`` as the engine sees it: an unnamed call gets its sequence name, and every call of an unnamed
    submission the caller's ``site`` (when the check is on). One new Call at most, none for a named call."""
    if call.name and site is None:
        return call
    return call.given(call.name or neg.unnamed(call.ps.process_set_id), site or call.site)


def _announce(calls: list[Call], rt: Any, error: Exception) -> None:
    """Tell the peers that this rank rejected ``calls`` (see ``submit_many``). Not for a process set this
    rank is not a member of (no sequence of it to keep), a name that is not a string, or a name still in
    flight on this rank (its pending op is not the rejected one)."""
    neg = rt.negotiator
    ranks = _member_ranks(calls[0].ps, rt)
    if ranks is None or any(c.name and (not isinstance(c.name, str) or neg.in_flight(c.name)) for c in calls):
        return
    reason = f"{type(error).__name__}: {error}"
    site = calls[0].site if calls[0].site is not UNKNOWN else current()  # for the message
    reqs = []
    for call in calls:
        name = call.name or neg.unnamed(rt.process_sets.sequence_id(call.ps))
        reqs.append(Request(name, call.kind.tag, "", (), ps=ranks, site=site.fingerprint, where=site.where,
                            error=reason))
    neg.reject(reqs)


def _member_ranks(ps: Any, rt: Any) -> tuple[int, ...] | None:
    """The ranks of ``ps`` if a call on it can be announced: it (or a set with its ranks) is registered and
    this rank is a member."""
    sid = rt.process_sets.sequence_id(ps)
    if sid is None:
        return None
    ranks = tuple(rt.process_sets[sid].ranks)
    return ranks if rt.topo.rank in ranks else None


def _prepared(call: Call, buffers: WireBuffers) -> tuple[Request, Op]:
    """``call``'s op, prepared by its kind on this thread (its wire leased from ``buffers`` when it can be), and
    the request that announces it."""
    op = Op(call, KINDS[call.kind], members=len(call.ps.ranks), buffers=buffers)
    tl = timeline.active()
    t0 = time.perf_counter() if tl is not None else 0.0
    op.steps.prepare(op)
    if tl is not None and op.wire is not call.tensor:  # a copy or compression happened (diagnostics)
        phase = "copy_in" if call.compression is Compression.none else "compress"
        tl.span(call.name, phase, t0, time.perf_counter(), kind=call.kind.tag, bytes=op.wire.nbytes)
    return request_of(call, op.wire), op
