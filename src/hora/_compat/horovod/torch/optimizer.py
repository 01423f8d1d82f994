"""``horovod.torch.optimizer`` under ``hora run``."""

from __future__ import annotations

from hora.training.optimizer import DistributedOptimizer  # noqa: F401
