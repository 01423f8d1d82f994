"""``horovod.ray.elastic_v2`` on hora: Ray's nodes as a host discovery (``RayExecutor(min_workers=...)`` uses it)."""

from __future__ import annotations

from hora.ray.elastic import ElasticParams, RayHostDiscovery  # noqa: F401

__all__ = ["ElasticParams", "RayHostDiscovery"]
