"""Checkpoints on shared storage: rank 0 writes atomically, every rank resumes from the latest complete one.

Horovod's advice, as a helper: only rank 0 writes (all ranks hold the same weights after a synchronous step),
and it writes to a temporary file in the same directory, flushes it to disk and renames it into place, so a
crash or a full disk mid-write never leaves a torn file under a checkpoint's name. ``restore()`` has rank 0
pick the newest complete checkpoint and tells every rank which one, so all ranks load the same file even while
a newer one is being written. The directory must be shared by every host (a PVC, NFS, the containers' /data or
/checkpoints volume); a rank that cannot see the chosen file gets a :class:`CheckpointError` saying so.

Files are ``<directory>/ckpt-<step, 9 digits>.pt``; temporary files start with a dot and are never chosen.
A temporary file is named after its writer (``.ckpt-<step>.pt.tmp.<host>.<pid>``): ``save`` and ``restore``
remove those of writers that died mid-save (a SIGKILL, a lost node): on the same host, when that process is
gone; from another host, when the file has not changed for :data:`STALE_AFTER_S`. ``restore`` skips a latest
checkpoint that cannot be read (cut short by a full disk, damaged) with a warning naming it, and resumes from
the newest one every rank can read.

Other users of the storage are kept out (docs/security.md, "Checkpoints"): ``save`` creates the directory for the
job's user alone (mode 0700), and ``restore`` refuses a checkpoint another user owns and loads with
``torch.load(weights_only=True)``: tensors, numbers, strings and plain containers (every ``state_dict``), never
code. A checkpoint holding your own classes needs ``restore(..., weights_only=False)`` (only for checkpoints
your own jobs wrote) or ``torch.serialization.add_safe_globals([...])``. The rules are
:mod:`hora.common.trusted_load`'s, for every checkpoint format.

Large models: :func:`save_sharded` / :func:`restore_sharded` (from :mod:`hora.sharded_checkpoint`) write one
directory per checkpoint, every rank its own part in parallel, and restore at any number of ranks, under the same
atomicity and trust rules.

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
from typing import IO, Any

import torch

from hora.api.functions import allgather_object, broadcast_object
from hora.common.trusted_load import UnsafeToLoad, load_owned, private_directory
from hora.common.writer_files import STALE_AFTER_S as STALE_AFTER_S
from hora.common.writer_files import RememberingFile, dead_writers_temporaries, fsync_dir, writer_id
from hora.errors import CheckpointError
from hora.runtime import lifecycle as runtime
from hora.sharded_checkpoint import (
    AsyncSave,
    clear_stale_sharded,
    restore_sharded,
    save_sharded,
    sharded_checkpoints,
)

__all__ = ["AsyncSave", "CheckpointError", "checkpoints", "clear_stale", "clear_stale_sharded", "latest", "restore",
           "restore_sharded", "save", "save_sharded", "sharded_checkpoints"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_TEMP = re.compile(r"^\.ckpt-\d{9}\.pt\.tmp\.(?:(?P<host>.+)\.)?(?P<pid>\d+)$")
# what torch.load raises on a file cut short or damaged
_UNREADABLE = (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError)


def _path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:09d}.pt"


def _rank_and_size() -> tuple[int, int]:
    if runtime.is_initialized():
        return runtime.rank(), runtime.size()
    return 0, 1


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
    ``keep`` checkpoints are kept (``keep=0`` keeps all). A directory ``save`` creates is the job's user's alone
    (mode 0700, :func:`hora.common.trusted_load.private_directory`). Returns the path on rank 0, None elsewhere.

    Raises:
        CheckpointError: the file could not be written (a full disk, no permission); no temporary file is left.
    """
    if step < 0 or step >= 10**9:
        raise ValueError(f"checkpoint step must be in 0..999999999, got {step}")
    if _rank_and_size()[0] != 0:
        return None
    where = Path(directory)
    final = _path(where, step)
    tmp = where / f".{final.name}.tmp.{writer_id()}"
    try:
        private_directory(where)
        clear_stale(where)
        with open(tmp, "wb") as f:
            _write(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(where)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {final}: {e.strerror or e}; check that {where} is "
                              "writable and has space") from e
    finally:
        tmp.unlink(missing_ok=True)  # a failed write (a full disk) leaves nothing behind
    if keep > 0:
        for _, old in checkpoints(where)[:-keep]:
            old.unlink(missing_ok=True)
    log.info("checkpoint %s written", final)
    return final


def _write(state: Any, f: IO[bytes]) -> None:
    sink = RememberingFile(f)
    try:
        torch.save(state, sink)  # type: ignore[arg-type]  # a writable object is what torch.save needs
    except RuntimeError as e:
        if sink.error is None:
            raise
        raise sink.error from e


def clear_stale(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files of writers that died mid-save; return what was removed.

    A writer on this host is dead when its process is gone (or a younger process has its pid); a writer on
    another host, or one named by pid alone (older hora), when its file has not changed for
    :data:`STALE_AFTER_S` seconds.
    """
    removed = dead_writers_temporaries(directory, _TEMP)
    for entry in removed:
        entry.unlink(missing_ok=True)
        log.warning("removed %s: the temporary file of a checkpoint write that never finished (its writer died)",
                    entry)
    return removed


def restore(directory: str | os.PathLike[str], *, map_location: Any = "cpu", weights_only: bool = True) -> Any | None:
    """Load the newest checkpoint of ``directory`` that every rank can read, on every rank; None when there is
    none yet.

    Call it on every rank (after ``hora.init()`` in a job of several ranks): rank 0 lists the checkpoints and
    every rank loads the same file from the shared directory. A newer one that cannot be read (cut short by a
    full disk, damaged) is skipped with a warning naming it, and the previous one is loaded.

    Args:
        directory: the checkpoints' directory, shared by every host.
        map_location: where tensors load (``torch.load``'s argument); the CPU by default.
        weights_only: load with ``torch.load(weights_only=True)`` (the default): tensors and plain values, never
            code. False loads any pickled object, which can run code: only for checkpoints your own jobs wrote.

    Raises:
        CheckpointError: a rank does not see the file rank 0 chose (the directory is not shared); the file is
            owned by another user, or holds objects ``weights_only=True`` does not load (the message names them
            and the fix); or no checkpoint in ``directory`` can be read.
    """
    rank, size = _rank_and_size()
    names: list[str] | None = None
    if rank == 0:
        clear_stale(directory)
        names = [str(p) for _, p in reversed(checkpoints(directory))]
    if size > 1:
        names = broadcast_object(names, root_rank=0, name="hora.checkpoint.restore")
    assert names is not None
    unreadable: list[str] = []
    for attempt, chosen in enumerate(names):
        state, problem = _load(chosen, map_location, weights_only)
        problems = [problem] if size == 1 else allgather_object(problem, name=f"hora.checkpoint.load.{attempt}")
        refused = [(r, p[1]) for r, p in enumerate(problems) if p is not None and p[0] == "refused"]
        if refused:  # every rank raises the same error: a file nobody should load is not skipped silently
            who, why = refused[0]
            raise CheckpointError(f"rank {who}: checkpoint {chosen} was not loaded: {why}")
        missing = [r for r, p in enumerate(problems) if p is not None and p[0] == "missing"]
        if missing and len(missing) < size:
            ranks = ", ".join(map(str, missing))
            raise CheckpointError(f"rank{'s' if len(missing) > 1 else ''} {ranks}: rank 0 chose checkpoint {chosen} "
                                  f"but {'they do' if len(missing) > 1 else 'its host does'} not see it; {directory} "
                                  "must be storage shared by every host (a PVC, NFS, a volume)")
        bad = [(r, p[1]) for r, p in enumerate(problems) if p is not None and p[0] == "unreadable"]
        if not missing and not bad:
            log.info("resumed from checkpoint %s", chosen)
            return state
        if bad:
            who, why = bad[0]
            unreadable.append(f"{chosen} ({why})")
            if rank == 0:
                log.warning("checkpoint %s cannot be read (rank %d: %s): it was cut short or is damaged; going back "
                            "to the previous one. The file is left in place (the next save of that step replaces "
                            "it)", chosen, who, why)
    if unreadable:
        raise CheckpointError(f"rank {rank}: no checkpoint in {directory} can be read: {'; '.join(unreadable)}. "
                              "Move the damaged files out of the directory to start afresh")
    return None


def _load(path: str, map_location: Any, weights_only: bool) -> tuple[Any, tuple[str, str] | None]:
    """``(state, None)``, or ``(None, ("missing" | "unreadable" | "refused", why))``."""
    try:
        return load_owned(path, map_location, weights_only=weights_only), None
    except FileNotFoundError as e:
        return None, ("missing", str(e))
    except CheckpointError as e:  # owned by another user
        return None, ("refused", str(e))
    except UnsafeToLoad as e:
        return None, ("refused", f"{e}; restore(..., weights_only=False) loads it, and can run code: only for "
                                 "checkpoints your own jobs wrote (or allow the classes on every rank with "
                                 "torch.serialization.add_safe_globals([...]))")
    except _UNREADABLE as e:
        first = (str(e).splitlines() or [""])[0].split(". ")[0]  # torch adds paragraphs of advice
        return None, ("unreadable", f"{type(e).__name__}: {first}"[:300])
