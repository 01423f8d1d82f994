"""Horovod 0.28 parity, issue 11 items 6-11 and issue 17 items 3-4: join with every collective kind, a clean
runtime after errors and shutdown()/init(), a handle pending at shutdown, a failed init, and the
DistributedOptimizer's parameter names, step() warning, sparse gradients and broadcast_optimizer_state.

Each test states the Horovod behaviour it checks; all run real ranks (the fork harness)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import hora as hvd
from hora import runtime
from tests.distributed.expect import close, rank_input, reduce
from tests.distributed.harness import run_ranks


# --- 11.6: join with every collective kind ---------------------------------------------------------------
def _join_every_kind(rank: int, size: int) -> dict:
    x = [rank_input(r, (6, 2), torch.float32) for r in range(size)]
    active = x[1:]  # rank 0 joins first and contributes nothing (zeros to reductions)
    out: dict = {}
    if rank == 0:
        out["join"] = hvd.join()
    else:
        close(hvd.allreduce(x[rank], op=hvd.Sum), reduce(active, hvd.Sum), "allreduce Sum, rank 0 joined")
        close(hvd.allreduce(x[rank], op=hvd.Average), reduce(active, hvd.Sum) / size,
              "allreduce Average divides by the full size")
        close(hvd.allgather(x[rank]), torch.cat(active), "allgather: the joined rank contributes no rows")
        close(hvd.broadcast(x[rank], root_rank=1), x[1], "broadcast from a rank that has not joined")
        rows = reduce(active, hvd.Sum)[2 * rank:2 * rank + 2]
        close(hvd.reducescatter(x[rank], op=hvd.Sum), rows, "reducescatter: the joined rank contributes zeros")
        got, received = hvd.alltoall(x[rank], splits=[2, 2, 2])
        close(got, torch.cat([t[2 * rank:2 * rank + 2] for t in active]), "alltoall: the joined rank sends none")
        assert received.tolist() == [0, 2, 2], received
        outs = hvd.grouped_allgather([x[rank], x[rank][:1]])
        close(outs[1], torch.cat([t[:1] for t in active]), "grouped allgather with a joined rank")
        hvd.barrier()
        # a broadcast whose root has joined cannot run: every waiting rank gets the reason, and the failed
        # unnamed op still takes its sequence slot on the joined rank (the next unnamed ops pair correctly)
        with pytest.raises(hvd.HorovodInternalError, match="root rank 0 already called join"):
            hvd.broadcast(x[rank], root_rank=0)
        if rank == size - 1:  # completes only once every other rank has joined: this rank joins last
            close(hvd.allgather(x[rank]), x[rank], "allgather with every other rank joined")
        out["join"] = hvd.join()
    # after everyone joined: no cascade, unnamed ops of every kind pair as before
    close(hvd.allgather(x[rank]), torch.cat(x), "allgather after join")
    close(hvd.broadcast(x[rank], root_rank=0), x[0], "broadcast after join")
    close(hvd.allreduce(x[rank], op=hvd.Sum), reduce(x, hvd.Sum), "allreduce after join")
    out["second"] = hvd.join()
    return out


def test_join_takes_part_in_every_collective_kind_and_returns_the_last_rank_as_horovod() -> None:
    """Horovod: a joined rank keeps serving the others' allreduce (zeros), allgather (no rows), broadcast
    (receives), reducescatter, alltoall and barrier until every rank has joined; join() returns the last
    rank to join, on every rank."""
    results = run_ranks(_join_every_kind, 3, timeout=60)
    assert [r["join"] for r in results] == [2, 2, 2]
    assert len({r["second"] for r in results}) == 1


# --- 17.3: a handle still pending at shutdown() -----------------------------------------------------------
def _pending_at_shutdown(rank: int, size: int) -> list[str]:
    from tests.distributed.harness import rank_store

    store = rank_store()
    hvd.init()
    seen = []
    if rank == 1:
        mine = hvd.allreduce_async(torch.ones(4), name="only-on-1")
        store.set("leaving", "1")
        hvd.shutdown()  # waits for rank 0's shutdown
    else:
        store.get("leaving")
        neg = runtime.state().negotiator
        while "__shutdown__" not in neg.table.entries:  # rank 1's shutdown request reached this rank
            time.sleep(0.01)
        # make this rank's op and its own shutdown travel in one round (a busy rank's usual case): hold the
        # round while both are queued
        with neg._round_lock:
            mine = hvd.allreduce_async(torch.ones(4), name="only-on-0")
            leaving = threading.Thread(target=hvd.shutdown)
            leaving.start()
            time.sleep(0.5)
        leaving.join()
    with pytest.raises(hvd.HorovodInternalError) as error:
        hvd.synchronize(mine)  # raises on both ranks, now and bounded, instead of waiting forever
    seen.append(str(error.value))
    hvd.init()  # and the next runtime is clean
    seen.append(str(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()))
    hvd.shutdown()
    return seen


def test_a_handle_pending_at_shutdown_fails_on_every_rank_instead_of_hanging() -> None:
    """Horovod fails every outstanding handle at shutdown ("Horovod has been shut down"); hora's synchronize()
    raises on every rank, saying which rank left without submitting the op, and init() starts afresh."""
    results = run_ranks(_pending_at_shutdown, 2, init=False, timeout=30)
    assert "'only-on-0'" in results[0][0] and "rank(s) [1] called shutdown()" in results[0][0]
    assert "'only-on-1'" in results[1][0] and "rank(s) [0] called shutdown()" in results[1][0]
    assert [r[1] for r in results] == ["[2.0, 2.0]"] * 2


# --- 17.4: a failed init() leaves nothing behind ----------------------------------------------------------
def _failed_init(rank: int, size: int) -> list:
    seen = []
    with pytest.raises(ValueError, match=r"ranks \[7\] do not exist"):
        hvd.init(process_sets=[hvd.ProcessSet([0, 7])])
    seen.append(hvd.is_initialized())
    odd = hvd.ProcessSet([0])
    with pytest.raises(ValueError, match="already exists"):  # fails after the groups were built
        hvd.init(process_sets=[odd, hvd.ProcessSet([0, 1])])
    seen.append(hvd.is_initialized())
    seen.append(odd.process_set_id)  # not left registered to a runtime that is gone
    hvd.init(process_sets=[odd])  # a second init works, with the same ProcessSet object
    seen.append(hvd.is_initialized())
    seen.append(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist())
    seen.append(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=odd).tolist() if rank == 0 else None)
    hvd.shutdown()
    hvd.init(process_sets="dynamic")  # Horovod's spelling for "add_process_set() allowed": always so here
    seen.append(hvd.add_process_set([1]).ranks)
    hvd.shutdown()
    return seen


def test_a_failed_init_leaves_nothing_behind_and_init_can_be_retried() -> None:
    """Horovod's init() raises on a process set with ranks the job lacks and is not initialised afterwards;
    hora also undoes a failure after its groups were built, and a retried init() works."""
    results = run_ranks(_failed_init, 2, init=False, timeout=60)
    for rank, seen in enumerate(results):
        assert seen[:4] == [False, False, None, True]
        assert seen[4] == [2.0, 2.0]
        assert seen[5] == ([1.0] if rank == 0 else None)
        assert seen[6] == [1]
