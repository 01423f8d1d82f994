"""One measurement of benchmarks/shaped_links.py, run on every rank by ``hora run`` on the shaped hosts.

Each mode alternates its variants in one run, rotating which goes first every cycle
(:func:`hora.bench.timing.alternate`), and rank 0 writes every sample to ``--out`` as JSON:

  ps            hora's ring allreduce against a parameter server (rank 0 serves and is a worker too; every
                receive posted at once, the data in chunks so the server sends chunk k back while chunk k+1
                arrives; the sum with torch in place, no Python copies); and how busy the machine's cores
                were during each (/proc/stat: all the simulated hosts share them)
  compression   allreduce (Average) with compression none, fp16 and bf16, and the cores' busy share
  wire16        raw 16-bit allreduce summed by Gloo against benchmarks/wire16.py's float32 sum, raw float32
  optimizer     a DistributedOptimizer step against a DDP step on the same model and data
  gradsync      DistributedOptimizer steps with compression none, fp16 and bf16, and the step without sync
  hierarchical  flat against hierarchical allreduce (started with HOROVOD_HIERARCHICAL_ALLREDUCE=1)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import wire16
from torch import nn

import hora as hvd
from hora.bench import cpu, models
from hora.bench.timing import alternate
from hora.datapath import hierarchical
from hora.runtime import lifecycle as runtime


def _jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat: every simulated host shares its cores."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(vals) - vals[3] - vals[4], sum(vals)


def timed(fn: Callable[[], Any], busy: list[float] | None = None) -> Callable[[], float]:
    """A sample of ``fn``'s time after a barrier; with ``busy``, also the fraction of the machine's cores that
    were busy meanwhile (appended to it)."""
    def sample() -> float:
        dist.barrier()
        before = _jiffies()
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        if busy is not None:
            after = _jiffies()
            busy.append((after[0] - before[0]) / max(1, after[1] - before[1]))
        return took

    return sample


class ParameterServer:
    """Sum ``tensor`` over every rank through rank 0, with torch.distributed point-to-point at its best."""

    def __init__(self, tensor: torch.Tensor, chunks: int) -> None:
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.parts = list(tensor.chunk(chunks))
        self.out = [torch.empty_like(p) for p in self.parts]
        # the server's receive buffers, allocated once (not timed)
        self.bufs = [[torch.empty_like(p) for p in self.parts] for _ in range(self.size - 1)] if self.rank == 0 else []

    def __call__(self) -> None:
        if self.rank == 0:
            recvs = [[dist.irecv(self.bufs[w - 1][c], src=w, tag=c) for w in range(1, self.size)]
                     for c in range(len(self.parts))]  # every receive posted at once
            sends = []
            for c, part in enumerate(self.parts):
                total = self.out[c]
                total.copy_(part)
                for w, work in enumerate(recvs[c]):
                    work.wait()
                    total.add_(self.bufs[w][c])
                sends += [dist.isend(total, dst=w, tag=c) for w in range(1, self.size)]
            for work in sends:
                work.wait()
        else:
            works = [dist.isend(p, dst=0, tag=c) for c, p in enumerate(self.parts)]
            works += [dist.irecv(o, src=0, tag=c) for c, o in enumerate(self.out)]
            for work in works:
                work.wait()


def _alternate_busy(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int) -> dict[str, Any]:
    """``alternate`` of the timed ``fns``: {"samples": ..., "cpu_busy": the cores' busy share per sample}."""
    busy: dict[str, list[float]] = {k: [] for k in fns}
    samples = alternate({k: timed(fn, busy[k]) for k, fn in fns.items()}, repeats, warmup=warmup)
    return {"samples": samples, "cpu_busy": {k: v[-repeats:] for k, v in busy.items()}, "cores": os.cpu_count()}


def mode_ps(ns: argparse.Namespace) -> dict[str, Any]:
    numel = ns.bytes // 4
    ring_t = torch.ones(numel)
    ps_t = torch.ones(numel)
    ps = ParameterServer(ps_t, ns.chunks)
    check = ParameterServer(torch.full((1000,), float(hvd.rank() + 1)), 2)
    check()
    expect = hvd.size() * (hvd.size() + 1) / 2
    assert all(bool((o == expect).all()) for o in check.out), "the parameter server summed wrongly"
    busy: dict[str, list[float]] = {"ring": [], "ps": []}
    samples = alternate({"ring": timed(lambda: hvd.allreduce_(ring_t, op=hvd.Sum), busy["ring"]),
                         "ps": timed(ps, busy["ps"])}, ns.repeats, warmup=1)
    return {"bytes": numel * 4, "chunks": ns.chunks, "samples": samples,
            "cpu_busy": {k: v[-ns.repeats:] for k, v in busy.items()}, "cores": os.cpu_count()}


def mode_compression(ns: argparse.Namespace) -> dict[str, Any]:
    """hvd.allreduce (out-of-place, Average) with compression none, fp16 and bf16, alternated; and this
    host's CPU rates (hora.bench.cpu) for the planner's prediction."""
    t = torch.randn(ns.bytes // 4)
    variants: dict[str, Callable[[], Any]] = {
        name: lambda c=c: hvd.allreduce(t, op=hvd.Average, compression=c)
        for name, c in (("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16), ("bf16", hvd.Compression.bf16))}
    return {"bytes": t.numel() * 4, **_alternate_busy(variants, ns.repeats, warmup=1), "cpu": cpu.measure().as_dict()}


def mode_wire16(ns: argparse.Namespace) -> dict[str, Any]:
    """Where a 16-bit allreduce's time goes, in place with no hora on top: raw float32 (the reference), raw
    16-bit summed by Gloo, and 16-bit through hora.sum16 (alltoall, float32 sum, allgather)."""
    numel = ns.bytes // 4
    f32 = torch.randn(numel)
    f16 = {dt: torch.randn(numel).to(dt) for dt in (torch.float16, torch.bfloat16)}
    group = dist.group.WORLD
    variants = {"fp32": timed(lambda: dist.all_reduce(f32))}
    for dt, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        variants[f"{name}_gloo_sum"] = timed(lambda t=f16[dt]: dist.all_reduce(t))
        variants[f"{name}_wire16"] = timed(lambda t=f16[dt]: wire16.allreduce_async(t, group).wait())
    return {"bytes": numel * 4, "samples": alternate(variants, ns.repeats, warmup=1)}


def _step_fn(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
             sync_first: bool = False) -> Callable[[], None]:
    """One training step. ``sync_first``: reduce every gradient, then step once (``synchronize()``, then
    ``step()`` under ``skip_synchronize()``), the DistributedOptimizer's update not overlapped with the wire."""
    loss = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss(model(x), y).backward()
        if sync_first:
            opt.synchronize()  # type: ignore[attr-defined]
            with opt.skip_synchronize():  # type: ignore[attr-defined]
                opt.step()
        else:
            opt.step()

    return step


def _data(ns: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(ns.batch_size, *models.input_shape(ns.model, ns.image_size))
    return x, torch.randint(0, models.classes(ns.model), (ns.batch_size,))


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
}


def _hora_optimizer(model: nn.Module, optimizer: str = "sgd", **kwargs: Any) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(OPTIMIZERS[optimizer](model.parameters()),
                                    named_parameters=model.named_parameters(), **kwargs)


def mode_optimizer(ns: argparse.Namespace) -> dict[str, Any]:
    """A DistributedOptimizer step (25 MB buckets as DDP; its update overlaps the wire) against a DDP step with
    the same optimizer, model and data; the same DistributedOptimizer stepping once after every bucket is back
    (``hora_sync_first``: no update overlap); the step without any sync (one rank's compute); with
    ``--one-bucket`` also one bucket of every gradient (``num_groups=1``: no overlap, one op).
    (HORA_BUCKET_CAP_MB cannot vary per optimizer: the knobs are read once, at hvd.init().)"""
    torch.manual_seed(0)
    names = ["hora", "hora_sync_first", "ddp", "local"] + (["hora_one_bucket"] if ns.one_bucket else [])
    nets = {k: models.build(ns.model) for k in names}
    for net in nets.values():
        net.load_state_dict(nets["hora"].state_dict())
    ddp = nn.parallel.DistributedDataParallel(nets["ddp"])
    x, y = _data(ns)
    make = OPTIMIZERS[ns.optimizer]
    steps = {"hora": _step_fn(nets["hora"], _hora_optimizer(nets["hora"], ns.optimizer), x, y),
             "hora_sync_first": _step_fn(nets["hora_sync_first"], _hora_optimizer(nets["hora_sync_first"],
                                                                                  ns.optimizer), x, y, sync_first=True),
             "ddp": _step_fn(ddp, make(ddp.parameters()), x, y),
             "local": _step_fn(nets["local"], make(nets["local"].parameters()), x, y)}
    if ns.one_bucket:
        steps["hora_one_bucket"] = _step_fn(nets["hora_one_bucket"],
                                            _hora_optimizer(nets["hora_one_bucket"], ns.optimizer, num_groups=1), x, y)
    return {"model": ns.model, "optimizer": ns.optimizer, "gradient_bytes": models.parameter_bytes(nets["hora"]),
            "image_size": ns.image_size, "batch_size": ns.batch_size,
            **_alternate_busy(steps, ns.repeats, warmup=2)}


def mode_gradsync(ns: argparse.Namespace) -> dict[str, Any]:
    """Gradient sync as training does it: DistributedOptimizer steps with compression none, fp16 and bf16
    (reused buckets, the cast done on the copy into them), and the same step with no sync at all."""
    torch.manual_seed(0)
    variants = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16, "bf16": hvd.Compression.bf16}
    nets = {k: models.build(ns.model) for k in [*variants, "local"]}
    for net in nets.values():
        net.load_state_dict(nets["none"].state_dict())
    x, y = _data(ns)
    steps = {k: _step_fn(nets[k], _hora_optimizer(nets[k], compression=c), x, y) for k, c in variants.items()}
    steps["local"] = _step_fn(nets["local"], torch.optim.SGD(nets["local"].parameters(), lr=0.01), x, y)
    return {"model": ns.model, "gradient_bytes": models.parameter_bytes(nets["none"]), "image_size": ns.image_size,
            "batch_size": ns.batch_size, **_alternate_busy(steps, ns.repeats, warmup=2)}


def mode_hierarchical(ns: argparse.Namespace) -> dict[str, Any]:
    """hvd.allreduce_ flat, the hierarchy's chosen way and the ways its groups also allow (shared memory: the
    shard and leader ways; shard: the leader way); and two references without hora: torch.distributed's own
    ring on the 6 ranks, and the hosts' leaders alone allreducing across hosts (no intra-host step: the
    wire's bound on this machine)."""
    h = runtime.hierarchy()
    if h is None:
        raise SystemExit("start with HOROVOD_HIERARCHICAL_ALLREDUCE=1 on several ranks per host")
    check = torch.full((1000,), float(hvd.rank()))
    assert bool((hvd.allreduce(check, op=hvd.Sum) == sum(range(hvd.size()))).all())
    t = torch.ones(ns.bytes // 4)
    chosen = h.mode

    def flat() -> None:
        with hierarchical.flat(runtime.hierarchy()):
            hvd.allreduce_(t, op=hvd.Sum)

    def way(mode: str) -> Callable[[], None]:
        def run() -> None:
            h.mode = mode
            try:
                hvd.allreduce_(t, op=hvd.Sum)
            finally:
                h.mode = chosen
        return run

    ways: dict[str, Callable[[], Any]] = {"flat": flat, "hierarchical": way(chosen)}
    for other in {"shm": ("shard", "leader"), "shard": ("leader",)}.get(chosen, ()):  # what its groups allow
        ways[other] = way(other)
    big = torch.arange(ns.bytes // 4, dtype=torch.float32) % 1000 + hvd.rank()  # exact in float32
    expect = (torch.arange(ns.bytes // 4, dtype=torch.float32) % 1000) * hvd.size() + sum(range(hvd.size()))
    for name, fn in ways.items():  # every way gives the flat ring's result, exactly (and warms up)
        t.copy_(big)
        fn()
        assert torch.equal(t, expect), f"{name}: wrong result"
    del big, expect
    t.fill_(1.0)

    def raw_leaders() -> None:
        if h.rank == h.leader:
            dist.all_reduce(t, group=h.cross_group)

    variants = {**ways, "raw_ring": lambda: dist.all_reduce(t), "raw_leaders": raw_leaders}
    return {"bytes": t.numel() * 4, "way": chosen, **_alternate_busy(variants, ns.repeats, warmup=0)}


MODES = {"ps": mode_ps, "compression": mode_compression, "wire16": mode_wire16, "gradsync": mode_gradsync,
         "optimizer": mode_optimizer, "hierarchical": mode_hierarchical}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("--out", required=True)
    p.add_argument("--bytes", type=int, default=100 * 2**20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd", help="optimizer: the torch optimizer")
    p.add_argument("--one-bucket", action="store_true", help="optimizer: add the one-bucket variant")
    ns = p.parse_args()
    hvd.init()
    result = MODES[ns.mode](ns)
    if hvd.rank() == 0:
        result.update(mode=ns.mode, ranks=hvd.size())
        Path(ns.out).write_text(json.dumps(result, indent=1) + "\n")
    hvd.shutdown()


if __name__ == "__main__":
    main()
