"""Memory and step time of sharded optimizers: hora unsharded / "optimizer" / "gradients" vs DDP, torch's
ZeroRedundancyOptimizer + DDP and FSDP2 (``fully_shard``), on one GPT-style model, CPU ranks on loopback (Gloo).

Two phases in one run:

- **memory**: each variant alone in fresh ranks (a process's peak resident memory is its own): after
  ``hvd.init()`` the kernel's high-water mark is reset, the model is built and wrapped, and a few AdamW steps
  run; each rank reports its peak resident bytes above what it held before the model existed (everything the
  model, its gradients, the optimizer state and the wrappers' buffers cost), and the bytes of parameters,
  gradients and optimizer state it holds after a step (unique storages; FSDP2's are its local shards).
- **time**: every variant built in the same ranks and stepped alternately (A B C ..., rotating), each sample
  the mean of a few steps; medians with the spread, and per-pair ratios against hora unsharded and DDP.
- **collectives**: raw c10d allreduce, reduce-scatter, allgather and one broadcast per owner's segment of
  bucket-sized tensors, alternating: the measurements behind the sharded modes' choice of collectives.

    python benchmarks/sharding_bench.py             # ~10 minutes on 2 cores
    python benchmarks/sharding_bench.py --quick     # a smoke run
"""

from __future__ import annotations

import argparse
import functools
import gc
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    add_output_flags,
    alternate,
    alternate_steps,
    fork_ranks,
    human_bytes,
    machine_info,
    markdown_table,
    output_dir,
    ratio_summary,
    summarize,
    write_results,
)

VARIANTS = ("hora", "hora_optimizer", "hora_gradients", "ddp", "zero_ddp", "fsdp2")
_STATUS = re.compile(r"^(VmRSS|VmHWM):\s+(\d+) kB$", re.M)


# --- the model: a small GPT (token embedding, pre-norm blocks, tied LM head) ----------------------------------
def _model(vocab: int, dim: int, layers: int, seq: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn = nn.MultiheadAttention(dim, max(1, dim // 64), batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            mask = torch.triu(torch.full((x.shape[1], x.shape[1]), float("-inf")), diagonal=1)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Parameter(torch.zeros(seq, dim))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(dim)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos[: idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.ln(x) @ self.tok.weight.t()  # (B, T, vocab), the head tied to the embedding

    torch.manual_seed(0)
    return GPT()


def _build(variant: str, shape: dict[str, int]) -> tuple[Any, Any]:
    """(model to call, optimizer) for one variant."""
    import torch

    import hora as hvd

    model = _model(shape["vocab"], shape["dim"], shape["layers"], shape["seq"])
    adamw = {"lr": 1e-4, "weight_decay": 0.1}
    if variant.startswith("hora"):
        sharding = {"hora": None, "hora_optimizer": "optimizer", "hora_gradients": "gradients"}[variant]
        opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **adamw),
                                       named_parameters=model.named_parameters(), sharding=sharding)
        return model, opt
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    if variant == "zero_ddp":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    return ddp, torch.optim.AdamW(ddp.parameters(), **adamw)


def _step(model: Any, opt: Any, idx: Any) -> None:
    import torch.nn.functional as F

    opt.zero_grad()
    logits = model(idx[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
    opt.step()


def _data(rank: int, shape: dict[str, int]) -> Any:
    import torch

    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=g)


# --- phase 1: memory, one variant per job -----------------------------------------------------------------
def _status() -> dict[str, int]:
    return {k: int(v) * 1024 for k, v in _STATUS.findall(Path("/proc/self/status").read_text())}


def _held_bytes(model: Any, opt: Any) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state this rank holds (each storage counted once)."""
    import torch

    seen: set[int] = set()

    def size(t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        local = getattr(t, "_local_tensor", t)  # FSDP2's DTensor: this rank's shard
        storage = local.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    params = list(model.parameters())
    state = getattr(opt, "optim", opt).state  # ZeroRedundancyOptimizer keeps its shard's state in .optim
    return {"params": sum(size(p) for p in params),
            "grads": sum(size(p.grad) for p in params if p.grad is not None),
            "state": sum(size(v) for entry in state.values() for v in entry.values())}


def _memory_rank(rank: int, size: int, variant: str, shape: dict[str, int], steps: int) -> dict[str, Any]:
    import torch

    import hora as hvd

    torch.set_num_threads(1)
    hvd.init()
    idx = _data(rank, shape)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS
    before = _status()["VmRSS"]
    model, opt = _build(variant, shape)
    for _ in range(steps):
        _step(model, opt, idx)
    peak = _status()["VmHWM"] - before
    held = _held_bytes(model, opt)  # after the last step, before the next zero_grad
    n = sum(p.numel() for p in _model(shape["vocab"], shape["dim"], shape["layers"], shape["seq"]).parameters())
    hvd.shutdown()
    return {"peak": peak, "held": held, "parameters": n}


# --- phase 2: step time, every variant in the same ranks --------------------------------------------------
def _time_rank(rank: int, size: int, variants: list[str], shape: dict[str, int], repeats: int,
               steps: int) -> dict[str, Any]:
    import torch

    import hora as hvd

    torch.set_num_threads(1)
    hvd.init()
    idx = _data(rank, shape)
    built = {v: _build(v, shape) for v in variants}
    result = alternate_steps({v: functools.partial(_step, *built[v], idx) for v in variants}, repeats, steps,
                             hvd.barrier)
    hvd.shutdown()
    return result


# --- phase 3: the collectives a sharded step could use, raw c10d on Gloo ----------------------------------
def _collectives_rank(rank: int, size: int, sizes_mb: list[int], repeats: int) -> dict[str, dict[str, list[float]]]:
    """Per bucket size: allreduce (what hora's sharded modes reduce with on the CPU), reduce-scatter (what they
    could), allgather of equal segments and one broadcast per owner's segment (how updated parameters could
    travel; hora broadcasts)."""
    import warnings

    import torch

    import hora as hvd

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's *_tensor names
    torch.set_num_threads(1)
    hvd.init()
    out: dict[str, dict[str, list[float]]] = {}
    for mb in sizes_mb:
        n = mb * 2**20 // 4 // size * size
        out[f"{mb} MB"] = alternate(_collectives(torch.randn(n), rank, size), repeats=repeats, warmup=1)
    hvd.shutdown()
    return out


def _collectives(full: Any, rank: int, size: int) -> dict[str, Any]:
    """The four ways, each a callable timing one call on ``full`` (a bucket)."""
    import torch
    import torch.distributed as dist

    part = torch.empty(full.numel() // size)
    segments = list(full.chunk(size))

    def timed(fn: Any) -> Any:
        def run() -> float:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return run

    return {
        "allreduce": timed(lambda: dist.all_reduce(full)),
        "reduce_scatter": timed(lambda: dist.reduce_scatter_tensor(part, full)),
        "allgather": timed(lambda: dist.all_gather_into_tensor(full, segments[rank])),
        "broadcast_per_owner": timed(lambda: [dist.broadcast(segments[m], src=m) for m in range(size)]),
    }


# --- the report -------------------------------------------------------------------------------------------
def _ratio(s: list[float], base: list[float] | None) -> str:
    if not base:
        return ""
    r = ratio_summary(s, base)
    return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"


def report(memory: dict[int, dict[str, list[dict[str, Any]]]], timing: dict[str, Any] | None,
           args: argparse.Namespace, load: list[list[float]],
           collectives: dict[str, dict[str, list[float]]] | None = None) -> str:
    shape = _shape(args)
    n = next(iter(next(iter(memory.values())).values()))[0]["parameters"]
    out = [f"GPT-style model: {n / 1e6:.1f} M parameters (vocab {shape['vocab']}, dim {shape['dim']}, "
           f"{shape['layers']} blocks, tied head), AdamW, {shape['batch']} x {shape['seq']} tokens per rank, "
           "CPU ranks on loopback (Gloo), torch's intra-op threads 1 per rank. Load average (1, 5, 15 min) at "
           f"the start of each phase: {load}.\n"]
    for ranks, per_variant in memory.items():
        rows = []
        for v, results in per_variant.items():
            peaks = [r["peak"] for r in results]
            held = results[0]["held"]
            rows.append([v, human_bytes(max(peaks)), human_bytes(min(peaks)), human_bytes(held["params"]),
                         human_bytes(held["grads"]), human_bytes(held["state"]),
                         human_bytes(held["params"] + held["grads"] + held["state"])])
        out.append(f"\n### Memory per rank, {ranks} ranks ({args.memory_steps} steps; rank 0's tensors)\n\n"
                   "Peak = the kernel's high-water mark of resident memory during model build and steps, above "
                   "what the rank held before the model existed.\n\n")
        out.append(markdown_table(["variant", "peak RSS (max rank)", "peak RSS (min rank)", "parameters",
                                   "gradients", "optimizer state", "params+grads+state"], rows))
    if timing is not None:
        wall, cpu = timing["wall"], timing["cpu"]
        rows = []
        for v, s in wall.items():
            st, cst = summarize(s), summarize(cpu[v])
            rows.append([v, f"{st['median'] * 1e3:.0f}", f"{st['min'] * 1e3:.0f}-{st['max'] * 1e3:.0f}",
                         _ratio(s, wall.get("hora")), _ratio(s, wall.get("ddp")), f"{cst['median'] * 1e3:.0f}",
                         _ratio(cpu[v], cpu.get("hora"))])
        out.append(f"\n### Step time, 2 ranks ({args.repeats} alternating samples of {args.steps} step(s); "
                   "rank 0's clocks)\n\nRatios: medians of per-pair ratios (min-max). CPU = process time of all "
                   "of rank 0's threads.\n\n")
        out.append(markdown_table(["variant", "step ms (median)", "min-max ms", "wall vs hora", "wall vs DDP",
                                   "CPU ms/step", "CPU vs hora"], rows))
    if collectives:
        rows = []
        for size_mb, per_op in collectives.items():
            base = per_op["allreduce"]
            for op, s in per_op.items():
                st = summarize(s)
                rows.append([size_mb, op, f"{st['median'] * 1e3:.1f}", f"{st['min'] * 1e3:.1f}-{st['max'] * 1e3:.1f}",
                             _ratio(s, base)])
        out.append(f"\n### The collectives, raw c10d on Gloo, 2 ranks ({args.repeats} alternating samples)\n\n")
        out.append(markdown_table(["bucket", "collective", "ms (median)", "min-max ms", "vs allreduce"], rows))
    return "".join(out)


def _shape(args: argparse.Namespace) -> dict[str, int]:
    return {"vocab": args.vocab, "dim": args.dim, "layers": args.layers, "seq": args.seq, "batch": args.batch}


def main(argv: list[str] | None = None) -> None:
    import os

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--steps", type=int, default=2, help="steps per timed sample")
    p.add_argument("--memory-steps", type=int, default=3)
    p.add_argument("--memory-ranks", default="2,4", help="world sizes of the memory phase")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--no-timing", action="store_true")
    add_output_flags(p, "a tiny model, 2 ranks, 2 samples: checks that every variant runs")
    args = p.parse_args(argv)
    if args.quick:
        args.vocab, args.dim, args.layers, args.seq, args.repeats, args.steps = 512, 64, 2, 16, 2, 1
        args.memory_ranks = "2"
    variants = args.variants.split(",")
    shape = _shape(args)
    load: list[list[float]] = []
    memory: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for ranks in (int(r) for r in args.memory_ranks.split(",")):
        load.append([round(x, 1) for x in os.getloadavg()])
        memory[ranks] = {v: fork_ranks(_memory_rank, ranks, v, shape, args.memory_steps, timeout=1800)
                         for v in variants}
    timing = collectives = None
    if not args.no_timing:
        load.append([round(x, 1) for x in os.getloadavg()])
        timing = fork_ranks(_time_rank, 2, variants, shape, args.repeats, args.steps, timeout=3600)[0]
        load.append([round(x, 1) for x in os.getloadavg()])
        sizes = [1] if args.quick else [4, 25]
        collectives = fork_ranks(_collectives_rank, 2, sizes, args.repeats, timeout=1800)[0]
    md = report(memory, timing, args, load, collectives)
    print(md)

    def plot(fig: Any) -> None:
        ax = fig.add_subplot(1, 2, 1)
        ranks = min(memory)
        names = list(memory[ranks])
        ax.bar(names, [max(r["peak"] for r in memory[ranks][v]) / 2**20 for v in names], color="#4477aa")
        ax.set_ylabel(f"peak RSS above start, MiB ({ranks} ranks, max rank)")
        ax.tick_params(axis="x", rotation=45)
        if timing is not None:
            bx = fig.add_subplot(1, 2, 2)
            bx.bar(names, [summarize(timing["wall"][v])["median"] * 1e3 for v in names], color="#228833")
            bx.set_ylabel("step time, ms (median, 2 ranks)")
            bx.tick_params(axis="x", rotation=45)

    data = {"machine": machine_info(), "args": vars(args), "memory": memory, "timing": timing,
            "collectives": collectives, "load": load, "markdown": md}
    for path in write_results("sharding_bench", data, md, plot, output_dir(args)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
