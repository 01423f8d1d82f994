"""hora.checkpoint: rank 0 writes atomically, every rank resumes from the latest complete one."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hora import checkpoint
from tests.distributed.harness import run_ranks
from tests.polling import wait_until


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


def _restore_or_error(rank: int, size: int, directory: str) -> Any:
    try:
        return _restore(rank, size, directory)
    except checkpoint.CheckpointError as e:
        return f"CheckpointError: {e}"


def test_a_truncated_latest_checkpoint_is_skipped_with_a_warning_naming_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint.save(tmp_path, 1, {"step": 1, "w": torch.ones(2)})
    whole = checkpoint.save(tmp_path, 2, {"step": 2, "w": torch.zeros(100_000)})
    assert whole is not None
    whole.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # the disk filled up mid-copy
    assert run_ranks(_restore, 2, str(tmp_path)) == [(1, [1.0, 1.0]), (1, [1.0, 1.0])]  # every rank: the same one
    with caplog.at_level("WARNING", logger="hora.checkpoint"):
        state = checkpoint.restore(tmp_path)
    assert state["step"] == 1
    assert any(f"checkpoint {whole} cannot be read" in r.getMessage() and "going back to the previous one"
               in r.getMessage() for r in caplog.records), caplog.text
    assert whole.exists()  # left for the user to look at; the next save of step 2 replaces it


def test_no_readable_checkpoint_is_an_error_naming_the_files(tmp_path: Path) -> None:
    (tmp_path / "ckpt-000000002.pt").write_bytes(b"not a torch file")  # e.g. copied in half by hand
    results = run_ranks(_restore_or_error, 2, str(tmp_path))
    for rank, text in enumerate(results):
        assert text.startswith(f"CheckpointError: rank {rank}: no checkpoint in {tmp_path} can be read: "
                               f"{tmp_path / 'ckpt-000000002.pt'} ("), text
        assert text.endswith("Move the damaged files out of the directory to start afresh"), text


def test_a_full_disk_is_a_checkpoint_error_and_leaves_no_temporary_file(small_disk) -> None:  # type: ignore[no-untyped-def]
    disk = small_disk(256)
    checkpoint.save(disk, 1, {"w": torch.ones(8)})
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot write checkpoint .*ckpt-000000002\.pt: No space "
                                                         r"left on device; check that .* is writable and has space"):
        checkpoint.save(disk, 2, {"w": torch.zeros(1 << 20)})  # 4 MB on a 256 KB disk
    assert sorted(p.name for p in disk.iterdir()) == ["ckpt-000000001.pt"]


SAVER_KILLED_MID_SAVE = """
import sys, time
from hora import checkpoint

class Slow:
    def __reduce__(self):  # torch.save pickles the state into the open temporary file
        open(sys.argv[2], "w").close()
        time.sleep(600)

checkpoint.save(sys.argv[1], 3, {"x": Slow()})
"""


def test_temporary_files_of_dead_writers_are_cleared_and_live_ones_kept(tmp_path: Path) -> None:
    folder, mid_save = tmp_path / "ckpt", tmp_path / "mid_save"
    writer = subprocess.Popen([sys.executable, "-c", SAVER_KILLED_MID_SAVE, str(folder), str(mid_save)])
    try:
        assert wait_until(mid_save.exists, timeout=60, step=0.05, unless=lambda: writer.poll() is not None), (
            "the writer never reached its save")
    finally:
        writer.kill()  # SIGKILL mid-save: its temporary file stays behind
        writer.wait()
    dead = [p.name for p in folder.iterdir()]
    assert len(dead) == 1 and dead[0].startswith(".ckpt-000000003.pt.tmp.") and dead[0].endswith(f".{writer.pid}")
    host = dead[0][len(".ckpt-000000003.pt.tmp."):-len(f".{writer.pid}")]
    live = folder / f".ckpt-000000004.pt.tmp.{host}.{os.getpid()}"  # this process: alive, so maybe still writing
    live.write_bytes(b"partial")
    elsewhere = folder / ".ckpt-000000005.pt.tmp.otherhost.77"  # another host's writer, recently active
    elsewhere.write_bytes(b"partial")
    abandoned = folder / ".ckpt-000000006.pt.tmp.otherhost.78"
    abandoned.write_bytes(b"partial")
    hour_ago = time.time() - checkpoint.STALE_AFTER_S - 60
    os.utime(abandoned, (hour_ago, hour_ago))

    assert checkpoint.restore(folder) is None
    assert sorted(p.name for p in folder.iterdir()) == sorted([live.name, elsewhere.name])
    checkpoint.save(folder, 7, {"step": 7})
    assert sorted(p.name for p in folder.iterdir()) == sorted([live.name, elsewhere.name, "ckpt-000000007.pt"])


def test_a_directory_save_creates_is_the_job_users_alone(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # a scratch directory every user writes to
    checkpoint.save(shared / "team" / "run1", 1, {"step": 1})
    for made in (shared / "team", shared / "team" / "run1"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, (made, oct(made.stat().st_mode))


def test_an_existing_directory_other_users_can_write_to_is_named_in_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with caplog.at_level("WARNING", logger="hora.common.trusted_load"):
        checkpoint.save(open_dir, 1, {"step": 1})
    assert f"{open_dir} is writable by other users (mode 777)" in caplog.text
    assert f"chmod 700 {open_dir}" in caplog.text
    assert checkpoint.restore(open_dir)["step"] == 1  # the job's own files still load


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_checkpoint_another_user_wrote_is_refused_on_every_rank(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 1, {"step": 1})
    planted = checkpoint.save(tmp_path, 2, {"step": 2})
    assert planted is not None
    os.chown(planted, 65534, 65534)  # as if user nobody had written the newest checkpoint
    results = run_ranks(_restore_or_error, 2, str(tmp_path))
    for text in results:
        assert text.startswith(f"CheckpointError: rank 0: checkpoint {planted} was not loaded: {planted} is owned "
                               "by "), text
        assert "not by this job's user root (uid 0): hora does not load files another user wrote" in text, text
        assert f"`chown root {planted}`" in text


class RunsCode:
    """A checkpoint entry whose unpickling creates ``path`` (what a planted or a stranger's file would do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def test_a_checkpoint_that_would_run_code_loads_only_with_the_explicit_opt_out(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    folder = tmp_path / "ckpt"
    checkpoint.save(folder, 3, {"step": 3, "extra": RunsCode(str(canary))})
    results = run_ranks(_restore_or_error, 2, str(folder))
    assert not canary.exists(), "restore() ran the checkpoint's code by default"
    for text in results:
        assert text.startswith(f"CheckpointError: rank 0: checkpoint {folder / 'ckpt-000000003.pt'} was not loaded: "
                               "it holds io.open, which only an unrestricted unpickler can load (it could run code); "
                               "restore(..., weights_only=False) loads it"), text
    state = checkpoint.restore(folder, weights_only=False)  # the user's own checkpoint, knowingly
    assert state["step"] == 3 and canary.exists()
