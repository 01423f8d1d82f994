"""hora.checkpoint: rank 0 writes atomically, every rank resumes from the latest complete one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests.distributed.harness import run_ranks

from hora import checkpoint


def _save_steps(rank: int, size: int, directory: str) -> list[str | None]:
    written = []
    for step in range(4):
        path = checkpoint.save(directory, step, {"step": step, "w": torch.full((3,), float(step))}, keep=2)
        written.append(str(path) if path else None)
    return written


def test_only_rank_0_writes_and_old_ones_are_pruned(tmp_path: Path) -> None:
    results = run_ranks(_save_steps, 2, str(tmp_path))
    assert results[1] == [None] * 4
    assert results[0] == [str(tmp_path / f"ckpt-00000000{s}.pt") for s in range(4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000002.pt", "ckpt-000000003.pt"]


def _restore(rank: int, size: int, directory: str) -> Any:
    state = checkpoint.restore(directory)
    return None if state is None else (state["step"], state["w"].tolist())


def test_every_rank_resumes_from_the_latest_complete_checkpoint(tmp_path: Path) -> None:
    assert run_ranks(_restore, 2, str(tmp_path / "empty")) == [None, None]  # a fresh start
    checkpoint.save(tmp_path, 5, {"step": 5, "w": torch.ones(2)})
    checkpoint.save(tmp_path, 7, {"step": 7, "w": torch.zeros(2)})
    # What a writer killed mid-save leaves: a temporary file, never a file under a checkpoint's name.
    (tmp_path / ".ckpt-000000009.pt.tmp.4242").write_bytes(b"torn")
    assert run_ranks(_restore, 2, str(tmp_path)) == [(7, [0.0, 0.0]), (7, [0.0, 0.0])]


def test_a_failed_write_leaves_no_checkpoint_and_says_where(tmp_path: Path) -> None:
    class Unpicklable:
        def __reduce__(self) -> Any:
            raise OSError(28, "No space left on device")

    with pytest.raises(checkpoint.CheckpointError, match="No space left on device"):
        checkpoint.save(tmp_path, 1, {"x": Unpicklable()})
    assert list(tmp_path.iterdir()) == []
    assert checkpoint.latest(tmp_path) is None


def test_a_damaged_checkpoint_says_how_to_go_back_to_the_previous_one(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 1, {"step": 1})
    (tmp_path / "ckpt-000000002.pt").write_bytes(b"not a torch file")  # e.g. copied in half by hand
    with pytest.raises(checkpoint.CheckpointError, match=r"ckpt-000000002\.pt.*move it out of the directory"):
        checkpoint.restore(tmp_path)
    (tmp_path / "ckpt-000000002.pt").rename(tmp_path / "damaged")
    assert checkpoint.restore(tmp_path) == {"step": 1}
