"""Every kind of collective on this rank's device, each checked against what the same call gives computed on
the CPU: the body of both the one-GPU test (CUDA tensors through Gloo) and the several-GPU one (NCCL)."""

from __future__ import annotations

import torch

import hora as hvd
from hora.datapath.kinds.adasum import adasum_tree
from tests.distributed.expect import ops_for, rank_input, reduce, split_sizes
from tests.gpu.common import device, same

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8]


def _inputs(size: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> list[torch.Tensor]:
    return [rank_input(r, shape, dtype, salt=salt) for r in range(size)]


def allreduces(rank: int, size: int) -> int:
    """Every op and dtype, async and in place, with prescale and postscale, and grouped."""
    dev, n = device(), 0
    for i, dtype in enumerate(DTYPES):
        for op in ops_for(dtype):
            inputs = _inputs(size, (3, 5), dtype, salt=i)
            what = f"allreduce {dtype} {op.name}"
            same(hvd.allreduce(inputs[rank].to(dev), op=op, name=what), reduce(inputs, op), what)
            t = inputs[rank].to(dev, copy=True)  # in place: never the input itself (the dry run's CPU)
            same(hvd.synchronize(hvd.allreduce_async_(t, op=op, name=f"{what} in place")), reduce(inputs, op),
                 f"{what} in place")
            same(t, reduce(inputs, op), f"{what}: the caller's tensor holds the result")
            n += 2
    inputs = _inputs(size, (1000,), torch.float32, salt=99)
    same(hvd.allreduce(inputs[rank].to(dev), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
         reduce(inputs, hvd.Sum, 0.5, 3.0), "prescale and postscale")
    groups = [_inputs(size, (k + 1, 2), torch.float32, salt=k) for k in range(5)]
    outs = hvd.grouped_allreduce([g[rank].to(dev) for g in groups], op=hvd.Average)
    for k, (out, g) in enumerate(zip(outs, groups)):
        same(out, reduce(g, hvd.Average), f"grouped allreduce #{k}")
    return n + 6


def data_movement(rank: int, size: int) -> int:
    """allgather (uneven rows), broadcast, alltoall (uneven splits), reducescatter (uneven rows), Adasum."""
    dev = device()
    rows = [_inputs(size, (r + 1, 3), torch.float32, salt=r)[r] for r in range(size)]  # rank r sends r+1 rows
    same(hvd.allgather(rows[rank].to(dev), name="allgather uneven"), torch.cat(rows), "allgather, uneven rows")
    ints = _inputs(size, (2, 4), torch.int64, salt=7)
    outs = hvd.grouped_allgather([ints[rank].to(dev), rows[rank].to(dev)])
    same(outs[0], torch.cat(ints), "grouped allgather int64")
    same(outs[1], torch.cat(rows), "grouped allgather float32")

    root = size - 1
    src = _inputs(size, (4, 4), torch.float16, salt=3)
    same(hvd.broadcast(src[rank].to(dev), root_rank=root, name="broadcast"), src[root], "broadcast", exact=True)
    t = src[rank].to(dev, copy=True)
    hvd.broadcast_(t, root_rank=0, name="broadcast in place")
    same(t, src[0], "broadcast in place", exact=True)

    splits = [(rank + j) % 3 for j in range(size)]  # rows rank sends to member j, some of them 0
    mine = torch.arange(sum(splits) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
    out, received = hvd.alltoall(mine.to(dev), splits=torch.tensor(splits, dtype=torch.int32), name="alltoall")
    want, want_rows = [], []
    for j in range(size):  # what member j sends this rank
        theirs = [(j + k) % 3 for k in range(size)]
        start = sum(theirs[:rank])
        sent = torch.arange(sum(theirs) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * j
        want.append(sent[start:start + theirs[rank]])
        want_rows.append(theirs[rank])
    same(out, torch.cat(want), "alltoall, uneven splits", exact=True)
    assert received.tolist() == want_rows, f"alltoall received splits {received.tolist()}, expected {want_rows}"

    full = _inputs(size, (2 * size + 1, 3), torch.float32, salt=5)  # rows do not divide evenly
    counts = split_sizes(2 * size + 1, size)
    start = sum(counts[:rank])
    same(hvd.reducescatter(full[rank].to(dev), op=hvd.Sum, name="reducescatter"),
         reduce(full, hvd.Sum)[start:start + counts[rank]], "reducescatter, uneven rows")
    if size & (size - 1) == 0:
        vecs = [torch.randn(64, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(size)]
        cpu = hvd.allreduce(vecs[rank], op=hvd.Adasum, name="adasum cpu")  # CPU tensors: Adasum over every rank
        same(cpu, adasum_tree(torch.stack(vecs)), "Adasum of CPU tensors", on=torch.device("cpu"))
        # CUDA tensors: Horovod's GPU Adasum, the ranks of a host averaged first (here every rank is on one host)
        want = reduce(vecs, hvd.Average) if dev.type == "cuda" else cpu
        same(hvd.allreduce(vecs[rank].to(dev), op=hvd.Adasum, name="adasum"), want, "Adasum")
    hvd.barrier()
    return 9


def helpers_and_join(rank: int, size: int) -> int:
    """broadcast_parameters / broadcast_optimizer_state of a model on the device, allgather_object, and a joined
    rank contributing zeros (made on hora's device) to an allreduce and no rows to an allgather. Returns the
    rank ``join()`` named last."""
    dev = device()
    torch.manual_seed(rank)  # different on every rank until broadcast; rank 0's equals the reference below
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 6).to(dev)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    ref(torch.randn(4, 6)).sum().backward()
    ref_opt.step()
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        same(got, want, f"broadcast_parameters: {name}")
    for got, want in zip(opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        for key in ("exp_avg", "exp_avg_sq"):
            same(got[key], want[key], f"broadcast_optimizer_state: {key}")
    objs = hvd.allgather_object({"rank": rank, "t": torch.full((2,), float(rank), device=dev)})
    assert [o["rank"] for o in objs] == list(range(size))

    if rank == size - 1 and size > 1:
        last = hvd.join()  # contributes zeros to the others' ops below, made on its own device
    else:
        x = torch.full((5,), float(rank + 1), device=dev)
        others = size - 1 if size > 1 else 1  # the ranks that have not joined
        same(hvd.allreduce(x, op=hvd.Sum, name="with a joined rank"),
             torch.full((5,), float(sum(range(1, others + 1)))), "allreduce with a joined rank")
        same(hvd.allgather(torch.full((1, 2), float(rank), device=dev), name="gather with a joined rank"),
             torch.tensor([[float(r)] * 2 for r in range(others)]), "allgather with a joined rank (no rows)")
        last = hvd.join()
    return last


def every_kind(rank: int, size: int) -> tuple[int, int]:
    """(checks made, the rank join() named last): the caller checks every rank agrees on the latter."""
    return allreduces(rank, size) + data_movement(rank, size), helpers_and_join(rank, size)
