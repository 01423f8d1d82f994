"""hora on Ray: :class:`RayExecutor` (Horovod 0.28.1's ``horovod.ray.RayExecutor``) runs hora functions on Ray
actors. Ray Train's ``TorchTrainer`` needs nothing from here: ``hvd.init()`` in its workers joins the world Ray
set up (docs/frameworks.md).

Needs Ray: ``pip install 'hora[ray]'``.
"""

from __future__ import annotations

from hora.launcher.frameworks import require

require("ray", "ray", "hora.ray")

from hora.ray.executor import ElasticRayExecutor, MiniSettings, RayExecutor  # noqa: E402
from hora.ray.worker import BaseHorovodWorker  # noqa: E402

__all__ = ["BaseHorovodWorker", "ElasticRayExecutor", "MiniSettings", "RayExecutor"]
