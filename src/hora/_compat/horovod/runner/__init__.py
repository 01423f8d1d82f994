"""``horovod.runner`` under ``hora run``: ``run(func, ...)`` launches a function on every rank (``hora.run``)."""

from __future__ import annotations

from hora.launcher.pyfunc.run import run  # noqa: F401
