"""The negotiator's one timer thread: re-armable deadlines kept in a heap, callbacks run on that thread.

Two deadlines use it (see :mod:`hora.engine.scheduling.negotiator`): the stall check (fires while this rank is idle and
a collective it waits in is overdue) and the listen timer (ends the short deaf spell after a round ran on a
caller's thread). Each is a :class:`Timer` with at most one deadline armed at a time; arming it again
replaces that deadline. Nothing runs while nothing is armed.

Re-arming to a *later* deadline (the steady state: every idle period re-arms the stall check a little later)
does not wake the thread: it wakes at the old deadline, sees the newer one, and sleeps on. Only an *earlier*
deadline notifies it. Callbacks must be short and must not block (they take locks with ``blocking=False``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def _never(arg: int) -> None:
    """The callback of a stopped timer."""


class Timer:
    """One re-armable deadline on a :class:`TimerThread`: ``arm(delay, arg)`` calls ``fire(arg)`` on the timer
    thread once ``delay`` seconds pass, unless re-armed or disarmed first."""

    __slots__ = ("_owner", "arg", "deadline", "fire", "queued")

    def __init__(self, owner: TimerThread, fire: Callable[[int], None]) -> None:
        self._owner = owner
        self.fire = fire
        self.deadline: float | None = None  # the armed deadline (time.monotonic()), None when disarmed
        self.arg = 0
        self.queued = math.inf  # the earliest deadline this timer has in the heap (inf: none)

    def arm(self, delay_s: float, arg: int) -> None:
        self._owner._arm(self, time.monotonic() + max(delay_s, 0.0), arg)

    def disarm(self) -> None:
        with self._owner._cond:
            self.deadline = None


class TimerThread:
    """The heap of armed deadlines and the one thread that waits for the earliest (module docstring)."""

    def __init__(self, name: str = "hora-timers") -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()  # ties in the heap never compare Timers
        self._sleep_until = math.inf  # what the thread sleeps until; an earlier deadline must notify it
        self._stopped = False
        self._timers: list[Timer] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def timer(self, fire: Callable[[int], None]) -> Timer:
        timer = Timer(self, fire)
        self._timers.append(timer)
        return timer

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float = 1.0) -> None:
        """End the thread (armed deadlines are dropped) and wait up to ``join_s`` for it. The timers forget
        their callbacks, so an owner they point back to is freed at once, not at the next garbage collection
        (its sockets and process groups with it)."""
        with self._cond:
            self._stopped = True
            self._heap.clear()
            for timer in self._timers:
                timer.deadline, timer.fire = None, _never
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    def _arm(self, timer: Timer, deadline: float, arg: int) -> None:
        with self._cond:
            timer.deadline, timer.arg = deadline, arg
            if deadline < timer.queued:  # a later deadline reuses the entry already queued (see _run)
                timer.queued = deadline
                heapq.heappush(self._heap, (deadline, next(self._order), timer))
                if deadline < self._sleep_until:
                    self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                due = self._next_due()
                if due is None:
                    return
            timer, arg = due
            try:
                timer.fire(arg)
            except Exception:  # a timer's failure must not end the others
                log.exception("hora timer callback %r failed", timer.fire)

    def _next_due(self) -> tuple[Timer, int] | None:
        """Wait (lock held) until some timer's armed deadline passes; None once stopped."""
        while not self._stopped:
            if not self._heap:
                self._sleep_until = math.inf
                self._cond.wait()
                continue
            queued, _, timer = self._heap[0]
            now = time.monotonic()
            if queued > now:
                self._sleep_until = queued
                self._cond.wait(queued - now)
                continue
            heapq.heappop(self._heap)
            timer.queued = math.inf
            if timer.deadline is None:
                continue  # disarmed
            if timer.deadline > now:  # re-armed later since this entry was queued: queue the new deadline
                timer.queued = timer.deadline
                heapq.heappush(self._heap, (timer.deadline, next(self._order), timer))
                continue
            timer.deadline = None
            return timer, timer.arg
        return None
