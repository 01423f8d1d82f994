"""An idle hora process waits for work without burning CPU (no polling negotiator, no busy loop)."""

from __future__ import annotations

import time

import torch

import hora as hvd
from tests.distributed.harness import run_ranks


def _idle_cpu(rank: int, size: int) -> float:
    hvd.allreduce(torch.ones(4), name="warm")  # the negotiator has run rounds and is now idle
    if rank == 0:  # leave a pending op behind too: the stall watchdog must sleep, not poll
        handle = hvd.allreduce_async(torch.ones(1), name="late")
    before = time.process_time()  # CPU seconds of every thread of this process
    time.sleep(2.0)
    used = time.process_time() - before
    if rank == 1:
        handle = hvd.allreduce_async(torch.ones(1), name="late")
    hvd.synchronize(handle)
    return used


def test_idle_ranks_use_no_cpu() -> None:
    for used in run_ranks(_idle_cpu, 2):
        assert used < 0.2, f"an idle rank used {used:.3f} s of CPU in 2 s"
