"""The private core of every collective: validate -> prepare -> submit -> launch -> finish.

``submit()`` validates a call, prepares the wire buffer on the caller's thread (compress, prescale, cast a
dtype the backend lacks), and hands a :class:`LocalOp` to the negotiator. Once every member has submitted
the name, the negotiator thread calls the op's *launch* (one c10d call with ``async_op=True``); the caller's
``synchronize()`` runs its *finish* (average, postscale, decompress, copy out). Each kind is a small class
with those two steps; the public functions in :mod:`hora.ops` are thin wrappers over ``submit``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hora import callsite, runtime
from hora.callsite import Site
from hora.compression import Compression, Compressor
from hora.diagnostics import timeline
from hora.engine.dispatch import Launch, LocalOp
from hora.engine.plan import Request
from hora.errors import InvalidCallError, UnsupportedDtypeError
from hora.fusion import allreduce_async, wire_op
from hora.handles import Handle
from hora.process_sets import ProcessSet, global_process_set
from hora.reduce_ops import ReduceOp

# dtypes the backends lack travel as a wider type and are cast back when the op finishes
_WIRE_CAST = {torch.int16: torch.int32}
# an integer Average is summed in a type its sum cannot overflow (200 + 100 in uint8 would wrap to 44), then
# divided (truncating) and cast back; int64 has nothing wider: its sum overflows as a Sum would
_AVERAGE_WIRE = {torch.uint8: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32,
                 torch.int32: torch.int64}
_SUPPORTED = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                        torch.bfloat16, torch.float32, torch.float64, torch.bool})
_ARITHMETIC_OPS = frozenset({ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.PRODUCT})
_NO_WIRE = torch.empty(0)  # a Call's wire until its kind's prepare sets it (never written to)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(eq=False)
class Call:
    """One validated call: everything launch and finish need."""

    kind: str
    tensor: torch.Tensor
    name: str
    ps: ProcessSet
    op: ReduceOp = ReduceOp.SUM
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] | None = None
    compression: Compressor = Compression.none
    inplace: bool = False
    wire: torch.Tensor = _NO_WIRE  # set by prepare
    ctx: Any = None  # compression context
    out: Any = None  # set by launch: the c10d output buffer
    meta: Any = None  # set by launch: rows / splits the finish needs
    members: int = 0  # the process set's size when the call was submitted (Average divides by it)
    site: Site = callsite.UNKNOWN  # where the user called it (unnamed ops, when the check is on)
    rejected: Exception | None = None  # found invalid while the call was built (raised at submit)

    @property
    def index(self) -> int:
        return self.ps.rank()


def _validate(call: Call, rank: int) -> None:
    """Refuse a call that cannot work, on this rank, before anything is submitted.

    Every refusal is an :class:`InvalidCallError` (a ``ValueError`` and a ``RuntimeError``, so a Horovod
    script's ``except`` catches it whichever of the two Horovod raised); a bad dtype is also a ``TypeError``.
    """
    t = call.tensor
    where = f"{call.kind} {call.name or '(unnamed)'!r} on rank {rank}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _SUPPORTED:
        raise UnsupportedDtypeError(f"{where}: dtype {t.dtype} is not supported; use one of "
                                    f"{sorted(dtype_name(d) for d in _SUPPORTED)}")
    if not t.is_contiguous():
        raise InvalidCallError(f"{where}: the tensor is not contiguous; call .contiguous() on it first")
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidCallError(f"{where}: tensors on {t.device} are not supported (CPU and CUDA are)")
    if t.is_cuda and runtime.state().device is None:
        raise InvalidCallError(f"{where}: a CUDA tensor, but hora was initialised without CUDA (at hvd.init() "
                               "torch saw no CUDA device or no NCCL); move the tensor to the CPU, or make CUDA "
                               "visible before hvd.init()")
    if call.ps.process_set_id is None:
        raise InvalidCallError(f"{where}: {call.ps!r} is not registered; use hvd.add_process_set() first")
    if not call.ps.included():
        raise InvalidCallError(f"{where}: rank {rank} is not a member of {call.ps!r}")
    if call.kind in ("allreduce", "reducescatter"):
        _validate_reduction(call, where)
    if call.kind == "broadcast" and call.root not in call.ps.ranks:
        raise InvalidCallError(f"{where}: root rank {call.root} is not in {call.ps.ranks} "
                               f"(world size {runtime.size()}); root_rank is a global rank")
    if call.kind in ("allgather", "alltoall", "reducescatter") and t.dim() == 0:
        raise InvalidCallError(f"{where}: needs a tensor with at least one dimension (dim 0 is split or gathered)")


def _validate_reduction(call: Call, where: str) -> None:
    t = call.tensor
    if call.op == ReduceOp.ADASUM:
        fix = "use op=hvd.Sum or hvd.Average" if call.kind == "reducescatter" else "this is a bug in hora"
        raise InvalidCallError(f"{where}: op=hvd.Adasum is defined for allreduce only; {fix}")
    if t.dtype == torch.bool and call.op in _ARITHMETIC_OPS:
        raise UnsupportedDtypeError(f"{where}: {call.op.name.capitalize()} of bool tensors is not defined; "
                                    "use Min or Max")
    if (call.prescale != 1.0 or call.postscale != 1.0) and t.dtype == torch.bool:
        raise UnsupportedDtypeError(f"{where}: prescale/postscale factors cannot scale a bool tensor")


def _request(call: Call) -> Request:
    t = call.wire
    return Request(call.name, call.kind, dtype_name(t.dtype), tuple(call.tensor.shape), int(call.op), call.root,
                   float(call.prescale), float(call.postscale), tuple(call.ps.ranks), t.device.type, call.splits,
                   call.site.fingerprint, call.site.where)


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
    rt = runtime.state(f"hvd.{calls[0].kind}()")
    neg = rt.negotiator
    if neg.site_check and not calls[0].name and calls[0].site is callsite.UNKNOWN and calls[0].kind != "barrier":
        site = callsite.current()  # a barrier carries no data to mix up, and has no name= to opt out with
        for call in calls:
            call.site = site
    try:
        for call in calls:
            if call.rejected is not None:
                raise call.rejected
            if call.name and not isinstance(call.name, str):
                raise TypeError(f"collective names are strings, got {call.name!r}")
            _validate(call, rt.topo.rank)
        for call in calls:
            if not call.name:
                call.name = neg.unnamed(call.ps.process_set_id)
        ops = [_local_op(call, neg) for call in calls]
    except Exception as e:
        _announce(calls, rt, e)
        raise
    return neg.submit_many(ops, waiting)


def _announce(calls: list[Call], rt: Any, error: Exception) -> None:
    """Tell the peers that this rank rejected ``calls`` (see ``submit_many``). Not for a process set this
    rank is not a member of (no sequence of it to keep), a name that is not a string, or a name still in
    flight on this rank (its pending op is not the rejected one)."""
    neg = rt.negotiator
    ranks = _member_ranks(calls[0].ps, rt)
    if ranks is None or any(c.name and (not isinstance(c.name, str) or neg.in_flight(c.name)) for c in calls):
        return
    reason = f"{type(error).__name__}: {error}"
    site = calls[0].site if calls[0].site is not callsite.UNKNOWN else callsite.current()  # for the message
    reqs = []
    for call in calls:
        if not call.name:
            call.name = neg.unnamed(_sequence_id(call.ps, rt))
        reqs.append(Request(call.name, call.kind, "", (), ps=ranks, site=site.fingerprint, where=site.where,
                            error=reason))
    neg.reject(reqs)


def _sequence_id(ps: Any, rt: Any) -> int:
    """The registered process set whose sequence ``ps`` uses: itself, or (not registered: a ProcessSet
    made but never added, on every rank alike) the registered set with the same ranks."""
    sid = getattr(ps, "process_set_id", None)
    if sid is not None and rt.process_sets.get(sid) is ps:
        return int(sid)
    ranks = list(getattr(ps, "ranks", None) or ())
    return next(i for i, other in rt.process_sets.items() if other.ranks == ranks)


def _member_ranks(ps: Any, rt: Any) -> tuple[int, ...] | None:
    """The ranks of ``ps`` if a call on it can be announced: it (or a set with its ranks) is registered and
    this rank is a member."""
    try:
        sid = _sequence_id(ps, rt)
    except StopIteration:
        return None
    ranks = tuple(rt.process_sets[sid].ranks)
    return ranks if rt.topo.rank in ranks else None


def _local_op(call: Call, neg: Any) -> LocalOp:
    kind = KINDS[call.kind]
    call.members = len(call.ps.ranks)
    tl = timeline.active()
    t0 = time.perf_counter() if tl is not None else 0.0
    kind.prepare(call)
    if tl is not None and call.wire is not call.tensor:  # a copy or compression happened (diagnostics)
        phase = "copy_in" if call.compression is Compression.none else "compress"
        tl.span(call.name, phase, t0, time.perf_counter(), kind=call.kind, bytes=call.wire.nbytes)
    handle = Handle(call.name, call.kind, lambda: kind.finish(call), neg.done, neg.drive)
    event = None
    if call.wire.is_cuda:
        event = torch.cuda.Event()
        event.record()
    fusable = call.wire if call.kind == "allreduce" else None
    return LocalOp(_request(call), handle, lambda launch: kind.launch(call, launch), wire=fusable, event=event)


# --- the kinds ----------------------------------------------------------------------------------------------
def _to_wire(t: torch.Tensor, copy: bool) -> torch.Tensor:
    t = t.detach()  # same storage; autograd is handled by hora.ops' Functions, never on the wire
    cast = _WIRE_CAST.get(t.dtype)
    if cast is not None:
        return t.to(cast)
    return t.clone() if copy else t


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` is ``b``'s storage seen through another tensor object (e.g. ``b.detach()``)."""
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape


def _from_wire(call: Call, result: torch.Tensor) -> torch.Tensor:
    dtype = call.tensor.dtype
    if result.dtype == dtype:
        return result
    widened = dtype in _WIRE_CAST or (call.op == ReduceOp.AVERAGE and dtype in _AVERAGE_WIRE)
    return result.to(dtype) if widened else result


def scale_integers(t: torch.Tensor, factor: float) -> None:
    """Scale an integer tensor in place as Horovod does: multiply in float64, truncate toward zero."""
    t.copy_(t.double().mul_(factor).trunc_())


def _scale_after(call: Call, result: torch.Tensor) -> None:
    """Average (over the set's full size, joined ranks included) and postscale, in place."""
    n = call.members  # not call.ps.size(): a handle may be finished after shutdown() unbound the set
    if not result.is_floating_point():
        if call.postscale != 1.0:  # Horovod: one float64 factor, postscale / size for Average, truncated
            scale_integers(result, call.postscale / n if call.op == ReduceOp.AVERAGE else call.postscale)
        elif call.op == ReduceOp.AVERAGE:
            result.div_(n, rounding_mode="trunc")
        return
    if call.op == ReduceOp.AVERAGE:
        result.mul_(call.postscale / n)
    elif call.postscale != 1.0:
        result.mul_(call.postscale)


def _prepare_reduction(call: Call) -> None:
    compressed, call.ctx = call.compression.compress(call.tensor.detach())
    # never write into the caller's tensor unless asked to (in-place)
    wide = _AVERAGE_WIRE.get(compressed.dtype) if call.op == ReduceOp.AVERAGE else None
    if wide is not None:
        call.wire = compressed.detach().to(wide)
    else:
        shared = compressed.data_ptr() == call.tensor.data_ptr()
        copy = shared and not call.inplace and (call.kind == "allreduce" or call.prescale != 1.0)
        call.wire = _to_wire(compressed, copy=copy)
    if call.prescale != 1.0:
        if call.wire.is_floating_point():
            call.wire.mul_(call.prescale)
        else:
            scale_integers(call.wire, call.prescale)


def _finish_reduction(call: Call, result: torch.Tensor) -> torch.Tensor:
    _scale_after(call, result)  # in the wire's type: an integer Average divides its wide sum
    if result.dtype != call.tensor.dtype and call.ctx is None:
        result = _from_wire(call, result)
    result = call.compression.decompress(result, call.ctx)
    if call.inplace:
        if not _same_memory(result, call.tensor):  # the wire was a copy (cast, compression)
            call.tensor.copy_(result)
        return call.tensor
    return result


class Allreduce:
    prepare = staticmethod(_prepare_reduction)

    @staticmethod
    def launch(call: Call, launch: Launch) -> Any:
        if call.wire.numel() == 0:  # the same shape everywhere: every rank skips it
            return None
        return allreduce_async(call.wire, call.op, launch.group)

    @staticmethod
    def finish(call: Call) -> torch.Tensor:
        return _finish_reduction(call, call.wire)


class Allgather:
    @staticmethod
    def prepare(call: Call) -> None:
        call.wire = _to_wire(call.tensor, copy=False)

    @staticmethod
    def launch(call: Call, launch: Launch) -> Any:
        call.meta = rows = member_rows(launch)
        call.out, work = gather_rows(call.wire, rows, launch.group)
        return work

    @staticmethod
    def finish(call: Call) -> torch.Tensor:
        return _from_wire(call, unpad_rows(call.out, call.meta))


def member_rows(launch: Launch) -> list[int]:
    """Rows each member contributes to an allgather (a joined rank contributes none)."""
    reqs = launch.entry.requests
    return [reqs[r].shape[0] if r in reqs else 0 for r in launch.entry.first.ps]


def gather_rows(wire: torch.Tensor, rows: list[int], group: Any) -> tuple[torch.Tensor, Any]:
    """Allgather with uneven dim 0: pad every contribution to the largest, trim in ``unpad_rows``."""
    top = max(rows)
    rest = tuple(wire.shape[1:])
    out = torch.empty((top * len(rows), *rest), dtype=wire.dtype, device=wire.device)
    if wire.shape[0] != top:
        padded = torch.zeros((top, *rest), dtype=wire.dtype, device=wire.device)
        padded[: wire.shape[0]].copy_(wire)
        wire = padded
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return out, fn(out, wire, group=group, async_op=True)


def unpad_rows(out: torch.Tensor, rows: list[int]) -> torch.Tensor:
    top = max(rows)
    if all(r == top for r in rows):
        return out
    return torch.cat([out[i * top : i * top + r] for i, r in enumerate(rows)])


class Broadcast:
    @staticmethod
    def prepare(call: Call) -> None:
        call.wire = _to_wire(call.tensor, copy=not call.inplace)

    @staticmethod
    def launch(call: Call, launch: Launch) -> Any:
        if call.wire.numel() == 0:
            return None
        return dist.broadcast(call.wire, src=call.root, group=launch.group, async_op=True)

    @staticmethod
    def finish(call: Call) -> torch.Tensor:
        result = _from_wire(call, call.wire)
        if call.inplace:
            if not _same_memory(result, call.tensor):
                call.tensor.copy_(result)
            return call.tensor
        return result


def even_splits(rows: int, n: int) -> list[int]:
    """Rows per rank when dim 0 is divided evenly: the first ``rows % n`` ranks get one more."""
    return [rows // n + (1 if i < rows % n else 0) for i in range(n)]


class Alltoall:
    @staticmethod
    def prepare(call: Call) -> None:
        call.wire = _to_wire(call.tensor, copy=False)

    @staticmethod
    def launch(call: Call, launch: Launch) -> Any:
        recv = received_rows(launch, call.index)
        rest = tuple(call.wire.shape[1:])
        call.out = torch.empty((sum(recv), *rest), dtype=call.wire.dtype, device=call.wire.device)
        call.meta = recv
        return dist.all_to_all_single(call.out, call.wire, output_split_sizes=recv,
                                      input_split_sizes=list(call.splits or ()), group=launch.group, async_op=True)

    @staticmethod
    def finish(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        return _from_wire(call, call.out), torch.tensor(call.meta, dtype=torch.int32)


def received_rows(launch: Launch, index: int) -> list[int]:
    """Rows member ``index`` of an alltoall receives from each member (a joined rank sends none)."""
    reqs = launch.entry.requests
    return [reqs[r].splits[index] if r in reqs else 0 for r in launch.entry.first.ps]  # type: ignore[index]


class Reducescatter:
    prepare = staticmethod(_prepare_reduction)

    @staticmethod
    def launch(call: Call, launch: Launch) -> Any:
        call.out, work = scatter_rows(call.wire, len(launch.entry.first.ps), call.index, call.op, launch.group)
        return work

    @staticmethod
    def finish(call: Call) -> torch.Tensor:
        return _finish_reduction(call, call.out)


def scatter_rows(wire: torch.Tensor, n: int, index: int, op: int, group: Any) -> tuple[torch.Tensor, Any]:
    """Reduce-scatter along dim 0 with the uneven rule, padding every chunk to the largest."""
    counts = even_splits(wire.shape[0], n)
    top = counts[0]
    rest = tuple(wire.shape[1:])
    if any(c != top for c in counts):
        padded = torch.zeros((top * n, *rest), dtype=wire.dtype, device=wire.device)
        start = 0
        for i, c in enumerate(counts):
            padded[i * top : i * top + c].copy_(wire[start : start + c])
            start += c
        wire = padded
    out = torch.empty((top, *rest), dtype=wire.dtype, device=wire.device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = fn(out, wire, op=wire_op(op), group=group, async_op=True)
    return out[: counts[index]], work


class Barrier:
    @staticmethod
    def prepare(call: Call) -> None:
        call.wire = call.tensor

    @staticmethod
    def launch(call: Call, launch: Launch) -> Any:
        return dist.barrier(group=launch.group, async_op=True)

    @staticmethod
    def finish(call: Call) -> None:
        return None


class Join:
    @staticmethod
    def prepare(call: Call) -> None:
        call.wire = call.tensor

    @staticmethod
    def launch(call: Call, launch: Launch) -> None:
        from hora.engine.plan import last_joined

        call.meta = last_joined(launch.entry)

    @staticmethod
    def finish(call: Call) -> int:
        return int(call.meta)


KINDS: dict[str, Any] = {"allreduce": Allreduce, "allgather": Allgather, "broadcast": Broadcast,
                         "alltoall": Alltoall, "reducescatter": Reducescatter, "barrier": Barrier, "join": Join}


def launch_joined(launch: Launch) -> Any:
    """Take part in a collective for a rank that has called ``join()``: contribute zeros or nothing."""
    from hora.fusion import to_dtype

    req = launch.entry.first
    dtype, device = to_dtype(req.dtype), torch.device(req.device, torch.cuda.current_device()) \
        if req.device == "cuda" else torch.device("cpu")
    group = launch.group
    if req.kind in ("allreduce", "broadcast") and torch.Size(req.shape).numel() == 0:
        return None  # the members skip empty tensors too
    if req.kind == "allreduce":
        return allreduce_async(torch.zeros(req.shape, dtype=dtype, device=device), req.op, group)
    if req.kind == "allgather":
        empty = torch.zeros((0, *req.shape[1:]), dtype=dtype, device=device)
        return gather_rows(empty, member_rows(launch), group)[1]
    if req.kind == "broadcast":
        return dist.broadcast(torch.empty(req.shape, dtype=dtype, device=device), src=req.root, group=group,
                              async_op=True)
    if req.kind == "reducescatter":
        index = list(req.ps).index(launch.rank)
        zeros = torch.zeros(req.shape, dtype=dtype, device=device)
        return scatter_rows(zeros, len(req.ps), index, req.op, group)[1]
    if req.kind == "alltoall":  # sends no rows, receives (and drops) the rows the members send it
        index = list(req.ps).index(launch.rank)
        rest = tuple(req.shape[1:])
        recv = received_rows(launch, index)
        out = torch.empty((sum(recv), *rest), dtype=dtype, device=device)
        return dist.all_to_all_single(out, torch.empty((0, *rest), dtype=dtype, device=device),
                                      output_split_sizes=recv, input_split_sizes=[0] * len(req.ps), group=group,
                                      async_op=True)
    if req.kind == "barrier":
        return dist.barrier(group=group, async_op=True)
    return None


def default_set(process_set: ProcessSet | None) -> ProcessSet:
    return global_process_set if process_set is None else process_set
