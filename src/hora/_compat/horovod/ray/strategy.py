"""``horovod.ray.strategy`` on hora: ``create_placement_group`` (a ``TimeoutError`` when the cluster cannot hold it).
Horovod's strategy classes (``ColocatedStrategy``, ``PGStrategy``) are the executor's internals: hora places ranks
in :mod:`hora.ray.placement`."""

from __future__ import annotations

from hora.ray.placement import create_placement_group  # noqa: F401

__all__ = ["create_placement_group"]
