"""How host changes reach an elastic worker: rank 0's watcher thread, and Horovod's notification manager.

Two kinds of news come from the launcher's store (:mod:`hora.protocol.elastic`), both read by one thread
on rank 0 of each world, every ``_POLL_S``, so nothing is read or sent on the step path. Both are numbered
records read in order until one is missing, each checked against the job's secret before it is parsed
(:class:`~hora.protocol.signedstore.SignedStore`; one a stranger wrote is ignored, with one warning):

* host updates (``update/<n>``): the changes a world must reset for (hosts removed; new workers ready to join).
  The thread announces a new count through the negotiator (``Negotiator.announce``); every
  ``check_host_updates()`` is a notice point (a lock and a counter), and the engine hands the
  announcement out at the same notice point on every rank, agreed in two negotiation rounds
  (:mod:`hora.engine.scheduling.notices` has the proof), so every rank raises ``HostsUpdatedInterrupt`` at the same
  check.
* host discoveries (``discovered/<n>``): every change of the hosts the launcher found, as soon as it found it. The
  thread tells the states that ``hvd.elastic.run`` runs (Horovod's ``notification_manager``), whose
  ``on_hosts_updated(timestamp, HostUpdateResult)`` queues it in ``state._host_messages``, as Horovod's
  driver notifies rank 0. (hora's interrupt for an added host comes later, once its workers are ready.)

Example:
    >>> HostUpdateResult.removed | HostUpdateResult.added == HostUpdateResult.mixed
    True
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import weakref
from typing import Any, Protocol

from hora.errors import NotInitializedError, StoreAuthError
from hora.protocol import signedstore
from hora.protocol.signedstore import SignedStore
from hora.runtime import elastic_rendezvous as world
from hora.runtime import lifecycle as runtime

log = logging.getLogger(__name__)

_POLL_S = 0.1  # how often rank 0 looks for the launcher's next records (two small store reads)


class HostUpdateResult(enum.IntFlag):
    """What a host change did (Horovod's ``horovod.runner.elastic.worker.HostUpdateResult``)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class Listener(Protocol):
    def on_hosts_updated(self, timestamp: int, update_res: HostUpdateResult) -> None: ...


class WorkerNotificationManager:
    """Horovod's ``WorkerNotificationManager``: the states ``hvd.elastic.run`` is running, each told of every
    host change the launcher finds (on rank 0, as in Horovod; the other ranks learn of it at a commit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: set[Listener] = set()

    def init(self, *args: Any, **kwargs: Any) -> None:
        """Horovod starts its notification service here; hora's news travel through the launcher's store."""

    def register_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.add(listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.discard(listener)

    def handle_hosts_updated(self, timestamp: int, update_res: HostUpdateResult) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener.on_hosts_updated(timestamp, update_res)


notification_manager = WorkerNotificationManager()


class _UpdateWatch:
    """Rank 0's watcher of one world (started at its first check in that world), and every rank's check."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: weakref.ref[runtime.Runtime] | None = None  # the world this process's thread watches
        self.announced = 0  # the last count of host updates this process announced (rank 0 of a world)

    def check(self) -> tuple[int, int, bool] | None:
        """(count acted on before, count announced now, only removals since) when this check is where every
        rank learns of host updates; None otherwise (and always outside an elastic job)."""
        rt = runtime.state("check_host_updates()")
        if not rt.env.elastic:
            return None
        if rt.topo.rank == 0 and (self._watched is None or self._watched() is not rt):
            self._start(rt)
        notices = rt.negotiator.notice_point()
        if not notices:
            return None
        return min(n[0] for n in notices), max(n[1] for n in notices), all(n[2] for n in notices)

    def _start(self, rt: runtime.Runtime) -> None:
        with self._lock:
            if self._watched is not None and self._watched() is rt:
                return
            self._watched = weakref.ref(rt)
        store = rt.job_store
        joined = world.joined()  # the count the world already reflects is no news
        seen = joined.updates if joined is not None else world.host_updates(store, rt.env.job_id, 0)[0]
        found = world.discoveries(store, rt.env.job_id, None)[0]  # what was found before this world is old news
        threading.Thread(target=self._watch, args=(rt, store, seen, found), name="hora-elastic-updates",
                         daemon=True).start()

    def _watch(self, rt: runtime.Runtime, store: SignedStore, seen: int, found: int) -> None:
        """Rank 0's thread: announce each new count of host updates, pass each discovery on, until this world
        ends."""
        while True:
            time.sleep(_POLL_S)
            if not _current(rt):
                return
            try:
                found, changes = world.discoveries(store, rt.env.job_id, found)
                now, removed_only = world.host_updates(store, rt.env.job_id, seen)
            except StoreAuthError as e:  # a forged record: the job goes on as if it were not there
                signedstore.ignored(e)
                continue
            except Exception as e:  # the launcher and its store are gone: the job is ending anyway
                log.debug("hora elastic: stopped watching host updates: %s", e)
                return
            for change in changes:
                flags = (HostUpdateResult.added if change.added else HostUpdateResult.no_update) | (
                    HostUpdateResult.removed if change.removed else HostUpdateResult.no_update)
                notification_manager.handle_hosts_updated(int(time.time()), flags)
            if now > seen:
                log.info("hora elastic: host update %d announced by the launcher", now)
                rt.negotiator.announce((seen, now, removed_only))
                seen = self.announced = now


def _current(rt: runtime.Runtime) -> bool:
    """``rt`` is still this process's live runtime (its world has not ended)."""
    try:
        return runtime.state() is rt
    except NotInitializedError:
        return False


watch = _UpdateWatch()
