"""The fork harness of the distributed tests: :mod:`hora.testing` (shared with the benchmarks).

Example:
    >>> def fn(rank, size):
    ...     return hvd.allreduce(torch.tensor([rank]), op=hvd.Sum).item()
    >>> run_ranks(fn, 2)  # doctest: +SKIP
    [1, 1]
"""

from __future__ import annotations

from hora.testing import FAILURE_GRACE_S, rank_store, run_ranks

__all__ = ["FAILURE_GRACE_S", "rank_store", "run_ranks"]
