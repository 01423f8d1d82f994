"""The CPU side of an allreduce: what hora does to the bytes besides sending them, timed on this host.

A wire model (alpha-beta) predicts a bare in-place allreduce; hora's other allreduces also copy, cast and
scale the data on the CPU, before or after the wire (a large compressed one in pieces beside it: :func:`pieces`,
:func:`with_wire`):

* out-of-place (``hvd.allreduce``): the input is copied into a fresh wire tensor;
* compression (``fp16``/``bf16``): a cast of the float32 input down into a reused 16-bit buffer
  (the runtime's :class:`hora.datapath.wire.WireBuffers`), and a cast of the result back up, then Average's division
  (:func:`hora.datapath.wire.cast_scaled`): into a fresh tensor out of place, into the caller's tensor in place;
* Average, uncompressed: one multiply of the wire tensor.

A fresh tensor of more than 32 MB is new memory from the kernel (glibc serves it with mmap), so the copy and the
out-of-place cast back also pay the page faults of touching it: sweep up to 64 MB for rates that include them.
The DistributedOptimizer reuses its buckets: its gradients are copied (or cast) into them during backward
whatever the compression, so it pays none of these (``call="bucket"``). The 16-bit sum itself is Gloo's, on
the wire: :mod:`hora.bench.planner` fits it as a 16-bit wire from a sweep run with ``--compression``.

``hora bench allreduce`` times each of these on every rank before the sweep (:func:`measure`, at the sweep's
largest size up to 64 MB) and stores the slowest rank's rates in its JSON; ``hora bench plan`` adds them to
the wire time (:func:`extra_seconds`).

Example:
    >>> rates = CpuRates(copy=1e-10, cast_down=2e-10, cast_up=2e-10, scale=1e-10)
    >>> round(extra_seconds(rates, 100e6, ranks=2, compression="fp16", call="out_of_place", average=True) * 1e3, 1)
    40.0
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from hora.datapath.wire import POOL_MIN_BYTES, cast_scaled, pipeline_ranges

__all__ = ["CpuRates", "extra_seconds", "measure", "pieces", "with_wire"]


@dataclass(frozen=True)
class CpuRates:
    """Seconds per byte (of the float32 tensor) of each local pass."""

    copy: float  # clone of a float32 tensor (a fresh tensor)
    cast_down: float  # float32 -> 16-bit, into a reused buffer
    cast_up: float  # 16-bit -> float32 and scaled, into a fresh tensor (an out-of-place result)
    scale: float  # in-place multiply
    cast_up_into: float = -1.0  # 16-bit -> float32 and scaled, into an existing tensor; -1: as cast_up

    def __post_init__(self) -> None:
        if self.cast_up_into < 0:  # a record from before it was timed
            object.__setattr__(self, "cast_up_into", self.cast_up)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CpuRates:
        return cls(**{f.name: float(data[f.name]) for f in fields(cls) if f.name in data})

    def slowest(self, other: CpuRates) -> CpuRates:
        return CpuRates(**{f.name: max(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(nbytes: int = 64 * 2**20, repeats: int = 3) -> CpuRates:
    """Time each pass on a ``nbytes`` float32 tensor on this host (median of ``repeats``), as hora does it."""
    x = torch.randn(nbytes // 4)
    half = x.to(torch.float16)
    into = torch.empty_like(x)
    scaled = x.clone()
    n = float(x.numel() * 4)
    return CpuRates(copy=_median_seconds(x.clone, repeats) / n,
                    cast_down=_median_seconds(lambda: half.copy_(x), repeats) / n,
                    cast_up=_median_seconds(lambda: cast_scaled(half, torch.empty_like(x), 0.5), repeats) / n,
                    scale=_median_seconds(lambda: scaled.mul_(1.0), repeats) / n,
                    cast_up_into=_median_seconds(lambda: cast_scaled(half, into, 0.5), repeats) / n)


def extra_seconds(rates: CpuRates, nbytes: float, ranks: int, compression: str = "none", call: str = "inplace",
                  average: bool = False) -> float:
    """CPU seconds hora adds to the wire time of an allreduce of ``nbytes`` (float32) on ``ranks`` ranks.

    ``call``: ``inplace`` (``hvd.allreduce_``), ``out_of_place`` (``hvd.allreduce``: a fresh result) or
    ``bucket`` (the DistributedOptimizer: gradients are copied into a reused bucket during backward whatever
    the compression; a compressed bucket only changes that copy into a cast).
    """
    if ranks < 2 or call == "bucket":
        return 0.0
    if compression != "none":  # cast down into a reused buffer; cast back, then the division
        return nbytes * (rates.cast_down + (rates.cast_up if call == "out_of_place" else rates.cast_up_into))
    extra = nbytes * rates.copy if call == "out_of_place" else 0.0
    if average:
        extra += nbytes * rates.scale
    return extra


def pieces(nbytes: float, compression: str = "none", call: str = "inplace") -> int:
    """How many pieces hora sends a compressed allreduce of ``nbytes`` (float32) in, its casts overlapping the
    wire (:func:`hora.datapath.wire.pipeline_ranges`); 1 where the casts are serial with the wire."""
    if compression == "none" or call == "bucket" or nbytes / 2 < POOL_MIN_BYTES:
        return 1
    return len(pipeline_ranges(int(nbytes // 4), torch.float16, "cpu"))


def with_wire(wire_s: float, extra_s: float, k: int) -> float:
    """The time of an allreduce whose ``extra_s`` of CPU passes run in ``k`` pieces beside ``wire_s`` of wire:
    whichever is longer, plus one piece of the casts that cannot overlap (the first cast down, the last cast
    back). ``k = 1``: the two in series.

    >>> with_wire(1.0, 0.4, 1), with_wire(1.0, 0.4, 8)
    (1.4, 1.05)
    """
    return wire_s + extra_s if k <= 1 else max(wire_s, extra_s) + extra_s / k
