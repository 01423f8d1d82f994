"""Notices: a value one rank announces, handed to every rank at the same numbered notice point.

A *notice point* is a call every rank makes the same number of times, in the same order relative to its
collectives (``hvd.elastic``'s ``commit()`` / ``check_host_updates()``). It costs a lock and a counter: no
message, no store read. A rank *announces* a value (``Negotiator.announce``; in an elastic job rank 0's
watcher of the launcher's host updates does); the value rides in that rank's next round's flags, and
:meth:`Notices.notice_point` returns it on every rank at the same notice point.

The agreement takes two rounds. Round numbers and every round's gathered frames are the same on every rank.

1. Round A carries the announcement. Processing it, every rank *arms*: under the lock, it stops letting
   notice points pass and puts ``p_r``, the number of notice points it has passed, in its frame of round A+1.
2. Round A+1 carries every rank's ``p_r`` (each rank sends the flags pending after round A in its next
   round, which is A+1 everywhere; flags make it start at once). Every rank computes the same target
   ``T = max(p_0, ..., p_n-1, last target) + 1`` and disarms.

Notices travel on *channels* (``"elastic"``: host updates at ``commit()``; ``"autotune"``: settings at the
optimizer's step boundary): a notice point of one channel returns that channel's values only, and a value that
came due at a notice point of another channel waits for its channel's next notice point. Every rank makes the
same sequence of notice points, so that is the same call on every rank too. A listener of a channel (``listen``)
also gets each value on the thread running the round that carried the announcement (round A, the same round on
every rank), for what must change at the same round everywhere rather than at a notice point.

Proof that every rank returns the value at its notice point number ``T`` and at no other: a notice point passes
(adds one to the count) only under the lock and only while the rank is not armed, and arming reads ``p_r``
under the same lock, so no rank passes a notice point between arming and the decision: when ``T`` is decided
each rank has passed ``p_r <= T - 1`` notice points. Later passes count ``p_r + 1, p_r + 2, ...`` one by one,
so exactly one of them is number ``T``: there every rank gets the value (every rank makes the same calls;
a rank that makes no more notice points never gets it, nor does any other). Targets only grow, so notices
come out in the order they were decided. A notice point reached while armed waits for round A+1 (one round
trip; in a training loop round A+1 is usually over before the next notice point); if negotiation breaks
meanwhile, it raises the negotiator's error.

Example:
    >>> import threading
    >>> from hora.engine.scheduling.pending import Pending
    >>> pending = Pending(0)
    >>> notices = Notices(pending, wake=lambda: None)
    >>> notices.on_round([{"notice": [["elastic", "hello"]]}])   # round A: rank 0's announcement; this rank arms
    >>> pending.flags["passed"]
    0
    >>> notices.on_round([pending.flags])            # round A+1: every rank's count; target 1
    >>> notices.notice_point()
    ['hello']
    >>> notices.notice_point()
    []
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.engine.scheduling.pending import Pending
from hora.errors import CollectiveError

NOTICE = "notice"  # round flag: [channel, value] pairs this rank announces
PASSED = "passed"  # round flag: how many notice points this rank had passed when it armed
_WAIT_S = 1.0  # a waiting notice point looks at the negotiator's state this often


class Notices:
    """The notices of one negotiator (one world); see the module docstring.

    Args:
        pending: the rank's pending ops; its lock guards the notices too, and its flags carry them.
        wake: rings the negotiator thread (called with ``pending.lock`` held) when a notice point waits.
    """

    def __init__(self, pending: Pending, wake: Callable[[], None]) -> None:
        self._pending = pending
        self._cond = threading.Condition(pending.lock)
        self._wake = wake
        self._passed = 0  # notice points this rank has passed
        self._armed: list[Any] | None = None  # values announced in round A, while round A+1 is due
        self._due: list[tuple[int, list[Any]]] = []  # (notice point number, [channel, value] pairs), increasing
        self._mailbox: dict[str, list[Any]] = {}  # channel -> values due, waiting for that channel's notice point
        self._listeners: dict[str, Callable[[Any], None]] = {}
        self._last_target = 0
        self._error: BaseException | None = None

    def listen(self, channel: str, listener: Callable[[Any], None] | None) -> None:
        """Call ``listener(value)`` for each value announced on ``channel``, on the thread running the round that
        carries it (the same round on every rank); None stops it. It must not block."""
        with self._cond:
            if listener is None:
                self._listeners.pop(channel, None)
            else:
                self._listeners[channel] = listener

    def notice_point(self, channel: str = "elastic") -> list[Any]:
        """Pass one notice point of ``channel`` (a caller's thread): that channel's values whose agreed notice
        point this is or was ([] mostly).

        Raises:
            CollectiveError: negotiation broke while this notice point waited for an agreement.
        """
        with self._cond:
            while self._armed is not None:
                if self._error is not None:
                    raise CollectiveError(f"hora could not agree on a notice: {self._error}") from self._error
                self._wake()
                self._cond.wait(_WAIT_S)
            self._passed += 1
            while self._due and self._due[0][0] <= self._passed:
                for name, value in self._due.pop(0)[1]:
                    self._mailbox.setdefault(str(name), []).append(value)
            return self._mailbox.pop(channel, [])

    def on_round(self, flags: Sequence[Mapping[str, Any]]) -> None:
        """A round's flags, every rank's in rank order (the thread running the round): decide round A+1's
        target, then arm for the values announced in this round."""
        with self._cond:
            if self._armed is not None:
                if any(PASSED not in f for f in flags):  # the two-round rule is broken: a bug, say where
                    raise AssertionError(f"the round after a notice lacks notice point counts: {list(flags)}")
                target = max(max(int(f[PASSED]) for f in flags), self._last_target) + 1
                self._due.append((target, self._armed))
                self._last_target, self._armed = target, None
                self._cond.notify_all()
            announced = [v for f in flags for v in f.get(NOTICE, ())]
            if announced:
                self._armed = announced
                self._pending.flags[PASSED] = self._passed
                for name, value in announced:
                    listener = self._listeners.get(str(name))
                    if listener is not None:
                        listener(value)

    def fail(self, error: BaseException) -> None:
        """Negotiation is over: a notice point waiting for an agreement raises ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()
