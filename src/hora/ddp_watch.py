"""Noticing a model that is also wrapped in ``DistributedDataParallel``, without scanning the heap.

A DistributedOptimizer whose model is also in DDP must not reduce those gradients a second time. From the
optimizer's creation until its first step, a global module forward pre-hook notes every DDP module that runs
forward (DDP is itself a module, so its own call is seen). The first backward follows the first forward, so
by the optimizer's first step the DDP modules of that forward are known; the hook is then removed and
modules run at full speed (with no global hook, torch takes its fast call path). An optimizer built and never
stepped keeps its watch (one small Python call per module call) until it is garbage-collected.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel


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
