"""Process sets: collectives over a subset of ranks, built on c10d subgroups.

Example:
    >>> evens = hvd.ProcessSet([0, 2])          # doctest: +SKIP
    >>> hvd.init(process_sets=[evens])          # doctest: +SKIP
    >>> if evens.included():                    # doctest: +SKIP
    ...     hvd.allreduce(t, process_set=evens)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)


class ProcessSet:
    """A set of global ranks that run collectives together.

    Args:
        ranks: the global ranks in the set (sorted; duplicates are an error). The global process set is built
            by ``init()`` and covers every rank.
    """

    def __init__(self, ranks: Iterable[int] | None = None) -> None:
        self.ranks: list[int] = sorted(int(r) for r in ranks) if ranks is not None else []
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ProcessSet ranks {self.ranks} contain duplicates")
        self.process_set_id: int | None = None
        self.group: ProcessGroup | None = None  # hora's data-plane c10d group for this set
        self._my_rank: int = -1

    def _bind(self, set_id: int, group: Any, my_rank: int) -> None:
        self.process_set_id = set_id
        self.group = group
        self._my_rank = my_rank

    def _check_registered(self) -> None:
        if self.process_set_id is None:
            raise ValueError(
                f"{self!r} is not registered: pass it to hvd.init(process_sets=[...]) or hvd.add_process_set()"
            )

    def size(self) -> int:
        """Number of ranks in the set."""
        self._check_registered()
        return len(self.ranks)

    def rank(self) -> int:
        """This process's index in the set, or -1 when it is not a member."""
        self._check_registered()
        return self.ranks.index(self._my_rank) if self._my_rank in self.ranks else -1

    def included(self) -> bool:
        """True when this process is a member."""
        self._check_registered()
        return self._my_rank in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


# The global process set object is created once and rebound on every init(), so a reference taken at import
# time (`from hora import global_process_set`) stays valid across shutdown()/init().
global_process_set = ProcessSet()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set. Every rank must call this, in the same order (a collective).

    Args:
        process_set: a ProcessSet or a list of global ranks.

    Returns:
        The registered ProcessSet.
    """
    from hora import runtime

    return runtime.state("add_process_set()").register_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set. Every rank must call this, in the same order.

    Returns:
        True when the set was registered and is now removed.
    """
    from hora import runtime

    return runtime.state("remove_process_set()").unregister_process_set(process_set)
