"""One GPU: CUDA tensors through every collective and through fusion over Gloo (two ranks sharing the GPU),
the compression pieces, DistributedOptimizer with torch.amp.GradScaler, SyncBatchNorm, a user's side stream,
and a 1-rank NCCL world. Each result is checked against the same computation on the CPU."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hora as hvd
from hora.datapath import fusion
from tests.distributed.expect import rank_input, reduce
from tests.gpu.common import ON_CPU, device, gloo_world, nccl_world, same
from tests.gpu.every_kind import every_kind

pytestmark = pytest.mark.gpu


def test_cuda_tensors_through_every_collective_over_gloo() -> None:
    results = gloo_world(every_kind, 2)
    assert [r[1] for r in results] == [0, 0]  # rank 1 joined first: rank 0 is the last to join, on both
    assert results[0][0] >= 70  # the checks ran


def _count_fused_batches() -> list[int]:
    """Patch this rank's fusion buffers to record the size of every fused batch (in a forked rank only)."""
    sizes: list[int] = []
    original = fusion.FusionBuffers.allreduce

    def counting(self: Any, wires: Any, entries: Any, group: Any) -> None:
        sizes.append(len(entries))
        original(self, wires, entries, group)

    fusion.FusionBuffers.allreduce = counting  # type: ignore[method-assign]
    return sizes


def _fusion(rank: int, size: int) -> list[int]:
    dev = device()
    sizes = _count_fused_batches()
    for rep in range(3):
        inputs = [[rank_input(r, (100 + k,), dtype, salt=k + rep) for r in range(size)]
                  for k, dtype in enumerate([torch.float32] * 6 + [torch.float16] * 4)]
        handles = [hvd.allreduce_async(ins[rank].to(dev), op=hvd.Sum, name=f"fuse.{rep}.{k}")
                   for k, ins in enumerate(inputs)]
        outs = hvd.grouped_allreduce([ins[rank].to(dev) for ins in inputs], op=hvd.Average)
        for k, (h, out, ins) in enumerate(zip(handles, outs, inputs)):
            same(hvd.synchronize(h), reduce(ins, hvd.Sum), f"async #{k}")
            same(out, reduce(ins, hvd.Average), f"grouped #{k}")
    return sizes


def test_small_cuda_allreduces_are_fused_over_gloo() -> None:
    for sizes in gloo_world(_fusion, 2):
        assert sizes and max(sizes) > 1, f"no fused batch (batch sizes {sizes})"


def _compression(rank: int, size: int) -> int:
    dev = device()
    for comp, wire in ((hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)):
        x = rank_input(rank, (257, 3), torch.float32).to(dev)
        packed, ctx = comp.compress(x)
        assert packed.device == dev and packed.dtype == wire, f"{comp}: compressed to {packed.dtype} on {packed.device}"
        same(comp.decompress(packed, ctx), x.cpu(), f"{comp}: round trip of small integers")
        inputs = [rank_input(r, (3 * 2**20,), torch.float32) for r in range(size)]  # 12 MB: pieces on CPU
        same(hvd.allreduce(inputs[rank].to(dev), op=hvd.Average, compression=comp, name=f"{wire}.avg"),
             reduce(inputs, hvd.Average), f"{comp} allreduce")
        same(hvd.allreduce(inputs[rank].to(dev), op=hvd.Sum, compression=comp, prescale_factor=0.5,
                           name=f"{wire}.sum"), reduce(inputs, hvd.Sum, 0.5), f"{comp} sum, prescaled")
        rows = [rank_input(r, (5, 4), torch.float32, salt=2) for r in range(size)]
        same(hvd.reducescatter(rows[rank].to(dev), op=hvd.Sum, compression=comp, name=f"{wire}.rs"),
             reduce(rows, hvd.Sum)[: 3] if rank == 0 else reduce(rows, hvd.Sum)[3:], f"{comp} reducescatter")
        outs = hvd.grouped_allreduce([ins[rank].to(dev) for ins in (rows, inputs)], op=hvd.Sum, compression=comp)
        same(outs[0], reduce(rows, hvd.Sum), f"{comp} grouped")
    return 1


def test_compression_on_cuda_tensors() -> None:
    assert gloo_world(_compression, 2) == [1, 1]


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _amp_steps(model: torch.nn.Module, opt: Any, batches: list[tuple[torch.Tensor, torch.Tensor]],
               distributed: bool, recipe: str = "horovod", dtype: torch.dtype = torch.float16) -> list[float]:
    """An AMP training loop with clipping. ``"horovod"``: backward on the scaled loss, synchronize, unscale,
    step without reducing again. ``"torch"``: torch's own recipe, no synchronize (the scaler's reading of
    the gradients reduces them)."""
    dev = device()
    scaler = torch.amp.GradScaler(dev.type, init_scale=2.0**40, backoff_factor=2.0**-36, growth_interval=1000)
    scales = []
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast(dev.type, dtype=dtype):
            loss = F.mse_loss(model(x.to(dev)), y.to(dev))
        scaler.scale(loss).backward()
        if distributed and recipe == "horovod":
            opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        with opt.skip_synchronize() if distributed and recipe == "horovod" else contextlib.nullcontext():
            scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return scales


def _amp(rank: int, size: int, recipe: str = "horovod",
         dtype: torch.dtype = torch.float16) -> tuple[list[float], list[float]]:
    dev = device()
    full = [_batch(step, 8 * size) for step in range(6)]
    model = _model().to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    shards = [(x.chunk(size)[rank], y.chunk(size)[rank]) for x, y in full]
    scales = _amp_steps(model, opt, shards, True, recipe, dtype)
    ref = _model().to(dev)  # one process on the whole batch: the mean of equal shards' mean losses
    ref_scales = _amp_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), full, False, recipe, dtype)
    what = f"{recipe}'s recipe in {dtype}"
    assert scales == ref_scales, f"{what}: loss scales {scales}, one process on the whole batch: {ref_scales}"
    if not ON_CPU and dtype == torch.float16:
        assert scales[0] == 16.0, f"{what}: the first step should overflow fp16 and be skipped: scales {scales}"
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=tol, rtol=tol, msg=lambda m, name=name: f"{what}: {name}: {m}")
    return scales, [float(p.detach().double().sum()) for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["horovod", "torch"])
def test_distributed_optimizer_with_grad_scaler(recipe: str) -> None:
    results = gloo_world(_amp, 2, recipe)
    assert results[0] == results[1]  # the same scales and parameters on both ranks


def _sync_batch_norm(rank: int, size: int) -> int:
    dev = device()
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(3)
        full = (torch.randn(4 * size, 3, 5, 5, generator=g) * 2 + 1).to(dtype)
        grad_out = torch.randn(full.shape, generator=g).to(dtype)
        mine = full.chunk(size)[rank].to(dev).requires_grad_()
        sbn = hvd.SyncBatchNorm(3).to(dev)
        y = sbn(mine)
        y.backward(grad_out.chunk(size)[rank].to(dev))
        ref = torch.nn.BatchNorm2d(3).to(dev)  # one process, the whole batch, on the same device
        whole = full.float().to(dev).requires_grad_()
        ref_y = ref(whole)
        ref_y.backward(grad_out.float().to(dev))
        tol = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.float16 else {"atol": 1e-4, "rtol": 1e-4}
        assert y.device == dev and y.dtype == dtype
        torch.testing.assert_close(y.float(), ref_y.chunk(size)[rank], **tol)
        torch.testing.assert_close(mine.grad.float(), whole.grad.chunk(size)[rank], **tol)  # type: ignore[union-attr]
        grads = hvd.allreduce(torch.cat([sbn.weight.grad, sbn.bias.grad]), op=hvd.Sum)  # type: ignore[list-item]
        torch.testing.assert_close(grads, torch.cat([ref.weight.grad, ref.bias.grad]), **tol)  # type: ignore[list-item]
        torch.testing.assert_close(sbn.running_mean, ref.running_mean, **tol)
        torch.testing.assert_close(sbn.running_var, ref.running_var, **tol)
    return 1


def test_sync_batch_norm_on_cuda() -> None:
    assert gloo_world(_sync_batch_norm, 2) == [1, 1]


def _side_stream(rank: int, size: int) -> int:
    """Tensors produced and results read on a stream of the user's, busy with work before each op: the op must
    wait for the producing stream, and the reader for the op (a fused batch too)."""
    dev = device()
    stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        a = torch.full((1 << 22,), float(rank + 1), device=dev)
        for _ in range(30):  # keep the side stream busy: an op not waiting for it would read a too early
            a = a * 1.0 + 0.0
        handle = hvd.allreduce_async(a, op=hvd.Sum, name="side stream")
        small = [torch.full((100,), float(rank + k), device=dev) + 0.0 for k in range(8)]
        doubled = [out * 2 for out in hvd.grouped_allreduce(small, op=hvd.Sum)]
        total = hvd.synchronize(handle) * 2
    if stream is not None:
        torch.cuda.current_stream(dev).wait_stream(stream)
    same(total, torch.full((1 << 22,), 2.0 * sum(r + 1 for r in range(size))), "the side stream's allreduce")
    for k, out in enumerate(doubled):
        same(out, torch.full((100,), 2.0 * sum(r + k for r in range(size))), f"the side stream's fused #{k}")
    return 1


def test_a_users_side_stream() -> None:
    assert gloo_world(_side_stream, 2) == [1, 1]


def _one_rank(rank: int, size: int) -> int:
    checks, last = every_kind(rank, size)
    assert last == 0
    _fusion(rank, size)
    _amp(rank, size)
    _sync_batch_norm(rank, size)
    return checks


def test_a_one_rank_nccl_world() -> None:
    assert nccl_world(_one_rank, 1)[0] >= 70
