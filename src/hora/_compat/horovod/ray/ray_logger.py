"""``horovod.ray.ray_logger`` on hora: ``log(dict)`` in a worker reaches the callbacks given to ``run``."""

from __future__ import annotations

from hora.ray.ray_logger import configure, log  # noqa: F401

__all__ = ["configure", "log"]
