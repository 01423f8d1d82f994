"""Sharded checkpoints in one process: what they refuse to load and how they say it (hora.sharded_checkpoint)."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hora import checkpoint
from hora.errors import CheckpointError


class Counter:
    """An extra value with state_dict()/load_state_dict(), whose state holds a class of its own."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state = saved["state"]


class Custom:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def test_the_directory_is_private_and_empty_dicts_come_back(tmp_path: Path) -> None:
    where = tmp_path / "run"
    path = checkpoint.save_sharded(where, 5, model=_model(), meta={}, counter=Counter(7))
    assert stat.S_IMODE(where.stat().st_mode) == 0o700 and path == where / "ckpt-000000005.dcp"
    meta: dict[str, Any] = {"stale": 1}
    counter = Counter(0)
    assert checkpoint.restore_sharded(where, model=_model(), meta=meta, counter=counter) == 5
    assert meta == {} and counter.state == 7


def test_another_users_file_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = checkpoint.save_sharded(tmp_path, 1, model=_model())
    os.chown(path / "__0_0.distcp", 65534, 65534)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is owned by .*uid 65534.*not by this job's user"):
        checkpoint.restore_sharded(tmp_path, model=_model())


def test_metadata_naming_code_is_refused_before_it_runs(tmp_path: Path) -> None:
    path = checkpoint.save_sharded(tmp_path, 1, model=_model())

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"names posix\.system, which is not one of DCP's records"):
        checkpoint.restore_sharded(tmp_path, model=_model())
    assert not (tmp_path / "pwned").exists()


def test_values_needing_code_load_only_when_asked(tmp_path: Path) -> None:
    checkpoint.save_sharded(tmp_path, 1, model=_model(), counter=Counter(Custom()))
    with pytest.raises(CheckpointError, match=r"extra\.counter.*Custom.*weights_only=False\) loads it"):
        checkpoint.restore_sharded(tmp_path, model=_model(), counter=Counter(None))
    counter = Counter(None)
    assert checkpoint.restore_sharded(tmp_path, model=_model(), counter=counter, weights_only=False) == 1
    assert counter.state == Custom()


def test_another_model_or_a_missing_part_is_named(tmp_path: Path) -> None:
    checkpoint.save_sharded(tmp_path, 1, model=_model())
    other = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    with pytest.raises(CheckpointError, match=r"not this one \(other shapes: 0\.weight \(4, 3\) in the checkpoint, "
                                              r"\(5, 3\) here"):
        checkpoint.restore_sharded(tmp_path, model=other)
    model = _model()
    with pytest.raises(CheckpointError, match="holds no optimizer state; restore it without optimizer="):
        checkpoint.restore_sharded(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match=r"holds no meta=\.\.\."):
        checkpoint.restore_sharded(tmp_path, model=model, meta={})


def test_extra_values_must_restore_in_place(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"epoch=3: .* a dict \(pass epoch=\{\.\.\.\}\)"):
        checkpoint.save_sharded(tmp_path, 1, model=_model(), epoch=3)
    assert not list(tmp_path.iterdir())


def test_no_checkpoint_yet_is_none(tmp_path: Path) -> None:
    assert checkpoint.restore_sharded(tmp_path / "nothing", model=_model()) is None
