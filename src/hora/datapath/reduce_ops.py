"""Reduce operations, with Horovod's names and values (``hvd.Average``, ``hvd.Sum``, ...), and the arithmetic of
Average (a sum on the wire, divided by the set's size afterwards)."""

from __future__ import annotations

import enum
import warnings

import torch

from hora.errors import InvalidCallError


class ReduceOp(enum.IntEnum):
    """How an allreduce or reducescatter combines tensors. Values match Horovod's."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


def resolve_op(op: ReduceOp | int | None, average: bool | None) -> ReduceOp:
    """Combine Horovod's ``op=`` and its deprecated ``average=`` into one op (None means Average)."""
    if op is not None and average is not None:
        raise InvalidCallError("pass either op= or the deprecated average=, not both")
    if average is not None:
        warnings.warn("average= is deprecated (as in Horovod since 0.19): pass op=hvd.Average or op=hvd.Sum",
                      DeprecationWarning, stacklevel=4)
        return Average if average else Sum
    if op is None:
        return Average
    if type(op) is ReduceOp:
        return op
    try:
        return ReduceOp(int(op))
    except ValueError:
        raise InvalidCallError(f"unknown reduce op {op!r}; use hvd.Average, Sum, Adasum, Min, Max or Product") from None


# --- Average: a sum, then a division by the set's size. The one place that arithmetic is written: single ops
# (finish_sum), sparse allreduce (average_values) and the DistributedOptimizer's buckets (bucket_scales).

# an integer Average is summed in a type its sum cannot overflow (200 + 100 in uint8 would wrap to 44), then
# divided (truncating) and cast back; int64 has nothing wider: its sum overflows as a Sum would
AVERAGE_WIRE = {torch.uint8: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32,
                torch.int32: torch.int64}


def scale_integers(t: torch.Tensor, factor: float) -> None:
    """Scale an integer tensor in place as Horovod does: multiply in float64, truncate toward zero."""
    t.copy_(t.double().mul_(factor).trunc_())


def finish_sum(result: torch.Tensor, op: int, postscale: float, size: int) -> None:
    """Turn the wire's sum into ``op``'s result, in place: Average divides by ``size`` (the set's full size,
    joined ranks included), then ``postscale`` applies. Integers as Horovod: one float64 factor
    (postscale / size for Average), truncated; a plain Average of integers is a truncating division."""
    if not result.is_floating_point():
        if postscale != 1.0:
            scale_integers(result, postscale / size if op == ReduceOp.AVERAGE else postscale)
        elif op == ReduceOp.AVERAGE:
            result.div_(size, rounding_mode="trunc")
        return
    if op == ReduceOp.AVERAGE:
        result.mul_(postscale / size)
    elif postscale != 1.0:
        result.mul_(postscale)


def float_factor(op: int, postscale: float, size: int) -> float:
    """The one factor :func:`finish_sum` multiplies a floating-point sum by (postscale / size for Average)."""
    return postscale / size if op == ReduceOp.AVERAGE else postscale


def average_values(values: torch.Tensor, op: int, size: int) -> torch.Tensor:
    """A sparse allreduce's gathered values: divided by ``size`` for Average (a new tensor), else as they are."""
    return values / size if op == ReduceOp.AVERAGE else values


def bucket_scales(op: int, size: int, predivide: float, uncompressed: bool) -> tuple[float, float]:
    """Factors a gradient bucket applies on the copy in and on the copy out, so Average costs no extra pass.

    Uncompressed, the whole 1/size goes in (the copy out is then a plain copy). On a compressed wire,
    Horovod's split is kept: 1/predivide before the sum, predivide/size after, so fp16 sums do not overflow or
    underflow more than they would in Horovod.

    >>> bucket_scales(ReduceOp.AVERAGE, 4, 2.0, uncompressed=False)
    (0.5, 0.5)
    """
    if op != ReduceOp.AVERAGE:
        return 1.0, 1.0
    if uncompressed:
        return 1.0 / size, 1.0
    return 1.0 / predivide, predivide / size
