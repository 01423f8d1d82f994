"""Two or more GPUs, one rank each, CUDA tensors through NCCL: every kind of collective, process sets, the
hierarchical allreduce (the leader way on unequal hosts, the shard way on equal ones), gradient buckets
against DDP bit for bit, and a rank whose thread has another current device than the one hora bound it to."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hora as hvd
from hora.datapath import hierarchical
from hora.runtime import lifecycle as runtime
from tests.distributed.expect import rank_input, reduce, split_sizes
from tests.gpu.common import ON_CPU, as_hosts, cuda_devices, device, nccl_world, same
from tests.gpu.every_kind import every_kind


def _ranks(most: int = 4) -> int:
    return min(cuda_devices(), most)


@pytest.mark.gpu(2)
def test_nccl_every_kind() -> None:
    n = _ranks()
    results = nccl_world(every_kind, n)
    assert len({r[1] for r in results}) == 1 and results[0][1] != n - 1  # one last joiner, not the early one
    assert results[0][0] >= 70


def _sets(rank: int, size: int) -> int:
    dev = device()
    layouts = [[r] for r in range(size)] + [list(range(0, size, 2)), list(range(size - 1))]
    if size > 2:
        layouts.append(list(range(1, size, 2)))
    sets = [hvd.add_process_set(ranks) for ranks in layouts]
    checks = 0
    for ps, ranks in zip(sets, layouts):
        if rank not in ranks:
            continue
        what = f"set {ranks}"
        inputs = [rank_input(r, (6, 3), torch.float32, salt=len(ranks)) for r in range(size)]
        members = [inputs[r] for r in ranks]
        same(hvd.allreduce(inputs[rank].to(dev), op=hvd.Sum, process_set=ps, name=f"{what} ar"),
             reduce(members, hvd.Sum), f"{what}: allreduce")
        same(hvd.allgather(inputs[rank].to(dev), process_set=ps, name=f"{what} ag"), torch.cat(members),
             f"{what}: allgather")
        same(hvd.broadcast(inputs[rank].to(dev), root_rank=ranks[-1], process_set=ps, name=f"{what} bc"),
             inputs[ranks[-1]], f"{what}: broadcast from global rank {ranks[-1]}", exact=True)
        index = ranks.index(rank)
        counts = split_sizes(6, len(ranks))
        start = sum(counts[:index])
        same(hvd.reducescatter(inputs[rank].to(dev), op=hvd.Sum, process_set=ps, name=f"{what} rs"),
             reduce(members, hvd.Sum)[start:start + counts[index]], f"{what}: reducescatter")
        checks += 4
    for ps in sets:
        hvd.remove_process_set(ps)
    return checks


@pytest.mark.gpu(2)
def test_process_sets_on_nccl() -> None:
    n = _ranks()
    counts = nccl_world(_sets, n)
    assert all(c >= 8 for c in counts), counts


def _hierarchical(rank: int, size: int) -> int:
    per_host = [2, size - 2]  # unequal hosts with 3 GPUs: the leader way; [2, 2] with 4: the shard way
    as_hosts(rank, per_host)
    hvd.init()
    try:
        h = runtime.hierarchy()
        even = per_host[0] == per_host[1]
        want = ("shm" if ON_CPU else "shard") if even else "leader"  # the dry run's Gloo may share memory
        assert h is not None and h.mode == want, f"hierarchy {h}"
        dev = device()
        before = h.calls
        for dtype, n in ((torch.float32, 9 * 2**20 + 3), (torch.int64, 1001), (torch.float16, 4096)):
            inputs = [rank_input(r, (n,), dtype, salt=n) for r in range(size)]
            same(hvd.allreduce(inputs[rank].to(dev), op=hvd.Sum, name=f"hier {dtype}"), reduce(inputs, hvd.Sum),
                 f"hierarchical allreduce {dtype}, {n} elements")
        small = [[rank_input(r, (50 + k,), torch.float32, salt=k) for r in range(size)] for k in range(6)]
        outs = hvd.grouped_allreduce([s[rank].to(dev) for s in small], op=hvd.Average)  # fused
        for k, (out, s) in enumerate(zip(outs, small)):
            same(out, reduce(s, hvd.Average), f"hierarchical fused #{k}")
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 8).to(dev)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        g = torch.Generator().manual_seed(rank)
        F.mse_loss(model(torch.randn(4, 32, generator=g).to(dev)), torch.zeros(4, 8, device=dev)).backward()
        opt.step()
        with hierarchical.flat(runtime.hierarchy()):
            flat = hvd.allreduce(model.weight.detach(), op=hvd.Average, name="weights agree")
        same(model.weight.detach(), flat.cpu(), "the buckets' result is the same on every rank")
        return h.calls - before
    finally:
        hvd.shutdown()


@pytest.mark.gpu(3)
def test_hierarchical_allreduce_on_nccl() -> None:
    from hora.testing import run_ranks  # init=False: each rank sets its "host" first

    calls = run_ranks(_hierarchical, _ranks(), init=False, timeout=300.0)
    assert all(c >= 5 for c in calls), f"allreduces that took the three steps, per rank: {calls}"


def _ddp_against_buckets(rank: int, size: int, optimizer: str) -> list[str]:
    """The same model trained with DDP and with DistributedOptimizer on the same data: bit for bit the same.
    (With 2 ranks a sum is one addition whatever the bucket layout, and 1/2 is exact, so nothing may differ.)"""
    dev = device()
    torch.use_deterministic_algorithms(True)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                   torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(dev)

    def make(params: Any) -> torch.optim.Optimizer:
        if optimizer == "adam":
            return torch.optim.Adam(params, lr=0.01)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    ddp = torch.nn.parallel.DistributedDataParallel(build(), device_ids=[dev.index] if dev.type == "cuda" else None)
    ddp_opt = make(ddp.parameters())
    mine = build()
    opt = hvd.DistributedOptimizer(make(mine.parameters()), named_parameters=mine.named_parameters())
    for step in range(4):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=g).to(dev), torch.randn(16, 8, generator=g).to(dev)
        for model, o in ((ddp, ddp_opt), (mine, opt)):
            o.zero_grad()
            F.mse_loss(model(x), y).backward()
            o.step()
    differ = [name for (name, a), b in zip(ddp.module.named_parameters(), mine.parameters()) if not torch.equal(a, b)]
    return differ


@pytest.mark.gpu(2)
@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam"])
def test_buckets_match_ddp_bit_for_bit(optimizer: str) -> None:
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # deterministic cuBLAS (torch.use_deterministic_algorithms)
    assert nccl_world(_ddp_against_buckets, 2, optimizer, env=env) == [[], []]


def _another_current_device(rank: int, size: int) -> int:
    """Rank 1's thread switches its current device away from the one hora bound it to, then joins (its zeros
    must be made on hora's device) and allreduces a tensor on hora's device."""
    dev = device()
    if rank == 1 and not ON_CPU:
        torch.cuda.set_device(0)
    if rank == 0:
        x = torch.full((1000,), 3.0, device=dev)
        same(hvd.allreduce(x, op=hvd.Sum, name="while rank 1 has joined"), torch.full((1000,), 3.0),
             "allreduce with rank 1 joined from another current device", on=dev)
    hvd.join()
    y = hvd.allreduce(torch.full((7,), float(rank), device=dev), op=hvd.Sum, name="tensor on hora's device")
    same(y, torch.full((7,), float(sum(range(size)))), "an allreduce issued with another device current", on=dev)
    return 1


@pytest.mark.gpu(2)
def test_a_thread_with_another_current_device() -> None:
    assert nccl_world(_another_current_device, 2) == [1, 1]


def _objects_from_each_gpu(rank: int, size: int) -> list[str]:
    state = {"exp_avg": torch.full((3,), float(rank), device=device())}
    got = hvd.broadcast_object(state if rank == 0 else None, root_rank=0, name="gpu-object")
    gathered = hvd.allgather_object(state, name="gpu-objects")
    where = [str(got["exp_avg"].device)] if rank != 0 else []
    return where + [str(g["exp_avg"].device) for g in gathered]


@pytest.mark.gpu(2)
def test_objects_from_cuda_tensors_arrive_on_the_cpu_of_every_rank() -> None:
    """broadcast_object's docstring (Horovod's too): tensors arrive on the CPU. Without map_location="cpu" every
    rank loaded rank 0's tensors onto cuda:0, the sender's index, whatever GPU it was bound to."""
    results = nccl_world(_objects_from_each_gpu, _ranks())
    assert results[0] == ["cpu"] * len(results), results
    for where in results[1:]:
        assert where == ["cpu"] * (len(results) + 1), results
