"""Matching by name, and bad calls: local errors at once, cross-rank mismatches on every rank, job goes on."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

import hora as hvd
from tests.distributed.expect import close, rank_input, reduce
from tests.distributed.harness import rank_store, run_ranks


def _out_of_order(rank: int, size: int) -> None:
    names = [f"op{i}" for i in range(6)]
    order = names if rank % 2 == 0 else names[::-1]
    x = {n: [rank_input(r, (i + 2,), torch.float32, salt=i) for r in range(size)] for i, n in enumerate(names)}
    handles = {}
    for n in order:
        if n == "op4":
            handles[n] = hvd.allgather_async(x[n][rank], name=n)
        elif n == "op5":
            handles[n] = hvd.broadcast_async(x[n][rank], root_rank=size - 1, name=n)
        else:
            handles[n] = hvd.allreduce_async(x[n][rank], op=hvd.Sum, name=n)
    for n in reversed(order):  # finish in yet another order
        out = hvd.synchronize(handles[n])
        if n == "op4":
            close(out, torch.cat(x[n]), n)
        elif n == "op5":
            close(out, x[n][size - 1], n)
        else:
            close(out, reduce(x[n], hvd.Sum), n)
    # unnamed ops keep working next to named ones
    close(hvd.allreduce(x["op0"][rank], op=hvd.Sum), reduce(x["op0"], hvd.Sum), "unnamed after named")


@pytest.mark.parametrize("nprocs,plane", [(2, "tcp"), (3, "tcp"), (3, "gloo")])
def test_named_async_ops_in_different_orders_on_each_rank(nprocs: int, plane: str) -> None:
    run_ranks(_out_of_order, nprocs, env={"HORA_CONTROL_PLANE": plane})


def _local_errors(rank: int, size: int) -> None:
    store = rank_store()
    if rank == 0:
        # each must fail at once on this rank alone: the other ranks never submit these
        with pytest.raises((TypeError, ValueError), match=r"(?i)complex64|dtype"):
            hvd.allreduce(torch.ones(3, dtype=torch.complex64))
        with pytest.raises(ValueError, match=r"(?i)contiguous"):
            hvd.allreduce(torch.ones(4, 3).t())
        with pytest.raises(ValueError, match=r"(?i)contiguous"):
            hvd.allgather(torch.ones(4, 3).t())
        for root in (size, -1):
            with pytest.raises(ValueError, match=r"(?i)root"):
                hvd.broadcast(torch.ones(3), root_rank=root)
        with pytest.raises(ValueError, match=r"(?i)split"):
            hvd.alltoall(torch.ones(1), splits=[1] * size)  # splits add up to more than dim 0
        with pytest.raises(ValueError, match=r"(?i)op|reduce"):
            hvd.allreduce(torch.ones(3), op=99)
        # a name still in flight on this rank
        h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="dup")
        with pytest.raises(ValueError, match="dup"):
            hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="dup")
        store.set("checked", "1")
    else:
        store.get("checked")  # submit "dup" only after rank 0 tried it twice
        h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="dup")
    close(hvd.synchronize(h), torch.full((3,), float(size)), "the in-flight op still completes")
    # the name is free again once finished
    close(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="dup"), torch.full((3,), float(size)), "name reused")


def test_bad_calls_fail_at_once_on_the_calling_rank() -> None:
    run_ranks(_local_errors, 2)


def _rejected_then_unnamed(rank: int, size: int) -> list[float]:
    bad = rank == 0  # rejected locally on one rank only; the user catches it and carries on
    calls = [(lambda: hvd.allreduce(torch.ones(4, 3).t() if bad else torch.ones(3, 4)), ValueError, "contiguous"),
             (lambda: hvd.allreduce(torch.ones(3, dtype=torch.complex64 if bad else torch.float32)), TypeError,
              "complex64"),
             (lambda: hvd.broadcast(torch.ones(3), root_rank=size if bad else 0), ValueError, "root")]
    for call, error, reason in calls:
        # the rejected call still takes its place in the sequence: the peer's matching call fails with the reason
        with pytest.raises(error if bad else hvd.PeerRejectedCallError, match=reason):
            call()
    return [hvd.allreduce(torch.ones(1), op=hvd.Sum).item() for _ in range(2)]


def test_a_call_rejected_on_one_rank_does_not_desync_unnamed_ops() -> None:
    """More cases in test_sequence_drift.py."""
    assert run_ranks(_rejected_then_unnamed, 2, timeout=10) == [[2.0, 2.0]] * 2


def _mismatch(rank: int, what: str, call: Callable[[], object]) -> dict:
    hvd.barrier()  # time the detection, not how late a loaded machine starts the other ranks
    start = time.monotonic()
    with pytest.raises(hvd.CollectiveMismatchError) as info:
        call()
    took = time.monotonic() - start
    err = info.value
    # a contract (issue 2, point 5), not a speed figure: a mismatch must surface, never hang
    assert took < 5.0, f"{what}: CollectiveMismatchError after {took:.1f} s"
    return {"what": what, "name": err.name, "ranks": sorted(err.per_rank), "fields": list(err.fields),
            "descs": [err.per_rank[r] for r in sorted(err.per_rank)], "msg": str(err)}


def _mismatches(rank: int, size: int) -> list[dict]:
    ones = torch.ones(4)
    other = hvd.add_process_set([0, 1]) if size > 2 else None
    cases: list[tuple[str, Callable[[], object]]] = [
        ("shape", lambda: hvd.allreduce(torch.ones(4 + rank), name="m.shape")),
        ("dtype", lambda: hvd.allreduce(torch.ones(4, dtype=torch.float32 if rank else torch.float64), name="m.dtype")),
        ("kind", lambda: (hvd.allreduce if rank else hvd.allgather)(ones, name="m.kind")),
        ("op", lambda: hvd.allreduce(ones, op=hvd.Sum if rank else hvd.Max, name="m.op")),
        ("root", lambda: hvd.broadcast(ones, root_rank=rank % 2, name="m.root")),
        ("prescale", lambda: hvd.allreduce(ones, prescale_factor=1.0 + rank, name="m.pre")),
        ("postscale", lambda: hvd.allreduce(ones, postscale_factor=1.0 + rank, name="m.post")),
        ("async", lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(2 + rank), name="m.async"))),
    ]
    if other is not None:
        cases.append(("process set", lambda: hvd.allreduce(
            ones, name="m.ps", process_set=other if rank == 1 else hvd.global_process_set)))
    seen = []
    for what, call in cases:
        seen.append(_mismatch(rank, what, call))
        # the job goes on: the next collective works
        close(hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum), torch.full((2,), float(sum(range(size)))),
              f"allreduce after a {what} mismatch")
    return seen


@pytest.mark.parametrize("nprocs,plane", [(2, "tcp"), (3, "tcp"), (3, "gloo")])
def test_mismatched_metadata_raises_on_every_rank_and_the_job_goes_on(nprocs: int, plane: str) -> None:
    results = run_ranks(_mismatches, nprocs, env={"HORA_CONTROL_PLANE": plane})
    expected_fields = {"shape": ("shape",), "dtype": ("dtype",), "kind": ("kind",), "op": ("op",),
                       "root": ("root",), "prescale": ("prescale",), "postscale": ("postscale",),
                       "async": ("shape",), "process set": ("process", "ps")}
    for rank, seen in enumerate(results):
        assert [s["what"] for s in seen] == list(expected_fields)[:len(seen)]
        for s in seen:
            assert s["ranks"] == list(range(nprocs)), f"rank {rank}: every rank's request is named: {s['msg']}"
            assert any(w in f for w in expected_fields[s["what"]] for f in s["fields"]), f"rank {rank}: {s}"
            assert len(set(s["descs"])) > 1, f"rank {rank}: each rank's description is shown: {s['msg']}"
            assert all(f"rank {r}:" in s["msg"] for r in s["ranks"]), s["msg"]
        same = ("what", "name", "ranks", "fields", "descs")
        assert [{k: s[k] for k in same} for s in seen] == [{k: s[k] for k in same} for s in results[0]], \
            "every rank reports the same mismatch"
