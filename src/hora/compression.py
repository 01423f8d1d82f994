"""Gradient compression: a compressor is any object with ``compress`` and ``decompress``.

``compress(tensor) -> (compressed, ctx)`` and ``decompress(compressed, ctx) -> tensor``. hora ships
``Compression.none``, ``Compression.fp16`` (Horovod's) and ``Compression.bf16`` (hora's; same range as
fp32, so no overflow on large gradients).

Example:
    >>> import torch
    >>> c, ctx = Compression.fp16.compress(torch.ones(2))
    >>> c.dtype, Compression.fp16.decompress(c, ctx).dtype
    (torch.float16, torch.float32)
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Compressor(Protocol):
    """What hora needs of a compressor."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class NoneCompressor:
    """Leaves tensors as they are. ``str()`` gives its name, ``none``."""

    name = "none"

    def __repr__(self) -> str:
        return "Compression.none"

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class CastCompressor:
    """Casts floating-point tensors to ``wire_dtype`` for the wire and back afterwards.

    ``wire_dtype`` is what crosses the network; integer tensors pass through untouched.
    """

    def __init__(self, wire_dtype: torch.dtype) -> None:
        self.wire_dtype = wire_dtype

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point() and tensor.dtype != self.wire_dtype:
            return tensor.to(self.wire_dtype), tensor.dtype
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)

    @property
    def name(self) -> str:
        """``fp16``, ``bf16``, or the wire dtype's name for another cast."""
        return _CAST_NAMES.get(self.wire_dtype, str(self.wire_dtype).replace("torch.", ""))

    def __repr__(self) -> str:
        return f"Compression.{self.name}" if self.wire_dtype in _CAST_NAMES else f"CastCompressor({self.wire_dtype})"

    def __str__(self) -> str:
        return self.name


_CAST_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class Compression:
    """Horovod's namespace of built-in compressors."""

    none: Compressor = NoneCompressor()
    fp16: Compressor = CastCompressor(torch.float16)
    bf16: Compressor = CastCompressor(torch.bfloat16)


def wire_dtype(compression: Compressor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` has on the wire under ``compression`` (for preallocating buffers)."""
    if isinstance(compression, CastCompressor) and dtype.is_floating_point:
        return compression.wire_dtype
    return dtype
