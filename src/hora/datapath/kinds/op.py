"""What the kinds' steps work on: the :class:`Kind` of a collective, the :class:`Op` that carries one submitted
call through its steps, and the :class:`Peers` a launch sees of the other members.

A kind's four steps (:class:`Steps`; each kind's in its own module of this package, looked up in
:data:`hora.datapath.kinds.KINDS`):

- ``prepare(op)``: on the caller's thread at submit, build the wire buffer (compress, prescale, cast a dtype the
  backend lacks, copy when the caller's tensor must stay untouched);
- ``launch(op, peers)``: on the thread that ran the negotiation round, once every member has submitted, issue the
  c10d call (:mod:`hora.datapath.c10d`); returns its Work;
- ``launch_joined(peers)``: the same collective for a rank that has called ``join()``: zeros or no rows;
- ``finish(op)``: on the caller's thread in ``synchronize()``, after the Work completed: average, postscale,
  decompress, copy out; returns what the user gets.

The steps read the call (:class:`CallInputs`: :class:`hora.calls.call.Call` is one) and the members' agreed
request (:class:`Agreed`: :class:`hora.engine.scheduling.table.Request` is one) through the fields named here, so the
data path imports neither layer above it. Nothing here negotiates or knows about other calls: the engine decides
when ``launch`` runs.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from hora.common.process_sets import ProcessSet
from hora.datapath.c10d import Work
from hora.datapath.reduce_ops import ReduceOp
from hora.datapath.wire import Compressor, WireBuffers, to_dtype

if TYPE_CHECKING:
    from hora.datapath.hierarchical import Hierarchy


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


class CallInputs(Protocol):
    """What the steps read of a call (:class:`hora.calls.call.Call`)."""

    @property
    def kind(self) -> Kind: ...
    @property
    def tensor(self) -> torch.Tensor: ...
    @property
    def ps(self) -> ProcessSet: ...
    @property
    def reduce_op(self) -> ReduceOp: ...
    @property
    def root(self) -> int: ...
    @property
    def prescale(self) -> float: ...
    @property
    def postscale(self) -> float: ...
    @property
    def splits(self) -> tuple[int, ...] | None: ...
    @property
    def compression(self) -> Compressor: ...
    @property
    def inplace(self) -> bool: ...


class Agreed(Protocol):
    """What a launch reads of a member's request (:class:`hora.engine.scheduling.table.Request`)."""

    @property
    def kind(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def reduce_op(self) -> int: ...
    @property
    def root(self) -> int: ...
    @property
    def ps(self) -> tuple[int, ...]: ...
    @property
    def device(self) -> str: ...
    @property
    def splits(self) -> tuple[int, ...] | None: ...


@dataclass(eq=False)
class Peers:
    """What a kind's launch sees of a ready collective beyond its own call: the group to run on, this rank,
    what the members agreed on, and per member what it submitted and in which round (the engine builds it from
    the round's table; the kinds never see the table)."""

    group: dist.ProcessGroup  # the process set's
    rank: int
    agreed: Agreed  # the first member's request: every field the members must agree on
    requests: Mapping[int, Agreed]  # rank -> its request (a joined rank has none)
    arrival: Mapping[int, int]  # rank -> the round its request arrived in
    hierarchy: Hierarchy | None = None  # the runtime's hierarchical allreduce, when one was built

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

    def index(self) -> int:
        """This rank's index among the members (a joined rank's too)."""
        return list(self.agreed.ps).index(self.rank)

    def zeros(self, rows: int | None = None) -> torch.Tensor:
        """What a joined rank contributes: zeros of the members' dtype and shape (``rows`` rows, if given)."""
        req = self.agreed
        device = torch.device(req.device, torch.cuda.current_device()) if req.device == "cuda" else torch.device("cpu")
        shape = req.shape if rows is None else (rows, *req.shape[1:])
        return torch.zeros(shape, dtype=to_dtype(req.dtype), device=device)


class Steps(Protocol):
    """A kind's four steps (module docstring)."""

    def prepare(self, op: Op) -> None: ...

    def launch(self, op: Op, peers: Peers) -> Work | None: ...

    def launch_joined(self, peers: Peers) -> Work | None: ...

    def finish(self, op: Op) -> Any: ...


@dataclass(eq=False)
class Op:
    """A submitted call, its kind's steps, and what the steps compute. Owned by one thread at a time: the
    caller's at submit (prepare), the thread that runs the round at launch, the caller's again in
    ``synchronize()`` (finish), each hand-over ordered by the handle's latch. The engine calls
    ``op.steps.launch(op, peers)`` and the handle ``op.steps.finish(op)``: a stack trace names the kind's step."""

    call: CallInputs
    steps: Steps
    members: int = 0  # the process set's size when the call was submitted (Average divides by it)
    wire: torch.Tensor = _NO_WIRE  # set by prepare: the buffer the collective sends (and receives in place)
    ctx: Any = None  # compression context (Adasum: how many levels summed within a host)
    buffers: WireBuffers | None = None  # the runtime's reused 16-bit wire buffers (None: every wire is new)
    lease: torch.Tensor | None = None  # a reused 16-bit wire buffer taken from ``buffers``, given back at finish
    out: torch.Tensor = _NO_WIRE  # set by launch when the output is not the wire: the c10d output buffer
    rows: list[int] | None = None  # set by launch: rows from each member (allgather's sent, alltoall's received)
    last_joined: int = -1  # set by Join's launch: the rank whose join arrived last

    @property
    def index(self) -> int:
        """This rank's index in the call's process set."""
        return self.call.ps.rank()
