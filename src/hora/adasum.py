"""Adasum (Maleki et al., 2020): combine gradients so that orthogonal ones add and parallel ones average.

For two vectors::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient stays 1 when its vector's squared norm is below 1e-8, as in Horovod). Over ``2^k`` ranks
the pairs combine as a binary tree: ranks differing in bit 0 first, then in bit 1, and so on, which is the
order Horovod's recursive vector-halving uses. ``hvd.allreduce(t, op=hvd.Adasum)`` is its own kind of
collective (:class:`hora.kinds.Adasum`): one allgather brings every rank's vector and each rank computes the
tree locally: simple, exact, and fine for the gradient sizes Gloo carries. This module is the arithmetic only.

Example:
    >>> import torch
    >>> adasum_pair(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
    tensor([1., 1.])
    >>> adasum_pair(torch.tensor([2.0, 0.0]), torch.tensor([2.0, 0.0]))
    tensor([2., 0.])
"""

from __future__ import annotations

import torch

from hora.errors import UnsupportedCallError

_NORM_EPS = 1e-8


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two vectors (dot products in float64)."""
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
