"""``hora bench model``: synthetic-data training throughput, and scaling efficiency against one rank.

For each rank count n of ``--np-list`` (default: 1 and every power of two up to the job's size, and the size),
ranks 0..n-1 train the model on random data with the DistributedOptimizer on a process set of those ranks
(n = 1: the plain optimizer, no hora at all); the others wait. The counts are alternated, rotating the order
each cycle, so that drift of the machine falls on all of them. Throughput is n * batch / step time; scaling
efficiency is throughput(n) / (n * throughput(1)), per cycle, as a median with its spread.

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
from hora.bench.report import Progress, human_bytes, markdown_table
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
        self.model = models.build(cfg.model)
        self.model.train()
        opt: torch.optim.Optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        if n > 1:
            opt = hvd.DistributedOptimizer(opt, named_parameters=self.model.named_parameters(),
                                           compression=COMPRESSIONS[cfg.compression], process_set=process_set)
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0, process_set=process_set)
        self.opt = opt
        shape = models.input_shape(cfg.model, cfg.image_size)
        self.data = torch.randn(cfg.batch_size, *shape)
        self.target = torch.randint(0, models.classes(cfg.model), (cfg.batch_size,))
        self.loss = nn.CrossEntropyLoss()

    def step(self) -> None:
        self.opt.zero_grad()
        self.loss(self.model(self.data), self.target).backward()
        self.opt.step()


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
    for trainer in trainers.values():
        for _ in range(cfg.warmup):
            trainer.step()
    progress = Progress(cfg.repeats, f"model {cfg.model}", enabled=rank == 0)

    def sample(n: int) -> Callable[[], float]:
        def one() -> float:
            hvd.barrier()
            elapsed = 0.0
            if rank < n:
                start = time.perf_counter()
                for _ in range(cfg.steps):
                    trainers[n].step()
                elapsed = (time.perf_counter() - start) / cfg.steps
            return elapsed

        return one

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
    rows = []
    for n in counts:
        step = summarize(samples[str(n)])
        rows.append({"ranks": n, "step_s": step, "images_per_s": n * cfg.batch_size / step["median"],
                     "efficiency": ratio_summary(base, samples[str(n)]), "samples": samples[str(n)]})
    record = {"kind": "model", "model": cfg.model, "batch_size": cfg.batch_size, "image_size": cfg.image_size,
              "compression": cfg.compression, "gradient_bytes": grad_bytes, "ranks": size, "steps": cfg.steps,
              "repeats": cfg.repeats, "rows": rows}
    return record


def markdown(result: dict[str, Any]) -> str:
    headers = ["ranks", "step time (median)", "spread", "images/s", "scaling efficiency vs 1 rank (median, spread)"]
    rows = [[r["ranks"], f"{r['step_s']['median'] * 1e3:.1f} ms", f"{r['step_s']['spread']:.0%}",
             f"{r['images_per_s']:.1f}", f"{r['efficiency']['median']:.2f} ({r['efficiency']['spread']:.0%})"]
            for r in result["rows"]]
    images = "" if result["model"].endswith("mlp") else f", {result['image_size']}px images"
    title = (f"model {result['model']}, batch {result['batch_size']} per rank{images}, gradients "
             f"{human_bytes(result['gradient_bytes'])}, compression {result['compression']}; "
             f"{result['steps']} steps per sample, median of {result['repeats']} alternated samples\n\n")
    return title + markdown_table(headers, rows)


def plot(result: dict[str, Any]) -> Callable[[Any], None]:
    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        ranks = [r["ranks"] for r in result["rows"]]
        ax.plot(ranks, [r["images_per_s"] for r in result["rows"]], "o-", label="measured")
        one = result["rows"][0]["images_per_s"]
        ax.plot(ranks, [one * n for n in ranks], "--", label="linear scaling")
        ax.set_xlabel("ranks")
        ax.set_ylabel("images/s")
        ax.set_title(f"{result['model']} synthetic training throughput")
        ax.legend()
        ax.grid(True, alpha=0.3)

    return draw
