"""The hardened NCCL paths, on two or more GPUs (one rank each), each test one that a bug there would fail:

- torch's and Horovod's AMP recipes in fp16 and bf16, and SyncBatchNorm, on NCCL against one process on the
  whole batch;
- a training step with SyncBatchNorm that never waits for the GPU (``torch.cuda.set_sync_debug_mode("error")``);
- a rank killed in the middle of a backward pass: the survivors raise within a bound (not at NCCL's timeout),
  rebuild their world in the same processes and finish the training as one process would;
- a script's NCCL-only default group: hora's CPU collectives still work;
- uneven allgathers, many in a row, their inputs produced on a busy side stream and their results read on
  another: every iteration's result is checked on the GPU (a padded buffer reused too early corrupts one);
- the hierarchical allreduce's bus bandwidth against flat NCCL, written as a report (never asserted);
- a CUDA tensor on another GPU than hora's refused; GPU Adasum as Horovod's (a host's ranks averaged, then
  Adasum across hosts), in less memory than one copy per rank.

Under ``HORA_GPU_SUITE_ON_CPU=1`` the same bodies run on CPU tensors over Gloo (docs/testing.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hora as hvd
from hora.datapath import hierarchical
from hora.datapath.kinds import adasum
from hora.errors import InvalidCallError
from hora.runtime import lifecycle as runtime
from hora.testing import run_ranks
from tests.distributed.expect import reduce
from tests.distributed.test_elastic import _Driver, _key
from tests.gpu.common import ON_CPU, TIMEOUT_S, as_hosts, cuda_devices, device, nccl_world, same
from tests.gpu.test_one_gpu import _amp, _sync_batch_norm


def _ranks(most: int = 4) -> int:
    return min(cuda_devices(), most)


# --- AMP and SyncBatchNorm on NCCL ----------------------------------------------------------------------------
def _amp_every_recipe(rank: int, size: int) -> list[Any]:
    return [_amp(rank, size, recipe, dtype) for recipe in ("horovod", "torch")
            for dtype in (torch.float16, torch.bfloat16)]


@pytest.mark.gpu(2)
def test_grad_scaler_both_recipes_fp16_and_bf16_on_nccl() -> None:
    results = nccl_world(_amp_every_recipe, _ranks())
    assert all(r == results[0] for r in results), "ranks ended with different loss scales or parameters"


@pytest.mark.gpu(2)
def test_sync_batch_norm_on_nccl() -> None:
    assert nccl_world(_sync_batch_norm, _ranks()) == [1] * _ranks()


# --- a step that never waits for the GPU ----------------------------------------------------------------------
def _step_without_host_sync(rank: int, size: int) -> list[float]:
    """Forward with SyncBatchNorm, backward, DistributedOptimizer step: after a first step (plans the
    buckets, loads the kernels), the second runs with CUDA's sync debug mode on "error", so any wait of the
    host for the GPU anywhere (a host-to-device copy of a Python number, an .item()) raises."""
    dev = device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 4)).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 3, 8, 8, generator=g).to(dev), torch.randn(4, 4, generator=g).to(dev)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    step()
    if not ON_CPU:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        if not ON_CPU:
            torch.cuda.set_sync_debug_mode("default")
    return [float(p.detach().double().sum()) for p in model.parameters()]


@pytest.mark.gpu(2)
def test_a_training_step_never_waits_for_the_gpu() -> None:
    results = nccl_world(_step_without_host_sync, _ranks())
    assert all(r == results[0] for r in results), "ranks ended with different parameters"


# --- a rank killed mid-backward -------------------------------------------------------------------------------
SAMPLES, BATCH, EPOCHS, LR = 24, 2, 2, 0.05
RECOVERY_DEADLINE_S = 90.0  # far below the collective timeout the test sets (600 s): recovery is not the watchdog


def _sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    x = torch.randn(16, generator=g)
    return x, x[:4].sum(0, keepdim=True)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def _replay(batches: list[tuple[int, ...]]) -> list[float]:
    """One process on the CPU applying the same global batches (mean loss over the global batch)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in batches:
        xs, ys = zip(*(_sample(i) for i in batch), strict=True)
        opt.zero_grad()
        F.mse_loss(model(torch.stack(xs)), torch.stack(ys)).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _elastic_training(victim: str, at_step: int) -> dict[str, Any]:
    """An elastic script; ``victim`` exits inside the backward pass of step ``at_step``, when the first layer's
    gradient is computed (the later layers' buckets are on the wire by then)."""
    hvd.init()
    dev = device()
    model = _mlp().to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, steps=0, applied=())
    resets: list[tuple[float, int]] = []
    state.register_reset_callbacks([lambda: resets.append((time.time(), hvd.size()))])
    me = os.environ["HORA_WORKER_ID"]

    def die_mid_backward(grad: torch.Tensor) -> torch.Tensor:
        if me == victim and state.steps == at_step:
            runtime.state().job_store.set(_key("died_at"), str(time.time()))
            os._exit(9)
        return grad

    model[0].weight.register_hook(die_mid_backward)

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.epoch < EPOCHS:
            mine = list(iter(state.sampler))
            for idx in range(math.ceil(len(mine) / BATCH)):
                batch = mine[idx * BATCH:(idx + 1) * BATCH]
                xs, ys = zip(*(_sample(i) for i in batch), strict=True)
                opt.zero_grad()
                F.mse_loss(state.model(torch.stack(xs).to(dev)), torch.stack(ys).to(dev)).backward()
                opt.step()
                everyone = hvd.allgather_object(batch, name="test.batch")
                state.sampler.record_batch(idx, BATCH)
                state.applied = (*state.applied, tuple(i for part in everyone for i in part))
                state.steps += 1
                state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    pid = os.getpid()
    train(state)
    store = runtime.state().job_store
    return {"params": torch.cat([p.detach().cpu().reshape(-1) for p in model.parameters()]).tolist(),
            "applied": state.applied, "resets": resets, "died_at": float(store.get(_key("died_at")).decode()),
            "same_process": os.getpid() == pid, "size": hvd.size(), "gen": runtime.world_generation()}


def _worker(index: int, workers: list[str]) -> dict[str, Any] | str:
    worker = workers[index]
    os.environ.update(HORA_ELASTIC="1", HORA_WORKER_ID=worker, HORA_HOSTNAME=worker.split(":")[0],
                      HORA_ELASTIC_TIMEOUT="120", HORA_COLLECTIVE_TIMEOUT="600",
                      HORA_FIRST_BUCKET_MB="0.01", HORA_BUCKET_CAP_MB="0.01")  # a bucket per layer
    if not ON_CPU:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index)  # a GPU of its own, as on its own host
    return _elastic_training(workers[-1], 2)


def _killed_mid_backward(rank: int, size: int) -> Any:
    workers = [f"h{i}:0" for i in range(1, size)]
    if rank == 0:  # the launcher's side: the first world, then the survivors' after the failure
        d = _Driver()
        d.wait_ready(workers, 0)
        d.publish(1, workers)
        d.wait_ready(workers[:-1], 1, timeout=RECOVERY_DEADLINE_S + 60)
        d.publish(2, workers[:-1])
        return "driver"
    if rank == size - 1:  # the victim runs in a child process, so this harness rank can report its end
        pid = os.fork()
        if pid == 0:
            _worker(rank - 1, workers)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        return f"died with {os.waitstatus_to_exitcode(status)}"
    return _worker(rank - 1, workers)


@pytest.mark.gpu(2)
def test_a_rank_killed_mid_backward_the_survivors_recover_in_process() -> None:
    workers = _ranks(3)
    results = run_ranks(_killed_mid_backward, workers + 1, init=False, timeout=TIMEOUT_S + 120)
    assert results[-1] == "died with 9"
    survivors = results[1:-1]
    for r in survivors:
        assert r["same_process"] and (r["gen"], r["size"]) == (2, workers - 1), r
        assert len(r["resets"]) == 1, f"resets {r['resets']}"
        took = r["resets"][0][0] - r["died_at"]
        assert took < RECOVERY_DEADLINE_S, f"recovered {took:.0f} s after the death (NCCL's watchdog, not hora?)"
        assert r["params"] == survivors[0]["params"] and r["applied"] == survivors[0]["applied"]
    epochs: list[list[int]] = [[]]
    for batch in survivors[0]["applied"]:
        if len(epochs[-1]) == SAMPLES:
            epochs.append([])
        epochs[-1].extend(batch)
    assert [sorted(e) for e in epochs] == [list(range(SAMPLES))] * EPOCHS, "samples lost or repeated"
    assert survivors[0]["params"] == pytest.approx(_replay(list(survivors[0]["applied"])), rel=1e-4, abs=1e-5)


# --- a script's NCCL-only default group --------------------------------------------------------------------------
def _under_an_nccl_only_default_group(rank: int, size: int) -> dict[str, Any]:
    """``init_process_group("nccl")`` before ``hvd.init()``, as torchrun scripts do (the dry run: "cuda:gloo",
    a default group without a CPU backend either)."""
    if not ON_CPU:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore(os.environ["HORA_STORE_ADDR"], int(os.environ["HORA_STORE_PORT"]), is_master=False)
    mine = dist.PrefixStore(f"user/{os.environ['HORA_JOB_ID']}", store)
    dist.init_process_group("cuda:gloo" if ON_CPU else "nccl", store=mine, rank=rank, world_size=size)
    try:
        hvd.init()
        dev = device()
        torch.manual_seed(rank)
        model = nn.Linear(5, 3).to(dev)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # its layout check is a CPU allgather
        torch.manual_seed(0)
        same(model.weight.detach(), nn.Linear(5, 3).weight.detach(), "rank 0's parameters")
        got = hvd.broadcast_object({"from": rank}, root_rank=size - 1)
        metric = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, name="a CPU metric")
        on_device = hvd.allreduce(torch.full((4,), float(rank), device=dev), op=hvd.Sum, name="on the device")
        same(on_device, torch.full((4,), float(sum(range(size)))), "a device allreduce")
        hvd.shutdown()
        return {"object": got, "metric": metric.item()}
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu(2)
def test_a_scripts_nccl_only_default_group_keeps_horas_cpu_collectives() -> None:
    n = _ranks()
    assert run_ranks(_under_an_nccl_only_default_group, n, init=False, timeout=TIMEOUT_S) == \
        [{"object": {"from": n - 1}, "metric": float(n * (n + 1) // 2)}] * n


# --- uneven allgathers fed by a busy stream ---------------------------------------------------------------------
ITERATIONS = 40


def _uneven_allgathers(rank: int, size: int) -> list[int]:
    """Rank r gathers ``base + 1000 r`` rows (rank 0 sends the fewest: its input is padded on hora's launch
    stream). Inputs are made on a side stream that is busy (on every rank but 0, so rank 0 runs ahead) and
    the results read on the default stream, which is the one that waits for the collectives: rank 0's next
    padding must not land in memory its previous allgather is still sending. Each iteration's result is
    compared on the GPU with what it must be, without waiting for it on the host."""
    dev = device()
    base, cols = (1 << 10, 8) if ON_CPU else (1 << 16, 64)  # 16 MB a rank on a GPU
    rows = [base + 1000 * r for r in range(size)]
    owner = torch.repeat_interleave(torch.arange(size, device=dev), torch.tensor(rows, device=dev))  # (sum rows,)
    side = None if ON_CPU else torch.cuda.Stream(dev)
    busy = None if ON_CPU or rank == 0 else torch.randn(2048, 2048, device=dev)
    wrong = torch.zeros(ITERATIONS, dtype=torch.int64, device=dev)
    for it in range(ITERATIONS):
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if busy is not None:
                for _ in range(10):
                    busy = busy @ busy / busy.norm()  # the side stream is busy for a while
            x = torch.full((rows[rank], cols), float(100 * it + rank), device=dev)
            handle = hvd.allgather_async(x, name=f"uneven.{it}")
        out = hvd.synchronize(handle)  # on the default stream
        want = (owner + 100 * it).to(out.dtype)
        wrong[it] = (out != want[:, None]).sum()
    if not ON_CPU:
        torch.cuda.synchronize()
    return wrong.tolist()


@pytest.mark.gpu(2)
def test_uneven_allgathers_fed_by_a_busy_stream_are_right_every_iteration() -> None:
    for rank, wrong in enumerate(nccl_world(_uneven_allgathers, _ranks())):
        bad = {it: n for it, n in enumerate(wrong) if n}
        assert not bad, f"rank {rank}: wrong elements in iterations {bad}"


# --- hierarchical allreduce against flat NCCL: a bandwidth report ----------------------------------------------
REPORT_DIR = Path(os.environ.get("HORA_GPU_REPORT_DIR", "out/gpu-report"))


def _timed(fn: Any, dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start


def _bandwidth(rank: int, size: int) -> dict[str, Any]:
    """Flat and hierarchical allreduces of the same tensors, alternating, 5 timed repeats each after a warm-up;
    the slowest rank's time of each (a collective ends when its last rank does); the results equal."""
    as_hosts(rank, [size // 2, size // 2])
    hvd.init()
    try:
        h = runtime.hierarchy()
        assert h is not None, "no hierarchy on two hosts of several ranks"
        dev = device()
        report: dict[str, Any] = {"ranks": size, "hosts": 2, "way": h.mode, "sizes": {}}
        for nbytes in ((16 << 20,) if ON_CPU else (64 << 20, 256 << 20)):
            n = nbytes // 4
            t = (torch.arange(n, device=dev) % 1000).float() + rank  # whole numbers: every order sums alike

            def flat(t: torch.Tensor = t) -> None:
                with hierarchical.flat(runtime.hierarchy()):
                    hvd.allreduce_(t, op=hvd.Sum, name="bw.flat")

            def hier(t: torch.Tensor = t) -> None:
                hvd.allreduce_(t, op=hvd.Sum, name="bw.hier")

            check = {}
            for name, fn in (("flat", flat), ("hierarchical", hier)):
                t.copy_((torch.arange(n, device=dev) % 1000).float() + rank)
                fn()
                check[name] = t.clone()
            assert torch.equal(check["flat"], check["hierarchical"]), "hierarchical result differs from flat"
            times: dict[str, list[float]] = {"flat": [], "hierarchical": []}
            for _ in range(5):
                for name, fn in (("flat", flat), ("hierarchical", hier)):
                    mine = torch.tensor([_timed(fn, dev)])
                    times[name].append(hvd.allreduce(mine, op=hvd.Max, name=f"bw.t.{name}").item())
            bus = 2 * (size - 1) / size * nbytes  # bytes a ring moves over each rank's link
            report["sizes"][nbytes] = {
                name: {"median_s": statistics.median(ts), "spread_s": max(ts) - min(ts),
                       "bus_GBps": bus / statistics.median(ts) / 1e9} for name, ts in times.items()}
        return report
    finally:
        hvd.shutdown()


@pytest.mark.gpu(4)
def test_hierarchical_bus_bandwidth_against_flat_nccl_report() -> None:
    """A benchmark-style report (docs/testing.md says where it goes and what to record), never a timing
    assertion: the run checks only that both ways give the same sums."""
    n = _ranks(8) // 2 * 2
    report = run_ranks(_bandwidth, n, init=False, timeout=TIMEOUT_S)[0]
    report["device"] = "cpu (dry run)" if ON_CPU else "see nvidia-smi"
    report["load_average"] = os.getloadavg()
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "hierarchical_bandwidth.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"hierarchical ({report['way']} way) against flat, {n} ranks as 2 hosts:"]
    for nbytes, ways in report["sizes"].items():
        lines.append(f"  {int(nbytes) >> 20} MB: " + ", ".join(
            f"{name} {w['bus_GBps']:.1f} GB/s bus ({w['median_s'] * 1e3:.1f} ms, spread {w['spread_s'] * 1e3:.1f})"
            for name, w in ways.items()))
    print("\n".join(lines))
    assert report["way"] == ("shm" if ON_CPU else "shard")


# --- a tensor on another GPU; GPU Adasum -------------------------------------------------------------------------
def _another_gpu(rank: int, size: int) -> str:
    other = torch.device("cuda", (rank + 1) % size)
    with pytest.raises(InvalidCallError) as info:
        hvd.allreduce(torch.ones(3, device=other), name="on another GPU")
    return str(info.value)


@pytest.mark.gpu(2)
@pytest.mark.skipif(ON_CPU, reason="needs two CUDA devices in one process")
def test_a_tensor_on_another_gpu_is_refused() -> None:
    for rank, message in enumerate(nccl_world(_another_gpu, 2)):
        assert f"the tensor is on cuda:{(rank + 1) % 2}, but this rank's collectives run on cuda:{rank}" in message


def _adasum_memory(rank: int, size: int) -> float:
    """The Adasum of 256 MB per rank needs less extra device memory than one more copy of it (an allgather
    alone needed ``size`` copies)."""
    dev = device()
    n = (1 << 16) if ON_CPU else (64 << 20)
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(dev)
    hvd.allreduce_(x.clone(), op=hvd.Adasum, name="warm-up")
    if ON_CPU:
        return 0.0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    hvd.allreduce_(x, op=hvd.Adasum, name="measured")
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(dev) - before) / x.nbytes


@pytest.mark.gpu(2)
def test_gpu_adasum_holds_at_most_half_a_tensor_more() -> None:
    for rank, extra in enumerate(nccl_world(_adasum_memory, _ranks())):
        assert extra < 1.0, f"rank {rank}: Adasum took {extra:.2f} tensors' worth of extra device memory"


def _adasum_hosts(rank: int, size: int) -> None:
    """Two "hosts" of size/2 ranks: Horovod's GPU Adasum averages each host's tensors, then combines the two
    averages (the dry run, on CPU tensors, combines every rank's as Adasum of CPU tensors does)."""
    as_hosts(rank, [size // 2, size // 2], hierarchical=False)
    hvd.init()
    try:
        xs = [torch.randn(1001, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(size)]
        got = hvd.allreduce(xs[rank].to(device()), op=hvd.Adasum, name="hosts")
        half = size // 2
        want = (adasum.adasum_tree(torch.stack(xs)) if ON_CPU
                else adasum.adasum_pair(reduce(xs[:half], hvd.Average), reduce(xs[half:], hvd.Average)))
        same(got, want, "GPU Adasum of two hosts' averages")
    finally:
        hvd.shutdown()


@pytest.mark.gpu(4)
def test_gpu_adasum_averages_within_hosts_and_combines_across() -> None:
    run_ranks(_adasum_hosts, 4, init=False, timeout=TIMEOUT_S)
