"""What one collective call is, and what each kind of collective does at its four steps.

First the records every layer from the call builders down sees: the :class:`Kind`, the validated :class:`Call`,
the :class:`Request` the peers must agree on, the :class:`Op` that carries a call with its kind's steps through
the engine, and the :class:`Peers` a launch sees of the other members (never the engine's table). Then the steps.

A :class:`Call` is one validated user call. Its :class:`Kind` says which collective it is; ``KINDS[kind]``
holds that kind's steps:

- ``prepare(call)``: on the caller's thread at submit, build the wire buffer (compress, prescale, cast a
  dtype the backend lacks, copy when the caller's tensor must stay untouched);
- ``launch(call, peers)``: on the thread that ran the negotiation round, once every member has submitted,
  issue the c10d call (:mod:`hora.datapath.c10d`, or :func:`hora.datapath.hierarchical.allreduce`; a large 16-bit CPU
  allreduce: one per piece, its casts beside the wire, :func:`_launch_pieces`); returns its Work;
- ``launch_joined(peers)``: the same collective for a rank that has called ``join()``: zeros or no rows;
- ``finish(call)``: on the caller's thread in ``synchronize()``, after the Work completed: average,
  postscale, decompress, copy out; returns what the user gets.

Nothing here negotiates or knows about other calls: the engine decides when ``launch`` runs.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from hora.common.process_sets import ProcessSet
from hora.datapath import adasum, hierarchical, streams
from hora.datapath import c10d as dataplane
from hora.datapath.c10d import Work, to_dtype
from hora.datapath.compression import WIRE_BUFFERS, Compression, Compressor, cast_scaled, lease_wire, pipeline_ranges
from hora.datapath.reduce_ops import AVERAGE_WIRE, ReduceOp, finish_sum, float_factor, scale_integers
from hora.diagnostics import callsite
from hora.diagnostics.callsite import Site


# --- what a call is: its kind, the call, the request, the op, the peers --------------------------------------------
class Kind(str, enum.Enum):
    """Which collective a call is. Compares (and hashes) equal to its value, the string on the wire."""

    ALLREDUCE = "allreduce"
    ADASUM = "adasum"  # an allreduce with op=hvd.Adasum: an allgather, then the Adasum tree on every rank
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    ALLTOALL = "alltoall"
    REDUCESCATTER = "reducescatter"
    BARRIER = "barrier"
    JOIN = "join"
    SHUTDOWN = "shutdown"  # the engine's own request when a rank calls shutdown(): no data, no steps here

    tag: str  # the plain string requests carry (set below: ``.value`` is an enum property, slow per op)

    __hash__ = str.__hash__  # a plain "allreduce" finds Kind.ALLREDUCE in a dict or set, and the reverse

    def __str__(self) -> str:
        return self.tag


for _kind in Kind:
    _kind.tag = _kind._value_


REDUCTIONS = frozenset({Kind.ALLREDUCE, Kind.REDUCESCATTER})  # the kinds that take op= and scale factors
_NO_WIRE = torch.empty(0)  # an Op's wire until its kind's prepare sets it (never written to)


@dataclass(frozen=True, eq=False)
class Call:
    """One call as the user made it, validated: its inputs, never changed once submitted (what the steps compute
    goes into its :class:`Op`)."""

    kind: Kind
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
    site: Site = callsite.UNKNOWN  # where the user called it (unnamed ops, when the check is on)
    rejected: Exception | None = None  # found invalid while the call was built (raised at submit)

    @property
    def index(self) -> int:
        return self.ps.rank()

    def given(self, name: str, site: Site) -> Call:
        """This call with the name and call site ``submit`` gives it (faster than ``dataclasses.replace``,
        which the per-op path cannot afford; every field is passed on)."""
        return Call(self.kind, self.tensor, name, self.ps, op=self.op, root=self.root, prescale=self.prescale,
                    postscale=self.postscale, splits=self.splits, compression=self.compression,
                    inplace=self.inplace, site=site, rejected=self.rejected)


class Request(NamedTuple):
    """What a rank says about one op it submitted. Every field up to ``device`` must agree across ranks
    (for allgather/alltoall only the trailing dimensions of ``shape`` must agree), and so must ``site``
    where every rank sent one (unnamed ops; 0 = not checked).

    A request with ``error`` set announces a call this rank rejected before sending anything (a
    non-contiguous tensor, a bad root...): it still takes its place, and the op fails on every member."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    op: int = 0
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    ps: tuple[int, ...] = ()  # member ranks of the process set
    device: str = "cpu"
    splits: tuple[int, ...] | None = None
    site: int = 0  # call-site fingerprint of an unnamed op (hora.diagnostics.callsite); 0: not checked
    where: str = ""  # that call site as file:line, for messages
    error: str = ""  # set: this rank rejected the call (the reason)


@dataclass(eq=False)
class Peers:
    """What a kind's launch sees of a ready collective beyond its own call: the group to run on, this rank,
    what the members agreed on, and per member what it submitted and in which round (the engine builds it from
    the round's table; the kinds never see the table)."""

    group: dist.ProcessGroup  # the process set's
    rank: int
    agreed: Request  # the first member's request: every field the members must agree on
    requests: Mapping[int, Request]  # rank -> its request (a joined rank has none)
    arrival: Mapping[int, int]  # rank -> the round its request arrived in

    def rows(self) -> list[int]:
        """Rows each member contributes to an allgather (a joined member contributes none)."""
        return [self.requests[r].shape[0] if r in self.requests else 0 for r in self.agreed.ps]

    def received_rows(self, index: int) -> list[int]:
        """Rows member ``index`` of an alltoall receives from each member (a joined member sends none)."""
        reqs = self.requests
        return [reqs[r].splits[index] if r in reqs else 0 for r in self.agreed.ps]  # type: ignore[index]

    def last_joined(self) -> int:
        """The rank whose join arrived last; ties: the highest rank."""
        return max(self.arrival, key=lambda r: (self.arrival[r], r))


class Steps(Protocol):
    """A kind's four steps (see :mod:`hora.datapath.kinds`)."""

    def prepare(self, op: Op) -> None: ...

    def launch(self, op: Op, peers: Peers) -> Work | None: ...

    def launch_joined(self, peers: Peers) -> Work | None: ...

    def finish(self, op: Op) -> Any: ...


@dataclass(eq=False)
class Op:
    """A submitted call, its kind's steps, and what the steps compute. Owned by one thread at a time: the
    caller's at submit (prepare), the thread that runs the round at launch, the caller's again in
    ``synchronize()`` (finish), each hand-over ordered by the handle's latch. The engine launches
    ``Op.launch`` and the handle finishes with ``Op.finish``: a stack trace names the kind, never a lambda."""

    call: Call
    steps: Steps
    members: int = 0  # the process set's size when the call was submitted (Average divides by it)
    wire: torch.Tensor = _NO_WIRE  # set by prepare: the buffer the collective sends (and receives in place)
    ctx: Any = None  # compression context (Adasum: how many levels summed within a host)
    lease: torch.Tensor | None = None  # a reused 16-bit wire buffer (compression.WIRE_BUFFERS), given back at finish
    out: torch.Tensor = _NO_WIRE  # set by launch when the output is not the wire: the c10d output buffer
    rows: list[int] | None = None  # set by launch: rows from each member (allgather's sent, alltoall's received)
    last_joined: int = -1  # set by Join's launch: the rank whose join arrived last

    @property
    def index(self) -> int:
        return self.call.ps.rank()

    def prepare(self) -> None:
        self.steps.prepare(self)

    def launch(self, peers: Peers) -> Work | None:
        return self.steps.launch(self, peers)

    def finish(self) -> Any:
        return self.steps.finish(self)


# dtypes the backends lack travel as a wider type and are cast back when the op finishes
_WIRE_CAST = {torch.int16: torch.int32}


# --- the wire buffer ----------------------------------------------------------------------------------------
def _to_wire(t: torch.Tensor, copy: bool) -> torch.Tensor:
    t = t.detach()  # same storage; autograd is handled by hora.api.ops' Functions, never on the wire
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
    widened = dtype in _WIRE_CAST or (call.op == ReduceOp.AVERAGE and dtype in AVERAGE_WIRE)
    return result.to(dtype) if widened else result


def _copy_out(call: Call, result: torch.Tensor) -> torch.Tensor:
    """The user's result: ``result``, or for an in-place call the caller's tensor holding it."""
    if not call.inplace:
        return result
    if not _same_memory(result, call.tensor):  # the wire was a copy (cast, compression)
        call.tensor.copy_(result)
    return call.tensor


def _zeros_like_request(peers: Peers, rows: int | None = None) -> torch.Tensor:
    """What a joined rank contributes: zeros of the members' dtype and shape (``rows`` rows, if given)."""
    req = peers.agreed
    device = torch.device(req.device, torch.cuda.current_device()) if req.device == "cuda" else torch.device("cpu")
    shape = req.shape if rows is None else (rows, *req.shape[1:])
    return torch.zeros(shape, dtype=to_dtype(req.dtype), device=device)


# --- reductions: allreduce, reducescatter -------------------------------------------------------------------
def _prepare_reduction(op: Op) -> None:
    call = op.call
    tensor = call.tensor.detach()
    op.lease = lease_wire(call.compression, tensor)
    if op.lease is not None:  # a built-in cast into a reused buffer: the same as compress(), no allocation
        op.wire, op.ctx = op.lease.view(tensor.shape), tensor.dtype
        if call.kind is Kind.ALLREDUCE:
            return  # cast piece by piece when it starts, each piece's cast overlapping another's wire
        op.wire.copy_(tensor)
        if call.prescale != 1.0:
            op.wire.mul_(call.prescale)
        return
    compressed, op.ctx = call.compression.compress(tensor)
    # never write into the caller's tensor unless asked to (in-place)
    wide = AVERAGE_WIRE.get(compressed.dtype) if call.op == ReduceOp.AVERAGE else None
    if wide is not None:
        op.wire = compressed.detach().to(wide)
    else:
        shared = compressed.data_ptr() == call.tensor.data_ptr()
        copy = shared and not call.inplace and (call.kind is Kind.ALLREDUCE or call.prescale != 1.0)
        op.wire = _to_wire(compressed, copy=copy)
    if call.prescale != 1.0:
        if op.wire.is_floating_point():
            op.wire.mul_(call.prescale)
        else:
            scale_integers(op.wire, call.prescale)


def _finish_reduction(op: Op, result: torch.Tensor) -> torch.Tensor:
    call = op.call
    if op.lease is None:
        return _finish_wire(op, result)
    try:  # an allreduce's pieces were cast back as they arrived (_launch_pieces): its result is ready
        return op.out if call.kind is Kind.ALLREDUCE else _finish_wire(op, result)
    finally:
        WIRE_BUFFERS.give(op.lease)
        op.lease = None


def _finish_wire(op: Op, result: torch.Tensor) -> torch.Tensor:
    call = op.call
    # in the wire's type: an integer Average divides its wide sum; not call.ps.size(): a handle may be
    # finished after shutdown() unbound the set
    finish_sum(result, call.op, call.postscale, op.members)
    if result.dtype != call.tensor.dtype and op.ctx is None:
        result = _from_wire(call, result)
    return _copy_out(call, call.compression.decompress(result, op.ctx))


def _launch_pieces(wire: torch.Tensor, reduce_op: int, group: Any, state: Op | None = None) -> Work:
    """Allreduce ``wire`` in the pieces :func:`~hora.datapath.compression.pipeline_ranges` gives, one c10d call each.

    With ``state`` (a compressed call's op whose wire is a reused buffer, :func:`_prepare_reduction`): each piece
    of the caller's tensor is cast down just before its piece is sent, while the previous piece is on the
    wire, and cast back (with Average's division and postscale) into the result as soon as it arrives, on
    the backend's thread, while the next piece is on the wire."""
    ranges = pipeline_ranges(wire.numel(), wire.dtype, wire.device.type)
    if state is None and len(ranges) == 1:
        return hierarchical.allreduce(wire, reduce_op, group)
    flat = wire.view(-1)
    if state is None:
        return dataplane.FuturesWork([hierarchical.allreduce(flat[a:b], reduce_op, group).get_future()
                                      for a, b in ranges])
    call = state.call
    src = call.tensor.detach().view(-1)  # contiguous: lease_wire's condition
    state.out = call.tensor if call.inplace else torch.empty(call.tensor.shape, dtype=call.tensor.dtype)
    dst = state.out.detach().view(-1)
    factor = float_factor(call.op, call.postscale, state.members)
    futures = []
    for a, b in ranges:
        piece = flat[a:b]
        piece.copy_(src[a:b])
        if call.prescale != 1.0:
            piece.mul_(call.prescale)
        work = hierarchical.allreduce(piece, reduce_op, group)
        futures.append(work.get_future().then(
            lambda _done, a=a, b=b: cast_scaled(flat[a:b], dst[a:b], factor)))  # type: ignore[misc]
    return dataplane.FuturesWork(futures)


class Allreduce:
    prepare = staticmethod(_prepare_reduction)

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work | None:
        call = op.call
        if op.wire.numel() == 0:  # the same shape everywhere: every rank skips it
            return None
        return _launch_pieces(op.wire, call.op, peers.group, op if op.lease is not None else None)

    @staticmethod
    def launch_joined(peers: Peers) -> Work | None:
        req = peers.agreed
        if torch.Size(req.shape).numel() == 0:
            return None  # the members skip empty tensors too
        return _launch_pieces(_zeros_like_request(peers), req.op, peers.group)

    @staticmethod
    def finish(op: Op) -> torch.Tensor:
        return _finish_reduction(op, op.wire)


class Reducescatter:
    prepare = staticmethod(_prepare_reduction)

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work:
        call = op.call
        op.out, work = dataplane.scatter_rows(op.wire, op.members, op.index, call.op, peers.group)
        return work

    @staticmethod
    def launch_joined(peers: Peers) -> Work:
        req = peers.agreed
        index = list(req.ps).index(peers.rank)
        return dataplane.scatter_rows(_zeros_like_request(peers), len(req.ps), index, req.op, peers.group)[1]

    @staticmethod
    def finish(op: Op) -> torch.Tensor:
        streams.consumed_here(op.out)
        return _finish_reduction(op, op.out)


class Adasum:
    """``allreduce(op=hvd.Adasum)``: the members combine their flattened tensors in place by vector halving and
    distance doubling (:func:`hora.datapath.adasum.vhdd`), as Horovod does; on CUDA tensors of the whole job
    a host's ranks average theirs first (Horovod's GPU Adasum: summed, then divided by the ranks per host).
    Runs entirely at launch, in the agreed order; ``op.ctx``: the summed levels."""

    @staticmethod
    def prepare(op: Op) -> None:
        call = op.call
        flat = call.tensor.detach().reshape(-1)
        if call.prescale != 1.0:
            flat = flat * call.prescale
        op.wire = _to_wire(flat, copy=not call.inplace and call.prescale == 1.0)  # combined in place

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work:
        ranks = peers.agreed.ps
        cuda = op.wire.is_cuda
        try:
            op.ctx = summed = adasum.summed_levels(ranks, cuda)
            adasum.vhdd(op.wire, ranks, peers.rank, peers.group, summed)
        except Exception as e:  # noqa: BLE001 - a peer lost mid-way (the backend's error): reported at wait()
            return dataplane.done_work(e)
        # on CUDA every step was issued on the launch stream, which each step's Work was waited on
        return streams.EventWork(torch.cuda.current_stream(op.wire.device)) if cuda else dataplane.done_work()

    @staticmethod
    def launch_joined(peers: Peers) -> None:
        return None  # never runs: the negotiation table fails Adasum while a rank has joined (plan.JOIN_OK)

    @staticmethod
    def finish(op: Op) -> torch.Tensor:
        call = op.call
        result = op.wire.view(call.tensor.shape)
        if op.ctx:  # a host's ranks were summed: Horovod divides by the ranks per host (its postscale)
            result.div_(1 << op.ctx) if result.is_floating_point() else result.floor_divide_(1 << op.ctx)
        if result.dtype != call.tensor.dtype:
            result = result.to(call.tensor.dtype)
        if call.postscale != 1.0:
            result.mul_(call.postscale)
        return _copy_out(call, result)


# --- data movement: allgather, broadcast, alltoall ----------------------------------------------------------
def _prepare_rows(op: Op) -> None:
    """The caller's rows as they are (an int16 is widened): a gather or an exchange only reads them."""
    op.wire = _to_wire(op.call.tensor, copy=False)


class Allgather:
    prepare = staticmethod(_prepare_rows)

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work:
        op.rows = rows = peers.rows()
        op.out, work = dataplane.gather_rows(op.wire, rows, peers.group)
        return work

    @staticmethod
    def launch_joined(peers: Peers) -> Work:
        return dataplane.gather_rows(_zeros_like_request(peers, rows=0), peers.rows(), peers.group)[1]

    @staticmethod
    def finish(op: Op) -> torch.Tensor:
        call = op.call
        streams.consumed_here(op.out)
        return _from_wire(call, dataplane.unpad_rows(op.out, op.rows))  # type: ignore[arg-type]


class Broadcast:
    @staticmethod
    def prepare(op: Op) -> None:
        call = op.call
        op.wire = _to_wire(call.tensor, copy=not call.inplace)

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work | None:
        call = op.call
        if op.wire.numel() == 0:
            return None
        return dataplane.broadcast(op.wire, call.root, peers.group)

    @staticmethod
    def launch_joined(peers: Peers) -> Work | None:
        req = peers.agreed
        if torch.Size(req.shape).numel() == 0:
            return None  # the members skip empty tensors too
        return dataplane.broadcast(_zeros_like_request(peers), req.root, peers.group)

    @staticmethod
    def finish(op: Op) -> torch.Tensor:
        call = op.call
        return _copy_out(call, _from_wire(call, op.wire))


class Alltoall:
    prepare = staticmethod(_prepare_rows)

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work:
        call = op.call
        op.rows = recv = peers.received_rows(op.index)
        rest = tuple(op.wire.shape[1:])
        op.out = torch.empty((sum(recv), *rest), dtype=op.wire.dtype, device=op.wire.device)
        return dataplane.alltoall(op.out, op.wire, recv, list(call.splits or ()), peers.group)

    @staticmethod
    def launch_joined(peers: Peers) -> Work:
        """Sends no rows; receives (and drops) the rows the members send it."""
        req = peers.agreed
        recv = peers.received_rows(list(req.ps).index(peers.rank))
        out = _zeros_like_request(peers, rows=sum(recv))
        return dataplane.alltoall(out, _zeros_like_request(peers, rows=0), recv, [0] * len(req.ps), peers.group)

    @staticmethod
    def finish(op: Op) -> tuple[torch.Tensor, torch.Tensor]:
        call = op.call
        streams.consumed_here(op.out)
        return _from_wire(call, op.out), torch.tensor(op.rows, dtype=torch.int32)


# --- synchronisation: barrier, join ----------------------------------------------------------------------------
class Barrier:
    @staticmethod
    def prepare(op: Op) -> None:
        call = op.call
        op.wire = call.tensor

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work:
        return dataplane.barrier(peers.group)

    @staticmethod
    def launch_joined(peers: Peers) -> Work:
        return dataplane.barrier(peers.group)

    @staticmethod
    def finish(op: Op) -> None:
        return None


class Join:
    """No data: ready once every rank has joined; the result is the rank whose join arrived last."""

    @staticmethod
    def prepare(op: Op) -> None:
        call = op.call
        op.wire = call.tensor

    @staticmethod
    def launch(op: Op, peers: Peers) -> None:
        op.last_joined = peers.last_joined()

    @staticmethod
    def launch_joined(peers: Peers) -> None:
        return None

    @staticmethod
    def finish(op: Op) -> int:
        return op.last_joined


KINDS: dict[str, Steps] = {Kind.ALLREDUCE: Allreduce, Kind.ADASUM: Adasum, Kind.ALLGATHER: Allgather,  # type: ignore[dict-item]
                           Kind.BROADCAST: Broadcast, Kind.ALLTOALL: Alltoall, Kind.REDUCESCATTER: Reducescatter,
                           Kind.BARRIER: Barrier, Kind.JOIN: Join}


def launch_joined(peers: Peers) -> Work | None:
    """Take part in a ready collective for a rank that has called ``join()``: contribute zeros or nothing."""
    steps = KINDS.get(peers.agreed.kind)
    return steps.launch_joined(peers) if steps is not None else None


def allreduce_flat(wire: torch.Tensor, op: int, group: Any) -> Work:
    """Allreduce ``wire`` in place on ``group``, in the pieces a single allreduce of it would take: the launch
    path of single ops, fused batches and gradient buckets alike."""
    return _launch_pieces(wire, op, group)
