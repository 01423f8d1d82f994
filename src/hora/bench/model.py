"""``hora bench model``: synthetic-data training throughput, and scaling efficiency against one rank.

For each rank count n of ``--np-list`` (default: 1 and every power of two up to the job's size, and the size),
ranks 0..n-1 train the model on random data with the DistributedOptimizer on a process set of those ranks
(n = 1: the plain optimizer, no hora at all); the others wait, one step at a time (every rank passes a barrier
before each step, so no rank waits in a collective for a whole sample: the stall inspector would report that).
The counts are alternated, rotating the order each cycle, so that drift of the machine falls on all of them.
Throughput is n * batch / median step time; scaling efficiency is throughput(n) / (n * throughput(1)), from
the same medians, with the spread of the per-cycle ratios beside it. Each rank trains on its GPU when it has
one (``hora.init()`` bound it), else on the CPU; the defaults (:func:`defaults_for`) depend on which.

Example:
    hora run -np 4 -H a:2,b:2 hora bench model --model resnet50 --batch-size 32 --np-list 1,2,4
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import hora as hvd
from hora.bench import models
from hora.bench.report import Progress, human_bytes, markdown_table, noise_warning, noisy_mark
from hora.bench.sweep import COMPRESSIONS
from hora.bench.timing import alternate, ratio_summary, summarize
from hora.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    model: str = "mlp"
    batch_size: int = 32
    image_size: int = 224
    compression: str = "none"
    np_list: Sequence[int] = ()
    steps: int = 5  # timed steps per sample
    repeats: int = 5  # alternation cycles
    warmup: int = 2  # untimed steps per rank count, before the first cycle
    device: str = "cpu"  # "cuda": this rank's GPU (the one hora.init() bound)


# model, image side, batch per rank: sized so that `hora run -np N hora bench model` finishes in about two
# minutes on a quiet machine (measured: docs/performance.md); ResNet-50 at 224 px is far too slow for that on CPUs.
DEFAULTS = {"cuda": ("resnet50", 224, 32), "cpu": ("resnet18", 64, 32)}


def defaults_for(device: str) -> tuple[str, int, int]:
    """The default (model, image size, batch per rank) on ``device`` ("cuda" or "cpu").

    >>> defaults_for("cpu")
    ('resnet18', 64, 32)
    """
    return DEFAULTS["cuda" if device == "cuda" else "cpu"]


def default_np_list(size: int) -> list[int]:
    """1, 2, 4, ... up to ``size``, and ``size`` itself.

    >>> default_np_list(6)
    [1, 2, 4, 6]
    """
    counts, n = [], 1
    while n < size:
        counts.append(n)
        n *= 2
    return [*counts, size]


class _Trainer:
    """One rank's model, optimizer and synthetic batch for one rank count."""

    def __init__(self, cfg: ModelConfig, n: int, process_set: Any) -> None:
        torch.manual_seed(1234)
        self.device = torch.device(cfg.device)
        self.model = models.build(cfg.model).to(self.device)
        self.model.train()
        opt: torch.optim.Optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        if n > 1:
            opt = hvd.DistributedOptimizer(opt, named_parameters=self.model.named_parameters(),
                                           compression=COMPRESSIONS[cfg.compression], process_set=process_set)
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0, process_set=process_set)
        self.opt = opt
        shape = models.input_shape(cfg.model, cfg.image_size)
        self.data = torch.randn(cfg.batch_size, *shape, device=self.device)
        self.target = torch.randint(0, models.classes(cfg.model), (cfg.batch_size,), device=self.device)
        self.loss = nn.CrossEntropyLoss()

    def step(self) -> None:
        self.opt.zero_grad()
        self.loss(self.model(self.data), self.target).backward()
        self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels are done: its time is real


def run(cfg: ModelConfig) -> dict[str, Any]:
    """Measure on this rank; every rank returns rank 0's record (rank 0 takes part in every count)."""
    size, rank = hvd.size(), hvd.rank()
    counts = sorted(set(cfg.np_list or default_np_list(size)))
    if counts[0] < 1 or counts[-1] > size:
        raise ConfigError(f"--np-list {','.join(map(str, counts))}: counts must be between 1 and the job's "
                          f"{size} ranks (hora run -np N starts them)")
    if 1 not in counts:
        counts.insert(0, 1)
    sets: dict[int, Any] = {}
    for n in counts:  # every rank registers every set, in the same order
        if 1 < n < size:
            sets[n] = hvd.add_process_set(list(range(n)))
        elif n == size:
            sets[n] = hvd.global_process_set
    trainers = {n: _Trainer(cfg, n, sets.get(n)) for n in counts if rank < n}
    grad_bytes = models.parameter_bytes(next(iter(trainers.values())).model) if trainers else 0

    def lockstep(n: int, steps: int) -> float:
        """``steps`` steps of the n-rank trainer on ranks 0..n-1, a barrier of every rank before each: the
        others wait one step at a time. Returns the members' mean step time (0 elsewhere)."""
        elapsed = 0.0
        for _ in range(steps):
            hvd.barrier()
            if rank < n:
                start = time.perf_counter()
                trainers[n].step()
                elapsed += time.perf_counter() - start
        return elapsed / steps

    for n in counts:
        lockstep(n, cfg.warmup)
    progress = Progress(cfg.repeats, f"model {cfg.model}", enabled=rank == 0)

    def sample(n: int) -> Callable[[], float]:
        return lambda: lockstep(n, cfg.steps)

    samples = alternate({str(n): sample(n) for n in counts}, cfg.repeats, warmup=0,
                        after_each=lambda: progress.step())
    progress.close()
    hvd.barrier()
    for ps in sets.values():
        if ps is not hvd.global_process_set:
            hvd.remove_process_set(ps)
    record = _record(cfg, counts, samples, grad_bytes, size) if rank == 0 else None
    return hvd.broadcast_object(record, root_rank=0)  # type: ignore[no-any-return]


def _record(cfg: ModelConfig, counts: list[int], samples: dict[str, list[float]], grad_bytes: int,
            size: int) -> dict[str, Any]:
    base = samples["1"]
    one_rank = cfg.batch_size / summarize(base)["median"]
    rows = []
    for n in counts:
        step = summarize(samples[str(n)])
        images = n * cfg.batch_size / step["median"]
        rows.append({"ranks": n, "step_s": step, "images_per_s": images,
                     "efficiency": ratio_summary(base, samples[str(n)]),  # the per-cycle ratios' summary
                     "efficiency_of_medians": images / (n * one_rank),  # the table's figure: the medians beside it
                     "samples": samples[str(n)]})
    record = {"kind": "model", "model": cfg.model, "batch_size": cfg.batch_size, "image_size": cfg.image_size,
              "compression": cfg.compression, "gradient_bytes": grad_bytes, "ranks": size, "steps": cfg.steps,
              "repeats": cfg.repeats, "device": cfg.device, "rows": rows}
    return record


def markdown(result: dict[str, Any]) -> str:
    headers = ["ranks", "step time (median)", "spread", "images/s",
               "scaling efficiency vs 1 rank (images/s / (ranks x 1 rank's))", "spread (per cycle)"]
    rows = []
    marked = 0
    for r in result["rows"]:
        mark = noisy_mark(r["step_s"]["spread"], r["efficiency"]["spread"])
        marked += bool(mark)
        rows.append([f"{r['ranks']}{mark}", f"{r['step_s']['median'] * 1e3:.1f} ms", f"{r['step_s']['spread']:.0%}",
                     f"{r['images_per_s']:.1f}", f"{r['efficiency_of_medians']:.2f}",
                     f"{r['efficiency']['spread']:.0%}"])
    images = "" if result["model"].endswith("mlp") else f", {result['image_size']}px images"
    title = (f"model {result['model']}, batch {result['batch_size']} per rank{images}, on "
             f"{result.get('device', 'cpu')}, gradients {human_bytes(result['gradient_bytes'])}, compression "
             f"{result['compression']}; {result['steps']} steps per sample, median of {result['repeats']} "
             "alternated samples\n\n")
    return title + markdown_table(headers, rows) + noise_warning(marked, len(rows))


def plot(result: dict[str, Any]) -> Callable[[Any], None]:
    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        ranks = [r["ranks"] for r in result["rows"]]
        ax.plot(ranks, [r["images_per_s"] for r in result["rows"]], "o-", label="measured")
        one = result["rows"][0]["images_per_s"]
        ax.plot(ranks, [one * n for n in ranks], "--", label="linear scaling")
        ax.set_xticks(ranks)  # rank counts are whole numbers
        ax.set_xlabel("ranks")
        ax.set_ylabel("images/s")
        ax.set_title(f"{result['model']} synthetic training throughput")
        ax.legend()
        ax.grid(True, alpha=0.3)

    return draw
