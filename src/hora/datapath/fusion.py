"""Tensor fusion's buffer: small allreduces that became ready together run as one, in a reused flat buffer.

Which allreduces go together is the engine's decision (:func:`hora.engine.scheduling.dispatch.plan_batches`), made from
what the members agreed on alone, so every rank, including a rank that has joined and only contributes zeros,
issues exactly the same c10d calls. A fused buffer is allreduced as one single allreduce is
(:func:`hora.datapath.kinds.reductions.allreduce_flat`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hora.datapath import streams
from hora.datapath.hierarchical import Hierarchy
from hora.datapath.kinds.reductions import allreduce_flat


class FusionBuffers:
    """One growable flat buffer per (dtype, device), reused by every fused allreduce."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self._buffers: dict[tuple[torch.dtype, str], torch.Tensor] = {}

    def _get(self, dtype: torch.dtype, device: str, numel: int) -> torch.Tensor:
        buf = self._buffers.get((dtype, device))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1024), dtype=dtype, device=device)
            self._buffers[(dtype, device)] = buf
        return buf[:numel]

    def allreduce(self, wires: Sequence[torch.Tensor | None], sizes: Sequence[int], dtype: torch.dtype, device: str,
                  reduce_op: int, group: Any, hierarchy: Hierarchy | None) -> None:
        """Reduce ``wires`` (of ``sizes`` elements each) in place as one allreduce (through ``hierarchy`` when
        one was built); a None wire (a joined rank) contributes zeros."""
        flat = self._get(dtype, device, sum(sizes))
        if flat.is_cuda:  # the copies below run on the launch stream; the wires were made on the callers'
            stream = torch.cuda.current_stream(flat.device)
            for wire in wires:
                if wire is not None:
                    streams.used_on(wire, stream)
        offset = 0
        for wire, n in zip(wires, sizes):
            if wire is None:
                flat[offset : offset + n].zero_()
            else:
                flat[offset : offset + n].copy_(wire.reshape(-1))
            offset += n
        allreduce_flat(flat, reduce_op, group, hierarchy).wait()
        offset = 0
        for wire, n in zip(wires, sizes):
            if wire is not None:
                wire.view(-1).copy_(flat[offset : offset + n]) if wire.is_contiguous() else wire.copy_(
                    flat[offset : offset + n].view_as(wire))
            offset += n
