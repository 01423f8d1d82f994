"""Every rank's arrival at ``init()``: the barrier that makes a job start together, at a cost to each rank that
does not grow with the number of ranks.

hora's Gloo groups connect a pair of ranks at its first collective (``HORA_GLOO_LAZY_CONNECT``), so making
them no longer waits for every rank; this barrier does, within ``--start-timeout``, and names the ranks that
did not come. In the world's store prefix (``hora/<job>/g<gen>/``):

``arrived/<rank>``
    each rank's mark, read only after a timeout, to name the late ranks;
``arrivals``
    a counter every rank adds 1 to;
``arrived/all``
    ``"1"``, set by the rank whose addition brings the counter to the job's size; every rank waits for it in
    the store (no polling). In an elastic world ``hora run``'s driver sets it to ``"ended"`` when a member
    ends (:func:`hora.protocol.elastic.arrivals_key`), so the others stop waiting at once.

So each rank makes four store operations (a set, an add, a wait, a get; the last rank one more) where a poll
naming every rank's key made O(n) every 5 ms. The counter carries no MAC and ``arrived/all`` only wakes the
ranks (a value of it that fails its MAC check is logged once and read as a wake-up): what a stranger can do
with either is release the barrier early or hold it to the timeout; who ended is read from the launcher's
authenticated posts (:mod:`hora.protocol.signedstore`).

Example:
    >>> from torch.distributed import HashStore
    >>> from hora.protocol.signedstore import SignedStore
    >>> store = SignedStore(HashStore(), None, "job1", "here").under("hora/job1/g1")
    >>> Arrivals(store, rank=0, size=1).arrive()
    >>> Arrivals(store, rank=0, size=1).wait(1.0)
    ([], {})
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping

import torch.distributed as dist

from hora.errors import StoreAuthError
from hora.protocol import elastic as ep
from hora.protocol import signedstore
from hora.protocol.signedstore import SignedStore

__all__ = ["COUNTER", "Arrivals"]

COUNTER = "arrivals"
_ALL_ARRIVED = "1"


class Arrivals:
    """One rank's part in the barrier of one ``init()``.

    Args:
        store: the job's store under the world's prefix (every value authenticated).
        rank: this rank.
        size: how many ranks must arrive.
    """

    def __init__(self, store: SignedStore, rank: int, size: int) -> None:
        self._store = store
        self.rank = rank
        self.size = size

    def arrive(self) -> None:
        """Mark this rank as arrived; the last one to arrive releases everyone (unless the driver has already
        released them because a member ended: its word stays)."""
        self._store.set(f"arrived/{self.rank}", "1")
        if self._store.add(COUNTER, 1) >= self.size:
            self._store.compare_set(ep.ARRIVALS_RELEASED, "", _ALL_ARRIVED)

    def wait(self, timeout_s: float,
             ended: Callable[[], Mapping[int, str]] | None = None) -> tuple[list[int], dict[int, str]]:
        """Wait until every rank has arrived.

        Args:
            timeout_s: the longest wait (the start timeout).
            ended: the ranks the launcher saw end, with how (``hora run``'s board), read when the driver
                released the wait because a member ended, or after the timeout.

        Returns:
            ``([], {})`` once every rank arrived; the late ranks and the ended ones (with how) when the launcher
            posted that a member ended; the late ranks after ``timeout_s``.
        """
        if not self._released(timeout_s):
            return self.late(), dict(ended()) if ended is not None else {}
        try:
            word = self._store.get(ep.ARRIVALS_RELEASED).decode()
        except StoreAuthError as e:  # a stranger's: a wake-up like any other, what follows is decided below
            signedstore.ignored(e)
            word = ""
        if word == _ALL_ARRIVED:
            return [], {}
        gone = dict(ended()) if ended is not None else {}  # the launcher's authenticated posts decide
        return (self.late() if gone else []), gone

    def _released(self, timeout_s: float) -> bool:
        try:
            self._store.wait([ep.ARRIVALS_RELEASED], datetime.timedelta(seconds=timeout_s))
            return True
        except dist.DistStoreError as e:  # torch's wait timeout; any other store error is not ours to hide
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                return False
            raise

    def late(self) -> list[int]:
        """The ranks that have not arrived (one store operation per rank: read only after a failure)."""
        return [r for r in range(self.size) if not self._store.check([f"arrived/{r}"])]
