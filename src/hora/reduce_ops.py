"""Reduce operations, with Horovod's names and values (``hvd.Average``, ``hvd.Sum``, ...)."""

from __future__ import annotations

import enum
import warnings

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
