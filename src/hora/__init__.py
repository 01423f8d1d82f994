"""hora: Horovod's API and launcher, in pure Python, on torch.distributed.

    import hora as hvd
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())          # GPUs only
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

This module only exposes the public names, gathered in :mod:`hora._public` and loaded the first time one of
them is used: ``import hora`` alone imports no torch (the ``hora`` command answers a usage error at once).
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing
from typing import Any as _Any

__version__ = "0.1.0"

if _typing.TYPE_CHECKING:  # the names, for type checkers; at run time they load on first use (below)
    from hora._public import *  # noqa: F403


def _load_public() -> None:
    """Make every public name an attribute of this module (once; later lookups never reach ``__getattr__``)."""
    public = _importlib.import_module("hora._public")
    globals().update({name: value for name, value in vars(public).items()
                      if not name.startswith("_") and name != "annotations"})


def __getattr__(name: str) -> _Any:
    """Every public name on first use (:mod:`hora._public`); ``hvd.elastic`` as in Horovod."""
    if name == "elastic":
        return _importlib.import_module("hora.elastic")
    if not name.startswith("__"):
        _load_public()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module 'hora' has no attribute {name!r}")


def __dir__() -> list[str]:
    _load_public()
    return sorted(globals())
