"""The wire buffer: what a collective sends and receives in place of the caller's tensor.

A call's wire is its tensor, or a copy of it when the caller's tensor must stay untouched, or a cast of it:
for a dtype the backends lack (:func:`to_wire`, cast back by :func:`from_wire`), for an integer Average (summed
wide), or for compression. :func:`copy_out` gives an in-place call's result back in the caller's tensor. A
request names its wire's dtype as :func:`dtype_name` spells it; :func:`to_dtype` reads it back.

Compression: a compressor is any object with ``compress(tensor) -> (compressed, ctx)`` and
``decompress(compressed, ctx) -> tensor``. hora ships ``Compression.none``, ``Compression.fp16`` (Horovod's)
and ``Compression.bf16`` (hora's; same range as fp32, so no overflow on large gradients).

The built-in casts of large CPU tensors (>= 1 MiB on the wire) do not allocate a 16-bit tensor per call: the
wire is a buffer taken from the runtime's :class:`WireBuffers` (``Runtime.wire_buffers``, one per ``init()``,
handed to each op) and given back when the op finishes, so a training loop's
compressed allreduces reuse the same memory (a fresh tensor above 32 MB is new pages from the kernel, page
faults and all, every time). :func:`cast_scaled` casts back, then divides (Average) in float32.

Example:
    >>> import torch
    >>> c, ctx = Compression.fp16.compress(torch.ones(2))
    >>> c.dtype, Compression.fp16.decompress(c, ctx).dtype
    (torch.float16, torch.float32)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Protocol, runtime_checkable

import torch

from hora.datapath import c10d as dataplane
from hora.datapath.reduce_ops import AVERAGE_WIRE, ReduceOp


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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: how a request names its tensor's dtype."""
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def wire_dtype(compression: Compressor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` has on the wire under ``compression`` (for preallocating buffers)."""
    if isinstance(compression, CastCompressor) and dtype.is_floating_point:
        return compression.wire_dtype
    return dtype


# --- the wire of a call ---------------------------------------------------------------------------------------
# dtypes the backends lack travel as a wider type and are cast back when the op finishes
WIRE_CAST = {torch.int16: torch.int32}


def to_wire(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """``t`` as the collective sends it: its own storage, a copy (``copy``), or a wider type the backends have."""
    t = t.detach()  # same storage; autograd is handled by hora.api.ops' Functions, never on the wire
    cast = WIRE_CAST.get(t.dtype)
    if cast is not None:
        return t.to(cast)
    return t.clone() if copy else t


def from_wire(result: torch.Tensor, dtype: torch.dtype, reduce_op: ReduceOp) -> torch.Tensor:
    """A result in the caller's ``dtype`` again when the wire had widened it (:data:`WIRE_CAST`, an integer
    Average); any other difference is the compressor's to undo."""
    if result.dtype == dtype:
        return result
    widened = dtype in WIRE_CAST or (reduce_op == ReduceOp.AVERAGE and dtype in AVERAGE_WIRE)
    return result.to(dtype) if widened else result


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` is ``b``'s storage seen through another tensor object (e.g. ``b.detach()``)."""
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape


def copy_out(result: torch.Tensor, tensor: torch.Tensor, inplace: bool) -> torch.Tensor:
    """The user's result: ``result``, or for an in-place call the caller's ``tensor`` holding it."""
    if not inplace:
        return result
    if not same_memory(result, tensor):  # the wire was a copy (cast, compression)
        tensor.copy_(result)
    return tensor


# --- reused wire buffers ---------------------------------------------------------------------------------------
POOL_MIN_BYTES = 2 << 20  # smaller wires come from the allocator's reused heap (and may be fused): nothing to gain
PIPELINE_BYTES = 2 << 20  # a 16-bit CPU allreduce goes in pieces of at least this many bytes...
PIPELINE_MAX = 8  # ...and at most this many pieces
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


class WireBuffers:
    """Idle flat wire buffers, kept for the next call of the same dtype and size (CPU only).

    ``take`` hands out an idle buffer or a new one; ``give`` takes it back once the op has finished with it.
    A buffer that is never given back (a failed op, a handle never synchronized) is simply freed by Python.
    At most ``per_size`` idle buffers of one (dtype, size) are kept, for the ``sizes`` most recently used
    sizes: bounded memory however many shapes a program reduces.

    Example:
        >>> pool = WireBuffers()
        >>> a = pool.take(torch.float16, 4); pool.give(a)
        >>> pool.take(torch.float16, 4).data_ptr() == a.data_ptr(), pool.allocated
        (True, 1)
    """

    def __init__(self, per_size: int = 2, sizes: int = 8) -> None:
        self.per_size = per_size
        self.sizes = sizes
        self.allocated = 0  # buffers made so far (tests and diagnostics: it stops growing in a steady loop)
        self._idle: OrderedDict[tuple[torch.dtype, int], list[torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat CPU buffer of ``numel`` elements of ``dtype`` (its content is garbage)."""
        key = (dtype, numel)
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                buf = idle.pop()
                if not idle:
                    del self._idle[key]
                return buf
            self.allocated += 1
        return torch.empty(numel, dtype=dtype)

    def give(self, buf: torch.Tensor) -> None:
        """Take back a buffer from :meth:`take`; the caller no longer uses it."""
        key = (buf.dtype, buf.numel())
        with self._lock:
            idle = self._idle.setdefault(key, [])
            self._idle.move_to_end(key)
            if len(idle) < self.per_size:
                idle.append(buf)
            while len(self._idle) > self.sizes:
                self._idle.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()


def lease_wire(compression: Compressor, tensor: torch.Tensor, pool: WireBuffers) -> torch.Tensor | None:
    """For a built-in cast of a large contiguous CPU float tensor: a reused flat buffer of the wire dtype from
    ``pool`` to cast it into (give it back to ``pool`` when done). None for everything else, which goes
    through ``compression.compress`` as usual."""
    if (type(compression) is not CastCompressor or tensor.device.type != "cpu" or not tensor.is_floating_point()
            or tensor.dtype == compression.wire_dtype or not tensor.is_contiguous()):
        return None
    numel = tensor.numel()
    if numel * compression.wire_dtype.itemsize < POOL_MIN_BYTES:
        return None
    return pool.take(compression.wire_dtype, numel)


def cast_scaled(src: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
    """``out[...] = src * scale``: a cast into ``out``'s dtype, then the scaling there (for a 16-bit wire cast
    back to float32: the float32 product, rounded once, more precise than scaling the 16-bit values); one
    pass when the dtypes are the same.

    Two whole-tensor torch calls, never a Python loop over chunks: in a rank, hora's background threads take
    the GIL between calls, so each call of such a loop waits behind them
    (docs/performance.md, "The measurements behind design choices").
    ``src`` and ``out`` have the same number of elements.
    """
    src = src.view(out.shape) if src.is_contiguous() else src.reshape(out.shape)
    if scale != 1.0 and src.dtype == out.dtype:
        torch.mul(src, scale, out=out)  # one pass
        return
    out.copy_(src)
    if scale != 1.0:
        out.mul_(scale)


def pipeline_ranges(numel: int, dtype: torch.dtype, device: str) -> list[tuple[int, int]]:
    """The pieces (start, stop) a CPU allreduce of a 16-bit wire of ``numel`` elements is issued in: one c10d
    allreduce each, so the cast of one piece overlaps the wire of another. Decided from what every rank's
    request says (dtype, shape, device) alone, never from local state, so every rank, a joined one included,
    issues the same calls.

    >>> pipeline_ranges(10, torch.float16, "cpu")
    [(0, 10)]
    >>> len(pipeline_ranges(50 * 2**20 // 2, torch.float16, "cpu")), len(pipeline_ranges(2**22, torch.float32, "cpu"))
    (8, 1)
    """
    if dtype in SIXTEEN_BIT and device == "cpu":
        return dataplane.pieces(numel, dtype.itemsize, PIPELINE_BYTES, PIPELINE_MAX)
    return [(0, numel)]
