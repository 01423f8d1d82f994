"""Elastic training with a sharded optimizer and an LR scheduler, through real resets (the store-driven worlds of
tests/distributed/test_elastic.py).

AdamW's moments live only on their owners; when a host leaves, joins, or a worker dies, the state must reach
the new world's owners exactly (the dead worker's shard from the copy its neighbour kept at the last commit),
and a rollback must roll the learning-rate schedule back too. Each run records every global batch it applied;
one process replaying those batches with AdamW and the same schedule must end with the same parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hora as hvd
from hora.training.sharding import _check_nothing_lost
from hora.training.state_exchange import Offer
from tests.distributed.harness import run_ranks
from tests.distributed.test_elastic import EPOCHS, SAMPLES, Setup, _data, _failure, _grow, _shrink

COMMIT_EVERY = 2  # steps between commits: a failure rolls back a step, and the schedule with it


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _schedule(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _replay(batches: list[tuple[int, ...]]) -> list[float]:
    model = _model()
    opt = _adamw(model)
    sched = _schedule(opt)
    for batch in batches:
        xs, ys = zip(*(_data(i) for i in batch), strict=True)
        opt.zero_grad()
        F.mse_loss(model(torch.stack(xs)), torch.stack(ys)).backward()
        opt.step()
        sched.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _sharded(mode: str, commit_every: int) -> Setup:
    """AdamW sharded as ``mode``, a StepLR schedule in the TorchState, a commit every ``commit_every`` steps."""
    def build() -> tuple[nn.Module, Any, dict[str, Any], Callable[[], None], Callable[[], dict[str, Any]]]:
        model = _model()
        opt = hvd.DistributedOptimizer(_adamw(model), named_parameters=model.named_parameters(), sharding=mode)
        sched = _schedule(opt)  # on the DistributedOptimizer
        owned: list[tuple[int, list[str]]] = []

        def after_step() -> None:
            sched.step()
            owned.append((hvd.size(), opt.owned_parameter_names()))

        def report() -> dict[str, Any]:
            return {"owned": owned[-1], "lr": opt.param_groups[0]["lr"], "with_state": len(opt.state),
                    "every": len(list(model.parameters()))}
        return model, opt, {"scheduler": sched}, after_step, report
    return Setup(build, commit_every)


def _check(results: list[dict[str, Any]], sizes: list[int]) -> None:
    first = results[0]
    for r in results[1:]:
        assert r["params"] == first["params"], "ranks ended with different parameters"
        assert r["applied"] == first["applied"]
    assert sorted(set(first["sizes"])) == sorted(sizes)
    samples = [i for batch in first["applied"] for i in batch]
    assert sorted(samples) == sorted(list(range(SAMPLES)) * EPOCHS), "samples lost or repeated"
    # the state moved to the last world's owners: a partition, each rank holding its own entries only
    names = [n for r in results for n in r["owned"][1]]
    assert all(r["owned"][0] == first["size"] for r in results)
    assert len(names) == len(set(names)) == first["every"], names
    assert [r["with_state"] for r in results] == [len(r["owned"][1]) for r in results]
    assert first["params"] == pytest.approx(_replay(list(first["applied"])), rel=1e-5, abs=1e-6)
    assert first["lr"] == pytest.approx(0.05 * 0.5 ** (len(first["applied"]) // 2))  # StepLR(2, 0.5)


@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
def test_a_dead_workers_shard_comes_from_its_neighbours_copy_and_the_schedule_rolls_back(mode: str) -> None:
    """h3 dies after step 3, one step past the commit at step 2: the survivors roll back the model, the
    optimizer shards, the schedule and the data, take h3's shard from the copy h1 kept at the commit, and
    train on at 2 ranks, ending where one process applying the same batches ends."""
    results = run_ranks(_failure, 4, _sharded(mode, COMMIT_EVERY), 3, init=False, timeout=180)
    assert results[3] == "died with 9"
    survivors = results[1:3]
    assert [(r["rank"], r["size"]) for r in survivors] == [(0, 2), (1, 2)]
    assert survivors[0]["sizes"][:2] == (3, 3) and survivors[0]["sizes"][2] == 2  # step 3 was rolled back
    _check(survivors, [3, 2])


def test_a_removed_hosts_shard_moves_to_the_survivors() -> None:
    results = run_ranks(_shrink, 4, _sharded("gradients", COMMIT_EVERY), init=False, timeout=180)
    assert results[3] == "left with 0"
    _check(results[1:3], [3, 2])


def test_a_new_worker_gets_its_share_of_the_state() -> None:
    # a commit every step: the new worker joins after 3 steps of 2 x 2 samples, 12 left, 4 per rank
    results = run_ranks(_grow, 4, _sharded("optimizer", 1), init=False, timeout=180)
    workers = results[1:]
    assert [(r["rank"], r["size"]) for r in workers] == [(0, 3), (1, 3), (2, 3)]
    assert workers[2]["with_state"] > 0  # the new worker owns, and holds, some of the moved state
    _check(workers, [2, 3])


# --- losing a shard and its copy ------------------------------------------------------------------------
World = tuple[int, tuple[int, ...]]


def _offer(world: World | None, member: int, stateful: bool = True, copy_world: World | None = None) -> Offer:
    """A survivor's offer: its live state owned as ``member`` of ``world``, and the copy it kept at its last
    commit there as ``member`` (the previous member's shard)."""
    live = (world, member) if world is not None else None
    kept = (copy_world or world, member) if world is not None else None
    return Offer((), (), (), (live, kept, stateful))


def test_a_shard_is_lost_only_when_its_rank_and_the_copy_keeper_both_left() -> None:
    old = (1, (0, 1, 2, 3))
    # members 0 and 2 survive, keeping the copies of 3 and 1: nothing lost
    _check_nothing_lost([_offer(old, 0), _offer(old, 2)])
    # members 0 and 1 survive: member 2's shard was on 2 and its copy on 3, both gone
    with pytest.raises(hvd.ShardStateLostError, match=r"rank\(s\) \[2\]"):
        _check_nothing_lost([_offer(old, 0), _offer(old, 1)])
    # a copy kept in an older world does not cover a shard of the newer one
    newer = (2, (0, 1, 4, 5))
    with pytest.raises(hvd.ShardStateLostError, match=r"\[1\]"):
        _check_nothing_lost([_offer(newer, 0, copy_world=old), _offer(newer, 2, copy_world=old),
                             _offer(newer, 3, copy_world=old)])
    # nobody holds any state yet (before the first step): nothing to lose
    _check_nothing_lost([_offer(old, 0, stateful=False), _offer(None, 0, stateful=False)])
