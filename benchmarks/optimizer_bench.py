"""Step time of hora's DistributedOptimizer vs DDP vs per-tensor allreduce on ResNet-50, 2 ranks, loopback.

Every variant trains its own copy of ResNet-50 (25.6 M parameters, 161 gradient tensors, 97.5 MB of fp32
gradients) on small synthetic images, so communication is a large share of the step, as on a real
multi-node job. Variants run alternately in the same processes (A B C ... A B C), each sample the mean of a
few steps; figures are medians with the spread, and ratios are taken pair by pair against DDP.

    python benchmarks/optimizer_bench.py            # ~3-4 minutes on 2 cores
    python benchmarks/optimizer_bench.py --quick    # a smoke run

Variants: ``local`` (no communication, the floor), ``ddp`` (DistributedDataParallel, bucket_cap_mb=25),
``per_tensor`` (one synchronous torch.distributed allreduce per gradient after backward), ``hora``
(DistributedOptimizer), ``hora_fp16`` / ``hora_bf16`` (with compression).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from common import (
    add_output_flags,
    alternate_steps,
    fork_ranks,
    machine_info,
    markdown_table,
    output_dir,
    ratio_summary,
    summarize,
    write_results,
)

VARIANTS = ("local", "ddp", "per_tensor", "hora", "hora_fp16", "hora_bf16")


def _build(variant: str) -> tuple[Any, Any, Any]:
    """(model, optimizer, after_backward) for one variant."""
    import torch
    import torch.distributed as dist
    from resnet50_synthetic import ResNet50

    import hora as hvd

    torch.manual_seed(0)
    model = ResNet50(num_classes=1000)
    after = None
    if variant == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if variant.startswith("hora"):
        comp = {"hora": hvd.Compression.none, "hora_fp16": hvd.Compression.fp16,
                "hora_bf16": hvd.Compression.bf16}[variant]
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
    elif variant == "per_tensor":
        size = dist.get_world_size()

        def after() -> None:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(size)
    return model, opt, after


def _rank(rank: int, size: int, variants: list[str], repeats: int, steps: int, batch: int, image: int) -> dict:
    import torch
    import torch.nn.functional as F

    import hora as hvd

    torch.set_num_threads(1)  # two ranks share two cores
    hvd.init()
    built = {v: _build(v) for v in variants}
    data = torch.randn(batch, 3, image, image)
    target = torch.randint(0, 1000, (batch,))

    def step_of(variant: str):
        model, opt, after = built[variant]

        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(model(data), target).backward()
            if after is not None:
                after()
            opt.step()
        return step

    result = alternate_steps({v: step_of(v) for v in variants}, repeats, steps, hvd.barrier)
    hvd.shutdown()
    return result


def _ratio(s: list[float], base: list[float] | None) -> str:
    if not base:
        return ""
    r = ratio_summary(s, base)
    return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"


def report(result: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> str:
    wall, cpu = result["wall"], result["cpu"]
    rows = []
    for v, s in wall.items():
        st, cst = summarize(s), summarize(cpu[v])
        rows.append([v, f"{st['median'] * 1e3:.0f}", f"{st['min'] * 1e3:.0f}-{st['max'] * 1e3:.0f}",
                     _ratio(s, wall.get("ddp")), f"{cst['median'] * 1e3:.0f}", _ratio(cpu[v], cpu.get("ddp"))])
    head = (f"ResNet-50 ({args.batch}x3x{args.image}x{args.image} per rank), 2 ranks on loopback (Gloo), "
            f"{args.repeats} alternating samples of {args.steps} step(s) each; rank 0's clocks. Ratios are "
            "medians of per-pair ratios (min-max). CPU = process time of all of rank 0's threads, which the "
            "load of other processes on the machine disturbs far less than wall time.\n\n")
    return head + markdown_table(["variant", "step ms (median)", "min-max ms", "wall vs DDP", "CPU ms/step",
                                  "CPU vs DDP"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--steps", type=int, default=1, help="steps per sample")
    p.add_argument("--batch", type=int, default=2, help="images per rank")
    p.add_argument("--image", type=int, default=32, help="side: small, so communication is a large share")
    p.add_argument("--variants", default=",".join(VARIANTS))
    add_output_flags(p, "2 samples of 1 step of the hora and DDP variants: checks that it runs")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 2, 1
        if args.variants == ",".join(VARIANTS):
            args.variants = "ddp,hora"
    variants = args.variants.split(",")
    results = fork_ranks(_rank, 2, variants, args.repeats, args.steps, args.batch, args.image, timeout=1800)
    samples = results[0]["wall"]  # rank 0's clock; the barrier aligns the ranks' samples
    md = report(results[0], args)
    print(md)

    def plot(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        names = list(samples)
        med = [summarize(samples[n])["median"] * 1e3 for n in names]
        quart = [statistics.quantiles(samples[n], n=4) if len(samples[n]) > 1 else [samples[n][0]] * 3
                 for n in names]  # the shared machine's load makes min-max meaningless: show quartiles
        lo = [m - q[0] * 1e3 for m, q in zip(med, quart)]
        hi = [q[2] * 1e3 - m for m, q in zip(med, quart)]
        ax.bar(names, med, yerr=[lo, hi], capsize=4, color=["#999", "#4477aa", "#cc6677", "#228833", "#66ccee",
                                                             "#aa3377"][: len(names)])
        ax.set_ylabel("step time, ms (median, quartiles)")
        ax.set_title("ResNet-50 step, 2 ranks on loopback: hora vs DDP vs per-tensor allreduce")

    data = {"machine": machine_info(), "args": vars(args), "samples_s": results, "markdown": md}
    for path in write_results("optimizer_bench", data, md, plot, output_dir(args)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
