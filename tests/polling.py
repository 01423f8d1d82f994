"""The one polling helper of the suite: wait for a condition by asking it again, never by sleeping a fixed time.

Where the code under test offers an event (a ``threading.Event``, a process's ``wait(timeout)``, a blocking
read with a deadline), wait on that instead; poll only what can only be asked (a file another process writes,
a line in a log, a store key).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, step: float = 0.02,
               unless: Callable[[], object] | None = None) -> T:
    """Ask ``predicate`` every ``step`` seconds until it returns something true, for at most ``timeout`` seconds;
    return its last answer (so ``assert wait_until(...)`` fails when the time ran out, and a found value is
    returned).

    ``unless``: give up as soon as it returns something true, e.g. ``lambda: proc.poll() is not None`` (a
    launcher that ended will never write the line waited for); the predicate is asked once more after it, so
    what the ended process left behind still counts.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        if unless is not None and unless():
            return predicate()
        time.sleep(step)
