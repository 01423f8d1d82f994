"""Adasum (Maleki et al., 2020): combine gradients so that orthogonal ones add and parallel ones average.

For two vectors::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

with the dot product and the squared norms in float64, whatever the tensors' dtype. A coefficient stays 1 when
its vector's squared norm is below ``sqrt(DBL_MIN)`` (about 1.5e-154), Horovod 0.28.1's threshold: the pair is
then summed. Only float64 vectors whose values are all below about 1e-77 (or zero) fall under it: the
smallest normal float16, bfloat16 and float32 numbers square to far more. Over ``2^k`` ranks the pairs
combine as a binary tree: ranks differing in bit 0 first, then in bit 1, and so on, which is the order
Horovod's recursive vector-halving uses. ``hvd.allreduce(t, op=hvd.Adasum)`` is its own kind of collective
(:class:`hora.datapath.kinds.Adasum`): one allgather brings every rank's vector and each rank computes the tree locally:
simple, exact, and fine for the gradient sizes Gloo carries. This module is the arithmetic only.

Example:
    >>> import torch
    >>> adasum_pair(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
    tensor([1., 1.])
    >>> adasum_pair(torch.tensor([2.0, 0.0]), torch.tensor([2.0, 0.0]))
    tensor([2., 0.])
"""

from __future__ import annotations

import math
import sys

import torch

from hora.errors import UnsupportedCallError

# Horovod 0.28.1 (common/ops/adasum/adasum.h) skips the rescaling of a vector whose squared norm is below the
# square root of the smallest normal double: below it, the dot product over the squared norm is not trusted.
_NORM_EPS = math.sqrt(sys.float_info.min)


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two vectors (the dot product and squared norms in float64, Horovod's threshold)."""
    a64, b64 = a.double(), b.double()
    dot = torch.dot(a64.reshape(-1), b64.reshape(-1))
    anorm, bnorm = a64.pow(2).sum(), b64.pow(2).sum()
    acoeff = torch.where(anorm >= _NORM_EPS, 1.0 - dot / (2.0 * anorm), torch.ones_like(dot))
    bcoeff = torch.where(bnorm >= _NORM_EPS, 1.0 - dot / (2.0 * bnorm), torch.ones_like(dot))
    return (acoeff * a64 + bcoeff * b64).to(a.dtype)


def adasum_tree(rows: torch.Tensor) -> torch.Tensor:
    """Adasum of the rows of ``rows`` (shape ``(2^k, n)``), paired as a binary tree."""
    count = rows.shape[0]
    if count & (count - 1):
        raise UnsupportedCallError(f"Adasum needs a power-of-two number of ranks, got {count}")
    level = list(rows)
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]
