"""``horovod.torch.mpi_ops`` under ``hora run``: the collectives and basics, as ``horovod.torch`` has them."""

from __future__ import annotations

from typing import Any as _Any

import hora as _hora
from hora.datapath.reduce_ops import resolve_op as _resolve_op

globals().update({_name: getattr(_hora, _name) for _name in dir(_hora) if not _name.startswith("_")})


def handle_average_backwards_compatibility(op: _Any, average: _Any) -> _Any:
    """Horovod's helper for the deprecated ``average=`` argument: the op to use (Average when neither)."""
    return _resolve_op(op, average)
