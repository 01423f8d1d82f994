"""The worker's side of the board it shares with ``hora run``'s driver in the rendezvous store.

A rank whose process cannot run Python (stopped, inside a native call that holds the GIL, cut off by the
network) cannot say so itself; the ranks waiting for it can, and the launcher can look at its process from
outside (its agent reads ``/proc``). Through these keys (names in :mod:`hora.protocol.messages`) a waiting
rank posts whom it waits for (or which of its data transfers have not finished), learns that a rank it
waits for has already exited, and names the culprit of a failure so the launcher's headline blames that rank
and not the one that waited.

Only under ``hora run`` (other launchers have no driver reading the board): elsewhere every call does
nothing. Store errors are swallowed: the board only adds information, it never decides a job's fate. The store
is the job's :class:`~hora.protocol.signedstore.SignedStore`: a post that fails its MAC check is ignored (one warning
per key); only the arrivals, checked once every rank has arrived, fail ``init()`` naming the forged key.

Example:
    >>> Board(None, "", 0).ended([1, 2])
    {}
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from hora.errors import StoreAuthError
from hora.protocol import messages as protocol
from hora.protocol import signedstore
from hora.protocol.signedstore import SignedStore

log = logging.getLogger(__name__)


class Board:
    """Board access for one rank; ``store`` is the job's (unprefixed) store, None to disable."""

    def __init__(self, store: SignedStore | None, job_id: str, rank: int) -> None:
        self._store = store if job_id else None
        self._job = job_id
        self.rank = rank
        self._alive_at: dict[int, int] = {}  # rank -> the ``ends`` count when it was seen not to have ended

    @property
    def active(self) -> bool:
        return self._store is not None

    def _key(self, key: str, **fields: object) -> str:
        return protocol.board_key(self._job, key, **fields)

    def post_waiting(self, missing: Iterable[int], waited_s: float, round_no: int) -> None:
        """Tell the launcher this rank's negotiation round ``round_no`` has waited ``waited_s`` for ``missing``."""
        if self._store is None:
            return
        value = json.dumps({"missing": sorted(missing), "waited": round(waited_s, 1), "round": round_no,
                            "ts": time.time()})
        try:
            self._store.set(self._key(protocol.WAITING, rank=self.rank), value)
            self._store.add(self._key(protocol.WAITS), 1)
        except Exception as e:  # the store went away with the launcher: nothing to tell
            log.debug("board: cannot post waiting: %s", e)

    def post_inflight(self, ops: list[dict[str, Any]], waited_s: float, expired: bool, shutdown_s: float) -> None:
        """Tell the launcher which data transfers of this rank have been on the wire for ``waited_s`` (each op:
        ``kind``, ``name``, ``op`` in words, ``ps``, ``bytes``, ``age``); ``expired``: past the shutdown time.
        An empty ``ops`` withdraws the post (they finished)."""
        if self._store is None:
            return
        value = json.dumps({"ops": ops, "waited": round(waited_s, 1), "expired": expired, "shutdown": shutdown_s,
                            "ts": time.time()})
        try:
            self._store.set(self._key(protocol.INFLIGHT, rank=self.rank), value)
            self._store.add(self._key(protocol.WAITS), 1)
        except Exception as e:
            log.debug("board: cannot post transfers in flight: %s", e)

    def ended(self, ranks: Iterable[int]) -> dict[int, str]:
        """Of ``ranks``, those the launcher saw exit, with how (``"exit code 0"``)."""
        if self._store is None:
            return {}
        found: dict[int, str] = {}
        try:
            ends = int(self._store.add(self._key(protocol.ENDS), 0))  # one round trip while nothing changed
            for rank in ranks:
                if ends == 0 or self._alive_at.get(rank) == ends:
                    continue
                key = self._key(protocol.ENDED, rank=rank)
                if not self._store.check([key]):
                    self._alive_at[rank] = ends
                    continue
                try:
                    found[rank] = self._store.get(key).decode()
                except StoreAuthError as e:  # a stranger's post: that rank is not known to have ended
                    signedstore.ignored(e)
        except Exception as e:
            log.debug("board: cannot read ended ranks: %s", e)
        return found

    def blame(self, rank: int, how: str) -> None:
        """Name ``rank`` as the culprit of the failure this rank is about to raise (the first one named wins)."""
        if self._store is None:
            return
        try:
            self._store.compare_set(self._key(protocol.CULPRIT), "", json.dumps({"rank": rank, "how": how,
                                                                                 "by": self.rank}))
        except Exception as e:
            log.debug("board: cannot name the culprit: %s", e)

    def arrive(self, generation: int) -> None:
        """Mark this rank as having reached its ``generation``-th ``init()``."""
        if self._store is None:
            return
        try:
            self._store.set(self._key(protocol.ARRIVED, gen=generation, rank=self.rank), "1")
        except Exception as e:
            log.debug("board: cannot mark arrival: %s", e)

    def wait_arrivals(self, size: int, generation: int, timeout_s: float,
                      poll_s: float = 0.005) -> tuple[list[int], dict[int, str]]:
        """Wait until every rank below ``size`` has reached its ``generation``-th ``init()`` (:meth:`arrive`),
        watching the launcher's ``ended/<rank>`` posts meanwhile (an elastic world's member can die after the
        world was published: its peers must not wait for it inside the backend's rendezvous).

        Returns:
            ``(late ranks, ended ranks with how)``: ``([], {})`` once every rank arrived (or when the board is
            off); as soon as the launcher saw one of them end, the ended ones; after ``timeout_s``, the late
            ranks alone.

        Raises:
            StoreAuthError: an arrival was not posted by a process holding the job's secret.
        """
        if self._store is None:
            return [], {}
        keys = [self._key(protocol.ARRIVED, gen=generation, rank=r) for r in range(size)]
        deadline = time.monotonic() + timeout_s
        try:
            while not self._store.check(keys):  # one round trip for all of them
                ended = self.ended(range(size))  # one round trip while nobody ended
                if ended:
                    return self.not_arrived(size, generation), ended
                if time.monotonic() > deadline:
                    return self.not_arrived(size, generation), {}
                time.sleep(poll_s)
            self._store.multi_get(keys)  # every arrival was posted by a rank of this job (one more round trip)
        except StoreAuthError:
            raise
        except Exception as e:  # the store went away with the launcher: the backend's rendezvous will say so
            log.debug("board: cannot read arrivals: %s", e)
        return [], {}

    def not_arrived(self, size: int, generation: int) -> list[int]:
        """The ranks that have not reached their ``generation``-th ``init()``."""
        if self._store is None:
            return []
        try:
            return [r for r in range(size)
                    if not self._store.check([self._key(protocol.ARRIVED, gen=generation, rank=r)])]
        except Exception as e:
            log.debug("board: cannot read arrivals: %s", e)
            return []
