"""``ElasticSampler``: splits an epoch's samples over the ranks, and again over a new world mid-epoch.

Horovod 0.28.1's design. Each epoch has one order of all samples: ``range(len(dataset))`` shuffled by
``random.Random(seed + epoch)`` (Python's own generator, as Horovod's, so a Horovod checkpoint of the sampler
means the same samples here). What the epoch has processed is one counter, ``processed_num``: the first
``processed_num`` samples of that order. ``record_batch(batch_idx, batch_size)`` after each optimizer step adds
the whole global batch (``batch_size * num_replicas``: every rank stepped on its part of it), so the counter
stays a prefix of the order however the ranks are dealt. The samples after it are dealt round-robin to the
ranks of the current world (rank ``r`` takes positions ``r, r + n, r + 2n, ...``); after a reset, and whenever
``load_state_dict`` puts a counter back (``restore()``, ``sync()``), they are dealt again over the world of
that moment, so a resize in the middle of an epoch neither loses nor repeats a committed sample.

``state_dict()`` is ``{"epoch", "processed_num"}``, Horovod 0.28.1's, so a checkpoint loads in either.

As in Horovod and ``torch.utils.data.DistributedSampler``, when the remaining samples do not divide evenly
over the ranks, the first few are dealt again to fill the last round (at most ``size() - 1`` samples), so
every rank runs the same number of steps.

Example:
    >>> sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)     # doctest: +SKIP
    >>> loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch

from hora.runtime import lifecycle as runtime

log = logging.getLogger(__name__)


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's ``hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)``.

    Args:
        dataset: anything with a length; its indices ``0..len-1`` are sampled.
        shuffle: deal the samples in a random order (the same on every rank; a new one each epoch).
        seed: the shuffle's seed (plus the epoch); the same on every rank.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0  # the epoch's samples processed so far: the first ones of its order
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []  # the epoch's order after the processed samples
        self.num_samples = 0  # this rank's samples in a pass over the remaining ones
        self.total_size = 0  # num_samples * num_replicas (the remaining ones, filled up to a round)
        self.indices: list[int] = []  # this rank's samples of the current pass
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet, a new order. Call it at the end of an epoch, so that a
        reset in the middle of one does not start it over."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one global batch processed: ``batch_size`` samples on every rank (call it after the optimizer
        step that used them). ``batch_idx`` is accepted for Horovod's signature; the count is what matters."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch": ..., "processed_num": ...}`` (Horovod 0.28.1's)."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a ``state_dict()`` (Horovod's, or hora's before 0.28.1's design: ``{"epoch",
        "processed_indices"}``, counted as that many samples processed) and deal the rest of its epoch again."""
        self.epoch = int(state_dict["epoch"])
        if "processed_num" in state_dict:
            self.processed_num = int(state_dict["processed_num"])
        else:
            processed = state_dict["processed_indices"]
            self.processed_num = len(processed)
            if processed:
                log.warning("ElasticSampler: a state_dict of the older format (the processed samples, not their "
                            "count): counted as %d samples processed; the rest of epoch %d may repeat or skip some "
                            "samples", len(processed), self.epoch)
        self.reset()

    def reset(self) -> None:
        """Deal the samples not processed this epoch over the current world (``hvd.size()`` ranks)."""
        initialized = runtime.is_initialized()
        self.num_replicas = runtime.size() if initialized else 1
        self.rank = runtime.rank() if initialized else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        dealt = list(self.remaining_indices)
        while dealt and len(dealt) < self.total_size:  # fill the last round (more than once: tiny datasets)
            dealt += dealt[:self.total_size - len(dealt)]
        self.indices = dealt[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
