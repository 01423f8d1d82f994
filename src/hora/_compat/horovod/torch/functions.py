"""``horovod.torch.functions`` under ``hora run``."""

from __future__ import annotations

from hora.api.functions import (  # noqa: F401
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
