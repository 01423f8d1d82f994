"""The worker's side of an elastic job's rendezvous: which world (ranks, size) this process belongs to.

In an elastic job (``hora run --min-np ...``, ``WorkerEnv.elastic``) the launcher's driver decides the
worlds: it writes ``world/<gen>`` (every member's rank, local and cross ranks, host) then ``gen`` (the
newest), under ``hora/<job>/elastic/`` in the rendezvous store. A worker posts ``ready/<worker_id>`` (the
last world it was in, 0 if none) when it joins and at every reset, then waits in the store (no polling) for
a world newer than its last one. A worker that was in a world and is not in the next one has been removed:
it leaves with exit code 0.

When a worker joins: the workers of the job's first world join at ``init()``. A worker that starts while the
job already runs (a host added, a failed host back after its cooldown) does not: ``init()`` gives it a world
of its own (:func:`alone`) to build its model, optimizer and state in, while ``hvd.rank()``, ``hvd.size()``
and the local and cross ranks show the place the launcher planned for it in the world it joins
(:func:`planned`, from its start values, as Horovod starts a new worker). It posts ready only at its first
collective or ``hvd.elastic.run`` call (:mod:`hora.runtime.newcomer`). The driver announces it once it is ready, so
the others train on while it imports and builds, and wait for it only for the state sync itself. Host
changes reach workers through the ``update/<n>`` records (:func:`host_updates`). Key names and the World
record are shared with the driver (:mod:`hora.protocol.elastic`, the standard library only).

Only the runtime (``init()``) and :mod:`hora.elastic` use this module. Its store is the job's
:class:`~hora.protocol.signedstore.SignedStore`: every record is checked before it is parsed.

Example:
    >>> joined() is None  # outside an elastic job
    True
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time

import torch.distributed as dist

from hora.common.env import WorkerEnv
from hora.errors import ElasticTimeoutError
from hora.protocol import elastic as proto
from hora.protocol.signedstore import SignedStore
from hora.protocol.topology import Topology

log = logging.getLogger(__name__)

_POLL_S = 0.01  # a worker woken by world/<gen> before the driver wrote gen: how soon it reads gen again
_joined: proto.World | None = None  # the last world this process joined
_before: proto.World | None = None  # the world it was in before that one


def join(store: SignedStore, env: WorkerEnv, last_gen: int, timeout_s: float) -> tuple[WorkerEnv, proto.World]:
    """Post ready and wait for the driver's next world that holds this worker.

    Args:
        store: the job's rendezvous store (unprefixed).
        env: this process's start environment (``worker_id``, ``job_id``, host).
        last_gen: the last world this worker was in (0 at the first ``init()``).
        timeout_s: the elastic timeout: how long to wait for that world.

    Returns:
        This worker's environment in the new world (rank, size, local and cross ranks from the record) and
        the world itself.

    Raises:
        SystemExit: (code 0) this worker was in world ``last_gen`` and the newer world leaves it out.
        ElasticTimeoutError: no world holding this worker came within ``timeout_s``.
    """
    job = env.job_id
    store.set(proto.elastic_key(job, proto.READY, worker_id=env.worker_id), str(last_gen))
    log.debug("worker %s ready after world %d", env.worker_id, last_gen)
    deadline = time.monotonic() + timeout_s
    seen = last_gen
    while True:
        gen = newest(store, job)
        if gen > seen:
            world = proto.World.from_json(store.get(proto.elastic_key(job, proto.WORLD, gen=gen)))
            member = world.workers.get(env.worker_id)
            if member is not None:
                new_env = dataclasses.replace(
                    env, rank=member.rank, size=world.size, local_rank=member.local_rank,
                    local_size=member.local_size, cross_rank=member.cross_rank, cross_size=member.cross_size,
                    hostname=member.hostname or env.hostname, world_gen=gen)
                log.info("worker %s joins world %d as rank %d of %d", env.worker_id, gen, member.rank, world.size)
                global _joined, _before
                _before, _joined = _joined, world
                return new_env, world
            if last_gen > 0:
                log.warning("hora elastic: worker %s (in world %d) is not in world %d: its host was removed; "
                            "leaving with exit code 0", env.worker_id, last_gen, gen)
                raise SystemExit(0)
            seen = gen  # a world made before this new worker was ready: wait for the next one
        left = deadline - time.monotonic()
        if left <= 0 or not _wait_for_world(store, job, seen + 1, left):
            raise ElasticTimeoutError(
                f"worker {env.worker_id} waited {timeout_s:g} s for the launcher's next world (after world "
                f"{last_gen}) and none came: too few hosts (--min-np), or the launcher is gone. Give hosts more "
                "time with --elastic-timeout (HOROVOD_ELASTIC_TIMEOUT)")


def _wait_for_world(store: SignedStore, job: str, gen: int, timeout_s: float) -> bool:
    """Wait in the store (no polling) until world ``gen`` is published; False after ``timeout_s``. The driver
    writes ``world/<gen>`` before ``gen``: a worker woken between the two writes looks again a moment later."""
    key = proto.elastic_key(job, proto.WORLD, gen=gen)
    if store.check([key]):
        time.sleep(_POLL_S)
        return True
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        return True
    except dist.DistStoreError as e:  # torch's wait timeout; any other store error is not ours to hide
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            return False
        raise


def newest(store: SignedStore, job: str) -> int:
    """The number of the newest world the driver published (0: none yet, the job is starting).

    ``gen`` is rewritten in place, so each of its older values keeps a valid MAC: a stranger who put one back
    (a replay) would keep a worker waiting for a world it already has, until the elastic timeout. So ``gen``
    is read as where to start looking only: the worlds themselves, ``world/<n>``, each written once, are
    followed from there while the next one exists (one ``check`` when ``gen`` is current)."""
    key = proto.elastic_key(job, proto.GEN)
    gen = int(store.get(key)) if store.check([key]) else 0
    while store.check([proto.elastic_key(job, proto.WORLD, gen=gen + 1)]):
        gen += 1
    return gen


def planned(env: WorkerEnv) -> Topology:
    """The place the launcher planned for a new worker in the world it joins: its start values (the driver
    numbers it after the workers it will join, :func:`hora.protocol.elastic.assign_world`). What
    ``hvd.rank()``, ``hvd.size()``, the local and cross ranks report until it joins.

    Example:
        >>> t = planned(WorkerEnv(rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2))
        >>> (t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size)
        (3, 4, 1, 2, 1, 2)
    """
    return Topology(rank=env.rank, size=env.size, local_rank=env.local_rank, local_size=env.local_size,
                    cross_rank=env.cross_rank or 0, cross_size=env.cross_size or 1, hostnames=(), homogeneous=True)


def alone(env: WorkerEnv) -> WorkerEnv:
    """A new worker's environment until it joins its first world: a job of its own, rank 0 of 1, with no key
    in the launcher's store. The local rank and size stay the launcher's (the slot's GPU), so the device is
    bound to the one it will train on.

    Example:
        >>> e = alone(WorkerEnv(rank=3, size=4, local_rank=1, local_size=2, source="hora", elastic=True))
        >>> (e.rank, e.size, e.local_rank, e.local_size, e.elastic)
        (0, 1, 1, 2, False)
    """
    return dataclasses.replace(env, rank=0, size=1, cross_rank=0, cross_size=1, source="single", elastic=False,
                               world_gen=0, store_is_server=True)


def hosts_by_rank(env: WorkerEnv) -> list[str] | None:
    """Every rank's host in the world ``env`` describes, from the launcher's record (so ``init()`` needs no
    collective to learn them); None outside an elastic world or when the record does not name them all."""
    record = _joined if env.elastic else None
    if record is None or record.gen != env.world_gen or record.size != env.size:
        return None
    names = [p.hostname for p in sorted(record.workers.values(), key=lambda p: p.rank)]
    return names if all(names) else None


def joined() -> proto.World | None:
    """The last world this process joined (None outside elastic jobs)."""
    return _joined


def grew() -> bool:
    """The last world this process joined holds a worker that the world before it did not: whatever the reset
    was for (e.g. the removal of hosts whose workers handed the state to new ones), the state must be synced."""
    return _before is not None and _joined is not None and any(w not in _before.workers for w in _joined.workers)


def discoveries(store: SignedStore, job_id: str, seen: int | None) -> tuple[int, list[proto.Update]]:
    """The changes of hosts the driver found after the first ``seen`` (None: none, only how many there are):
    (how many in all, the new ones), read in order until one is missing (no counter: a stranger could change
    one)."""
    changes = []
    n = seen or 0
    while store.check([proto.elastic_key(job_id, proto.DISCOVERY, n=n + 1)]):
        n += 1
        if seen is not None:
            changes.append(proto.Update.from_json(store.get(proto.elastic_key(job_id, proto.DISCOVERY, n=n))))
    return n, changes


def host_updates(store: SignedStore, job_id: str, seen: int) -> tuple[int, bool]:
    """The driver's host changes after the first ``seen``: (how many in all, True when all of the new ones
    only removed hosts). One store round trip while nothing changed: the records ``update/<n>`` are numbered
    from 1 and read in order until one is missing (no counter: a stranger could change one)."""
    updates = []
    n = seen
    while store.check([proto.elastic_key(job_id, proto.UPDATE, n=n + 1)]):
        n += 1
        updates.append(proto.Update.from_json(store.get(proto.elastic_key(job_id, proto.UPDATE, n=n))))
    return n, proto.skip_sync(updates)
