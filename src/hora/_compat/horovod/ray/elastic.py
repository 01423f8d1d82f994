"""``horovod.ray.elastic`` on hora: the older elastic executor and Ray's nodes as a host discovery."""

from __future__ import annotations

from hora.ray.elastic import RayHostDiscovery  # noqa: F401
from hora.ray.executor import ElasticRayExecutor  # noqa: F401

__all__ = ["ElasticRayExecutor", "RayHostDiscovery"]
