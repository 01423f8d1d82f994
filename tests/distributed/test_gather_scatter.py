"""allgather, broadcast, alltoall and reducescatter against locally computed results, with grads."""

from __future__ import annotations

import pytest
import torch

import hora as hvd
from tests.distributed.expect import ALL, NUMERIC, close, rank_input, reduce, split_sizes
from tests.distributed.harness import run_ranks


def _gathered(size: int, dtype: torch.dtype, salt: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Rank r contributes r + 1 rows of shape (2, 3): dim 0 differs per rank."""
    parts = [rank_input(r, (r + 1, 2, 3), dtype, salt) for r in range(size)]
    return parts, torch.cat(parts)


def _alltoall_case(size: int, dtype: torch.dtype) -> tuple[list[list[int]], list[torch.Tensor]]:
    """splits[s][d] = rows rank s sends to rank d (zero for some pairs); inputs[s] holds sum(splits[s]) rows."""
    splits = [[(s + 2 * d) % 3 for d in range(size)] for s in range(size)]
    inputs = [rank_input(s, (sum(splits[s]), 2), dtype, salt=s) for s in range(size)]
    return splits, inputs


def _alltoall_expected(splits: list[list[int]], inputs: list[torch.Tensor], dst: int) -> torch.Tensor:
    rows = []
    for s, x in enumerate(inputs):
        start = sum(splits[s][:dst])
        rows.append(x[start:start + splits[s][dst]])
    return torch.cat(rows)


def _sweep(rank: int, size: int) -> None:
    for dtype in ALL:
        parts, whole = _gathered(size, dtype)
        close(hvd.allgather(parts[rank]), whole, f"allgather {dtype}")
        for root in range(size):
            x = rank_input(rank, (4, 3), dtype, salt=root)
            close(hvd.broadcast(x, root_rank=root), rank_input(root, (4, 3), dtype, salt=root),
                  f"broadcast {dtype} root {root}")
            close(x, rank_input(rank, (4, 3), dtype, salt=root), "broadcast leaves its input alone")
        splits, inputs = _alltoall_case(size, dtype)
        out, received = hvd.alltoall(inputs[rank], splits=splits[rank])
        close(out, _alltoall_expected(splits, inputs, rank), f"alltoall {dtype} with splits")
        assert [int(v) for v in received] == [splits[s][rank] for s in range(size)], f"received_splits {dtype}"
        even = [rank_input(s, (2 * size, 3), dtype) for s in range(size)]
        out = hvd.alltoall(even[rank])
        assert isinstance(out, torch.Tensor), "alltoall without splits returns only the output"
        close(out, _alltoall_expected([[2] * size] * size, even, rank), f"alltoall {dtype} without splits")
    for dtype in NUMERIC:
        rows = 2 * size + 1  # uneven: the first rows % size ranks get one extra row
        inputs = [rank_input(r, (rows, 2), dtype) for r in range(size)]
        counts = split_sizes(rows, size)
        start = sum(counts[:rank])
        for op in ([hvd.Sum, hvd.Average] if dtype.is_floating_point else [hvd.Sum]):
            out = hvd.reducescatter(inputs[rank], op=op)
            close(out, reduce(inputs, op)[start:start + counts[rank]], f"reducescatter {dtype} {op.name}")
    # reducescatter's default op is Average
    x = [rank_input(r, (size, 2), torch.float64) for r in range(size)]
    close(hvd.reducescatter(x[rank]), reduce(x, hvd.Average)[rank:rank + 1], "reducescatter default op")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_allgather_broadcast_alltoall_reducescatter_every_dtype(nprocs: int) -> None:
    run_ranks(_sweep, nprocs)


def _variants(rank: int, size: int) -> None:
    parts, whole = _gathered(size, torch.float32)
    close(hvd.synchronize(hvd.allgather_async(parts[rank], name="ag")), whole, "allgather_async")
    parts2, whole2 = _gathered(size, torch.int64, salt=1)
    outs = hvd.grouped_allgather([parts[rank], parts2[rank]])
    close(outs[0], whole, "grouped_allgather[0]")
    close(outs[1], whole2, "grouped_allgather[1]")
    outs = hvd.synchronize(hvd.grouped_allgather_async([parts2[rank], parts[rank]]))
    close(outs[0], whole2, "grouped_allgather_async[0]")
    close(outs[1], whole, "grouped_allgather_async[1]")

    root = size - 1
    x = rank_input(rank, (5,), torch.float64)
    want = rank_input(root, (5,), torch.float64)
    close(hvd.synchronize(hvd.broadcast_async(x, root, name="bc")), want, "broadcast_async")
    close(x, rank_input(rank, (5,), torch.float64), "broadcast_async left its input alone")
    y = x.clone()
    assert hvd.broadcast_(y, root) is y
    close(y, want, "broadcast_")
    z = x.clone()
    assert hvd.synchronize(hvd.broadcast_async_(z, root)) is z
    close(z, want, "broadcast_async_")

    splits, inputs = _alltoall_case(size, torch.float32)
    out, received = hvd.synchronize(hvd.alltoall_async(inputs[rank], splits=torch.tensor(splits[rank])))
    close(out, _alltoall_expected(splits, inputs, rank), "alltoall_async with splits as a tensor")
    assert [int(v) for v in received] == [splits[s][rank] for s in range(size)]

    rows = 3 * size + 1
    ins = [rank_input(r, (rows, 2), torch.float32) for r in range(size)]
    counts = split_sizes(rows, size)
    mine = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    close(hvd.synchronize(hvd.reducescatter_async(ins[rank], op=hvd.Sum)), reduce(ins, hvd.Sum)[mine],
          "reducescatter_async")
    ins2 = [rank_input(r, (rows, 3), torch.float64, salt=3) for r in range(size)]
    outs = hvd.grouped_reducescatter([ins[rank], ins2[rank]], op=hvd.Sum)
    close(outs[0], reduce(ins, hvd.Sum)[mine], "grouped_reducescatter[0]")
    close(outs[1], reduce(ins2, hvd.Sum)[mine], "grouped_reducescatter[1]")
    outs = hvd.synchronize(hvd.grouped_reducescatter_async([ins2[rank]], op=hvd.Average))
    close(outs[0], reduce(ins2, hvd.Average)[mine], "grouped_reducescatter_async")
    out = hvd.reducescatter(ins[rank], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    close(out, reduce(ins, hvd.Sum, prescale=0.5, postscale=3.0)[mine], "reducescatter with scale factors")
    for comp in (hvd.Compression.fp16, hvd.Compression.bf16):
        out = hvd.reducescatter(ins[rank], op=hvd.Sum, compression=comp)
        close(out, reduce(ins, hvd.Sum)[mine], f"reducescatter float32 with {comp}", atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_async_inplace_and_grouped_variants(nprocs: int) -> None:
    run_ranks(_variants, nprocs)


def _grads(rank: int, size: int) -> None:
    # Conventions follow Horovod 0.28: allgather's and broadcast's backward average the upstream gradients
    # over ranks; alltoall's routes them back; reducescatter's allgathers them, times the size for Sum and
    # times the scale factors (so Sum on 2 ranks gives 2, Average 1, for ones upstream).
    parts, whole = _gathered(size, torch.float64)
    x = parts[rank].clone().requires_grad_()
    upstream = [rank_input(r, tuple(whole.shape), torch.float64, salt=7) for r in range(size)]
    hvd.allgather(x).backward(upstream[rank])
    offset = sum(r + 1 for r in range(rank))
    close(x.grad, reduce(upstream, hvd.Average)[offset:offset + rank + 1], "allgather grad")

    for root in range(size):
        x = rank_input(rank, (4,), torch.float64).requires_grad_()
        up = [rank_input(r, (4,), torch.float64, salt=root) for r in range(size)]
        hvd.broadcast(x, root).backward(up[rank])
        want = reduce(up, hvd.Average) if rank == root else torch.zeros(4, dtype=torch.float64)
        close(x.grad, want, f"broadcast grad root {root}")

    splits, inputs = _alltoall_case(size, torch.float64)
    x = inputs[rank].clone().requires_grad_()
    out, _ = hvd.alltoall(x, splits=splits[rank])
    up = [rank_input(r, (sum(splits[s][r] for s in range(size)), 2), torch.float64, salt=9) for r in range(size)]
    out.backward(up[rank])
    # the grad of the rows rank r sent to rank d is what rank d's upstream grad holds for them
    recv_splits = [[splits[s][d] for s in range(size)] for d in range(size)]
    close(x.grad, _alltoall_expected(recv_splits, up, rank), "alltoall grad")

    rows = 2 * size + 1
    counts = split_sizes(rows, size)
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0)):
        x = rank_input(rank, (rows, 2), torch.float64).requires_grad_()
        out = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
        up = [rank_input(r, (counts[r], 2), torch.float64, salt=4) for r in range(size)]
        out.backward(up[rank])
        scale = pre * post * (size if op == hvd.Sum else 1)
        close(x.grad, torch.cat(up) * scale, f"reducescatter grad {op.name} {pre} {post}")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_gradients(nprocs: int) -> None:
    run_ranks(_grads, nprocs)


def _zero_size(rank: int, size: int) -> None:
    close(hvd.allgather(torch.ones(0, 2)), torch.ones(0, 2), "allgather of 0 rows on every rank")
    close(hvd.broadcast(torch.ones(0), 0), torch.ones(0), "broadcast of an empty tensor")
    out = hvd.reducescatter(torch.ones(1, 2), op=hvd.Sum)  # fewer rows than ranks: the others get none
    close(out, torch.full((1, 2), float(size)) if rank == 0 else torch.ones(0, 2), "reducescatter of 1 row")
    out, received = hvd.alltoall(torch.ones(size - 1, 1) * rank, splits=[1] * (size - 1) + [0])
    want = torch.arange(size, dtype=torch.float32).reshape(size, 1) if rank < size - 1 else torch.ones(0, 1)
    close(out, want, "alltoall sending nothing to the last rank")
    close(hvd.allreduce(torch.ones(0), op=hvd.Sum), torch.ones(0), "allreduce of an empty tensor")


def test_zero_size_tensors() -> None:
    run_ranks(_zero_size, 3)
