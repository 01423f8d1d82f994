"""``ray_logger`` (Horovod's ``horovod.ray.ray_logger``): a worker of an elastic Ray job sends a dict back to the
driver with :func:`log`, and each callback given to the executor's ``run(fn, callbacks=[...])`` is called with it
there, while the job runs.

The executor :func:`configure`\\ s each worker with a Ray queue before its function runs; outside such a job
:func:`log` warns once and drops the dict.

Example (in the worker's function)::

    from horovod.ray import ray_logger
    ray_logger.log({"epoch": epoch, "loss": loss})
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

_queue: Any = None  # this process's queue to the driver (a ray.util.queue.Queue), once configured
_warned = False


def configure(queue: Any) -> None:
    """Send this process's :func:`log` calls to ``queue`` (the executor does it in each worker)."""
    global _queue
    _queue = queue


def log(info: Mapping[str, Any]) -> None:
    """Send ``info`` (picklable values) to the driver's callbacks; outside a job with callbacks, warn once."""
    global _warned
    if _queue is not None:
        _queue.put(dict(info))
    elif not _warned:
        _warned = True
        warnings.warn("ray_logger.log() called outside an elastic Ray job run with callbacks: the dict is dropped",
                      stacklevel=2)
