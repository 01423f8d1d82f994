"""The one polling helper of the suite: wait for a condition by asking it again, never by sleeping a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, step: float = 0.02) -> T:
    """Ask ``predicate`` every ``step`` seconds until it returns something true, for at most ``timeout`` seconds;
    return its last answer (so ``assert wait_until(...)`` fails when the time ran out, and a found value is
    returned)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(step)
