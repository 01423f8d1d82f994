"""hora's stand-in for the ``horovod`` package (only on PYTHONPATH under ``hora run``, without real Horovod)."""

from __future__ import annotations

from hora import __version__  # noqa: F401
