"""A rank that dies while the others wait for it is noticed at once (its control connections close, or the
death watch sees it), even when no collective is touching it: the waiting ranks get HorovodInternalError
naming the lost rank, not a hang."""

from __future__ import annotations

import time

import pytest
import torch

import hora as hvd
from tests.distributed.harness import run_ranks


def _one_rank_leaves(rank: int, size: int) -> str:
    hvd.init()
    hvd.allreduce(torch.ones(1), name="before")
    if rank == 1:
        time.sleep(0.5)  # the others are already waiting for "after" when this process exits
        return "left"
    start = time.monotonic()
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(torch.ones(1), name="after")  # rank 1 never submits it
    took = time.monotonic() - start
    assert took < 20, f"noticed the lost rank only after {took:.1f} s"  # a deadline, not a speed figure
    return str(info.value)


@pytest.mark.parametrize("plane", ["tcp", "gloo"])  # the mesh sees the loss itself; gloo has the death watch
def test_waiting_ranks_learn_which_rank_is_gone(plane: str) -> None:
    results = run_ranks(_one_rank_leaves, 3, timeout=60, init=False,  # rank 1 exits without shutdown()
                        env={"HORA_CONTROL_PLANE": plane})
    assert results[1] == "left"
    for message in (results[0], results[2]):
        assert "rank 1 on host" in message and "is gone" in message, message


def _one_rank_shuts_down(rank: int, size: int) -> str:
    hvd.allreduce(torch.ones(1), name="before")
    if rank == 1:
        return "shut down"  # the harness calls hvd.shutdown() now, while ranks 0 and 2 wait for "after"
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(torch.ones(1), name="after")
    return str(info.value)


def test_a_rank_shutting_down_fails_what_waits_for_it() -> None:
    results = run_ranks(_one_rank_shuts_down, 3, timeout=60)
    assert results[1] == "shut down"
    for message in (results[0], results[2]):
        assert "rank(s) [1] called shutdown() without submitting it" in message, message
        assert message.endswith("(uneven data), call hvd.join() after the training loop."), message
