"""``horovod.spark.common.util`` on hora: ``host_hash``, the key ``horovod.spark.run`` groups ranks by."""

from __future__ import annotations

from hora.spark.task import host_hash  # noqa: F401

__all__ = ["host_hash"]
