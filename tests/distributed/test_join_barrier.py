"""barrier and join: joined ranks contribute zeros, Average still divides by the full size."""

from __future__ import annotations

import time

import torch

import hora as hvd
from tests.distributed.expect import close, rank_input, reduce
from tests.distributed.harness import rank_store, run_ranks


def _barrier(rank: int, size: int) -> list[bool]:
    store = rank_store()
    seen = []
    for step in range(3):
        if rank == step % size:
            time.sleep(0.3)  # the others reach the barrier first and must wait for this rank
            store.set(f"before-{step}", "1")
        assert hvd.barrier() is None
        seen.append(store.check([f"before-{step}"]))
    return seen


def test_barrier_waits_for_every_rank() -> None:
    assert run_ranks(_barrier, 3) == [[True] * 3] * 3


def _join(rank: int, size: int) -> tuple[int, int]:
    x = [rank_input(r, (4,), torch.float64) for r in range(size)]
    ints = [rank_input(r, (2, 2), torch.int32) for r in range(size)]
    if rank == 0:
        first = hvd.join()  # joins at once: contributes zeros to the others' allreduces
    else:
        close(hvd.allreduce(x[rank], op=hvd.Sum, name="sum"), reduce(x[1:], hvd.Sum), "Sum with rank 0 joined")
        close(hvd.allreduce(x[rank], op=hvd.Average, name="avg"), reduce(x[1:], hvd.Sum) / size,
              "Average with rank 0 joined divides by the full size")
        close(hvd.allreduce(ints[rank], op=hvd.Sum, name="ints"), reduce(ints[1:], hvd.Sum), "int Sum with a join")
        outs = hvd.grouped_allreduce([x[rank], ints[rank]], op=hvd.Sum, name="grp")
        close(outs[0], reduce(x[1:], hvd.Sum), "grouped allreduce with a join")
        if rank == size - 1:
            # completes only once every other rank has joined, so this rank is the last to join
            close(hvd.allreduce(x[rank], op=hvd.Sum, name="solo"), x[rank], "Sum with all other ranks joined")
        first = hvd.join()
    # after everyone joined, collectives work as before and a second join works too
    close(hvd.allreduce(x[rank], op=hvd.Sum, name="after"), reduce(x, hvd.Sum), "allreduce after join")
    second = hvd.join()
    return first, second


def test_join_contributes_zeros_and_returns_the_last_rank() -> None:
    results = run_ranks(_join, 3)
    assert [r[0] for r in results] == [2, 2, 2]  # the last rank to join, the same on every rank
    assert len({r[1] for r in results}) == 1 and results[0][1] in (0, 1, 2)


def _unnamed_after_join(rank: int, size: int) -> None:
    x = [rank_input(r, (4,), torch.float64) for r in range(size)]
    if rank != 0:
        close(hvd.allreduce(x[rank], op=hvd.Sum), reduce(x[1:], hvd.Sum), "unnamed Sum with rank 0 joined")
    hvd.join()
    # rank 0 took part in the unnamed op above (with zeros): the next unnamed op must match on every rank
    close(hvd.allreduce(x[rank], op=hvd.Sum), reduce(x, hvd.Sum), "unnamed allreduce after join")


def test_unnamed_ops_after_join_still_match() -> None:
    run_ranks(_unnamed_after_join, 3, timeout=15)


def _adasum_after_join(rank: int, size: int) -> str:
    message = ""
    if rank == 1:
        hvd.join()
    else:
        try:  # Adasum's tree needs every member's vector: a joined rank has none to give
            hvd.allreduce(torch.ones(3), op=hvd.Adasum, name="ada")
        except hvd.HoraError as e:
            message = str(e)
        hvd.join()
    close(hvd.allreduce(torch.ones(2), op=hvd.Adasum, name="ada2"), torch.ones(2), "Adasum once all are back")
    return message


def test_adasum_while_a_rank_has_joined_fails_saying_so() -> None:
    messages = run_ranks(_adasum_after_join, 2, timeout=20)
    assert "adasum 'ada' cannot run: rank(s) [1] already called join()" in messages[0], messages[0]
