"""The worker's side of an elastic job's rendezvous: which world (ranks, size) this process belongs to.

In an elastic job (``hora run --min-np ...``, ``WorkerEnv.elastic``) the launcher's driver decides the
worlds: it writes ``world/<gen>`` (every member's rank, local and cross ranks, host) then ``gen`` (the
newest), under ``hora/<job>/elastic/`` in the rendezvous store. A worker posts ``ready/<worker_id>`` (the
last world it was in, 0 if none) at its first ``init()`` and at every reset, then waits for a world newer
than its last one. A worker that was in a world and is not in the next one has been removed: it leaves with
exit code 0. Host changes reach workers through the ``updates`` counter and the ``update/<n>`` records
(:func:`host_updates`). Key names and the World record are shared with the driver
(:mod:`hora.launch.elastic_protocol`, the standard library only).

Only the runtime (``init()``) and :mod:`hora.elastic` use this module.

Example:
    >>> parse_world('{"gen": 2, "size": 1, "workers": {"h:0": {"rank": 0, "local_rank": 0, "local_size": 1,'
    ...             ' "cross_rank": 0, "cross_size": 1, "hostname": "h"}}}').size
    1
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from hora.env import WorkerEnv
from hora.errors import ElasticTimeoutError
from hora.launch import elastic_protocol as proto

log = logging.getLogger(__name__)

_POLL_S = 0.01  # how often a waiting worker reads the newest world's number (one small store read)
_joined: proto.World | None = None  # the last world this process joined


def parse_world(text: str | bytes) -> proto.World:
    """The World record the driver wrote."""
    return proto.World.from_json(text)


def join(store: Any, env: WorkerEnv, last_gen: int, timeout_s: float) -> tuple[WorkerEnv, proto.World]:
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
    keys = proto.Keys(env.job_id)
    store.set(keys.ready(env.worker_id), str(last_gen))
    log.debug("worker %s ready after world %d", env.worker_id, last_gen)
    deadline = time.monotonic() + timeout_s
    seen = last_gen
    while True:
        gen = _newest(store, keys)
        if gen > seen:
            world = parse_world(store.get(keys.world(gen)))
            member = world.workers.get(env.worker_id)
            if member is not None:
                new_env = dataclasses.replace(
                    env, rank=member.rank, size=world.size, local_rank=member.local_rank,
                    local_size=member.local_size, cross_rank=member.cross_rank, cross_size=member.cross_size,
                    hostname=member.hostname or env.hostname)
                log.info("worker %s joins world %d as rank %d of %d", env.worker_id, gen, member.rank, world.size)
                global _joined
                _joined = world
                return new_env, world
            if last_gen > 0:
                log.warning("hora elastic: worker %s (in world %d) is not in world %d: its host was removed; "
                            "leaving with exit code 0", env.worker_id, last_gen, gen)
                raise SystemExit(0)
            seen = gen  # a world made before this new worker was ready: wait for the next one
        if time.monotonic() > deadline:
            raise ElasticTimeoutError(
                f"worker {env.worker_id} waited {timeout_s:g} s for the launcher's next world (after world "
                f"{last_gen}) and none came: too few hosts (--min-np), or the launcher is gone. Give hosts more "
                "time with --elastic-timeout (HOROVOD_ELASTIC_TIMEOUT)")
        time.sleep(_POLL_S)


def joined() -> proto.World | None:
    """The last world this process joined (None outside elastic jobs)."""
    return _joined


def _newest(store: Any, keys: proto.Keys) -> int:
    if not store.check([keys.gen]):
        return 0
    return int(store.get(keys.gen))


def updates_count(store: Any, job_id: str) -> int:
    """How many host changes the driver has announced so far (one store round trip)."""
    return int(store.add(proto.Keys(job_id).updates, 0))


def host_updates(store: Any, job_id: str, seen: int) -> tuple[int, bool]:
    """The driver's host changes after the first ``seen``: (how many in all, True when all of the new ones
    only removed hosts)."""
    keys = proto.Keys(job_id)
    count = updates_count(store, job_id)
    removed_only = True
    for n in range(seen + 1, count + 1):
        update = proto.HostUpdate.from_json(store.get(keys.update(n)))
        removed_only = removed_only and not update.added
    return count, removed_only
