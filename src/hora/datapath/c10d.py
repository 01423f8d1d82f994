"""The data plane: the only module that issues c10d collectives on hora's tensors, and the torch-version shims.

Every call is asynchronous (it returns the c10d ``Work``) and runs on one of hora's own groups (a process
set's group, or the hierarchy's local / cross groups), never on the user's. The layers above call these and
nothing else of ``torch.distributed``'s collective API: :mod:`hora.datapath.kinds` (one call per op),
:mod:`hora.datapath.fusion` (one call per fused batch) and :mod:`hora.datapath.hierarchical` (its three steps). Rows
padding for uneven allgathers and reduce-scatters is done here too, since it is how those calls are issued.

Example:
    >>> wire_op(ReduceOp.AVERAGE)   # an Average is summed; the division happens when the op finishes
    <RedOpType.SUM: 0>
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hora.datapath import streams
from hora.datapath.reduce_ops import ReduceOp

Work = Any  # a c10d Work (torch has no public type for it)

_WIRE_OPS = {
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,  # the division happens when the op finishes
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}

# torch-version shims, resolved once at import: the single-tensor allgather / reduce-scatter were renamed
# (``all_gather_single`` and ``reduce_scatter_single`` where present, else the ``*_tensor`` forms), and
# ``AllreduceOptions.asyncOp`` exists only in recent releases
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # also the Gloo
# control plane's allgather of frames (engine/transport/gloo_plane.py): the one place torch's name for it is chosen
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_HAS_ASYNC_OP = hasattr(dist.AllreduceOptions(), "asyncOp")

_OPTIONS: dict[int, Any] = {}  # reduce op -> c10d AllreduceOptions, built once: nothing allocated per op


class FuturesWork:
    """A Work made of torch futures: complete when every one is; ``wait()`` raises what one of them failed with.
    For CPU paths that run an allreduce as several pieces (a 16-bit allreduce in pieces) or on the calling
    thread (the hierarchy's shared-memory way: :func:`done_work`). (The hierarchy's leader way keeps the c10d
    Works themselves: on NCCL a Work's ``is_completed()`` and its future's ``done()`` answer different things.)"""

    __slots__ = ("_futures",)

    def __init__(self, futures: list[Any]) -> None:
        self._futures = futures

    def wait(self, timeout: Any = None) -> bool:
        for future in self._futures:
            future.wait()
        return True

    def is_completed(self) -> bool:
        return all(future.done() for future in self._futures)

    def get_future(self) -> Any:
        return torch.futures.collect_all(self._futures)


class KeptWork:
    """A Work and the temporaries it reads that were allocated for it on the launch stream (an uneven
    allgather's or reduce-scatter's padded input). Since torch's PR #150398, ProcessGroupNCCL lets go of its
    own references to a collective's tensors in ``Work.wait()``, right after ordering the *waiting* stream after
    the collective (WorkNCCL::synchronizeStream: block the current stream on the end event, then unstash). A
    tensor allocated on another stream, the launch stream, would then go back to that stream's pool at once,
    and the next launch could write into it while NCCL still sends it. So they stay here until ``wait()``,
    which records them on the waiting stream before letting go: the allocator reuses their memory only once
    that stream, and so the collective, is past this point."""

    __slots__ = ("_kept", "_work")

    def __init__(self, work: Work, kept: tuple[torch.Tensor, ...]) -> None:
        self._work = work
        self._kept = kept

    def wait(self, timeout: Any = None) -> bool:
        self._work.wait()
        for tensor in self._kept:
            streams.consumed_here(tensor)
        self._kept = ()
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def get_future(self) -> Any:
        return self._work.get_future()


def done_work(error: Exception | None = None) -> FuturesWork:
    """The Work of an op that already ran on the calling thread: done, or failed with ``error`` (raised at
    ``wait()``, where a backend failure of an asynchronous op is, so it is reported the same way)."""
    future: Any = torch.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)
    return FuturesWork([future])


def wire_op(op: int) -> Any:
    """The c10d reduce op that carries a hora reduce op on the wire."""
    wire = _WIRE_OPS.get(op)  # type: ignore[call-overload]  # an IntEnum key matches its int value
    return wire if wire is not None else _WIRE_OPS[ReduceOp(op)]


def allreduce(tensor: torch.Tensor, op: int, group: Any) -> Work:
    """``dist.all_reduce(tensor, op, group, async_op=True)`` without its per-call Python checks, which cost more
    than hora's whole round: hora validated the tensor at submit (never complex), and never coalesces on its
    own groups."""
    opts = _OPTIONS.get(op)
    if opts is None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = wire_op(op)
        if _HAS_ASYNC_OP:
            opts.asyncOp = True
        opts = _OPTIONS.setdefault(op, opts)
    return group.allreduce([tensor], opts)


def reduce_scatter(out: torch.Tensor, tensor: torch.Tensor, op: int, group: Any) -> Work:
    """Reduce ``tensor`` (``group.size()`` equal pieces) across ``group``; this rank's piece of the result into
    ``out``, which may be that piece of ``tensor`` itself (in place)."""
    return _reduce_scatter_into(out, tensor, op=wire_op(op), group=group, async_op=True)


def gather(out: torch.Tensor, tensor: torch.Tensor, group: Any) -> Work:
    """Allgather ``tensor`` from every member of ``group`` into ``out``, in rank order; ``tensor`` may be this
    rank's piece of ``out`` itself (in place)."""
    return all_gather_into(out, tensor, group=group, async_op=True)


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group: Any) -> list[Work]:
    """Send ``send`` to global rank ``peer`` and receive ``recv`` from it, as one batch (NCCL issues the pair
    in one group call, so neither side waits on the other's order); an empty side is left out (its peer
    leaves out the matching one). Returns the Works to wait for (none when both sides are empty)."""
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, peer, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, peer, group))
    return list(dist.batch_isend_irecv(ops)) if ops else []


def reduce(tensor: torch.Tensor, dst: int, op: int, group: Any) -> Work:
    """Reduce ``tensor`` in place onto global rank ``dst`` of ``group``."""
    return dist.reduce(tensor, dst=dst, op=wire_op(op), group=group, async_op=True)


def broadcast(tensor: torch.Tensor, src: int, group: Any) -> Work:
    """Broadcast ``tensor`` in place from global rank ``src``."""
    return dist.broadcast(tensor, src=src, group=group, async_op=True)


def barrier(group: Any) -> Work:
    return dist.barrier(group=group, async_op=True)


def alltoall(out: torch.Tensor, tensor: torch.Tensor, out_splits: list[int], in_splits: list[int],
             group: Any) -> Work:
    """Send ``in_splits[i]`` rows of ``tensor`` to member i, receive ``out_splits[i]`` rows into ``out``."""
    return dist.all_to_all_single(out, tensor, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=True)


def gather_rows(wire: torch.Tensor, rows: list[int], group: Any) -> tuple[torch.Tensor, Work]:
    """Allgather with uneven dim 0: pad every contribution to the largest, trim in :func:`unpad_rows`."""
    top = max(rows)
    rest = tuple(wire.shape[1:])
    out = torch.empty((top * len(rows), *rest), dtype=wire.dtype, device=wire.device)
    if wire.shape[0] == top:
        return out, all_gather_into(out, wire, group=group, async_op=True)
    padded = torch.zeros((top, *rest), dtype=wire.dtype, device=wire.device)
    padded[: wire.shape[0]].copy_(wire)
    return out, KeptWork(all_gather_into(out, padded, group=group, async_op=True), (padded,))


def unpad_rows(out: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows each member really sent, from :func:`gather_rows`' padded output."""
    top = max(rows)
    if all(r == top for r in rows):
        return out
    return torch.cat([out[i * top : i * top + r] for i, r in enumerate(rows)])


def pieces(numel: int, itemsize: int, min_bytes: int, max_count: int) -> list[tuple[int, int]]:
    """(start, stop) of the equal pieces a pipelined op cuts ``numel`` elements into: as many as fit at
    ``min_bytes`` or more each, at most ``max_count``, at least one (``[(0, 0)]`` for nothing). Decided from
    the size alone, so every rank cuts the same way.

    >>> pieces(10, 4, 16, 8)  # 40 bytes: two pieces of 16 or more
    [(0, 5), (5, 10)]
    >>> pieces(0, 4, 16, 8)
    [(0, 0)]
    """
    count = max(1, min(max_count, numel * itemsize // min_bytes))
    step = -(-numel // count)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)] if numel else [(0, 0)]


def even_splits(rows: int, n: int) -> list[int]:
    """Rows per member when dim 0 is divided evenly: the first ``rows % n`` members get one more.

    >>> even_splits(5, 3)
    [2, 2, 1]
    """
    return [rows // n + (1 if i < rows % n else 0) for i in range(n)]


def scatter_rows(wire: torch.Tensor, n: int, index: int, op: int, group: Any) -> tuple[torch.Tensor, Work]:
    """Reduce-scatter along dim 0 with the uneven rule (:func:`even_splits`), padding every chunk to the
    largest. Returns member ``index``'s slice (filled once the Work completes) and the Work."""
    counts = even_splits(wire.shape[0], n)
    top = counts[0]
    rest = tuple(wire.shape[1:])
    out = torch.empty((top, *rest), dtype=wire.dtype, device=wire.device)
    if all(c == top for c in counts):
        return out[: counts[index]], _reduce_scatter_into(out, wire, op=wire_op(op), group=group, async_op=True)
    padded = torch.zeros((top * n, *rest), dtype=wire.dtype, device=wire.device)
    start = 0
    for i, c in enumerate(counts):
        padded[i * top : i * top + c].copy_(wire[start : start + c])
        start += c
    work = _reduce_scatter_into(out, padded, op=wire_op(op), group=group, async_op=True)
    return out[: counts[index]], KeptWork(work, (padded,))
