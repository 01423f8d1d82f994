"""``horovod.ray.worker`` on hora: the actor class of one rank."""

from __future__ import annotations

from hora.ray.worker import BaseHorovodWorker  # noqa: F401

__all__ = ["BaseHorovodWorker"]
