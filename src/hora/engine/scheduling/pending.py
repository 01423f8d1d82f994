"""This rank's side of negotiation: what it submitted and has not sent, what is still in flight, and the
sequence numbers of its unnamed ops. Shared by the submitting threads and whichever thread runs a round,
under one lock; nothing here blocks.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from hora.common.names import parse_unnamed, unnamed
from hora.datapath import streams
from hora.datapath.kinds.op import Kind, Op
from hora.engine.scheduling.handles import Handle
from hora.engine.scheduling.table import Request


@dataclass(eq=False)
class LocalOp:
    """An op this rank submitted: its request, its handle, and the op (the call and its kind's steps) to launch
    once ready (None: nothing to launch, e.g. the engine's own shutdown request). Built by :func:`local_op`."""

    req: Request
    handle: Handle
    op: Op | None
    wire: torch.Tensor | None = None  # the buffer an allreduce sends: fusion may copy it into a fused buffer
    event: Any = None  # CUDA event recorded at submit on the stream that produced the tensor
    submitted_at: float = 0.0


def local_op(req: Request, op: Op | None, handle: Handle) -> LocalOp:
    """The engine's record of an op this rank submits: an allreduce's wire may be fused or sent inline, and a
    CUDA wire's producing stream is recorded so the launch waits for it."""
    if op is None:
        return LocalOp(req, handle, None)
    wire = op.wire
    event = streams.producer_event(wire) if wire.is_cuda else None
    return LocalOp(req, handle, op, wire=wire if req.kind == Kind.ALLREDUCE else None, event=event)


class Pending:
    """The ops and messages of one rank between submit and launch (module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lock = threading.RLock()  # the negotiator takes it too, to change its phase with what is here
        self.outbox: list[LocalOp] = []  # submitted, not yet sent in a round
        self.rejected: list[Request] = []  # calls rejected on this rank, announced in the next round
        self.flags: dict[str, Any] = {}  # stall queries and answers for the next round
        self._mine: dict[str, LocalOp] = {}  # submitted, not yet launched or failed
        self._in_flight: dict[str, Any] = {}  # name -> its handle, until the handle is synchronized
        self._seq: dict[int | None, int] = {}  # process set id -> the next unnamed op's number

    def snapshot(self) -> dict[str, Any]:
        """What is pending, as plain values (caller holds ``lock``): see :meth:`Negotiator.snapshot`."""
        return {"sequence": dict(self._seq), "submitted": sorted(self._mine), "in_flight": sorted(self._in_flight),
                "outbox": [op.req.name for op in self.outbox], "rejected": [r.name for r in self.rejected]}

    def has_outgoing(self) -> bool:
        """Something to send in the next round (caller holds ``lock``)."""
        return bool(self.outbox or self.flags or self.rejected)

    def add(self, ops: list[LocalOp]) -> None:
        """Queue ``ops`` for the next round (caller holds ``lock``); a name still in flight is refused."""
        names = [op.req.name for op in ops]
        for name in names:
            if name in self._in_flight or names.count(name) > 1:
                raise ValueError(
                    f"collective name {name!r} is still in flight on rank {self.rank}: synchronize() its "
                    "handle before submitting the name again, or use a different name")
        now = time.perf_counter()
        for op in ops:
            self._in_flight[op.req.name] = op.handle
            op.submitted_at = now
            self._mine[op.req.name] = op
            self.outbox.append(op)

    def take_outgoing(self) -> tuple[list[LocalOp], dict[str, Any], list[Request]]:
        """What the next round sends: the queued ops, the flags and the rejected calls (now emptied)."""
        with self.lock:
            out = (self.outbox, self.flags, self.rejected)
            self.outbox, self.flags, self.rejected = [], {}, []
        return out

    def take(self, name: str) -> LocalOp | None:
        """Hand over this rank's op ``name`` to be launched or failed (None: this rank has joined)."""
        with self.lock:
            return self._mine.pop(name, None)

    def fail(self, name: str, error: BaseException) -> None:
        op = self.take(name)
        if op is not None:
            op.handle.fail(error)

    def take_all(self) -> list[LocalOp]:
        """Hand over everything submitted and not yet launched (negotiation is over: the caller fails them)."""
        with self.lock:
            ops = list(self._mine.values()) + [op for op in self.outbox if op.req.name not in self._mine]
            self._mine.clear()
            self.outbox = []
        return ops

    def in_flight(self, name: str) -> bool:
        with self.lock:
            return name in self._in_flight

    def running(self) -> list[Any]:
        """The handles submitted and not yet synchronized (launched or not)."""
        with self.lock:
            return list(self._in_flight.values())

    def release(self, name: str) -> None:
        """The handle of ``name`` was synchronized: the name may be used again."""
        with self.lock:
            self._in_flight.pop(name, None)

    def unnamed(self, ps_id: int | None) -> str:
        """A sequence name for an unnamed op: shared by every kind in a process set, so a rank calling a
        different collective than its peers is a mismatch at once, not a silent hang."""
        with self.lock:
            n = self._seq.get(ps_id, 0)
            self._seq[ps_id] = n + 1
        return unnamed(ps_id, n)  # type: ignore[arg-type]  # a registered set (collectives validated it)

    def advance_sequence(self, name: str) -> None:
        """A joined rank took part in (or saw fail) an unnamed op it never submitted: keep its sequence in
        step. ``name`` is ``noname.ps<id>.<n>``, or ``noname.ps<id>.<n>.<part>`` (a sparse allreduce)."""
        parsed = parse_unnamed(name)
        if parsed is None:
            return
        ps_id, n = parsed
        with self.lock:
            self._seq[ps_id] = max(self._seq.get(ps_id, 0), int(n) + 1)
