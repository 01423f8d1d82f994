"""The fork harness of the distributed tests: :mod:`hora.testing` (shared with the benchmarks).

Example:
    >>> def fn(rank, size):
    ...     return hvd.allreduce(torch.tensor([rank]), op=hvd.Sum).item()
    >>> run_ranks(fn, 2)  # doctest: +SKIP
    [1, 1]
"""

from __future__ import annotations

import os

from hora.testing import FAILURE_GRACE_S, rank_store, run_ranks

__all__ = ["FAILURE_GRACE_S", "as_host", "rank_store", "run_ranks"]


def as_host(rank: int, per_host: list[int], hierarchical: str) -> None:
    """Set a forked rank's launcher variables as hora run would for ``per_host[h]`` ranks on "host" h (before
    ``hvd.init()``), with ``HOROVOD_HIERARCHICAL_ALLREDUCE=hierarchical``."""
    host, first = 0, 0
    while rank >= first + per_host[host]:
        first += per_host[host]
        host += 1
    os.environ.update({"HORA_HOST_KEY": f"host{host}", "HORA_LOCAL_RANK": str(rank - first),
                       "HORA_LOCAL_SIZE": str(per_host[host]), "HORA_CROSS_RANK": str(host),
                       "HORA_CROSS_SIZE": str(len(per_host)), "HOROVOD_HIERARCHICAL_ALLREDUCE": hierarchical})
