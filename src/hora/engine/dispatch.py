"""Running what a negotiation round decided: every ready op this rank takes part in is issued here, in the
order the round agreed, by whichever thread ran the round.

Tiny allreduces whose data came with the round are reduced locally; small allreduces ready together are
fused into one reused buffer; everything else is one c10d call (``LocalOp.launch``). A rank that has joined
takes part with zeros. Failures to start an op are reported on its handle; negotiation goes on.

With a CUDA device, every launch runs on hora's device and launch stream, after the event each op recorded on
the stream that produced its tensor (:mod:`hora.datapath.streams`), whichever thread runs the round.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hora.datapath import fusion, kinds, streams
from hora.datapath.kinds import Op, Peers
from hora.diagnostics import inflight
from hora.diagnostics import timeline as timeline_mod
from hora.engine.handles import Handle
from hora.engine.table import Entry, Request
from hora.errors import CollectiveError


@dataclass(eq=False)
class LocalOp:
    """An op this rank submitted: its request, its handle, and the op (the call and its kind's steps) to launch
    once ready (None: nothing to launch, e.g. the engine's own shutdown request)."""

    req: Request
    handle: Handle
    op: Op | None
    wire: torch.Tensor | None = None  # the buffer an allreduce sends: fusion may copy it into a fused buffer
    event: Any = None  # CUDA event recorded at submit on the stream that produced the tensor
    submitted_at: float = 0.0


class Dispatcher:
    """Issues ready entries for one rank. ``take(name)`` hands over (and forgets) this rank's op of that name,
    or None when this rank has joined and only contributes zeros."""

    def __init__(self, rank: int, process_sets: Mapping[int, Any], take: Callable[[str], LocalOp | None],
                 fusion_threshold: int, device: torch.device | None = None) -> None:
        self.rank = rank
        self._launch_stream = streams.LaunchStream(device) if device is not None else None
        self._process_sets = process_sets  # the runtime's live registry (dynamic sets come and go)
        self._take = take
        self._fused = fusion.FusionBuffers(fusion_threshold)
        self._joined_works: list[Any] = []  # zeros a joined rank contributes: kept alive until sent

    def set_fusion_threshold(self, threshold: int) -> None:
        """Fuse up to ``threshold`` bytes from the next round on (autotune; the round thread, every rank at the
        same round)."""
        self._fused.threshold = threshold

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
        for batch in fusion.plan_batches([e.first for e in on_wire], self._fused.threshold):
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
            op.wire.copy_(fusion.reduce_inline(entry.first, entry.inline))  # type: ignore[union-attr]
        except Exception as e:  # report on the handle, keep negotiating
            op.handle.fail(CollectiveError(f"allreduce {entry.name!r} failed on rank {self.rank}: {e}"))
            return
        op.handle.launched(None)
        self._trace(op, t_launch, None, inline=True)

    def _launch_one(self, entry: Entry, joined: frozenset[int]) -> None:
        op = self._take(entry.name)
        group = self._group_of(entry)
        peers = Peers(group, self.rank, entry.first, entry.requests, entry.arrival)
        kind = entry.first.kind
        if op is None:  # this rank has joined: contribute zeros / nothing
            work = kinds.launch_joined(peers)
            if work is not None:
                self._joined_works.append(work)
            return
        try:
            self._wait_cuda(op)
            t_launch = time.perf_counter()
            work = op.op.launch(peers) if op.op is not None else None
        except Exception as e:  # report on the handle, keep negotiating
            op.handle.fail(CollectiveError(f"{kind} {entry.name!r} could not start on rank {self.rank}: {e}"))
            return
        op.handle.launched(work)
        inflight.launched(op.handle, (op.req,), work)
        self._trace(op, t_launch, work)

    def _launch_fused(self, entries: list[Entry]) -> None:
        ops_ = [self._take(e.name) for e in entries]
        for op in ops_:
            if op is not None:
                self._wait_cuda(op)
        group = self._group_of(entries[0])
        t_launch = time.perf_counter()
        inflight.blocking(entries, [e.first for e in entries])  # this thread waits for it below
        try:
            self._fused.allreduce([op.wire if op is not None else None for op in ops_], [e.first for e in entries],
                                  group)
        except Exception as e:
            err = CollectiveError(f"fused allreduce of {len(entries)} tensors failed on rank {self.rank}: {e}")
            for op in ops_:
                if op is not None:
                    op.handle.fail(err)
            return
        finally:
            inflight.finished(entries)
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
                                "bytes": fusion.request_nbytes(r)}
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
