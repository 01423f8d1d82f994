"""hora on Spark: :func:`run` (Horovod 0.28.1's ``horovod.spark.run``) runs a hora function on Spark barrier
tasks. Spark's own ``TorchDistributor`` needs nothing from here: ``hvd.init()`` in its processes joins the world
it set up (docs/frameworks.md). Horovod's Spark estimators (``TorchEstimator``) are not provided.

Needs PySpark: ``pip install 'hora[spark]'``.
"""

from __future__ import annotations

from hora.launcher.frameworks import require

require("pyspark", "spark", "hora.spark")

from hora.spark.runner import run, run_elastic  # noqa: E402

__all__ = ["run", "run_elastic"]
