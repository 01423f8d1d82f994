"""``horovod.runner`` under ``hora run``: ``run(func, ...)`` launches a function on every rank (``hora.run``)."""

from __future__ import annotations

from hora.launch.pyrun import run  # noqa: F401
