"""A worker that starts while an elastic job runs: it builds alone, then joins at its first collective.

``hvd.init()`` on such a worker (a host added, a failed host back after its cooldown) does not make the job's
workers wait while it imports and builds: it gives the worker a world of its own to build in
(:func:`hora.runtime.elastic_rendezvous.alone`), while ``hvd.rank()``, ``hvd.size()``, ``hvd.local_rank()``...
report the place the launcher planned for it in the world it joins
(:func:`hora.runtime.elastic_rendezvous.planned`: a Horovod script that builds a
``DistributedSampler`` from ``hvd.size()`` at start-up gets the size it trains with). Its first collective or
``hvd.elastic.run`` call, whichever comes first, joins the job's world (:func:`join`): it posts ready, the
others take the change at their next commit, and that world forms. When the launcher had to place it
differently by then (another worker came or went meanwhile), :func:`moved` says so once, and
``hvd.elastic.run`` runs the state's reset callbacks before the sync.

Example:
    >>> hvd.init()                                  # doctest: +SKIP
    >>> hvd.size()                                  # the size of the world it joins; nothing waits yet
    4
"""

from __future__ import annotations

import logging

from hora.protocol.topology import Topology
from hora.runtime import lifecycle as runtime

log = logging.getLogger(__name__)

_moved = False  # the last join put this process elsewhere than init() said, and nobody was told yet


def join(what: str) -> runtime.Runtime:
    """The live runtime (``what`` names the call that needs it), after joining the job's world when this
    process is a new elastic worker still alone."""
    rt = runtime.state(what)
    if not rt.alone:
        return rt
    shown = _place(rt.joining or rt.topo)
    log.info("hora elastic: joining the job's world at %s", what)
    runtime.reset(failed=False)
    rt = runtime.state(what)
    if _place(rt.topo) != shown:
        global _moved
        _moved = True
        log.warning("hora elastic: this new worker joined as rank %d of %d (hvd.init() said %d of %d: the "
                    "launcher placed it again while it started)", rt.topo.rank, rt.topo.size, shown[0], shown[1])
    return rt


def moved() -> bool:
    """True once after a join that put this process elsewhere (rank, size, local or cross ranks) than
    ``hvd.init()`` reported; False after that, and when it joined where it was told."""
    global _moved
    was, _moved = _moved, False
    return was


def _place(t: Topology) -> tuple[int, int, int, int, int, int]:
    return t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size
