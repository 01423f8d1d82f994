"""Deterministic per-rank inputs and locally computed expected results for collective tests.

Every rank can compute every other rank's input, so each rank checks its collective's output against a
reference computed in-process with plain torch (no communication).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

import hora as hvd

INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NUMERIC = INTS + FLOATS
ALL = NUMERIC + [torch.bool]


def rank_input(rank: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small values, different on every rank: -2..2 (0..4 unsigned), so sums and products of up to 4 ranks fit
    every dtype exactly."""
    n = 1
    for d in shape:
        n *= d
    v = (torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt * 11 + 1) % 5
    if dtype == torch.bool:
        return (v % 2 == 1).reshape(tuple(shape))
    if dtype != torch.uint8:
        v = v - 2
    return v.to(dtype).reshape(tuple(shape))


_BINARY = {
    hvd.Sum: torch.add,
    hvd.Min: torch.minimum,
    hvd.Max: torch.maximum,
    hvd.Product: torch.mul,
}


def reduce(tensors: Sequence[torch.Tensor], op: hvd.ReduceOp, prescale: float = 1.0,
           postscale: float = 1.0) -> torch.Tensor:
    """What an allreduce of ``tensors`` (one per rank, in rank order) gives, computed locally.

    Arithmetic happens in float64 for floating dtypes (then rounds once), and in the dtype itself for
    integers and bool, as the backends do.
    """
    dtype = tensors[0].dtype
    work = [t.double() * prescale if dtype.is_floating_point else t for t in tensors]
    if op == hvd.Average:
        out = functools.reduce(torch.add, work) / len(work)
    elif dtype == torch.bool and op in (hvd.Min, hvd.Max):
        out = functools.reduce(torch.logical_and if op == hvd.Min else torch.logical_or, work)
    else:
        out = functools.reduce(_BINARY[op], work)
    if dtype.is_floating_point:
        out = out * postscale
    return out.to(dtype)


def split_sizes(n: int, parts: int) -> list[int]:
    """Rows each rank gets when ``n`` rows are split over ``parts`` ranks: the first ``n % parts`` get one extra."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float | None = None,
          rtol: float | None = None) -> None:
    """Equal in dtype, shape and value (floats to the dtype's tolerance); ``what`` names the case on failure."""
    assert isinstance(actual, torch.Tensor), f"{what}: expected a tensor, got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if atol is None and rtol is None and expected.dtype == torch.float16:
        atol, rtol = 1e-5, 2e-3  # two roundings (sum, then scale) may differ by one ulp from one rounding
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def ops_for(dtype: torch.dtype) -> list[hvd.ReduceOp]:
    """The reduce ops that make sense for ``dtype``."""
    if dtype == torch.bool:
        return [hvd.Min, hvd.Max]
    ops = [hvd.Sum, hvd.Min, hvd.Max, hvd.Product]
    return [hvd.Average, *ops] if dtype.is_floating_point else ops


# The first assert_close imports several seconds of modules. Pay that once, in the pytest parent at import,
# so every fork-started rank inherits it instead of paying it again in every test.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
