"""Horovod 0.28.1 parity of ``hvd.elastic`` (issue 24): the ElasticSampler's design and the states' API.

The facts come from Horovod 0.28.1's ``horovod/torch/elastic/{sampler,state}.py`` and ``horovod/common/elastic.py``
and its own single-process test of the sampler (``test/single/test_torch_elastic.py::test_elastic_sampler``),
whose steps the first test follows (on 1 rank, where its counts hold, and on 2, scaled by the size).
"""

from __future__ import annotations

import random
from typing import Any

from torch.utils.data import DataLoader

import hora as hvd
from tests.distributed.harness import run_ranks

BATCH = 2
PER_RANK = 8


def _horovods_sampler_steps(rank: int, size: int) -> None:
    dataset = list(range(PER_RANK * size))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    state = hvd.elastic.TorchState(sampler=sampler)
    state.sync()
    assert (sampler.epoch, sampler.processed_num) == (0, 0)
    per_step = BATCH * size  # record_batch counts the global batch: every rank's samples of it

    batches = 0
    for epoch in range(2):  # ordinary epochs: the count grows by a global batch per step
        sampler.set_epoch(epoch)
        for batch_idx, _ in enumerate(loader):
            sampler.record_batch(batch_idx, BATCH)
            assert sampler.processed_num == per_step * (batch_idx + 1)
            batches += 1
    assert batches == 2 * PER_RANK // BATCH

    # without set_epoch the count stays, and a new pass over the loader deals the same samples again
    assert sum(1 for _ in loader) == PER_RANK // BATCH
    assert sampler.processed_num == len(sampler) * size

    sampler.set_epoch(2)  # a partial epoch, committed
    assert sampler.processed_num == 0
    sampler.record_batch(0, BATCH)
    sampler.record_batch(1, BATCH)
    state.commit()
    sampler.record_batch(2, BATCH)
    sampler.record_batch(3, BATCH)
    assert sampler.processed_num == 4 * per_step
    state.restore()  # back to the commit
    assert sampler.processed_num == 2 * per_step
    sampler.record_batch(2, BATCH)  # after a restore the next batch counts again
    assert sampler.processed_num == 3 * per_step
    state.commit()
    state.sync()
    assert sampler.processed_num == 3 * per_step  # (Horovod's test: 3 * batch_size * hvd.size())

    # the rest of the epoch is dealt again: one batch per rank is left
    assert len(sampler) == BATCH
    assert sum(1 for _ in loader) == 1
    sampler.set_epoch(3)  # the next epoch starts over
    assert len(sampler) == PER_RANK
    assert sum(1 for _ in loader) == PER_RANK // BATCH


def test_elastic_sampler_counts_processed_samples_as_horovod_028s_does() -> None:
    """Horovod 0.28.1's ElasticSampler keeps ``processed_num``, a count of samples: ``record_batch(batch_idx,
    batch_size)`` adds ``batch_size * num_replicas``, ``state_dict()`` is ``{'epoch', 'processed_num'}``,
    ``restore()`` puts the committed count back and the next ``record_batch`` counts again (hora's
    ``processed_indices`` design raised AttributeError on ``processed_num``, and after a restore marked nothing).
    Horovod's own test_elastic_sampler, step by step, on 1 rank and on 2."""
    run_ranks(_horovods_sampler_steps, 1)
    run_ranks(_horovods_sampler_steps, 2)


def _orders_and_checkpoints(rank: int, size: int) -> dict[str, Any]:
    dataset = list(range(10))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=5)
    sampler.set_epoch(1)
    out: dict[str, Any] = {"mine": list(iter(sampler))}
    sampler.record_batch(0, 2)  # 2 samples on each of 2 ranks
    out["state"] = sampler.state_dict()
    other = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=5)
    other.load_state_dict({"epoch": 1, "processed_num": 4})  # e.g. from a Horovod checkpoint
    out["resumed"] = list(iter(other))
    return out


def test_the_epoch_order_and_state_dict_are_horovod_028s_so_checkpoints_load_across() -> None:
    """Horovod 0.28.1 shuffles ``range(len(dataset))`` with ``random.Random(seed + epoch)`` and deals rank r
    every size-th sample from position r; its state_dict ``{'epoch': 1, 'processed_num': 4}`` resumes after the
    first 4 samples of epoch 1's order."""
    results = run_ranks(_orders_and_checkpoints, 2)
    order = list(range(10))
    random.Random(5 + 1).shuffle(order)
    for rank, out in enumerate(results):
        assert out["mine"] == order[rank::2]
        assert out["state"] == {"epoch": 1, "processed_num": 4}
        assert out["resumed"] == order[4:][rank::2]  # the 6 left, 3 per rank



class _Counter:
    def __init__(self, value: int) -> None:
        self.value = value


class _CounterHandler(hvd.elastic.state.StateHandler):
    """A handler of one's own, written as for Horovod: the value is ``self.value``, save/restore/sync."""

    def __init__(self, counter: _Counter) -> None:
        super().__init__(counter)
        self.saved = counter.value

    def save(self) -> None:
        self.saved = self.value.value

    def restore(self) -> None:
        self.value.value = self.saved

    def sync(self) -> None:
        self.value.value = self.saved = hvd.broadcast_object(self.saved, 0, name="test.counter")


def _custom_handler(rank: int, size: int) -> list[int]:
    from hora.elastic import state as elastic_state

    registry = elastic_state.get_handler_registry()
    elastic_state.set_handler_registry([*registry, (_Counter, _CounterHandler)])
    try:
        state = hvd.elastic.TorchState(counter=_Counter(10 + rank), epoch=rank)
        seen = []
        state.sync()  # rank 0's counter everywhere
        seen.append(state.counter.value)
        state.counter.value = 20
        state.commit()
        state.counter.value = 30
        state.restore()
        seen.append(state.counter.value)
        state.counter = _Counter(40)  # a new object for the attribute: the handler tracks it (set_value)
        state.counter.value = 41
        state.restore()
        seen.append(state.counter.value)
        return seen
    finally:
        elastic_state.set_handler_registry(registry)


def test_torch_state_takes_handlers_of_ones_own_from_the_registry_as_horovod_028() -> None:
    """Horovod 0.28.1's TorchState finds each value's handler in a registry of (type, StateHandler subclass)
    that ``set_handler_registry`` extends; assigning a new object calls the handler's ``set_value`` (which
    saves it)."""
    assert run_ranks(_custom_handler, 2) == [[10, 20, 40], [10, 20, 40]]
