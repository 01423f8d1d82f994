"""``import horovod.torch as hvd`` under ``hora run``: every public name of :mod:`hora`."""

from __future__ import annotations

import importlib as _importlib
from typing import Any as _Any

import hora as _hora

globals().update({_name: getattr(_hora, _name) for _name in dir(_hora) if not _name.startswith("_")})
__version__ = "0.28.1"  # the Horovod API hora implements (see horovod/__init__.py)


def __getattr__(name: str) -> _Any:
    """``hvd.elastic`` (and the other submodules) on first use, as Horovod's package has them."""
    if name in ("elastic", "mpi_ops", "compression", "functions", "optimizer", "sync_batch_norm"):
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
