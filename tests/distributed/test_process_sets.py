"""Process sets: static and dynamic, queries, every collective with ``process_set=``, non-members refused."""

from __future__ import annotations

import pytest
import torch

import hora as hvd
from tests.distributed.expect import close, rank_input, reduce, split_sizes
from tests.distributed.harness import run_ranks


def _every_collective(ps: hvd.ProcessSet, rank: int) -> None:
    """Run every collective on ``ps`` (this rank is a member) and check against the members' inputs."""
    members = ps.ranks
    x = {r: rank_input(r, (3, 2), torch.float32, salt=len(members)) for r in members}
    tag = f"set {members}"
    close(hvd.allreduce(x[rank], op=hvd.Sum, process_set=ps), reduce([x[r] for r in members], hvd.Sum), f"{tag} Sum")
    close(hvd.allreduce(x[rank], process_set=ps), reduce([x[r] for r in members], hvd.Average), f"{tag} Average")
    close(hvd.synchronize(hvd.allreduce_async(x[rank], op=hvd.Max, process_set=ps)),
          reduce([x[r] for r in members], hvd.Max), f"{tag} allreduce_async")
    outs = hvd.grouped_allreduce([x[rank], x[rank] * 2], op=hvd.Sum, process_set=ps)
    close(outs[1], reduce([x[r] * 2 for r in members], hvd.Sum), f"{tag} grouped_allreduce")
    close(hvd.allgather(x[rank], process_set=ps), torch.cat([x[r] for r in members]), f"{tag} allgather")
    root = members[-1]  # a global rank
    close(hvd.broadcast(x[rank], root_rank=root, process_set=ps), x[root], f"{tag} broadcast from {root}")
    n = len(members)
    rows = {r: rank_input(r, (2 * n, 2), torch.float64) for r in members}
    me = ps.rank()
    want = torch.cat([rows[r][2 * me:2 * me + 2] for r in members])
    close(hvd.alltoall(rows[rank], process_set=ps), want, f"{tag} alltoall")
    uneven = {r: rank_input(r, (2 * n + 1, 2), torch.float64) for r in members}
    counts = split_sizes(2 * n + 1, n)
    start = sum(counts[:me])
    close(hvd.reducescatter(uneven[rank], op=hvd.Sum, process_set=ps),
          reduce([uneven[r] for r in members], hvd.Sum)[start:start + counts[me]], f"{tag} reducescatter")
    hvd.barrier(process_set=ps)


def _static(rank: int, size: int) -> dict:
    low, high, solo = hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 2]), hvd.ProcessSet([2])
    hvd.init(process_sets=[low, high, solo])
    try:
        assert hvd.global_process_set.size() == size
        assert hvd.global_process_set.ranks == list(range(size))
        assert hvd.global_process_set.rank() == rank and hvd.global_process_set.included()
        seen = {str(ps.ranks): (ps.size(), ps.rank(), ps.included()) for ps in (low, high, solo)}
        for ps in (low, high, solo):
            if ps.included():
                _every_collective(ps, rank)
        _every_collective(hvd.global_process_set, rank)
        return seen
    finally:
        hvd.shutdown()


def test_static_process_sets() -> None:
    seen = run_ranks(_static, 3, init=False)
    assert seen[0] == {"[0, 1]": (2, 0, True), "[1, 2]": (2, -1, False), "[2]": (1, -1, False)}
    assert seen[1] == {"[0, 1]": (2, 1, True), "[1, 2]": (2, 0, True), "[2]": (1, -1, False)}
    assert seen[2] == {"[0, 1]": (2, -1, False), "[1, 2]": (2, 1, True), "[2]": (1, 0, True)}


def _dynamic(rank: int, size: int) -> list:
    evens = hvd.add_process_set([0, 2])  # a list of ranks
    odds = hvd.add_process_set(hvd.ProcessSet([1, 3]))  # or a ProcessSet
    got = [evens.ranks, evens.size(), evens.rank(), odds.rank()]
    mine = evens if rank % 2 == 0 else odds
    _every_collective(mine, rank)
    # a rank outside the set is refused at once, before any communication
    other = odds if mine is evens else evens
    with pytest.raises(ValueError, match=r"(?i)process.set"):
        hvd.allreduce(torch.ones(2), process_set=other)
    with pytest.raises(ValueError, match=r"(?i)process.set"):
        hvd.allgather(torch.ones(2), process_set=other)
    # broadcast's root must be a member of the set
    with pytest.raises(ValueError, match=r"(?i)root"):
        hvd.broadcast(torch.ones(2), root_rank=other.ranks[0], process_set=mine)
    # a set with the same ranks as an existing one is refused
    with pytest.raises(ValueError):
        hvd.add_process_set([0, 2])
    assert hvd.remove_process_set(evens) is True
    assert hvd.remove_process_set(evens) is False  # already gone
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(2), process_set=evens)  # a removed set cannot be used
    again = hvd.add_process_set([0, 2])  # and can be re-added
    if again.included():
        _every_collective(again, rank)
    got.append(again.ranks)
    assert hvd.remove_process_set(odds) is True
    _every_collective(hvd.global_process_set, rank)
    return got


def test_dynamic_process_sets() -> None:
    results = run_ranks(_dynamic, 4)
    assert results == [
        [[0, 2], 2, 0, -1, [0, 2]],
        [[0, 2], 2, -1, 0, [0, 2]],
        [[0, 2], 2, 1, -1, [0, 2]],
        [[0, 2], 2, -1, 1, [0, 2]],
    ]
