"""What the negotiation engine needs from the runtime that built it, and nothing more.

:func:`hora.runtime.lifecycle.init` fills one :class:`EngineContext` per ``init()`` and hands it to
:class:`~hora.engine.scheduling.negotiator.Negotiator`; no module of the engine imports the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hora.common.knobs import Knobs
from hora.diagnostics.board import Board
from hora.protocol.jobsecret import JobSecret
from hora.protocol.signedstore import SignedStore

if TYPE_CHECKING:  # the engine only reads a process set's ranks and group; the type is for the checker
    from hora.common.process_sets import ProcessSet
    from hora.datapath.hierarchical import Hierarchy


@dataclass(frozen=True, eq=False)
class EngineContext:
    """One rank's view of its job, for the engine (built by ``init()``, dropped at ``shutdown()``)."""

    rank: int
    size: int
    hostnames: Sequence[str]  # by rank: for messages that name a peer's host
    knobs: Knobs
    store: SignedStore  # hora's keys of this init generation in the rendezvous store (values authenticated)
    store_addr: str  # the rendezvous host: peers reach this rank at its address on the route to it
    board: Board  # shared with ``hora run``'s driver (does nothing under other launchers)
    process_sets: Mapping[int, ProcessSet]  # the runtime's live registry (dynamic sets come and go)
    device: torch.device | None  # the CUDA device rounds issue collectives on, None on CPU
    ctrl_group: Any  # the Gloo group of the Gloo control plane (a c10d ProcessGroup)
    connect_store: Callable[[], dist.Store] | None  # a fresh store connection (the Gloo plane's bell); None: in memory
    secret: JobSecret | None = None  # the job's secret (env.job_secret()); None: the control plane is unauthenticated
    world: str = ""  # names this job's world (its store prefix: job id and generation); bound into every handshake
    # aborts the NCCL communicators of hora's data groups (CUDA worlds): called once when a peer is lost, so the
    # collectives launched with it end instead of holding the GPU (and a host waiting for it) forever
    abort_data_plane: Callable[[], None] | None = None
    # the hierarchical allreduce init() built (None: every allreduce is flat); the engine hands it to each launch
    hierarchy: Hierarchy | None = None

    def hostname(self, rank: int) -> str:
        return self.hostnames[rank] if 0 <= rank < len(self.hostnames) else "?"
