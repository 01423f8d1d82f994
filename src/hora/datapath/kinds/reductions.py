"""The reductions' steps: allreduce and reducescatter.

Both prepare the same wire (compress, widen an integer Average, prescale; a copy only where the caller's tensor
must stay untouched) and finish the same way (Average's division and postscale, cast back, decompress, copy
out). An allreduce launches as one c10d call, or, for a large 16-bit CPU wire, one per piece with each piece's
casts beside the wire (:func:`_launch_pieces`); on the global process set with the hierarchy on it takes the
hierarchy's three steps (:mod:`hora.datapath.hierarchical`). A reducescatter launches
:func:`hora.datapath.c10d.scatter_rows`.
"""

from __future__ import annotations

from typing import Any

import torch

from hora.datapath import c10d as dataplane
from hora.datapath import hierarchical, streams
from hora.datapath.c10d import Work
from hora.datapath.hierarchical import Hierarchy
from hora.datapath.kinds.op import Op, Peers
from hora.datapath.reduce_ops import AVERAGE_WIRE, ReduceOp, finish_sum, float_factor, scale_integers
from hora.datapath.wire import (
    cast_scaled,
    copy_out,
    from_wire,
    lease_wire,
    pipeline_ranges,
    to_wire,
)


def _prepare(op: Op, pieces: bool) -> None:
    """The wire of a reduction. ``pieces``: a built-in cast into a reused buffer is made piece by piece when the
    allreduce starts (each piece's cast overlapping another's wire), not here."""
    call = op.call
    tensor = call.tensor.detach()
    op.lease = lease_wire(call.compression, tensor, op.buffers) if op.buffers is not None else None
    if op.lease is not None:  # a built-in cast into a reused buffer: the same as compress(), no allocation
        op.wire, op.ctx = op.lease.view(tensor.shape), tensor.dtype
        if pieces:
            return
        op.wire.copy_(tensor)
        if call.prescale != 1.0:
            op.wire.mul_(call.prescale)
        return
    compressed, op.ctx = call.compression.compress(tensor)
    # never write into the caller's tensor unless asked to (in-place)
    wide = AVERAGE_WIRE.get(compressed.dtype) if call.reduce_op == ReduceOp.AVERAGE else None
    if wide is not None:
        op.wire = compressed.detach().to(wide)
    else:
        shared = compressed.data_ptr() == call.tensor.data_ptr()
        copy = shared and not call.inplace and (pieces or call.prescale != 1.0)
        op.wire = to_wire(compressed, copy=copy)
    if call.prescale != 1.0:
        if op.wire.is_floating_point():
            op.wire.mul_(call.prescale)
        else:
            scale_integers(op.wire, call.prescale)


def _finish(op: Op, result: torch.Tensor) -> torch.Tensor:
    call = op.call
    # in the wire's type: an integer Average divides its wide sum; not call.ps.size(): a handle may be
    # finished after shutdown() unbound the set
    finish_sum(result, call.reduce_op, call.postscale, op.members)
    if result.dtype != call.tensor.dtype and op.ctx is None:
        result = from_wire(result, call.tensor.dtype, call.reduce_op)
    return copy_out(call.compression.decompress(result, op.ctx), call.tensor, call.inplace)


def _give_back(op: Op) -> None:
    if op.lease is not None:
        op.buffers.give(op.lease)  # type: ignore[union-attr]  # a lease came from them
        op.lease = None


def _allreduce(piece: torch.Tensor, reduce_op: int, group: Any, hierarchy: Hierarchy | None) -> Work:
    """One piece: through the hierarchy when one was built (it decides whether this group takes its steps),
    else the flat c10d allreduce."""
    if hierarchy is None:
        return dataplane.allreduce(piece, reduce_op, group)
    return hierarchical.allreduce(piece, reduce_op, group, hierarchy)


def _launch_pieces(wire: torch.Tensor, reduce_op: int, group: Any, hierarchy: Hierarchy | None,
                   state: Op | None = None) -> Work:
    """Allreduce ``wire`` in the pieces :func:`~hora.datapath.wire.pipeline_ranges` gives, one c10d call each.

    With ``state`` (a compressed call's op whose wire is a reused buffer, :func:`_prepare`): each piece of the
    caller's tensor is cast down just before its piece is sent, while the previous piece is on the wire, and
    cast back (with Average's division and postscale) into the result as soon as it arrives, on the backend's
    thread, while the next piece is on the wire."""
    ranges = pipeline_ranges(wire.numel(), wire.dtype, wire.device.type)
    if state is None and len(ranges) == 1:
        return _allreduce(wire, reduce_op, group, hierarchy)
    flat = wire.view(-1)
    if state is None:
        return dataplane.FuturesWork([_allreduce(flat[a:b], reduce_op, group, hierarchy).get_future()
                                      for a, b in ranges])
    call = state.call
    src = call.tensor.detach().view(-1)  # contiguous: lease_wire's condition
    state.out = call.tensor if call.inplace else torch.empty(call.tensor.shape, dtype=call.tensor.dtype)
    dst = state.out.detach().view(-1)
    factor = float_factor(call.reduce_op, call.postscale, state.members)
    futures = []
    for a, b in ranges:
        piece = flat[a:b]
        piece.copy_(src[a:b])
        if call.prescale != 1.0:
            piece.mul_(call.prescale)
        work = _allreduce(piece, reduce_op, group, hierarchy)
        futures.append(work.get_future().then(
            lambda _done, a=a, b=b: cast_scaled(flat[a:b], dst[a:b], factor)))  # type: ignore[misc]
    return dataplane.FuturesWork(futures)


def allreduce_flat(wire: torch.Tensor, reduce_op: int, group: Any, hierarchy: Hierarchy | None) -> Work:
    """Allreduce ``wire`` in place on ``group``, in the pieces a single allreduce of it would take: the launch
    path of single ops, fused batches and gradient buckets alike."""
    return _launch_pieces(wire, reduce_op, group, hierarchy)


class Allreduce:
    @staticmethod
    def prepare(op: Op) -> None:
        _prepare(op, pieces=True)

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work | None:
        if op.wire.numel() == 0:  # the same shape everywhere: every rank skips it
            return None
        return _launch_pieces(op.wire, op.call.reduce_op, peers.group, peers.hierarchy,
                              op if op.lease is not None else None)

    @staticmethod
    def launch_joined(peers: Peers) -> Work | None:
        req = peers.agreed
        if torch.Size(req.shape).numel() == 0:
            return None  # the members skip empty tensors too
        return _launch_pieces(peers.zeros(), req.reduce_op, peers.group, peers.hierarchy)

    @staticmethod
    def finish(op: Op) -> torch.Tensor:
        if op.lease is None:
            return _finish(op, op.wire)
        _give_back(op)  # its pieces were cast back as they arrived (_launch_pieces): its result is ready
        return op.out


class Reducescatter:
    @staticmethod
    def prepare(op: Op) -> None:
        _prepare(op, pieces=False)

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work:
        op.out, work = dataplane.scatter_rows(op.wire, op.members, op.index, op.call.reduce_op, peers.group)
        return work

    @staticmethod
    def launch_joined(peers: Peers) -> Work:
        req = peers.agreed
        return dataplane.scatter_rows(peers.zeros(), len(req.ps), peers.index(), req.reduce_op,
                                      peers.group)[1]

    @staticmethod
    def finish(op: Op) -> torch.Tensor:
        streams.consumed_here(op.out)
        try:
            return _finish(op, op.out)
        finally:
            _give_back(op)
