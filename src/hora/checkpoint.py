"""Checkpoints on shared storage: rank 0 writes atomically, every rank resumes from the latest complete one.

Horovod's advice, as a helper: only rank 0 writes (all ranks hold the same weights after a synchronous step),
and it writes to a temporary file in the same directory, flushes it to disk and renames it into place, so a
crash or a full disk mid-write never leaves a torn file under a checkpoint's name. ``restore()`` has rank 0
pick the newest complete checkpoint and tells every rank which one, so all ranks load the same file even while
a newer one is being written. The directory must be shared by every host (a PVC, NFS, the containers' /data or
/checkpoints volume); a rank that cannot see the chosen file gets a :class:`CheckpointError` saying so.

Files are ``<directory>/ckpt-<step, 9 digits>.pt``; temporary files start with a dot and are never chosen.

Example:
    >>> from hora import checkpoint
    >>> state = checkpoint.restore("/checkpoints/run1")  # doctest: +SKIP
    >>> start = state["epoch"] + 1 if state else 0  # doctest: +SKIP
    >>> checkpoint.save("/checkpoints/run1", epoch, {"epoch": epoch, "model": model.state_dict()})  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from hora import runtime
from hora.errors import HoraError
from hora.functions import broadcast_object

__all__ = ["CheckpointError", "checkpoints", "latest", "restore", "save"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")


class CheckpointError(HoraError, OSError):
    """A checkpoint could not be written or read (a missing shared directory, a full disk, a bad file)."""


def _path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:09d}.pt"


def _rank_and_size() -> tuple[int, int]:
    if runtime.is_initialized():
        return runtime.rank(), runtime.size()
    return 0, 1


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every complete checkpoint in ``directory`` as ``(step, path)``, oldest first."""
    found = []
    try:
        entries = list(Path(directory).iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        m = _NAME.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry))
    return sorted(found)


def latest(directory: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """The newest complete checkpoint in ``directory`` as ``(step, path)``, or None when there is none."""
    found = checkpoints(directory)
    return found[-1] if found else None


def save(directory: str | os.PathLike[str], step: int, state: Any, *, keep: int = 3) -> Path | None:
    """On rank 0, write ``state`` (anything ``torch.save`` takes) as checkpoint ``step``; other ranks do nothing.

    The write is atomic (temporary file, fsync, rename, fsync of the directory). Afterwards only the newest
    ``keep`` checkpoints are kept (``keep=0`` keeps all). Returns the path on rank 0, None elsewhere.
    """
    if step < 0 or step >= 10**9:
        raise ValueError(f"checkpoint step must be in 0..999999999, got {step}")
    if _rank_and_size()[0] != 0:
        return None
    where = Path(directory)
    final = _path(where, step)
    tmp = where / f".{final.name}.tmp.{os.getpid()}"
    try:
        where.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(where)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {e.strerror or e}; check that {where} is "
                              "writable and has space") from e
    if keep > 0:
        for _, old in checkpoints(where)[:-keep]:
            old.unlink(missing_ok=True)
    log.info("checkpoint %s written", final)
    return final


def restore(directory: str | os.PathLike[str], *, map_location: Any = "cpu") -> Any | None:
    """Load the newest complete checkpoint in ``directory`` on every rank; None when there is none yet.

    Call it on every rank (after ``hora.init()`` in a job of several ranks): rank 0 chooses the file and every
    rank loads that same file from the shared directory.
    """
    rank, size = _rank_and_size()
    chosen: str | None = None
    if rank == 0:
        found = latest(directory)
        chosen = str(found[1]) if found else None
    if size > 1:
        chosen = broadcast_object(chosen, root_rank=0, name="hora.checkpoint.restore")
    if chosen is None:
        return None
    try:
        state = torch.load(chosen, map_location=map_location, weights_only=False)
    except FileNotFoundError as e:
        raise CheckpointError(f"rank {rank}: rank 0 chose checkpoint {chosen} but this host does not see it; "
                              f"{directory} must be storage shared by every host (a PVC, NFS, a volume)") from e
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"rank {rank}: cannot read checkpoint {chosen}: {e}. The file is damaged or was "
                              "written by an incompatible torch; move it out of the directory and restore() "
                              "takes the previous one") from e
    log.info("resumed from checkpoint %s", chosen)
    return state
