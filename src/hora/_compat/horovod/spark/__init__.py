"""``horovod.spark`` on hora: ``run`` runs a hora function on Spark barrier tasks (needs ``pip install
'hora[spark]'``). Horovod's estimators (``horovod.spark.torch.TorchEstimator``) are not provided."""

from __future__ import annotations

from hora.spark import run, run_elastic  # noqa: F401

__all__ = ["run", "run_elastic"]
