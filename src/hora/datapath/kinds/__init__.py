"""What each kind of collective does to tensors: its four steps (prepare, launch, launch_joined, finish), one
module per kind or per family of kinds, and :data:`KINDS`, which finds a kind's steps.

:mod:`.op` holds what the steps work on (:class:`~.op.Kind`, :class:`~.op.Op`, :class:`~.op.Peers`) and says what
each step does; :mod:`.reductions` (allreduce, reducescatter), :mod:`.adasum`, :mod:`.rows` (allgather,
alltoall), :mod:`.broadcast` and :mod:`.sync` (barrier, join) the kinds.
"""

from __future__ import annotations

from hora.datapath.c10d import Work
from hora.datapath.kinds.adasum import Adasum
from hora.datapath.kinds.broadcast import Broadcast
from hora.datapath.kinds.op import Kind, Peers, Steps
from hora.datapath.kinds.reductions import Allreduce, Reducescatter
from hora.datapath.kinds.rows import Allgather, Alltoall
from hora.datapath.kinds.sync import Barrier, Join

KINDS: dict[str, Steps] = {Kind.ALLREDUCE: Allreduce, Kind.ADASUM: Adasum, Kind.ALLGATHER: Allgather,  # type: ignore[dict-item]
                           Kind.BROADCAST: Broadcast, Kind.ALLTOALL: Alltoall, Kind.REDUCESCATTER: Reducescatter,
                           Kind.BARRIER: Barrier, Kind.JOIN: Join}


def launch_joined(peers: Peers) -> Work | None:
    """Take part in a ready collective for a rank that has called ``join()``: contribute zeros or nothing."""
    steps = KINDS.get(peers.agreed.kind)
    return steps.launch_joined(peers) if steps is not None else None
