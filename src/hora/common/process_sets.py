"""Process sets: collectives over a subset of ranks, built on c10d subgroups.

:class:`ProcessSetTable` is the one place sets are registered (checked, given an id and a c10d group) and
unbound again; ``hvd.add_process_set()`` / ``remove_process_set()`` (in :mod:`hora.runtime.lifecycle`) and
``hvd.init(process_sets=...)`` go through it.

Example:
    >>> evens = hvd.ProcessSet([0, 2])          # doctest: +SKIP
    >>> hvd.init(process_sets=[evens])          # doctest: +SKIP
    >>> if evens.included():                    # doctest: +SKIP
    ...     hvd.allreduce(t, process_set=evens)
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

from hora.common import env as hora_env
from hora.errors import ConfigError

log = logging.getLogger(__name__)


class ProcessSet:
    """A set of global ranks that run collectives together.

    Args:
        ranks: the global ranks in the set (sorted; duplicates are an error). The global process set is built
            by ``init()`` and covers every rank.
    """

    def __init__(self, ranks: Iterable[int] | None = None) -> None:
        if hasattr(ranks, "Get_rank") and hasattr(ranks, "Get_size"):  # Horovod's ProcessSet(mpi4py_comm)
            raise ConfigError("ProcessSet(comm): an MPI communicator selects the ranks in Horovod; hora has no MPI: "
                              "pass the global ranks instead, e.g. hvd.ProcessSet([0, 1])")
        self.ranks: list[int] = sorted(int(r) for r in ranks) if ranks is not None else []
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ProcessSet ranks {self.ranks} contain duplicates")
        self.process_set_id: int | None = None
        self.group: dist.ProcessGroup | None = None  # hora's data-plane c10d group for this set
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


class ProcessSetTable(dict[int, ProcessSet]):
    """The process sets of one ``init()``, by id (0: the global set, which covers every rank).

    Registering is collective: every rank registers the same sets in the same order (``dist.new_group``).
    """

    def __init__(self, size: int, rank: int, backend: str, lazy_connect: bool = False, gloo_iface: str = "",
                 timeout: datetime.timedelta | None = None) -> None:
        super().__init__()
        self.size, self.rank, self.backend = size, rank, backend
        self.lazy_connect = lazy_connect  # HORA_GLOO_LAZY_CONNECT: a set's Gloo group connects pairs at first use
        self.gloo_iface = gloo_iface  # HOROVOD_GLOO_IFACE: the network interface of the sets' Gloo groups
        self.timeout = timeout  # one collective's deadline on these groups (HORA_COLLECTIVE_TIMEOUT); None: torch's
        self._next_id = 1

    def new_group(self, ranks: Sequence[int] | None = None) -> Any:
        """A c10d group of hora's data plane over ``ranks`` (None: every rank), with this table's backend and
        timeout, made as hora's groups are (:func:`hora.common.env.torch_groups_of_hora`). Collective: every
        rank calls it, in the same order, members or not."""
        with hora_env.torch_groups_of_hora(self.lazy_connect, self.gloo_iface):
            return dist.new_group(ranks=list(ranks) if ranks is not None else None, backend=self.backend,
                                  timeout=self.timeout)

    @staticmethod
    def check(sets: Sequence[Any], size: int) -> None:
        """Refuse a bad ``init(process_sets=...)`` list before anything is built (every rank passes the same)."""
        seen: list[list[int]] = []
        for ps in sets:
            if not isinstance(ps, ProcessSet):
                raise TypeError(f"hvd.init(process_sets=...) takes hvd.ProcessSet objects, got {ps!r}")
            bad = [r for r in ps.ranks if not 0 <= r < size]
            if bad or not ps.ranks:
                raise ValueError(f"hvd.init(process_sets=...): {ps!r} must hold a non-empty subset of the ranks "
                                 f"0..{size - 1} (this job has {size}); ranks {bad} do not exist")
            if ps.ranks in seen:
                raise ValueError(f"hvd.init(process_sets=...): ranks {ps.ranks} are listed twice")
            seen.append(ps.ranks)

    def add_global(self, group: Any) -> None:
        """Bind :data:`global_process_set` (the object users imported) to this init's ``group``."""
        global_process_set.ranks = list(range(self.size))
        global_process_set._bind(0, group, self.rank)
        self[0] = global_process_set

    def register(self, ps: ProcessSet | Sequence[int]) -> ProcessSet:
        """Give ``ps`` (or a new set of these ranks) the next id and its own c10d group."""
        ps = ps if isinstance(ps, ProcessSet) else ProcessSet(ps)
        if ps.process_set_id is not None and self.get(ps.process_set_id) is ps:
            raise ValueError(f"{ps!r} is already registered")
        bad = [r for r in ps.ranks if not 0 <= r < self.size]
        if bad or not ps.ranks:
            raise ValueError(f"process set ranks {ps.ranks} must be a non-empty subset of 0..{self.size - 1}")
        for other in self.values():
            if other.ranks == ps.ranks:
                raise ValueError(f"a process set with ranks {ps.ranks} already exists: {other!r}")
        group = self.new_group(ps.ranks)
        ps._bind(self._next_id, group, self.rank)
        self[self._next_id] = ps
        self._next_id += 1
        return ps

    def unregister(self, ps: ProcessSet) -> bool:
        """Remove ``ps`` and destroy its group; False when it was not registered here."""
        if ps is global_process_set:
            raise ValueError("the global process set cannot be removed")
        if ps.process_set_id is None or self.get(ps.process_set_id) is not ps:
            return False
        del self[ps.process_set_id]
        if ps.group is not None and ps.included():
            dist.destroy_process_group(ps.group)
        _unbind(ps)
        return True

    def unbind_all(self) -> None:
        """Forget every set, the global one included (``shutdown()``, a failed ``init()``); their groups go
        with the default group or are destroyed by the caller."""
        for ps in list(self.values()):
            _unbind(ps)
        _unbind(global_process_set)
        self.clear()

    def sequence_id(self, ps: ProcessSet) -> int | None:
        """The registered set whose sequence of unnamed ops ``ps`` uses: itself, or (not registered: a
        ProcessSet made but never added, on every rank alike) the registered set with the same ranks."""
        sid = getattr(ps, "process_set_id", None)
        if sid is not None and self.get(sid) is ps:
            return int(sid)
        ranks = list(getattr(ps, "ranks", None) or ())
        return next((i for i, other in self.items() if other.ranks == ranks), None)


def _unbind(ps: ProcessSet) -> None:
    if ps is global_process_set:
        ps.ranks = []
    ps._bind(None, None, -1)  # type: ignore[arg-type]
    ps.process_set_id = None
