"""``horovod.ray.runner`` on hora: the executor and the coordinator that numbers the ranks by Ray node."""

from __future__ import annotations

from hora.ray import BaseHorovodWorker, MiniSettings, RayExecutor  # noqa: F401
from hora.ray.placement import Coordinator  # noqa: F401

__all__ = ["BaseHorovodWorker", "Coordinator", "MiniSettings", "RayExecutor"]
