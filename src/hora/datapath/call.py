"""What one collective call is, as every layer from the call builders down to the kinds sees it: its
:class:`Kind`, the validated :class:`Call`, the engine's :class:`Launch` of it, and the four :class:`Steps` a
kind implements (:mod:`hora.datapath.kinds`, which re-exports these names).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from hora.common.process_sets import ProcessSet
from hora.datapath.c10d import Work
from hora.datapath.compression import Compression, Compressor
from hora.datapath.reduce_ops import ReduceOp
from hora.diagnostics import callsite
from hora.diagnostics.callsite import Site

if TYPE_CHECKING:
    from hora.engine.table import Entry


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


@dataclass(eq=False)
class Launch:
    """What a launch needs beyond its own call, from the engine: every member's request (the round's entry),
    the group to run on, and this rank."""

    entry: Entry
    group: dist.ProcessGroup  # the process set's
    rank: int


class Steps(Protocol):
    """A kind's four steps (see the module docstring)."""

    def prepare(self, call: Call) -> None: ...

    def launch(self, call: Call, launch: Launch) -> Work | None: ...

    def launch_joined(self, launch: Launch) -> Work | None: ...

    def finish(self, call: Call) -> Any: ...
