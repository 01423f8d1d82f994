"""``horovod.torch.elastic.state`` under ``hora run``: :mod:`hora.elastic.state` (TorchState, the handlers and
their registry)."""

from __future__ import annotations

from hora.elastic.state import (  # noqa: F401
    ModelStateHandler,
    OptimizerStateHandler,
    SamplerStateHandler,
    StateHandler,
    TorchState,
    get_handler_registry,
    set_handler_registry,
)
