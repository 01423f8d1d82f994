"""The elastic contract between ``hora run``'s driver and the workers of an elastic job (stdlib only).

Every worker of an elastic job gets ``HORA_ELASTIC=1`` and ``HORA_WORKER_ID="<host>:<slot>"`` (stable for
the process's life) besides the usual variables (``HOROVOD_RANK`` etc. hold its start values). The keys
below live in the driver's rendezvous store under ``hora/<job>/elastic/`` (:func:`elastic_key`):

``world/<gen>``
    a :class:`World` as JSON, written before ``gen``. World 1 is the first world.
``gen``
    ``"<gen>"``: the newest world, rewritten in place. Workers read it as a hint only and follow ``world/<n>``
    from it while the next one exists, so an older value put back by a stranger (its MAC stays valid) delays
    nobody. A worker waits for a world past the last one it was in.
``ready/<worker_id>``
    ``"<last gen the worker was in, 0 if none>"``: set by a worker at its first ``hvd.init()`` and at every
    reset, before it waits for a newer ``gen``. A worker that was in world ``L`` and is absent from the first
    world after ``L`` it reads was removed: it logs one line and exits 0. A new worker (``"0"``) waits until a
    world contains it (the driver stops it if none ever will).
``update/<n>``
    a host change: the driver stores ``update/<n>`` (an :class:`Update` as JSON; ``n`` counts from 1). Rank 0
    looks for the record after the last one it saw (no counter: the store's counters carry no MAC) and its
    next ``commit()``/``check_host_updates()`` raises ``HostsUpdatedInterrupt(skip_sync=<only removals>)`` on
    every rank.
``discovered/<n>``
    a change of the hosts the discovery script prints, as soon as the driver saw it, in the same form (an
    :class:`Update`, ``n`` from 1, read in order the same way): rank 0 passes it to Horovod's
    ``state.on_hosts_updated`` (``state._host_messages``). The interrupt still waits for ``update/<n>``.

Every value is written and read through :class:`hora.protocol.signedstore.SignedStore`: a record that fails its MAC
check is never parsed.

Ranks of a new world (:func:`assign_world`): the workers of the previous world first, in their old rank
order (so rank 0 always holds state to sync from), then the new ones. The process groups of world ``N`` use
the store prefix :func:`world_prefix` (``hora/<job>/g<N>``: the world's gen, so new and old workers agree),
and its board (``ended/<rank>`` etc. of :mod:`hora.protocol.messages`) is the board of job id
:func:`world_job_id` (``<job>/g<N>``): a rank number means one worker within one world only.

A worker that dies or raises: its agent tells the driver, which posts ``ended/<rank>`` on that world's board
at once (the survivors' pending collectives fail with ``HorovodInternalError``) and sets the world's
``arrived/all`` (:func:`arrivals_key`) to ``"ended"``, so that members still waiting in ``init()`` for the
others to arrive (:mod:`hora.runtime.arrivals`) stop waiting; it blacklists the host and publishes a world
without that host's workers once every survivor has posted ready.

Example:
    >>> w1 = assign_world(None, 1, [("a:0", "a"), ("a:1", "a"), ("b:0", "b")])
    >>> [(wid, p.rank, p.local_rank, p.cross_rank) for wid, p in w1.ordered()]
    [('a:0', 0, 0, 0), ('a:1', 1, 1, 0), ('b:0', 2, 0, 1)]
    >>> w2 = assign_world(w1, 2, [("c:0", "c"), ("b:0", "b")])
    >>> [(wid, p.rank) for wid, p in w2.ordered()]
    [('b:0', 0), ('c:0', 1)]
    >>> World.from_json(w2.to_json()) == w2
    True
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Worker environment (read by hora.common.env on the worker side).
ELASTIC_ENV = "HORA_ELASTIC"  # "1" in every worker of an elastic job
WORKER_ID_ENV = "HORA_WORKER_ID"  # "<host>:<slot>", stable for the process's life

# Keys under hora/<job>/elastic/ (see the module docstring).
GEN = "gen"
WORLD = "world/{gen}"
READY = "ready/{worker_id}"
UPDATE = "update/{n}"
DISCOVERY = "discovered/{n}"


def elastic_key(job_id: str, key: str, **fields: object) -> str:
    """A key of job ``job_id``: ``elastic_key("ab12", WORLD, gen=3)`` -> ``"hora/ab12/elastic/world/3"``."""
    return f"hora/{job_id}/elastic/" + key.format(**fields)


def world_prefix(job_id: str, gen: int) -> str:
    """The store prefix of world ``gen``'s process groups: ``"hora/<job>/g<gen>"``."""
    return f"hora/{job_id}/g{gen}"


ARRIVALS_RELEASED = "arrived/all"  # in the world's prefix: "1" once every member arrived at init(), or "ended"
MEMBER_ENDED = "ended"  # the value of ARRIVALS_RELEASED with which the driver ends that wait


def arrivals_key(job_id: str, gen: int) -> str:
    """The key that releases world ``gen``'s members from their wait for each other in ``init()``:
    ``arrivals_key("ab12", 3)`` -> ``"hora/ab12/g3/arrived/all"``."""
    return f"{world_prefix(job_id, gen)}/{ARRIVALS_RELEASED}"


def world_job_id(job_id: str, gen: int) -> str:
    """The job id whose board (:func:`hora.protocol.messages.board_key`) serves world ``gen``: ``"<job>/g<gen>"``.

    >>> world_job_id("ab12", 3)
    'ab12/g3'
    """
    return f"{job_id}/g{gen}"


def worker_id(host: str, slot: int) -> str:
    """``"<host>:<slot>"``: who a worker process is, for its whole life (``slot``: its slot on that host).

    A host that comes back (after a blacklist cooldown, or re-added by discovery) reuses its ids: the driver
    deletes a worker's ``ready`` key before it starts the process that takes over that id.
    """
    return f"{host}:{slot}"


def parse_worker_id(value: str) -> tuple[str, int]:
    """``"node1:3"`` -> ``("node1", 3)``; works for bracketed IPv6 hosts (``"[::1]:0"``).

    >>> parse_worker_id("[::1]:2")
    ('[::1]', 2)
    """
    host, sep, slot = value.rpartition(":")
    if not sep or not host or not slot.isdigit():
        raise ValueError(f"{ELASTIC_ENV}: worker id {value!r} is not '<host>:<slot>'")
    return host, int(slot)


@dataclass(frozen=True, slots=True)
class Placement:
    """One worker's place in one world (Horovod's rank / local / cross numbering)."""

    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str  # the host as the discovery script or -H named it

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "local_rank": self.local_rank, "local_size": self.local_size,
                "cross_rank": self.cross_rank, "cross_size": self.cross_size, "hostname": self.hostname}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Placement:
        return cls(rank=int(d["rank"]), local_rank=int(d["local_rank"]), local_size=int(d["local_size"]),
                   cross_rank=int(d["cross_rank"]), cross_size=int(d["cross_size"]), hostname=str(d["hostname"]))


@dataclass(frozen=True, slots=True)
class World:
    """World ``gen``: every member worker's placement, keyed by worker id.

    ``updates`` is the value of the ``updates`` counter this world already reflects: a member starts
    comparing the counter against it (so an update posted while it joined is not missed, and one the world
    already took in does not interrupt it again).
    """

    gen: int
    workers: Mapping[str, Placement] = field(default_factory=dict)
    updates: int = 0

    @property
    def size(self) -> int:
        return len(self.workers)

    def ordered(self) -> list[tuple[str, Placement]]:
        """``(worker_id, placement)`` pairs in rank order."""
        return sorted(self.workers.items(), key=lambda item: item[1].rank)

    def worker_ids(self) -> list[str]:
        """The members' ids in rank order."""
        return [wid for wid, _ in self.ordered()]

    def hosts(self) -> list[str]:
        """The hosts of the members, in order of their first rank."""
        return list(dict.fromkeys(p.hostname for _, p in self.ordered()))

    def rank_of(self, wid: str) -> int | None:
        """The rank of worker ``wid`` in this world, None when it is not a member."""
        placement = self.workers.get(wid)
        return None if placement is None else placement.rank

    def to_json(self) -> str:
        return json.dumps({"gen": self.gen, "size": self.size, "updates": self.updates,
                           "workers": {wid: p.to_dict() for wid, p in self.ordered()}}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> World:
        d = json.loads(text)
        workers = {str(wid): Placement.from_dict(p) for wid, p in d["workers"].items()}
        world = cls(gen=int(d["gen"]), workers=workers, updates=int(d.get("updates", 0)))
        if int(d.get("size", world.size)) != world.size or sorted(p.rank for p in workers.values()) != list(
                range(world.size)):
            raise ValueError(f"elastic world {d.get('gen')}: ranks are not 0..size-1: {d!r}")
        return world


@dataclass(frozen=True, slots=True)
class Update:
    """A host change the driver announces (``update/<n>``): the hosts added and removed."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    @property
    def skip_sync(self) -> bool:
        """Only removals: every surviving worker already holds the same state (Horovod's ``skip_sync``)."""
        return not self.added

    def to_json(self) -> str:
        return json.dumps({"added": list(self.added), "removed": list(self.removed)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Update:
        d = json.loads(text)
        return cls(added=tuple(str(h) for h in d.get("added", ())), removed=tuple(str(h) for h in d.get("removed", ())))


def skip_sync(updates: Iterable[Update]) -> bool:
    """Whether a reset caused by all of ``updates`` may skip the state sync (none of them added a host)."""
    return all(u.skip_sync for u in updates)


def assign_world(previous: World | None, gen: int, members: Iterable[tuple[str, str]], updates: int = 0) -> World:
    """World ``gen`` for ``members`` (``(worker_id, hostname)`` pairs, new ones in the order to number them).

    Members that were in ``previous`` come first, in their old rank order; the others follow in the order
    given. ``local_rank`` is a worker's index among the members on its host (in rank order), ``cross_rank``
    its host's index among the hosts that have a member with that ``local_rank`` (hosts in order of first
    rank) — Horovod's numbering, as :func:`hora.protocol.topology.derive_topology` computes it for a fixed job.
    ``updates``: see :class:`World`.
    """
    members = list(members)
    seen: set[str] = set()
    for wid, _ in members:
        if wid in seen:
            raise ValueError(f"elastic world {gen}: worker {wid!r} listed twice")
        seen.add(wid)
    old = previous.workers if previous is not None else {}
    kept = sorted((m for m in members if m[0] in old), key=lambda m: old[m[0]].rank)
    order = kept + [m for m in members if m[0] not in old]
    hosts = [host for _, host in order]
    on_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        on_host.setdefault(host, []).append(rank)
    host_order = list(on_host)
    workers: dict[str, Placement] = {}
    for rank, (wid, host) in enumerate(order):
        local_rank = on_host[host].index(rank)
        peers = [h for h in host_order if len(on_host[h]) > local_rank]
        workers[wid] = Placement(rank=rank, local_rank=local_rank, local_size=len(on_host[host]),
                                 cross_rank=peers.index(host), cross_size=len(peers), hostname=host)
    return World(gen=gen, workers=workers, updates=updates)
