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
per key).

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

    def waits_of(self, rank: int, since_round: int) -> list[int] | None:
        """Whom ``rank`` posted (:meth:`post_waiting`) that its round waits for, if it posted for round
        ``since_round`` or later; None when it posted nothing since (it cannot run Python, or is not waiting)."""
        if self._store is None:
            return None
        key = self._key(protocol.WAITING, rank=rank)
        try:
            if not self._store.check([key]):
                return None
            post = json.loads(self._store.get(key))
            if int(post.get("round", -1)) < since_round:
                return None
            return [int(r) for r in post.get("missing", [])]
        except StoreAuthError as e:  # a stranger's post says nothing about that rank
            signedstore.ignored(e)
        except Exception as e:
            log.debug("board: cannot read rank %d's wait: %s", rank, e)
        return None

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
