"""``ElasticSampler``: splits an epoch's samples over the ranks, and again over a new world mid-epoch.

Each epoch has one order of all samples (shuffled with ``seed + epoch`` on every rank alike). The samples
not yet processed this epoch are dealt round-robin to the ranks of the current world; after a reset the
samples that remain are dealt again over the new world. ``record_batch(batch_idx, batch_size)`` after each
optimizer step marks the whole global batch as processed (every rank's part of it: the ranks stepped
together), so the samples a failed rank had processed before the last commit are not processed again.
Kept in a ``TorchState``, the processed samples are saved by ``commit()``, restored after a failure, and
united over the ranks by ``sync()``.

As in Horovod and ``torch.utils.data.DistributedSampler``, when the remaining samples do not divide evenly
over the ranks, the first few are dealt again to fill the last round (at most ``size() - 1`` samples), so
every rank runs the same number of steps.

Example:
    >>> sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)     # doctest: +SKIP
    >>> loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch

from hora import runtime


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's ``hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)``.

    Args:
        dataset: anything with a length; its indices ``0..len-1`` are sampled.
        shuffle: deal the samples in a random order (the same on every rank; a new one each epoch).
        seed: the shuffle's seed (plus the epoch).
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []  # this rank's samples of the current pass
        self._dealt: list[int] = []  # every rank's samples of the current pass, round-robin (rank r: [r::n])
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet, a new order."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark global batch ``batch_idx`` of the current pass processed: every rank's ``batch_size`` samples
        of it (call it after the optimizer step that used them; ``batch_idx`` counts from 0 in each pass)."""
        start = batch_idx * batch_size * self.num_replicas
        stop = min((batch_idx + 1) * batch_size, self.num_samples) * self.num_replicas
        self.processed_indices.update(self._dealt[start:stop])

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark ``indices`` (samples this rank processed) as processed."""
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's samples of batch ``batch_idx`` of the current pass."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Deal the samples not processed this epoch over the current world (``hvd.size()`` ranks)."""
        initialized = runtime.is_initialized()
        self.num_replicas = runtime.size() if initialized else 1
        self.rank = runtime.rank() if initialized else 0
        self.remaining_indices = [i for i in self._order() if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self._deal()

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def _deal(self) -> None:
        dealt = list(self.remaining_indices)
        if dealt:
            while len(dealt) < self.total_size:  # fill the last round (more than once only for tiny datasets)
                dealt += dealt[:self.total_size - len(dealt)]
        self._dealt = dealt
        self.indices = dealt[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        self._deal()
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples
