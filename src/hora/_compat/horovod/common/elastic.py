"""``horovod.common.elastic`` under ``hora run``: the states, the notification manager and ``run_fn``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hora.elastic.loop import run
from hora.elastic.notifications import notification_manager  # noqa: F401
from hora.elastic.state import ObjectState, State  # noqa: F401


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Horovod's framework-neutral retry loop; ``reset`` (its framework's shutdown-and-init) is hora's own."""
    return run(func)
