"""Tensor fusion: small allreduces that become ready together run as one, in a reused flat buffer.

Fusion is decided from what the members agreed on alone (the requests of a round, never local state), so every
rank, including a rank that has joined and only contributes zeros, issues exactly the same c10d calls. A fused
buffer is allreduced as one single allreduce is (:func:`hora.datapath.kinds.allreduce_flat`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hora.datapath import streams
from hora.datapath.c10d import to_dtype, wire_op
from hora.datapath.kinds import Kind, Request, allreduce_flat
from hora.datapath.reduce_ops import ReduceOp

MAX_FUSED_TENSOR_BYTES = 1 << 20  # larger tensors run alone: fusion would only add copies
INLINE_MAX_BYTES = 64  # allreduces this small travel inside the negotiation round itself


def request_nbytes(req: Request) -> int:
    """Bytes of the tensor a request describes (0 for requests without a tensor, e.g. shutdown)."""
    dtype = getattr(torch, req.dtype, None) if req.dtype else None
    if not isinstance(dtype, torch.dtype):
        return 0
    return int(torch.Size(req.shape).numel()) * dtype.itemsize


def _key(req: Request, threshold: int) -> tuple[object, ...] | None:
    if req.kind != Kind.ALLREDUCE or threshold <= 0 or request_nbytes(req) > min(threshold, MAX_FUSED_TENSOR_BYTES):
        return None
    return (req.dtype, int(wire_op(req.op)), req.ps, req.device)


def plan_batches(ready: Sequence[Request], threshold: int) -> list[list[int]]:
    """Group consecutive fusable allreduces (same dtype, wire op, process set, device) up to ``threshold``
    bytes; everything else is a batch of one. Order is kept; each batch is the indices of its requests."""
    if len(ready) < 2:  # the steady state of a synchronous loop: nothing to fuse
        return [[0]] if ready else []
    batches: list[list[int]] = []
    current: list[int] = []
    current_key: tuple[object, ...] | None = None
    current_bytes = 0
    for i, req in enumerate(ready):
        key = _key(req, threshold)
        size = request_nbytes(req) if key is not None else 0
        if key is not None and key == current_key and current_bytes + size <= threshold:
            current.append(i)
            current_bytes += size
            continue
        if current:
            batches.append(current)
        current, current_key, current_bytes = [i], key, size
    if current:
        batches.append(current)
    return batches


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

    def allreduce(self, wires: Sequence[torch.Tensor | None], requests: Sequence[Request], group: Any) -> None:
        """Reduce ``wires`` in place as one allreduce; a None wire (a joined rank) contributes zeros."""
        req = requests[0]
        sizes = [int(torch.Size(r.shape).numel()) for r in requests]
        flat = self._get(to_dtype(req.dtype), req.device, sum(sizes))
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
        allreduce_flat(flat, req.op, group).wait()
        offset = 0
        for wire, n in zip(wires, sizes):
            if wire is not None:
                wire.view(-1).copy_(flat[offset : offset + n]) if wire.is_contiguous() else wire.copy_(
                    flat[offset : offset + n].view_as(wire))
            offset += n


def inline_bytes(req: Request, wire: torch.Tensor | None) -> bytes | None:
    """The data of a tiny CPU allreduce, to send with its request (None when it goes on the data plane)."""
    if wire is None or req.kind != Kind.ALLREDUCE or req.device != "cpu":
        return None
    size = wire.numel() * wire.element_size()
    if size > INLINE_MAX_BYTES:
        return None
    return wire.reshape(-1).view(torch.uint8).numpy().tobytes() if size else b""


def reduce_inline(req: Request, inline: Mapping[int, bytes]) -> torch.Tensor:
    """Reduce the members' inline data (rank -> bytes) in rank order (the same arithmetic on every rank); a
    joined member contributes zeros, as it does on the data plane."""
    dtype = to_dtype(req.dtype)
    if torch.Size(req.shape).numel() == 0:
        return torch.empty(req.shape, dtype=dtype)
    zeros = torch.zeros(req.shape, dtype=dtype).reshape(-1)  # what a joined member contributes
    parts = [torch.frombuffer(bytearray(inline[r]), dtype=torch.uint8).view(dtype) if r in inline
             else zeros for r in req.ps]
    stacked = torch.stack(parts) if parts else torch.zeros((1, 0), dtype=dtype)
    op = ReduceOp(req.op)
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        out = stacked[0].clone()
        for part in stacked[1:]:
            out += part
    elif op == ReduceOp.PRODUCT:
        out = stacked[0].clone()
        for part in stacked[1:]:
            out *= part
    elif op == ReduceOp.MIN:
        out = stacked.amin(0)
    else:
        out = stacked.amax(0)
    return out.reshape(req.shape)
