"""hora.checkpoint.save_sharded / restore_sharded on real ranks: each rank writes its part, a checkpoint of N ranks
restores at M, training resumes bit for bit, a killed or full-disk save never becomes the latest, an asynchronous
save keeps the values of the moment it was asked for."""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hora as hvd
from hora import checkpoint
from hora.errors import CheckpointError
from hora.protocol.jobsecret import ENV_SECRET
from tests.distributed.test_optimizer import run_tensors


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _setup(sharding: str | None) -> tuple[Net, Any, Any]:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), sharding=sharding)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model: Net, opt: Any, sched: Any, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


def _full(model: Net, opt: Any) -> dict[str, Any]:
    """Everything a user would compare: the weights and torch's full optimizer state (a collective)."""
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})  # not the live tensors


def _save_after_training(rank: int, size: int, where: str, sharding: str | None) -> dict[str, Any]:
    model, opt, sched = _setup(sharding)
    _train(model, opt, sched, range(3))
    meta = {"epoch": 3, "seen": [1, 2, 3]}
    path = checkpoint.save_sharded(where, 3, model=model, optimizer=opt, scheduler=sched, meta=meta)
    full = _full(model, opt)
    _train(model, opt, sched, range(3, 5))  # the uninterrupted run, to compare a resumed one with
    return {"path": str(path), "full": full, "continued": _full(model, opt), "owned": opt.owned_parameter_names(),
            "rand": torch.rand(2)}


def _restore(rank: int, size: int, where: str, sharding: str | None, go_on: bool) -> dict[str, Any]:
    torch.manual_seed(50 + rank)
    model, opt, sched = _setup(sharding)
    for p in model.parameters():
        p.data.normal_()  # nothing of the starting point survives
    meta: dict[str, Any] = {}
    step = checkpoint.restore_sharded(where, model=model, optimizer=opt, scheduler=sched, meta=meta)
    out = {"step": step, "meta": meta, "lr": opt.param_groups[0]["lr"], "epoch": sched.last_epoch,
           "full": _full(model, opt), "rand": torch.rand(2)}
    if go_on:
        _train(model, opt, sched, range(3, 5))
        out["continued"] = _full(model, opt)
    return out


def _assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["opt"]["param_groups"] == want["opt"]["param_groups"]
    assert got["opt"]["state"].keys() == want["opt"]["state"].keys()
    for i, entry in want["opt"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["opt"]["state"][i][key], value), (i, key)


@pytest.mark.parametrize("sharding", [None, "optimizer", "gradients"])
def test_saved_at_two_ranks_restores_at_one_two_and_three(tmp_path: Path, sharding: str | None) -> None:
    saved = run_tensors(_save_after_training, 2, str(tmp_path), sharding)
    path = Path(saved[0]["path"])
    assert path == tmp_path / "ckpt-000000003.dcp" and saved[1]["path"] == saved[0]["path"]
    files = sorted(p.name for p in path.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its part
    sizes = [(path / f).stat().st_size for f in files[1:]]
    assert min(sizes) > max(sizes) / 4, sizes  # the model's tensors spread over both writers
    if sharding:
        assert set(saved[0]["owned"]).isdisjoint(saved[1]["owned"])

    for ranks in (1, 2, 3):
        back = run_tensors(_restore, ranks, str(tmp_path), sharding, ranks == 2)
        for r in back:
            assert r["step"] == 3 and r["meta"] == {"epoch": 3, "seen": [1, 2, 3]}
            assert r["epoch"] == 3 and r["lr"] == pytest.approx(0.005)  # StepLR halved it after step 2
            _assert_same_state(r["full"], saved[0]["full"])
        if ranks == 2:  # the same world: training goes on exactly as if never stopped
            for r, s in zip(back, saved):
                _assert_same_state(r["continued"], s["continued"])
                assert torch.equal(r["rand"], s["rand"])  # each rank's generator came back


def _save_then_die(rank: int, size: int, where: str) -> None:
    from hora.sharded_checkpoint import save_restore

    model, opt, sched = _setup("optimizer")
    _train(model, opt, sched, range(1))
    checkpoint.save_sharded(where, 1, model=model, optimizer=opt)
    _train(model, opt, sched, range(1, 2))
    gather = save_restore._gather

    def die_once_written(value: Any, name: str, size: int) -> Any:
        if name.endswith(".written"):  # every rank's files are on disk; the metadata and rename are not
            os.kill(os.getpid(), signal.SIGKILL)
        return gather(value, name, size)

    save_restore._gather = die_once_written
    checkpoint.save_sharded(where, 2, model=model, optimizer=opt)


def _latest(rank: int, size: int, where: str) -> dict[str, Any]:
    model, opt, _ = _setup("optimizer")
    return {"step": checkpoint.restore_sharded(where, model=model, optimizer=opt),
            "left": sorted(p.name for p in Path(where).iterdir())}


def test_a_save_killed_after_writing_never_becomes_the_latest(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="died"):
        run_tensors(_save_then_die, 2, str(tmp_path))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left[0].startswith(".ckpt-000000002.dcp.tmp.") and left[1:] == ["ckpt-000000001.dcp"]
    back = run_tensors(_latest, 2, str(tmp_path))
    assert [r["step"] for r in back] == [1, 1]
    assert back[0]["left"] == ["ckpt-000000001.dcp"]  # the dead writers' directory was cleared


def _fill_the_disk(rank: int, size: int, where: str) -> dict[str, Any]:
    model, opt, _ = _setup(None)
    checkpoint.save_sharded(where, 1, model=model, optimizer=opt)
    big = {"blob": torch.zeros(100_000)}  # 400 kB more than the 256 kB disk holds
    try:
        checkpoint.save_sharded(where, 2, model=model, optimizer=opt, big=big)
    except CheckpointError as e:
        error = str(e)
    else:
        error = ""
    return {"error": error, "step": checkpoint.restore_sharded(where, model=model, optimizer=opt),
            "left": sorted(p.name for p in Path(where).iterdir())}


def test_a_full_disk_raises_checkpoint_error_on_every_rank_and_leaves_the_last_good_one(small_disk: Any) -> None:
    disk = small_disk(256)
    results = run_tensors(_fill_the_disk, 2, str(disk))
    for r in results:
        assert "cannot write sharded checkpoint" in r["error"] and "ckpt-000000002.dcp" in r["error"], r["error"]
        assert "No space left on device" in r["error"] and "rank 0" in r["error"]
        assert r["step"] == 1
    assert results[0]["left"] == ["ckpt-000000001.dcp"]


def _async(rank: int, size: int, where: str) -> dict[str, Any]:
    model, opt, sched = _setup("gradients")
    _train(model, opt, sched, range(2))
    want = _full(model, opt)
    pending = checkpoint.save_sharded(where, 2, model=model, optimizer=opt, scheduler=sched, async_save=True)
    _train(model, opt, sched, range(2, 4))  # the values change while it writes
    assert isinstance(pending, checkpoint.AsyncSave)
    path = pending.wait(timeout=60)
    model2, opt2, sched2 = _setup("gradients")
    step = checkpoint.restore_sharded(where, model=model2, optimizer=opt2, scheduler=sched2)
    return {"path": str(path), "step": step, "want": want, "got": _full(model2, opt2)}


@pytest.mark.parametrize("secret", [True, False], ids=["secret", "no-secret"])
def test_an_asynchronous_save_keeps_the_values_it_was_asked_for(tmp_path: Path, secret: bool) -> None:
    """Without a job secret the ranks' plans travel as weights_only-loadable DCP records."""
    results = run_tensors(_async, 2, str(tmp_path), env=None if secret else {ENV_SECRET: None})
    for r in results:
        assert r["path"] == str(tmp_path / "ckpt-000000002.dcp") and r["step"] == 2
        _assert_same_state(r["got"], r["want"])


def _different_steps(rank: int, size: int, where: str) -> str:
    model, opt, _ = _setup(None)
    with pytest.raises(ValueError, match="different steps") as caught:
        checkpoint.save_sharded(where, 10 + rank, model=model, optimizer=opt)
    return str(caught.value)


def test_ranks_saving_different_steps_are_told_which(tmp_path: Path) -> None:
    said = run_tensors(_different_steps, 2, str(tmp_path))
    assert said[0] == said[1] and "rank 0: 10, rank 1: 11" in said[0]
    assert not list(tmp_path.glob("ckpt-*"))
