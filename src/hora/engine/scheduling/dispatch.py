"""Running what a negotiation round decided: every ready op this rank takes part in is issued here, in the
order the round agreed, by whichever thread ran the round.

Tiny allreduces whose data came with the round (:func:`inline_bytes`) are reduced locally
(:func:`reduce_inline`); small allreduces ready together are fused into one reused buffer (:func:`plan_batches`
groups them, :class:`hora.datapath.fusion.FusionBuffers` runs them); everything else is one launch of its kind's
steps. Both decisions are made from what the members agreed on alone (the requests of a round, never local
state), so every rank, including a rank that has joined and only contributes zeros, issues exactly the same
c10d calls. A rank that has joined takes part with zeros. Failures to start an op are reported on its handle;
negotiation goes on.

With a CUDA device, every launch runs on hora's device and launch stream, after the event each op recorded on
the stream that produced its tensor (:mod:`hora.datapath.streams`), whichever thread runs the round.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hora.datapath import fusion, kinds, streams
from hora.datapath.c10d import wire_op
from hora.datapath.hierarchical import Hierarchy
from hora.datapath.kinds.op import Kind, Peers
from hora.datapath.reduce_ops import ReduceOp
from hora.datapath.wire import to_dtype
from hora.diagnostics import timeline as timeline_mod
from hora.diagnostics.inflight import InflightWatch
from hora.engine.scheduling.pending import LocalOp
from hora.engine.scheduling.table import Entry, Request
from hora.errors import CollectiveError

MAX_FUSED_TENSOR_BYTES = 1 << 20  # larger tensors run alone: fusion would only add copies
INLINE_MAX_BYTES = 64  # allreduces this small travel inside the negotiation round itself


class Dispatcher:
    """Issues ready entries for one rank. ``take(name)`` hands over (and forgets) this rank's op of that name,
    or None when this rank has joined and only contributes zeros."""

    def __init__(self, rank: int, process_sets: Mapping[int, Any], take: Callable[[str], LocalOp | None],
                 fusion_threshold: int, inflight: InflightWatch, device: torch.device | None = None,
                 hierarchy: Hierarchy | None = None) -> None:
        self.rank = rank
        self._inflight = inflight
        self._hierarchy = hierarchy  # the runtime's hierarchical allreduce (None: every allreduce is flat)
        self._launch_stream = streams.LaunchStream(device) if device is not None else None
        self._process_sets = process_sets  # the runtime's live registry (dynamic sets come and go)
        self._take = take
        self._fused = fusion.FusionBuffers(fusion_threshold)
        self._joined_works: list[Any] = []  # zeros a joined rank contributes: kept alive until sent

    def set_fusion_threshold(self, threshold: int) -> None:
        """Fuse up to ``threshold`` bytes from the next round on (autotune; the round thread, every rank at the
        same round)."""
        self._fused.threshold = threshold

    @property
    def fusion_threshold(self) -> int:
        """Bytes up to which ready allreduces are fused now."""
        return self._fused.threshold

    def run(self, ready: Sequence[Entry], joined: frozenset[int]) -> None:
        """Issue ``ready`` in order: inline reductions first, then fused batches and single ops."""
        if self._launch_stream is None or not ready:
            self._run(ready, joined)
            return
        with self._launch_stream.active():
            self._run(ready, joined)

    def _run(self, ready: Sequence[Entry], joined: frozenset[int]) -> None:
        if self._joined_works:
            self._joined_works = [w for w in self._joined_works if not w.is_completed()]
        for entry in ready:
            if entry.inline and self.rank in entry.first.ps:
                self._finish_inline(entry)
        on_wire = [e for e in ready if not e.inline]
        for batch in plan_batches([e.first for e in on_wire], self._fused.threshold):
            members = [on_wire[i] for i in batch if self.rank in on_wire[i].first.ps]
            if not members:
                continue
            if len(members) > 1:
                self._launch_fused(members)
            else:
                self._launch_one(members[0], joined)

    def _finish_inline(self, entry: Entry) -> None:
        """A tiny allreduce whose data every member sent with its request: reduce it here, in rank order,
        identically on every rank. No data-plane op at all."""
        op = self._take(entry.name)
        if op is None:
            return  # a joined rank: nothing to return
        t_launch = time.perf_counter()
        try:
            op.wire.copy_(reduce_inline(entry.first, entry.inline))  # type: ignore[union-attr]
        except Exception as e:  # report on the handle, keep negotiating
            op.handle.fail(CollectiveError(f"allreduce {entry.name!r} failed on rank {self.rank}: {e}"))
            return
        op.handle.launched(None)
        self._trace(op, t_launch, None, inline=True)

    def _launch_one(self, entry: Entry, joined: frozenset[int]) -> None:
        op = self._take(entry.name)
        group = self._group_of(entry)
        peers = Peers(group, self.rank, entry.first, entry.requests, entry.arrival, self._hierarchy)
        kind = entry.first.kind
        if op is None:  # this rank has joined: contribute zeros / nothing
            work = kinds.launch_joined(peers)
            if work is not None:
                self._joined_works.append(work)
            return
        try:
            self._wait_cuda(op)
            t_launch = time.perf_counter()
            work = op.op.steps.launch(op.op, peers) if op.op is not None else None
        except Exception as e:  # report on the handle, keep negotiating
            op.handle.fail(CollectiveError(f"{kind} {entry.name!r} could not start on rank {self.rank}: {e}"))
            return
        op.handle.launched(work)
        self._inflight.launched(op.handle, (op.req,), work)
        self._trace(op, t_launch, work)

    def _launch_fused(self, entries: list[Entry]) -> None:
        ops_ = [self._take(e.name) for e in entries]
        for op in ops_:
            if op is not None:
                self._wait_cuda(op)
        group = self._group_of(entries[0])
        t_launch = time.perf_counter()
        self._inflight.blocking(entries, [e.first for e in entries])  # this thread waits for it below
        try:
            first = entries[0].first
            self._fused.allreduce([op.wire if op is not None else None for op in ops_],
                                  [int(torch.Size(e.first.shape).numel()) for e in entries], to_dtype(first.dtype),
                                  first.device, first.reduce_op, group, self._hierarchy)
        except Exception as e:
            err = CollectiveError(f"fused allreduce of {len(entries)} tensors failed on rank {self.rank}: {e}")
            for op in ops_:
                if op is not None:
                    op.handle.fail(err)
            return
        finally:
            self._inflight.finished(entries)
        # done on the launch stream: a CUDA batch's waiters order their streams after its copies back
        work = self._launch_stream.done() if self._launch_stream is not None and entries[0].first.device == "cuda" \
            else None
        for op in ops_:
            if op is not None:
                op.handle.launched(work)
                self._trace(op, t_launch, None, fused=len(entries))

    @staticmethod
    def _trace(op: LocalOp, t_launch: float, work: Any, fused: int = 0, inline: bool = False) -> None:
        """Timeline (diagnostics): ``negotiate`` from submit to launch, ``communicate`` from launch until
        the c10d work completes (a future callback, so a late synchronize() does not stretch it)."""
        tl = timeline_mod.active()
        if tl is None:
            return
        r = op.req
        args: dict[str, Any] = {"kind": r.kind, "dtype": r.dtype, "shape": list(r.shape),
                                "bytes": request_nbytes(r)}
        tl.span(r.name, "negotiate", op.submitted_at, t_launch, **args)
        if fused:
            args["fused"] = fused
        if inline:  # the data travelled in the negotiation round; "communicate" is the local reduction
            args["inline"] = True
        if work is None or r.device != "cpu":
            # done in place already (fused, inline); or a GPU op, whose completion the host does not see in
            # order (its callback could land after copy_out): the slice is the launch, marked as such
            if work is not None:
                args["launch_only"] = True
            tl.span(r.name, "communicate", t_launch, time.perf_counter(), **args)
            return
        try:
            work.get_future().add_done_callback(
                lambda _: tl.span(r.name, "communicate", t_launch, time.perf_counter(), **args))
        except (RuntimeError, AttributeError):  # a backend without futures: no communicate slice
            pass

    def _group_of(self, entry: Entry) -> Any:
        for ps in self._process_sets.values():
            if tuple(ps.ranks) == entry.first.ps:
                return ps.group
        raise CollectiveError(f"{entry.name!r}: no process set with ranks {list(entry.first.ps)} on rank {self.rank}")

    @staticmethod
    def _wait_cuda(op: LocalOp) -> None:
        """The current stream (the launch stream) waits for the stream that produced the op's tensor."""
        if op.event is not None:
            torch.cuda.current_stream().wait_event(op.event)


# --- what a round's requests say: tiny allreduces inline, small ones fused -------------------------------------
def request_nbytes(req: Request) -> int:
    """Bytes of the tensor a request describes (0 for requests without a tensor, e.g. shutdown)."""
    dtype = getattr(torch, req.dtype, None) if req.dtype else None
    if not isinstance(dtype, torch.dtype):
        return 0
    return int(torch.Size(req.shape).numel()) * dtype.itemsize


def _fusion_key(req: Request, threshold: int) -> tuple[object, ...] | None:
    if req.kind != Kind.ALLREDUCE or threshold <= 0 or request_nbytes(req) > min(threshold, MAX_FUSED_TENSOR_BYTES):
        return None
    return (req.dtype, int(wire_op(req.reduce_op)), req.ps, req.device)


def plan_batches(ready: Sequence[Request], threshold: int) -> list[list[int]]:
    """Group consecutive fusable allreduces (same dtype, wire op, process set, device) up to ``threshold``
    bytes; everything else is a batch of one. Order is kept; each batch is the indices of its requests."""
    if len(ready) < 2:  # the steady state of a synchronous loop: nothing to fuse
        return [[0]] if ready else []
    batches: list[list[int]] = []
    current: list[int] = []
    current_key: tuple[object, ...] | None = None
    current_bytes = 0
    for i, req in enumerate(ready):
        key = _fusion_key(req, threshold)
        size = request_nbytes(req) if key is not None else 0
        if key is not None and key == current_key and current_bytes + size <= threshold:
            current.append(i)
            current_bytes += size
            continue
        if current:
            batches.append(current)
        current, current_key, current_bytes = [i], key, size
    if current:
        batches.append(current)
    return batches


def inline_bytes(req: Request, wire: torch.Tensor | None) -> bytes | None:
    """The data of a tiny CPU allreduce, to send with its request (None when it goes on the data plane)."""
    if wire is None or req.kind != Kind.ALLREDUCE or req.device != "cpu":
        return None
    size = wire.numel() * wire.element_size()
    if size > INLINE_MAX_BYTES:
        return None
    return wire.reshape(-1).view(torch.uint8).numpy().tobytes() if size else b""


def reduce_inline(req: Request, inline: Mapping[int, bytes]) -> torch.Tensor:
    """Reduce the members' inline data (rank -> bytes) in rank order (the same arithmetic on every rank); a
    joined member contributes zeros, as it does on the data plane."""
    dtype = to_dtype(req.dtype)
    if torch.Size(req.shape).numel() == 0:
        return torch.empty(req.shape, dtype=dtype)
    zeros = torch.zeros(req.shape, dtype=dtype).reshape(-1)  # what a joined member contributes
    parts = [torch.frombuffer(bytearray(inline[r]), dtype=torch.uint8).view(dtype) if r in inline
             else zeros for r in req.ps]
    stacked = torch.stack(parts) if parts else torch.zeros((1, 0), dtype=dtype)
    op = ReduceOp(req.reduce_op)
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        out = stacked[0].clone()
        for part in stacked[1:]:
            out += part
    elif op == ReduceOp.PRODUCT:
        out = stacked[0].clone()
        for part in stacked[1:]:
            out *= part
    elif op == ReduceOp.MIN:
        out = stacked.amin(0)
    else:
        out = stacked.amax(0)
    return out.reshape(req.shape)
