"""Horovod 0.28 parity, behaviour by behaviour (issue 11 items 1-5).

Each test names the Horovod behaviour it holds hora to. The facts come from Horovod 0.28.1's
``horovod/torch/mpi_ops.py`` (the autograd Functions' ``backward``), its C++ core (how integer tensors are
scaled, what ``EnqueueTensorAlltoall`` refuses) and its own test suite (which exception type each bad call
raises, as ``test_torch.py`` catches them).
"""

from __future__ import annotations

import pytest
import torch

import hora as hvd
from tests.distributed.expect import close, rank_input, split_sizes
from tests.distributed.harness import run_ranks


def _evens(size: int) -> hvd.ProcessSet:
    return hvd.add_process_set([r for r in range(size) if r % 2 == 0])


# --- item 1: autograd through the grouped ops ----------------------------------------------------------------
def _grouped_autograd(rank: int, size: int) -> None:
    # Horovod's test_horovod_grouped_allreduce_grad: backward through each output in turn, ones upstream
    for op, want in ((hvd.Sum, float(size)), (hvd.Average, 1.0)):
        xs = [rank_input(rank, (3, 2), torch.float64, salt=i).requires_grad_() for i in range(3)]
        for out in hvd.grouped_allreduce(xs, op=op):
            out.backward(torch.ones_like(out))
        for i, x in enumerate(xs):
            close(x.grad, torch.full((3, 2), want, dtype=torch.float64), f"grouped_allreduce {op.name} grad #{i}")

    evens = _evens(size)
    if evens.included():  # one loss over every output; factors and a process set carry into the backward
        n = evens.size()
        xs = [rank_input(rank, (4,), torch.float32, salt=i).requires_grad_() for i in range(2)]
        outs = hvd.grouped_allreduce(xs, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, process_set=evens)
        (outs[0].sum() + 2 * outs[1].sum()).backward()
        close(xs[0].grad, torch.full((4,), 1.5 * n), "grouped_allreduce grad with factors on a process set")
        close(xs[1].grad, torch.full((4,), 3.0 * n), "grouped_allreduce grad, second output weighted 2")

    # Horovod's test_horovod_grouped_allgather_grad: rank r gives r + 1 rows; upstream rows of rank r hold r,
    # the same on every rank; the backward averages the upstream over ranks, so each rank gets its own value
    rows = [r + 1 for r in range(size)]
    upstream = torch.cat([torch.full((rows[r], 2), float(r)) for r in range(size)])
    xs = [torch.zeros(rows[rank], 2, requires_grad=True) for _ in range(2)]
    ints = torch.arange(rows[rank])  # a tensor that needs no grad may sit in the same group
    outs = hvd.grouped_allgather([xs[0], ints, xs[1]])
    close(outs[1], torch.cat([torch.arange(n) for n in rows]), "grouped_allgather carries the int tensor")
    for out in (outs[0], outs[2]):
        out.backward(upstream)
    for x in xs:
        close(x.grad, torch.full((rows[rank], 2), float(rank)), "grouped_allgather grad")

    # Horovod's test_horovod_grouped_reducescatter_grad: Sum with ones upstream gives size
    xs = [torch.ones(size * 4, 3, requires_grad=True) for _ in range(2)]
    for out in hvd.grouped_reducescatter(xs, op=hvd.Sum):
        out.backward(torch.ones_like(out))
    for x in xs:
        close(x.grad, torch.full((size * 4, 3), float(size)), "grouped_reducescatter Sum grad")


@pytest.mark.parametrize("nprocs", [3])
def test_grouped_allreduce_allgather_reducescatter_are_differentiable_like_horovods(nprocs: int) -> None:
    """Horovod 0.28's HorovodGroupedAllreduce/Allgather/Reducescatter Functions make the grouped ops
    differentiable, with the same backward as the single-tensor forms."""
    run_ranks(_grouped_autograd, nprocs)


# --- item 2: every gradient equals Horovod's definition -----------------------------------------------------
def _horovod_gradients(rank: int, size: int) -> None:
    evens = _evens(size)
    sets = [hvd.global_process_set] + ([evens] if evens.included() else [])
    for ps in sets:
        n, me, tag = ps.size(), ps.rank(), f"set {ps.ranks}"
        members = ps.ranks
        # reducescatter: allgather of the upstream grad, times the set's size for Sum, times both factors.
        # Horovod's own numbers: ones upstream on 2 ranks give 2 for Sum and 1 for Average.
        rows = 2 * n + 1
        counts = split_sizes(rows, n)
        ups = {r: rank_input(r, (counts[ps.ranks.index(r)], 2), torch.float64, salt=5) for r in members}
        for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0),
                              (hvd.Average, 0.5, 3.0)):
            scale = pre * post * (n if op == hvd.Sum else 1)
            want = torch.cat([ups[r] for r in members]) * scale
            x = rank_input(rank, (rows, 2), torch.float64).requires_grad_()
            hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps).backward(ups[rank])
            close(x.grad, want, f"{tag} reducescatter {op.name} pre {pre} post {post} grad")
            xs = [rank_input(rank, (rows, 2), torch.float64, salt=i).requires_grad_() for i in range(2)]
            outs = hvd.grouped_reducescatter(xs, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)
            (outs[0] * ups[rank]).sum().backward(retain_graph=True)
            outs[1].backward(ups[rank])
            for i, xi in enumerate(xs):
                close(xi.grad, want, f"{tag} grouped_reducescatter {op.name} pre {pre} post {post} grad #{i}")
        ones = torch.ones(n * 2, 1, requires_grad=True)
        hvd.reducescatter(ones, op=hvd.Sum, process_set=ps).backward(torch.ones(2, 1))
        close(ones.grad, torch.full((n * 2, 1), float(n)), f"{tag} Horovod's literal: Sum grad is the set's size")
        ones.grad = None
        hvd.reducescatter(ones, op=hvd.Average, process_set=ps).backward(torch.ones(2, 1))
        close(ones.grad, torch.ones(n * 2, 1), f"{tag} Horovod's literal: Average grad is 1")

        # allreduce: the allreduce of the upstream grads with the same op and factors (Min/Max/Product too)
        ups = {r: rank_input(r, (5,), torch.float64, salt=7) for r in members}
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            x = rank_input(rank, (5,), torch.float64).requires_grad_()
            hvd.allreduce(x, op=op, prescale_factor=2.0, postscale_factor=0.5, process_set=ps).backward(ups[rank])
            want = hvd.allreduce(ups[rank], op=op, prescale_factor=2.0, postscale_factor=0.5, process_set=ps)
            close(x.grad, want, f"{tag} allreduce {op.name} grad")
        # allgather: the Average allreduce of the upstream grads, this member's rows
        x = torch.zeros(me + 1, 2, requires_grad=True)
        total = n * (n + 1) // 2
        up = {r: rank_input(r, (total, 2), torch.float64, salt=3).float() for r in members}
        hvd.allgather(x, process_set=ps).backward(up[rank])
        start = me * (me + 1) // 2
        mean = sum(up[r] for r in members) / n
        close(x.grad, mean[start:start + me + 1], f"{tag} allgather grad")
        # broadcast: the Average allreduce of the upstream grads on the root, zeros elsewhere
        root = members[-1]
        x = torch.zeros(3, requires_grad=True)
        up3 = {r: rank_input(r, (3,), torch.float32, salt=2) for r in members}
        hvd.broadcast(x, root, process_set=ps).backward(up3[rank])
        close(x.grad, sum(up3[r] for r in members) / n if rank == root else torch.zeros(3), f"{tag} broadcast grad")
        # alltoall: the upstream grads routed back with the received splits
        x = torch.zeros(2 * n, 1, requires_grad=True)
        up_a = {r: torch.full((2 * n, 1), float(r + 1)) for r in members}
        hvd.alltoall(x, process_set=ps).backward(up_a[rank])
        close(x.grad, torch.cat([torch.full((2, 1), float(r + 1)) for r in members]), f"{tag} alltoall grad")


def test_gradients_of_every_op_follow_horovod_028_definitions() -> None:
    """Horovod 0.28: reducescatter's grad is the allgather of the grad times size for Sum (2 on 2 ranks)
    and 1 for Average, times the factors; allreduce's is the allreduce of the grad with the same op and
    factors; allgather's and broadcast's average; alltoall's routes back; on any process set."""
    run_ranks(_horovod_gradients, 3)


# --- item 3: prescale/postscale on integer tensors ---------------------------------------------------------
def _trunc(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's ScaleBuffer for integers: multiply in float64, convert back (truncating toward zero)."""
    return (t.double() * factor).trunc().to(t.dtype)


def _integer_scaling(rank: int, size: int) -> None:
    base = torch.tensor([7, -7, 3, -3, 100, 1], dtype=torch.int64)
    for dtype in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
        x = (base.abs() if dtype == torch.uint8 else base).to(dtype) + rank
        xs = [(base.abs() if dtype == torch.uint8 else base).to(dtype) + r for r in range(size)]
        summed = sum(_trunc(t, 0.37) for t in xs)
        close(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.37), summed.to(dtype), f"{dtype} prescale")
        close(hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.37), _trunc(sum(xs).to(dtype), 0.37),
              f"{dtype} postscale")
        both = _trunc(sum(_trunc(t, 1.5) for t in xs).to(dtype), 0.3)
        close(hvd.allreduce(x, op=hvd.Sum, prescale_factor=1.5, postscale_factor=0.3), both, f"{dtype} both")
        # Average: one postscale factor of post / size, as Horovod folds the average into it; hora sums an
        # integer Average in a wider type (100 + 101 in int8 does not wrap first), then casts back
        close(hvd.allreduce(x, op=hvd.Average, postscale_factor=3.0),
              _trunc(sum(t.long() for t in xs), 3.0 / size).to(dtype), f"{dtype} Average with postscale")
    # the literal case: [7, -7, 3] with prescale 0.5 on every rank truncates each to [3, -3, 1]
    got = hvd.allreduce(torch.tensor([7, -7, 3], dtype=torch.int32), op=hvd.Sum, prescale_factor=0.5)
    close(got, torch.tensor([3 * size, -3 * size, size], dtype=torch.int32), "truncation toward zero")
    # in place, grouped, reducescatter and grouped reducescatter take the factors too
    t = torch.tensor([10, -10], dtype=torch.int64)
    assert hvd.allreduce_(t, op=hvd.Sum, postscale_factor=0.25) is t
    close(t, _trunc(torch.tensor([10 * size, -10 * size]), 0.25), "allreduce_ with postscale")
    outs = hvd.grouped_allreduce([torch.tensor([5]), torch.tensor([9], dtype=torch.int32)], op=hvd.Sum,
                                 prescale_factor=0.5)
    close(outs[0], torch.tensor([2 * size]), "grouped_allreduce int64 prescale")
    close(outs[1], torch.tensor([4 * size], dtype=torch.int32), "grouped_allreduce int32 prescale")
    rows = torch.arange(2 * size, dtype=torch.int32) * 3 - 5
    want = _trunc(_trunc(rows, 0.5) * size, 1.7)[2 * rank:2 * rank + 2]
    close(hvd.reducescatter(rows, op=hvd.Sum, prescale_factor=0.5, postscale_factor=1.7), want,
          "reducescatter int32 with both factors")
    # Adasum takes the factors too (Adasum scales linearly, so the result halves)
    v = torch.tensor([1.0, 2.0, -1.0]) * (rank + 1) + torch.tensor([0.0, 0.0, 3.0]) * rank
    close(hvd.allreduce(v, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25),
          hvd.allreduce(v, op=hvd.Adasum) * 0.5, "Adasum with prescale and postscale")
    out = hvd.grouped_reducescatter([rows, rows.long()], op=hvd.Average, postscale_factor=2.0)
    close(out[0], _trunc(rows * size, 2.0 / size)[2 * rank:2 * rank + 2], "grouped_reducescatter Average post")
    close(out[1], out[0].long(), "grouped_reducescatter int64")


def test_prescale_and_postscale_scale_integer_tensors_in_float64_and_truncate_like_horovod() -> None:
    """Horovod 0.28 accepts prescale_factor/postscale_factor on integer tensors: it multiplies in float64
    and converts back, truncating toward zero (ScaleBufferCPUImpl); Average folds 1/size into postscale."""
    run_ranks(_integer_scaling, 2)


# --- item 4: alltoall without splits needs dim 0 divisible ---------------------------------------------------
def _alltoall_checks(rank: int, size: int) -> None:
    with pytest.raises(ValueError, match=r"multiple of the process set's size \(3\)"):
        hvd.alltoall(torch.ones(size + 1, 2))
    with pytest.raises(ValueError, match="multiple"):
        hvd.alltoall_async(torch.ones(2 * size - 1))
    evens = _evens(size)
    if evens.included():  # the set's size counts, not the world's
        with pytest.raises(ValueError, match=r"\(2\)"):
            hvd.alltoall(torch.ones(3), process_set=evens)
        close(hvd.alltoall(torch.full((4,), float(rank)), process_set=evens),
              torch.tensor([0.0, 0.0, 2.0, 2.0]), "alltoall of 4 rows on a set of 2")
    # splits may sum to less than dim 0: the rows after their sum are not sent (Horovod), more is an error
    x = torch.arange(size + 2, dtype=torch.float32) + 10 * rank
    out, received = hvd.alltoall(x, splits=[1] * size)
    close(out, torch.tensor([10.0 * r + rank for r in range(size)]), "splits summing to less than dim 0")
    assert received.tolist() == [1] * size
    with pytest.raises(ValueError, match="at most dim 0"):
        hvd.alltoall(torch.ones(2), splits=[1] * size)
    with pytest.raises(ValueError, match="integers"):
        hvd.alltoall(torch.ones(size), splits=torch.ones(size))
    # the job goes on: every refusal happened before anything was submitted
    close(hvd.alltoall(torch.full((size,), float(rank))), torch.arange(size, dtype=torch.float32), "after errors")
    # the grad of rows that were not sent is zero
    x = torch.ones(size + 1, requires_grad=True)
    out, _ = hvd.alltoall(x, splits=[1] * size)
    out.backward(torch.full((size,), 2.0))
    close(x.grad, torch.tensor([2.0] * size + [0.0]), "alltoall grad of rows not sent")


def test_alltoall_without_splits_raises_when_dim0_is_not_divisible_like_horovod() -> None:
    """Horovod 0.28 refuses an alltoall without splits whose dim 0 is not a multiple of the set's size
    (ValueError: "splits not provided, but first dimension of tensor is not an even multiple")."""
    run_ranks(_alltoall_checks, 3)


# --- item 5: errors are catchable as a Horovod script catches them -------------------------------------------
def _catchable(rank: int, size: int) -> None:
    # (the call, what Horovod 0.28's test_torch.py catches it as) -- each fails on this rank before submitting
    local = [
        (lambda: hvd.reducescatter(torch.ones(size * 2), op=hvd.Adasum), RuntimeError),
        (lambda: hvd.reducescatter(torch.tensor(1.0)), RuntimeError),
        (lambda: hvd.allgather(torch.tensor(1.0)), RuntimeError),
        (lambda: hvd.allreduce(torch.ones(3, dtype=torch.complex64)), ValueError),
        (lambda: hvd.allreduce(torch.ones(4, 3).t()), ValueError),
        (lambda: hvd.alltoall(torch.ones(size + 1)), ValueError),
        (lambda: hvd.alltoall(torch.ones(size - 1), splits=[1] * size), ValueError),
        (lambda: hvd.broadcast(torch.ones(2), root_rank=size), ValueError),
        (lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum), ValueError),
        (lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum), NotImplementedError),  # 3 ranks: not a power of 2
    ]
    for i, (call, horovod_type) in enumerate(local):
        with pytest.raises(horovod_type) as info:
            call()
        assert isinstance(info.value, hvd.InvalidCallError), f"#{i}: {info.value!r}"
        assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError), f"#{i}"
        assert not isinstance(info.value, hvd.HorovodInternalError), f"#{i}: elastic must not restart on it"
    with pytest.raises(TypeError):  # hora's own tests and scripts catch a bad dtype as TypeError
        hvd.allreduce(torch.ones(3, dtype=torch.complex64))
    # a name still in flight: ValueError in Horovod
    h = hvd.allreduce_async(torch.ones(2), name="twice")
    with pytest.raises(ValueError, match="twice"):
        hvd.allreduce_async(torch.ones(2), name="twice")
    hvd.synchronize(h)
    # ranks that disagree: Horovod raises HorovodInternalError, a RuntimeError
    with pytest.raises(RuntimeError) as mismatch:
        hvd.allreduce(torch.ones(rank + 1))
    assert isinstance(mismatch.value, hvd.HorovodInternalError)
    with pytest.raises(RuntimeError):
        hvd.broadcast(torch.ones(2), root_rank=rank)
    close(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(size)), "the job goes on")


def test_bad_calls_are_catchable_as_the_exception_horovod_raises() -> None:
    """Horovod 0.28 raises RuntimeError for reducescatter(op=Adasum) and rank-0 tensors, NotImplementedError
    for Adasum on a non-power-of-two size, ValueError for checks made before enqueueing, and
    HorovodInternalError (a RuntimeError) when ranks disagree: hora's errors are catchable the same way."""
    run_ranks(_catchable, 3)


# --- issue 24 item 2: Adasum of small vectors -----------------------------------------------------------------
def _adasum_small(rank: int, size: int) -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for value in (1e-5, torch.finfo(dtype).tiny if dtype != torch.float64 else 1e-70):
            x = torch.tensor([value, 0.0], dtype=dtype)
            got = hvd.allreduce(x, op=hvd.Adasum)
            close(got, x, f"Adasum of equal {dtype} vectors [{value:g}, 0]", atol=0, rtol=0)


def test_adasum_of_equal_small_vectors_is_the_vector_like_horovod_028() -> None:
    """Horovod 0.28.1 combines (does not sum) any vector whose squared norm is at least sqrt(DBL_MIN):
    ``hvd.allreduce(torch.tensor([1e-5, 0.0]), op=hvd.Adasum)`` on 2 ranks gives ``[1e-5, 0]`` (hora gave
    ``[2e-5, 0]``), down to the smallest normal float16, bfloat16 and float32 numbers."""
    run_ranks(_adasum_small, 2)
