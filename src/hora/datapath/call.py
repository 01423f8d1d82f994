"""What one collective call is, as every layer from the call builders down to the kinds sees it: its
:class:`Kind`, the validated :class:`Call`, the :class:`Request` the peers must agree on, the four :class:`Steps`
a kind implements (:mod:`hora.datapath.kinds`), the :class:`Op` that carries a call with its kind's steps through
the engine, and the :class:`Peers` a launch sees of the other members (never the engine's table).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from hora.common.process_sets import ProcessSet
from hora.datapath.c10d import Work
from hora.datapath.compression import Compression, Compressor
from hora.datapath.reduce_ops import ReduceOp
from hora.diagnostics import callsite
from hora.diagnostics.callsite import Site


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

    wire: str  # the plain string requests carry (set below: ``.value`` is an enum property, slow per op)

    __hash__ = str.__hash__  # a plain "allreduce" finds Kind.ALLREDUCE in a dict or set, and the reverse

    def __str__(self) -> str:
        return self.wire


for _kind in Kind:
    _kind.wire = _kind._value_


REDUCTIONS = frozenset({Kind.ALLREDUCE, Kind.REDUCESCATTER})  # the kinds that take op= and scale factors
_NO_WIRE = torch.empty(0)  # a Call's wire until its kind's prepare sets it (never written to)


@dataclass(eq=False)
class Call:
    """One validated call: everything its kind's steps need."""

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
    wire: torch.Tensor = _NO_WIRE  # set by prepare
    ctx: Any = None  # compression context
    out: torch.Tensor = _NO_WIRE  # set by launch when the output is not the wire: the c10d output buffer
    rows: list[int] | None = None  # set by launch: rows from each member (allgather's sent, alltoall's received)
    last_joined: int = -1  # set by Join's launch: the rank whose join arrived last
    members: int = 0  # the process set's size when the call was submitted (Average divides by it)
    site: Site = callsite.UNKNOWN  # where the user called it (unnamed ops, when the check is on)
    lease: torch.Tensor | None = None  # a reused 16-bit wire buffer (compression.WIRE_BUFFERS), given back at finish
    rejected: Exception | None = None  # found invalid while the call was built (raised at submit)

    @property
    def index(self) -> int:
        return self.ps.rank()


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

    def prepare(self, call: Call) -> None: ...

    def launch(self, call: Call, peers: Peers) -> Work | None: ...

    def launch_joined(self, peers: Peers) -> Work | None: ...

    def finish(self, call: Call) -> Any: ...


@dataclass(eq=False)
class Op:
    """A submitted call with its kind's steps: what the engine launches and the handle finishes (a stack trace
    names ``Op.launch`` and the kind's own ``launch``, never a lambda)."""

    call: Call
    steps: Steps

    def launch(self, peers: Peers) -> Work | None:
        return self.steps.launch(self.call, peers)

    def finish(self) -> Any:
        return self.steps.finish(self.call)
