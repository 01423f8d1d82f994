"""Noticing a model that is also wrapped in ``DistributedDataParallel``, without scanning the heap.

A DistributedOptimizer whose model is also in DDP must not reduce those gradients a second time. From the
optimizer's creation until its first step, a global module forward pre-hook notes every DDP module that runs
forward (DDP is itself a module, so its own call is seen). The first backward follows the first forward, so
by the optimizer's first step the DDP modules of that forward are known; the hook is then removed and
modules run at full speed (with no global hook, torch takes its fast call path). An optimizer built and never
stepped keeps its watch (one small Python call per module call) until it is garbage-collected.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)


class DdpWatch:
    """Collects the DDP modules that run forward until :meth:`stop`."""

    def __init__(self) -> None:
        self._seen: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
        seen = self._seen  # the hook holds the set, not the watch: a dropped watch is collected

        def note(module: torch.nn.Module, _inputs: Any) -> None:
            if isinstance(module, DistributedDataParallel):
                seen.add(module)

        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(note)
        weakref.finalize(self, self._handle.remove)

    def stop(self) -> list[DistributedDataParallel]:
        """Remove the hook; the DDP modules seen so far."""
        self._handle.remove()
        return list(self._seen)


def ddp_reduced(modules: list[DistributedDataParallel], params: Sequence[torch.Tensor]) -> dict[int, int]:
    """Which of ``params`` (by position) the DDP ``modules`` already average, each with its DDP world size;
    logs a warning naming how many when there are some."""
    index_of = {id(p): i for i, p in enumerate(params)}
    owned: dict[int, int] = {}
    for module in modules:
        world = module.process_group.size() if module.process_group is not None else 1
        for p in getattr(module, "_module_parameters", None) or list(module.module.parameters()):
            if id(p) in index_of:
                owned[index_of[id(p)]] = world
    if owned:
        log.warning(
            "the model is wrapped in DistributedDataParallel and its optimizer in hora's "
            "DistributedOptimizer: DDP already averages %d of %d parameters' gradients, so hora does not "
            "reduce them again (drop one of the two wrappers to silence this)",
            len(owned), len(params),
        )
    return owned


def undo_ddp_average(params: Sequence[torch.Tensor], owned: dict[int, int]) -> None:
    """Turn DDP's averages back into sums (the DistributedOptimizer was asked for ``op=Sum``)."""
    with torch.no_grad():
        for index, world in owned.items():
            grad = params[index].grad
            if grad is not None:
                grad.mul_(world)
