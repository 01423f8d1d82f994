"""hora.elastic on real processes: State commit/restore/sync, and resets driven through the store.

The reset tests play the launcher's driver themselves (process 0 of the fork harness writes the worlds and
host updates into the rendezvous store, with the key names and JSON of the elastic contract), so the worker
side is tested without ``hora run``: a world shrinks at a host removal, grows when a new worker is ready, and
loses a worker that dies mid-step. Each training run records every global batch it applied; a one-process
replay of exactly those batches must give the same parameters (no committed step lost or repeated), and
every sample must be applied exactly once per epoch across the resize.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hora as hvd
from hora.common import env as hora_env
from hora.elastic import notifications
from hora.protocol.signedstore import SignedStore
from hora.runtime import lifecycle as runtime
from tests.distributed.harness import run_ranks
from tests.elastic_job import check_same_training
from tests.polling import wait_until

SAMPLES = 24
BATCH = 2  # per rank
EPOCHS = 2
LR = 0.1


# --- State in a fixed world ----------------------------------------------------------------------------
def _state_ranks(rank: int, size: int) -> dict[str, Any]:
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.fill_(float(rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model, opt, epoch=rank, batch=10 * rank)
    calls: list[str] = []
    state.register_reset_callbacks([lambda: calls.append("reset")])
    state.sync()  # rank 0's model, optimizer and values everywhere
    out: dict[str, Any] = {"synced": (model.weight.sum().item(), state.epoch, state.batch)}
    state.epoch, state.batch = 5, 7
    with torch.no_grad():
        model.weight.fill_(2.0)
    state.commit()  # outside an elastic job: saves, and finds no host update
    state.epoch = 6
    with torch.no_grad():
        model.weight.fill_(3.0)
    F.mse_loss(model(torch.ones(2, 3)), torch.zeros(2, 1)).backward()
    opt.step()  # momentum buffers appear after the commit
    state.restore()
    out["restored"] = (model.weight.sum().item(), state.epoch, state.batch, len(opt.state))
    state.on_reset()
    out["calls"] = calls
    return out


def test_state_sync_commit_restore_and_reset_callbacks() -> None:
    for out in run_ranks(_state_ranks, 2):
        assert out["synced"] == (0.0, 0, 0)
        assert out["restored"] == (6.0, 5, 7, 0)  # the commit's weights and values, no optimizer state yet
        assert out["calls"] == ["reset"]


def _run_once_ranks(rank: int, size: int) -> tuple[int, str]:
    calls = []

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> None:
        calls.append(state.value)
        hvd.allreduce(torch.ones(1), name="ok")
        if rank == 1:
            raise hvd.HorovodInternalError("lost a peer")  # what a failed collective raises

    state = hvd.elastic.ObjectState(value=rank)
    try:
        train(state)
    except hvd.HorovodInternalError as e:
        return len(calls), str(e)
    return len(calls), ""


def test_run_outside_an_elastic_job_calls_once_and_raises_failures() -> None:
    assert run_ranks(_run_once_ranks, 2) == [(1, ""), (1, "lost a peer")]


# --- resets driven through the store -------------------------------------------------------------------
def _data(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    x = torch.randn(4, generator=g)
    return x, x.sum(dim=0, keepdim=True) * 0.5 + 1.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _replay(batches: list[tuple[int, ...]]) -> list[float]:
    """One process applying the same global batches with plain SGD (mean loss over the global batch)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in batches:
        xs, ys = zip(*(_data(i) for i in batch), strict=True)
        opt.zero_grad()
        F.mse_loss(model(torch.stack(xs)), torch.stack(ys)).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


class _Driver:
    """The launcher's side of the contract, played by process 0."""

    def __init__(self) -> None:
        raw = dist.TCPStore("127.0.0.1", int(os.environ["HORA_STORE_PORT"]), is_master=False, wait_for_workers=False)
        self.store = SignedStore(raw, hora_env.job_secret(), os.environ["HORA_JOB_ID"], "127.0.0.1")
        self.base = f"hora/{os.environ['HORA_JOB_ID']}/elastic/"
        self.updates = 0

    def wait_ready(self, workers: list[str], last_gen: int, timeout: float = 60.0) -> None:
        def ready(key: str) -> bool:
            return bool(self.store.check([key])) and self.store.get(key).decode() == str(last_gen)

        deadline = time.monotonic() + timeout
        for w in workers:
            assert wait_until(lambda w=w: ready(f"{self.base}ready/{w}"), timeout=deadline - time.monotonic(),
                              step=0.01), f"{w} never posted ready after world {last_gen}"

    def publish(self, gen: int, workers: list[str]) -> None:
        members = {w: {"rank": r, "local_rank": 0, "local_size": 1, "cross_rank": r, "cross_size": len(workers),
                       "hostname": w.split(":")[0]} for r, w in enumerate(workers)}
        record = {"gen": gen, "size": len(workers), "workers": members, "updates": self.updates}
        self.store.set(f"{self.base}world/{gen}", json.dumps(record))
        self.store.set(f"{self.base}gen", str(gen))

    def host_update(self, added: list[str], removed: list[str]) -> None:
        self.store.set(f"{self.base}update/{self.updates + 1}", json.dumps({"added": added, "removed": removed}))
        self.updates += 1

    def wait_key(self, key: str, timeout: float = 60.0) -> None:
        assert wait_until(lambda: self.store.check([key]), timeout=timeout, step=0.01), f"no {key}"


@dataclass(frozen=True)
class Setup:
    """What the elastic training script trains: ``build()`` gives the model, its DistributedOptimizer, more
    TorchState values, a call after each step and a report of extra results (called at the end); a commit every
    ``commit_every`` steps."""

    build: Callable[[], tuple[nn.Module, Any, dict[str, Any], Callable[[], None], Callable[[], dict[str, Any]]]]
    commit_every: int = 1


def _sgd() -> tuple[nn.Module, Any, dict[str, Any], Callable[[], None], Callable[[], dict[str, Any]]]:
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters())
    return model, opt, {}, lambda: None, dict


SGD_EVERY_STEP = Setup(_sgd)


def _train(hook: Callable[[Any], None], setup: Setup = SGD_EVERY_STEP) -> dict[str, Any]:
    """An elastic training script as a Horovod user writes it (ElasticSampler, TorchState, commits)."""
    hvd.init()
    dataset = list(range(SAMPLES))
    model, opt, values, after_step, report = setup.build()
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, steps=0, applied=(), sizes=(), **values)
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.epoch < EPOCHS:
            mine = list(iter(state.sampler))
            for idx in range(math.ceil(len(mine) / BATCH)):
                hook(state)
                batch = mine[idx * BATCH:(idx + 1) * BATCH]
                xs, ys = zip(*(_data(i) for i in batch), strict=True)
                opt.zero_grad()
                F.mse_loss(state.model(torch.stack(xs)), torch.stack(ys)).backward()
                opt.step()
                after_step()
                everyone = hvd.allgather_object(batch, name="test.batch")
                state.sampler.record_batch(idx, BATCH)
                state.applied = (*state.applied, tuple(i for part in everyone for i in part))
                state.sizes = (*state.sizes, hvd.size())
                state.steps += 1
                if state.steps % setup.commit_every == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    return {"params": params, "applied": state.applied, "sizes": state.sizes, "resets": resets,
            "rank": hvd.rank(), "size": hvd.size(), "gen": runtime.world_generation(), **report()}


def _worker(worker: str, hook: Callable[[Any], None], setup: Setup = SGD_EVERY_STEP) -> dict[str, Any] | str:
    os.environ.update(HORA_ELASTIC="1", HORA_WORKER_ID=worker, HORA_HOSTNAME=worker.split(":")[0],
                      HORA_ELASTIC_TIMEOUT="60")
    try:
        return _train(hook, setup)
    except SystemExit as e:
        return f"left with {e.code}"


def _key(name: str) -> str:
    """A key of this test's job (the harness's store serves every test of the session)."""
    return f"test/{os.environ['HORA_JOB_ID']}/{name}"


def _signal_and_wait(at_step: int) -> Callable[[Any], None]:
    """Rank 0 tells the test driver it has committed ``at_step`` steps, waits until the driver acted, then
    until its update watcher announced the update to its peers. The peers wait in this step's allreduce
    meanwhile, so every rank has passed ``at_step`` commits when the announcement arms them: the interrupt
    comes at the next commit."""
    def hook(state: Any) -> None:
        if state.steps == at_step and hvd.rank() == 0 and runtime.world_generation() == 1:
            store = runtime.state().job_store
            store.set(_key("at"), "1")
            assert wait_until(lambda: store.check([_key("go")]), timeout=60, step=0.01), "the driver never acted"
            assert wait_until(lambda: notifications.watch.announced >= 1, timeout=60, step=0.01), (
                "the update watcher never announced the update")
    return hook


def _check_training(results: list[dict[str, Any]], sizes: list[int]) -> None:
    first = results[0]
    check_same_training(results, SAMPLES, EPOCHS)
    assert sorted(set(first["sizes"])) == sorted(sizes)
    assert first["params"] == pytest.approx(_replay(list(first["applied"])), rel=1e-5, abs=1e-6)


def _shrink(rank: int, size: int, setup: Setup = SGD_EVERY_STEP) -> Any:
    if rank == 0:
        d = _Driver()
        workers = ["h1:0", "h2:0", "h3:0"]
        d.wait_ready(workers, 0)
        d.publish(1, workers)
        d.wait_key(_key("at"))
        d.host_update(added=[], removed=["h3"])
        d.store.set(_key("go"), "1")
        d.wait_ready(workers, 1)  # the removed worker resets too, then sees it is not in world 2
        d.publish(2, workers[:2])
        return "driver"
    # (a commit every step) 2 steps of 3 x 2 samples: 12 left, 6 per rank; interrupted at the next commit
    return _worker(f"h{rank}:0", _signal_and_wait(setup.commit_every), setup)


def test_a_removed_host_leaves_with_exit_0_and_the_rest_go_on() -> None:
    results = run_ranks(_shrink, 4, init=False, timeout=120)
    assert results[3] == "left with 0"
    survivors = results[1:3]
    assert [(r["rank"], r["size"], r["gen"]) for r in survivors] == [(0, 2, 2), (1, 2, 2)]
    assert survivors[0]["resets"] == [2]
    assert survivors[0]["sizes"][:2] == (3, 3) and survivors[0]["sizes"][2] == 2  # resized at the commit
    _check_training(survivors, [3, 2])


def _grow(rank: int, size: int, setup: Setup = SGD_EVERY_STEP) -> Any:
    if rank == 0:
        d = _Driver()
        d.wait_ready(["h1:0", "h2:0", "h3:0"], 0)  # h3 is ready at once, but joins only at a commit
        d.publish(1, ["h1:0", "h2:0"])
        d.wait_key(_key("at"))
        d.host_update(added=["h3"], removed=[])
        d.store.set(_key("go"), "1")
        d.wait_ready(["h1:0", "h2:0"], 1)
        d.publish(2, ["h1:0", "h2:0", "h3:0"])
        return "driver"
    return _worker(f"h{rank}:0", _signal_and_wait(2), setup)  # 3 steps of 2 x 2 samples: 12 left, 4 per rank


def test_a_new_worker_joins_at_a_commit_and_gets_the_state() -> None:
    results = run_ranks(_grow, 4, init=False, timeout=120)
    workers = results[1:]
    assert [(r["rank"], r["size"], r["gen"]) for r in workers] == [(0, 3, 2), (1, 3, 2), (2, 3, 2)]
    assert workers[0]["sizes"][:3] == (2, 2, 2) and workers[0]["sizes"][3] == 3
    assert workers[2]["resets"] == []  # the new worker was never reset: it started in world 2
    _check_training(workers, [2, 3])


def _die_at(at_step: int, worker: str) -> Callable[[Any], None]:
    def hook(state: Any) -> None:
        if state.steps == at_step and os.environ.get("HORA_WORKER_ID") == worker:
            os._exit(9)  # dies between two steps, without a word to anyone
    return hook


def _failure(rank: int, size: int, setup: Setup = SGD_EVERY_STEP, die_at: int = 2) -> Any:
    if rank == 0:
        d = _Driver()
        workers = ["h1:0", "h2:0", "h3:0"]
        d.wait_ready(workers, 0)
        d.publish(1, workers)
        d.wait_ready(workers[:2], 1)  # the survivors' collective failed: they restored and reset
        d.publish(2, workers[:2])
        return "driver"
    if rank == 3:  # the worker that dies runs in a child process, so this harness rank can report it
        pid = os.fork()
        if pid == 0:
            _worker("h3:0", _die_at(die_at, "h3:0"), setup)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        return f"died with {os.waitstatus_to_exitcode(status)}"
    return _worker(f"h{rank}:0", _die_at(die_at, "h3:0"), setup)  # 2 steps of 3 x 2 samples: 12 left, 6 per rank


def test_a_dead_worker_makes_the_survivors_restore_the_last_commit_and_go_on() -> None:
    results = run_ranks(_failure, 4, init=False, timeout=120)
    assert results[3] == "died with 9"
    survivors = results[1:3]
    assert [(r["rank"], r["size"], r["gen"]) for r in survivors] == [(0, 2, 2), (1, 2, 2)]
    assert survivors[0]["sizes"][:2] == (3, 3) and survivors[0]["sizes"][2] == 2
    _check_training(survivors, [3, 2])


def _paced(rank: int, size: int) -> Any:
    """Ranks commit at different paces, with a collective only every 10 commits (so they drift apart by
    several commits), while the driver announces a host removal."""
    if rank == 0:
        d = _Driver()
        workers = ["h1:0", "h2:0", "h3:0"]
        d.wait_ready(workers, 0)
        d.publish(1, workers)
        d.wait_key(_key("at"))
        d.host_update(added=[], removed=["h3"])
        return "driver"
    os.environ.update(HORA_ELASTIC="1", HORA_WORKER_ID=f"h{rank}:0", HORA_HOSTNAME=f"h{rank}",
                      HORA_ELASTIC_TIMEOUT="60")
    hvd.init()
    state = hvd.elastic.ObjectState(commits=0)
    rng = random.Random(rank)
    try:
        for i in range(3000):
            if i == 15 and hvd.rank() == 0:
                runtime.state().job_store.set(_key("at"), "1")
            if i % 10 == 0:
                hvd.allreduce(torch.ones(1), name=f"sync.{i}")
            time.sleep(rng.random() * 0.002 * rank)
            state.commits += 1
            state.commit()
    except hvd.elastic.HostsUpdatedInterrupt as e:
        return state.commits, e.skip_sync
    return state.commits, None


def test_every_rank_raises_hosts_updated_at_the_same_commit() -> None:
    results = run_ranks(_paced, 4, init=False, timeout=120)
    commits, skip_sync = results[1]
    assert skip_sync is True  # only a removal: no sync needed
    assert commits > 15
    assert results[1:] == [(commits, True)] * 3, "ranks raised at different commits"


# --- a new worker builds alone while the others train ------------------------------------------------------
BUILD_STEPS = 5  # steps the members must make while the newcomer builds (it waits for them)
PLANNED = {"right": (2, 3, 0, 1, 2, 3), "stale": (3, 4, 1, 2, 0, 1)}  # the launcher's start values for h3


def _slow_builder(rank: int, size: int, first: str, plan: str) -> Any:
    if rank == 0:
        d = _Driver()
        d.wait_ready(["h1:0", "h2:0"], 0)
        d.publish(1, ["h1:0", "h2:0"])
        d.wait_ready(["h3:0"], 0)  # the newcomer posts ready only at its first collective or hvd.elastic.run
        d.host_update(added=["h3"], removed=[])
        d.wait_ready(["h1:0", "h2:0"], 1)
        d.publish(2, ["h1:0", "h2:0", "h3:0"])
        return "driver"
    worker = f"h{rank}:0"
    os.environ.update(HORA_ELASTIC="1", HORA_WORKER_ID=worker, HORA_HOSTNAME=f"h{rank}", HORA_ELASTIC_TIMEOUT="60")
    store = dist.TCPStore("127.0.0.1", int(os.environ["HORA_STORE_PORT"]), is_master=False, wait_for_workers=False)
    out: dict[str, Any] = {}
    if worker == "h3:0":  # starts while world 1 trains, with the place the launcher planned for it
        names = ("HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE", "HORA_CROSS_RANK", "HORA_CROSS_SIZE")
        os.environ.update({n: str(v) for n, v in zip(names, PLANNED[plan], strict=True)})
        assert wait_until(lambda: int(store.add(_key("steps"), 0)) >= 1, timeout=60, step=0.01), (
            "world 1 never stepped")
        hvd.init()
        out["shown"] = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                        hvd.cross_size(), runtime.is_alone())
        begun = int(store.add(_key("steps"), 0))
        # a slow build: the members go on
        if not wait_until(lambda: int(store.add(_key("steps"), 0)) >= begun + BUILD_STEPS, timeout=60, step=0.01):
            return "the members stopped stepping while the newcomer built"
    else:
        hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR * hvd.size()),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0, sizes=())
    resets: list[int] = []

    def on_reset() -> None:
        resets.append(hvd.size())
        for group in opt.param_groups:
            group["lr"] = LR * hvd.size()
        if first == "collective" and worker != "h3:0":  # meets the newcomer's collective before train()
            out["hello"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="hello").item()

    state.register_reset_callbacks([on_reset])
    if first == "collective" and worker == "h3:0":  # its first collective joins the job's world
        out["hello"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="hello").item()
        out["after_hello"] = (hvd.rank(), hvd.size(), runtime.is_alone())

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.sizes.count(3) < 3:
            assert state.step < 5000, "the newcomer never joined"
            x, y = _data(state.step)
            opt.zero_grad()
            F.mse_loss(state.model(x.unsqueeze(0)), y.unsqueeze(0)).backward()
            opt.step()
            state.step += 1
            state.sizes = (*state.sizes, hvd.size())
            if hvd.rank() == 0 and hvd.size() == 2:
                store.add(_key("steps"), 1)
            state.commit()

    train(state)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    out.update(params=params, sizes=state.sizes, resets=resets, lr=opt.param_groups[0]["lr"], rank=hvd.rank(),
               size=hvd.size(), gen=runtime.world_generation(), alone_after=runtime.is_alone())
    return out


@pytest.mark.parametrize(("first", "plan"), [("run", "right"), ("collective", "right"), ("run", "stale")])
def test_a_new_worker_sees_the_world_it_joins_from_init_and_builds_while_the_others_train(first: str,
                                                                                        plan: str) -> None:
    """Horovod 0.28.1 starts a new worker with the rank and size of the world it joins: ``hvd.size()`` read
    right after ``hvd.init()`` (a DistributedSampler built at start-up) is the size it trains with. hora gives it
    the launcher's planned place at once and lets it build while the members train on (it waits for
    BUILD_STEPS of their steps: with a join in ``hvd.init()`` the members would sit in the state sync waiting
    for it); it joins at its first collective or ``hvd.elastic.run`` call. The reset callbacks run on it only
    when it joined elsewhere than ``hvd.init()`` said (a stale plan)."""
    results = run_ranks(_slow_builder, 4, first, plan, init=False, timeout=120)
    assert all(isinstance(r, dict) for r in results[1:]), results  # a string names what went wrong
    h1, h2, h3 = results[1:]
    assert h3["shown"] == (*PLANNED[plan], True)  # the planned place, before it joined
    if first == "collective":
        assert h3["hello"] == h1["hello"] == 3.0 and h3["after_hello"] == (2, 3, False)
    assert [(r["rank"], r["size"], r["gen"], r["alone_after"]) for r in (h1, h2, h3)] == [
        (0, 3, 2, False), (1, 3, 2, False), (2, 3, 2, False)]
    assert h1["sizes"].count(2) >= 1 + BUILD_STEPS and h1["sizes"][-3:] == (3, 3, 3)
    assert h1["resets"] == [3]
    assert h3["resets"] == ([3] if plan == "stale" else [])  # its callbacks ran only when the plan was stale
    for r in (h1, h2, h3):
        assert r["params"] == h1["params"] and r["sizes"] == h1["sizes"]
        assert r["lr"] == pytest.approx(LR * 3)
