"""The negotiation table: pure, deterministic logic every rank runs on the same inputs.

A :class:`Request` is what a rank says about one op it submitted, the record the negotiation is about. Each
round, every rank contributes the requests it submitted since the last round. Every rank adds all of
them to its :class:`Table` in the same order, so every rank reaches the same :class:`Decision`: which names
are ready (every member of the process set has submitted them, or joined), which failed because ranks
disagree on their metadata, and in which order to run them. No I/O here: the negotiator does that.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from hora.common.names import JOIN_NAME, SHUTDOWN_NAME, UNNAMED_PREFIX
from hora.datapath.kinds.op import Kind
from hora.datapath.reduce_ops import ReduceOp
from hora.diagnostics.where import describe_op
from hora.errors import CollectiveError, CollectiveMismatchError, HoraError, PeerRejectedCallError


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
    reduce_op: int = 0
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    ps: tuple[int, ...] = ()  # member ranks of the process set
    device: str = "cpu"
    splits: tuple[int, ...] | None = None
    site: int = 0  # call-site fingerprint of an unnamed op (hora.calls.call.current); 0: not checked
    where: str = ""  # that call site as file:line, for messages
    error: str = ""  # set: this rank rejected the call (the reason)


JOIN = Kind.JOIN
SHUTDOWN = Kind.SHUTDOWN
UNNAMED = UNNAMED_PREFIX  # prefix of the sequence names of unnamed ops: noname.ps<set id>.<n>
# kinds a joined rank takes part in: it contributes zeros to reductions, no rows to allgathers and alltoalls,
# and receives broadcasts (every kind Horovod has; not Adasum, whose tree needs every member's vector)
JOIN_OK = frozenset({Kind.ALLREDUCE, Kind.ALLGATHER, Kind.BROADCAST, Kind.BARRIER, Kind.REDUCESCATTER,
                     Kind.ALLTOALL, JOIN, SHUTDOWN})


_FIELDS = ("kind", "dtype", "shape", "op", "root", "prescale", "postscale", "process_set", "device")
CALL_SITE = "call site"
_ROWS_MAY_DIFFER = frozenset({Kind.ALLGATHER, Kind.ALLTOALL})
_REDUCTIONS = frozenset({Kind.ALLREDUCE, Kind.ADASUM, Kind.REDUCESCATTER})  # described with their op


def signature(req: Request) -> tuple[object, ...]:
    """The part of a request that must be identical on every rank."""
    shape = req.shape[1:] if req.kind in _ROWS_MAY_DIFFER else req.shape
    return (req.kind, req.dtype, shape, req.reduce_op, req.root, req.prescale, req.postscale, req.ps, req.device)


def describe(req: Request) -> str:
    """A request as a user would read it in an error message."""
    parts = [req.kind, f"dtype={req.dtype}", f"shape={list(req.shape)}"]
    if req.kind in _REDUCTIONS:
        parts.append(f"op={ReduceOp(req.reduce_op).name.capitalize()}")
        if req.prescale != 1.0 or req.postscale != 1.0:
            parts.append(f"prescale={req.prescale} postscale={req.postscale}")
    if req.kind == Kind.BROADCAST:
        parts.append(f"root={req.root}")
    parts.append(f"process_set={list(req.ps)}")
    parts.append(f"device={req.device}")
    if req.where:
        parts.append(f"at {req.where}")
    return " ".join(parts)


def differing_fields(reqs: Iterable[Request]) -> list[str]:
    reqs = list(reqs)
    sigs = [signature(r) for r in reqs]
    fields = [f for i, f in enumerate(_FIELDS) if len({s[i] for s in sigs}) > 1]
    sites = {r.site for r in reqs}
    if len(sites) > 1 and 0 not in sites:  # a rank that does not check (site 0) opts the op out
        fields.append(CALL_SITE)
    return fields


@dataclass(eq=False)
class Entry:
    """A name some rank has submitted and that has not run yet."""

    name: str
    requests: dict[int, Request]
    first_round: int
    first_time: float  # local clock when it first appeared: the stall inspector's start
    arrival: dict[int, int] = field(default_factory=dict)  # rank -> round its request arrived
    reported: bool = False
    fresh: bool = False  # some rank sent its request in full (not as a cache id) this time
    rejected: bool = False  # some rank rejected its call (a request with ``error``): the op fails at once
    inline: dict[int, bytes] = field(default_factory=dict)  # tiny allreduces: each rank's data, sent inline

    @cached_property
    def first(self) -> Request:
        """The request that arrived first (requests are only ever added, so it never changes)."""
        return next(iter(self.requests.values()))


@dataclass
class Decision:
    ready: list[Entry] = field(default_factory=list)  # in the order every rank runs them
    failed: list[tuple[Entry, HoraError]] = field(default_factory=list)
    late_failures: list[tuple[int, str, HoraError]] = field(default_factory=list)  # (rank, name, error)


class Table:
    """Pending names and their requests, identical on every rank after every round."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: dict[str, Entry] = {}
        # names that failed before every member submitted: the latecomers get the same error
        self.tombstones: dict[str, tuple[HoraError, set[int]]] = {}
        self._leaving: frozenset[int] = frozenset()  # ranks that called shutdown(), as of this round

    @property
    def joined(self) -> frozenset[int]:
        e = self.entries.get(JOIN_NAME)
        return frozenset(e.requests) if e is not None else frozenset()

    def add(self, rank: int, req: Request, round_no: int, now: float, decision: Decision,
            fresh: bool = True, data: bytes | None = None) -> None:
        tomb = self.tombstones.get(req.name)
        if tomb is not None and rank in tomb[1]:
            tomb[1].discard(rank)
            if not tomb[1]:
                del self.tombstones[req.name]
            decision.late_failures.append((rank, req.name, tomb[0]))
            return
        entry = self.entries.get(req.name)
        if entry is None:
            entry = self.entries[req.name] = Entry(req.name, {}, round_no, now)
        entry.requests[rank] = req
        entry.arrival[rank] = round_no
        entry.fresh = entry.fresh or fresh
        entry.rejected = entry.rejected or bool(req.error)
        if data is not None:
            entry.inline[rank] = data

    def decide(self, decision: Decision) -> Decision:
        """Move ready and failed entries out of the table, in table order.

        Metadata is compared once every member has submitted, so a mismatch error names what each rank sent.
        """
        joined = self.joined
        # the ranks leaving, as they stand when the round's requests are in: the shutdown entry itself may
        # complete (and leave the table) before the ops that wait for a leaving rank are looked at
        bye = self.entries.get(SHUTDOWN_NAME)
        self._leaving = frozenset(bye.requests) if bye is not None else frozenset()
        for name, entry in list(self.entries.items()):
            required = self._required(entry, joined)
            complete = required <= entry.requests.keys()
            if entry.rejected:
                error: HoraError | None = _rejection(entry)
            else:
                error = self._check(entry, joined) if complete else self._join_conflict(entry, joined)
            if error is not None:
                del self.entries[name]
                owed = required - entry.requests.keys()
                if owed:
                    self.tombstones[name] = (error, owed)
                decision.failed.append((entry, error))
            elif complete:
                del self.entries[name]
                decision.ready.append(entry)
        return decision

    @staticmethod
    def _required(entry: Entry, joined: frozenset[int]) -> set[int]:
        members = {r for req in entry.requests.values() for r in req.ps}  # ranks may disagree on the set
        if entry.first.kind in (JOIN, SHUTDOWN):
            return members
        return members - joined

    def _check(self, entry: Entry, joined: frozenset[int]) -> CollectiveError | None:
        reqs = entry.requests
        first = entry.first
        if any(r != first for r in reqs.values()):  # identical requests (the usual case) cannot disagree
            fields = differing_fields(reqs.values())
            if fields:
                return CollectiveMismatchError(entry.name, {r: describe(q) for r, q in reqs.items()}, fields,
                                               describe_op("collective", entry.name),
                                               _SITE_HINT if CALL_SITE in fields else "")
        return self._join_conflict(entry, joined)

    def _leaving_conflict(self, entry: Entry) -> CollectiveError | None:
        """A rank that called shutdown() will never submit anything else: fail what waits for it."""
        if not self._leaving or entry.first.kind == SHUTDOWN:
            return None
        gone = sorted(self._leaving.intersection(entry.first.ps) - set(entry.requests))
        if not gone:
            return None
        return CollectiveError(
            f"{entry.first.kind} {entry.name!r} cannot complete: rank(s) {gone} called shutdown() without "
            "submitting it. Every rank must run the same collectives before shutting down; if ranks run "
            "different numbers of steps (uneven data), call hvd.join() after the training loop."
        )

    def _join_conflict(self, entry: Entry, joined: frozenset[int]) -> CollectiveError | None:
        leaving = self._leaving_conflict(entry)
        if leaving is not None:
            return leaving
        if not joined:
            return None
        req = entry.first
        blocked = joined.intersection(req.ps) - entry.requests.keys()
        if blocked and req.kind not in JOIN_OK:
            return CollectiveError(
                f"{req.kind} {entry.name!r} cannot run: rank(s) {sorted(blocked)} already called join(). "
                f"Only {', '.join(sorted(JOIN_OK - {JOIN, SHUTDOWN}))} work while ranks have joined."
            )
        if blocked and req.kind == Kind.BROADCAST and req.root in blocked:
            return CollectiveError(
                f"broadcast {entry.name!r} cannot run: its root rank {req.root} already called join(), so "
                "nothing is there to send. Make the broadcast on every rank before any rank joins, or choose a "
                "root that joins last."
            )
        return None


_SITE_HINT = (
    "Unnamed collectives are paired by their order on each rank, and these ranks reached this one from "
    "different lines of code: if a rank skipped or added a collective (a rank-dependent branch, an exception "
    "caught around a call), its later unnamed collectives pair with the wrong ones too, so make every rank "
    "run the same collectives in the same order. If the ranks call it from different lines on purpose, pass "
    "the same name= on every rank (named collectives are matched by name), or set HORA_CALL_SITE_CHECK=0 to "
    "turn this check off."
)


def _rejection(entry: Entry) -> PeerRejectedCallError:
    """The error of an op some rank rejected locally: it names those ranks, where they called it, and why."""
    bad = {r: q for r, q in entry.requests.items() if q.error}
    first = next(iter(bad.values()))
    why = "; ".join(f"rank {r} rejected its call{f' at {q.where}' if q.where else ''}: {q.error}"
                    for r, q in sorted(bad.items()))
    return PeerRejectedCallError(
        f"{describe_op(first.kind, entry.name)} cannot run on process set {list(first.ps)}: {why}. Nothing was "
        "sent for it on any rank; fix that rank's call (later collectives pair as before)."
    )


def last_joined(entry: Entry) -> int:
    """The rank whose join arrived last (ties: the highest rank)."""
    return max(entry.arrival, key=lambda r: (entry.arrival[r], r))
