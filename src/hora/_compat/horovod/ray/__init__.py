"""``horovod.ray`` on hora: ``RayExecutor`` runs hora functions on Ray actors (needs ``pip install 'hora[ray]'``)."""

from __future__ import annotations

from hora.ray import BaseHorovodWorker, ElasticRayExecutor, RayExecutor  # noqa: F401

__all__ = ["BaseHorovodWorker", "ElasticRayExecutor", "RayExecutor"]
