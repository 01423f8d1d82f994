"""Sharded checkpoints: every rank writes its part in parallel; restored at any number of ranks.

``save_sharded`` writes one ``torch.distributed.checkpoint`` directory, ``<directory>/ckpt-<step>.dcp``, with
:mod:`hora.sharded_checkpoint.state`'s layout: the model's tensors spread over the ranks (each written once),
each rank's optimizer shard written by that rank, the scheduler, the random generators and your extra values.
It is written as ``.ckpt-<step>.dcp.tmp.<host>.<pid>`` and renamed into place by rank 0 only once every rank's
files and the metadata are on disk (fsynced): a save killed or cut short by a full disk never becomes the
latest, and its leftovers are removed later (:mod:`hora.common.writer_files`). A failed write raises the same
:class:`CheckpointError` on every rank, naming the rank and the reason.

``restore_sharded`` has rank 0 choose the newest complete checkpoint and every rank read what it needs from it:
the model's tensors straight into the model's own storage (no second copy), the optimizer entries of the
parameters this rank owns (a sharded ``DistributedOptimizer`` at this world's size), its own generators. Files
follow :mod:`hora.common.trusted_load`'s rules (:mod:`hora.sharded_checkpoint.trusted_dcp`).

The ranks coordinate through hora's object collectives (authenticated with the job's secret), five small rounds
per save and one or two per restore; DCP's own collectives (which unpickle what arrives) are not used.

Example:
    >>> save_sharded("/ckpt/run1", step, model=model, optimizer=opt, meta={"epoch": e})  # doctest: +SKIP
    >>> step = restore_sharded("/ckpt/run1", model=model, optimizer=opt, meta=meta)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hora.api.functions import allgather_object, broadcast_object
from hora.common.trusted_load import UnsafeToLoad, private_directory
from hora.common.writer_files import dead_writers_temporaries, fsync_dir, writer_id
from hora.errors import CheckpointError
from hora.runtime import lifecycle as runtime
from hora.sharded_checkpoint.state import Parts, apply, rank_state, template
from hora.sharded_checkpoint.trusted_dcp import (
    StagingSavePlanner,
    TrustedLoadPlanner,
    TrustedReader,
    TrustedWriter,
    dcp_records,
)

__all__ = ["AsyncSave", "clear_stale_sharded", "restore_sharded", "save_sharded", "sharded_checkpoints"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{9})\.dcp$")
_TEMP = re.compile(r"^\.ckpt-\d{9}\.dcp\.(?:tmp|old)\.(?P<host>.+)\.(?P<pid>\d+)$")
_UNREADABLE = (OSError, RuntimeError, EOFError, ValueError, AssertionError, KeyError, pickle.UnpicklingError)
_pending: AsyncSave | None = None  # this process's asynchronous save in flight: one at a time


def _rank_and_size() -> tuple[int, int]:
    if runtime.is_initialized():
        return runtime.rank(), runtime.size()
    return 0, 1


def _final(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:09d}.dcp"


def sharded_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every complete sharded checkpoint in ``directory`` as ``(step, path)``, oldest first."""
    try:
        entries = list(Path(directory).iterdir())
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), e) for e in entries if (m := _NAME.match(e.name)) and (e / ".metadata").exists()]
    return sorted(found)


def clear_stale_sharded(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary directories of sharded saves whose writer died; return what was removed."""
    removed = dead_writers_temporaries(directory, _TEMP)
    for entry in removed:
        shutil.rmtree(entry, ignore_errors=True)
        log.warning("removed %s: the temporary directory of a sharded checkpoint save that never finished (its "
                    "writer died)", entry)
    return removed


# -- the rounds: every rank learns every rank's outcome, so all fail together ---------------------------------------
def _gather(value: Any, name: str, size: int) -> list[Any]:
    if size == 1:
        return [value]
    with dcp_records():  # DCP's plan records load under weights_only=True when the job has no secret
        return allgather_object(value, name=name)


def _from_root(value: Any, name: str, size: int) -> Any:
    if size == 1:
        return value
    with dcp_records():
        return broadcast_object(value, root_rank=0, name=name)


def _failures(outcomes: list[Any]) -> list[tuple[int, str]]:
    """(rank, why) of every rank whose outcome is an ``("error", why)`` pair."""
    return [(r, o[1]) for r, o in enumerate(outcomes) if isinstance(o, tuple) and len(o) == 2 and o[0] == "error"]


def _why(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}{f': {error.filename}' if error.filename else ''}"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


def _raise_if_failed(outcomes: list[Any], what: str, where: Path) -> None:
    failed = _failures(outcomes)
    if failed:
        said = "; ".join(f"rank {r}: {why}" for r, why in failed[:4])
        raise CheckpointError(f"cannot {what} {where}: {said}; check that {where.parent} is writable by every rank "
                              "and has space")


# -- save ----------------------------------------------------------------------------------------------------------
def save_sharded(directory: str | os.PathLike[str], step: int, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, rng: bool = True,
                 keep: int = 3, async_save: bool = False, **extra: Any) -> Path | AsyncSave:
    """Write checkpoint ``step`` of ``directory``, every rank its own part, in parallel. Call it on every rank.

    Args:
        directory: the checkpoints' directory, shared by every host (created for the job's user alone).
        step: the checkpoint's number, 0..999999999 (the same on every rank).
        model: the model (its ``state_dict()``, the same on every rank).
        optimizer: a ``hvd.DistributedOptimizer`` (sharded or not: each rank saves what it owns) or any torch
            optimizer of ``model``'s parameters.
        scheduler: a learning-rate scheduler (rank 0's is saved).
        rng: save each rank's random generators (torch, CUDA, Python, NumPy).
        keep: keep only the newest ``keep`` sharded checkpoints afterwards (0 keeps all).
        async_save: return at once with an :class:`AsyncSave` while a thread writes: what this rank writes is
            copied to the CPU first (its share of the model and its optimizer shard), so training may go on.
            The next save or restore waits for it; its errors are raised by ``wait()`` or by that next call.
        **extra: more values to keep, each a dict or an object with ``state_dict()``/``load_state_dict()``
            (rank 0's are saved); pass the same names to :func:`restore_sharded`.

    Returns:
        The checkpoint's path (every rank), or the :class:`AsyncSave` whose ``wait()`` returns it.

    Raises:
        CheckpointError: a rank could not write its part (a full disk, no permission): on every rank, naming
            the rank; nothing is left under the checkpoint's name.
        ValueError: the ranks passed different steps.
    """
    if step < 0 or step >= 10**9:
        raise ValueError(f"checkpoint step must be in 0..999999999, got {step}")
    parts = Parts(model=model, optimizer=optimizer, scheduler=scheduler, rng=rng, extra=extra)
    parts.check_extra()
    wait_pending()
    rank, size = _rank_and_size()
    where = Path(directory)
    temp = _begin(where, step, rank, size)
    try:
        planner = StagingSavePlanner()
        writer = TrustedWriter(temp)
        offer = rank_state(parts, step=step, rank=rank, size=size)
        plan, metadata = _plan(offer, writer, planner, rank, size, _final(where, step))
    except BaseException:
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise

    def write() -> Path:
        return _write_and_publish(where, temp, step, plan, metadata, writer, planner, rank, size, keep)

    if not async_save:
        return write()
    planner.stage(plan)
    global _pending
    _pending = AsyncSave(write, _final(where, step))
    return _pending


def _begin(where: Path, step: int, rank: int, size: int) -> Path:
    """Round 1: rank 0 makes the temporary directory; every rank learns its name and checks the steps agree."""
    error = None
    me = writer_id()
    if rank == 0:
        try:
            private_directory(where)
            clear_stale_sharded(where)
            private_directory(where / f".{_final(where, step).name}.tmp.{me}")
        except OSError as e:
            error = _why(e)
    offers = _gather((step, me, error), "hora.checkpoint.save_sharded.begin", size)
    steps = {o[0] for o in offers}
    if len(steps) > 1:
        said = ", ".join(f"rank {r}: {o[0]}" for r, o in enumerate(offers))
        raise ValueError(f"save_sharded was called with different steps ({said}); every rank saves the same step")
    if offers[0][2] is not None:
        raise CheckpointError(f"cannot write sharded checkpoint {_final(where, step)}: rank 0: {offers[0][2]}; check "
                              f"that {where} is writable and has space")
    return where / f".{_final(where, step).name}.tmp.{offers[0][1]}"


def _plan(state: dict[str, Any], writer: TrustedWriter, planner: StagingSavePlanner, rank: int, size: int,
          final: Path) -> tuple[Any, Any]:
    """Rounds 2 and 3: local plans to rank 0, which dedups them (each replicated tensor written by one rank,
    spread evenly) and hands each rank its part. Returns this rank's final plan and (on rank 0) the metadata."""
    local: Any
    try:
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others wait in the next round
        local = ("error", _why(e))
    plans = _gather(local, "hora.checkpoint.save_sharded.plans", size)
    _raise_if_failed(plans, "plan sharded checkpoint", final)
    metadata: Any = None
    central: Any = None
    if rank == 0:
        try:
            central, metadata = planner.create_global_plan(plans)
            central = writer.prepare_global_plan(central)
        except Exception as e:  # noqa: BLE001
            central = ("error", _why(e))
    central = _from_root(central, "hora.checkpoint.save_sharded.central", size)
    _raise_if_failed([central], "plan sharded checkpoint", final)
    return planner.finish_plan(central[rank]), metadata


def _write_and_publish(where: Path, temp: Path, step: int, plan: Any, metadata: Any, writer: TrustedWriter,
                       planner: StagingSavePlanner, rank: int, size: int, keep: int) -> Path:
    """Rounds 4 and 5: every rank writes its files; rank 0 writes the metadata and renames the directory into
    place once all have, and tells everyone how it went."""
    final = _final(where, step)
    written: Any
    try:
        future = writer.write_data(plan, planner)
        future.wait()
        written = future.value()
    except Exception as e:  # noqa: BLE001 - a full disk: reported by every rank below
        written = ("error", _why(e))
    results = _gather(written, "hora.checkpoint.save_sharded.written", size)
    outcome = None
    if rank == 0:
        failed = _failures(results)
        if failed:
            shutil.rmtree(temp, ignore_errors=True)  # every rank has stopped writing: the round above says so
            outcome = "; ".join(f"rank {r}: {why}" for r, why in failed[:4])
        else:
            outcome = _publish(where, temp, final, writer, metadata, results, keep)
    outcome = _from_root(outcome, "hora.checkpoint.save_sharded.published", size)
    if outcome is not None:
        raise CheckpointError(f"cannot write sharded checkpoint {final}: {outcome}; check that {where} is writable "
                              "by every rank and has space (nothing was left under that name)")
    log.info("sharded checkpoint %s written", final)
    return final


def _publish(where: Path, temp: Path, final: Path, writer: TrustedWriter, metadata: Any, results: list[Any],
             keep: int) -> str | None:
    """On rank 0: the metadata, then the rename into place (a checkpoint of the same step is replaced); None when
    it worked, else why not. The temporary directory is gone either way."""
    old = where / f".{final.name}.old.{writer_id()}"
    try:
        writer.finish(metadata=metadata, results=results)
        fsync_dir(temp)
        if final.exists():
            os.replace(final, old)
        os.replace(temp, final)
        fsync_dir(where)
    except OSError as e:
        return f"rank 0: {_why(e)}"
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    if keep > 0:
        for _, stale in sharded_checkpoints(where)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return None


class AsyncSave:
    """A sharded save writing in the background (``save_sharded(..., async_save=True)``).

    The thread is not a daemon: a script that ends meanwhile waits for it before hora shuts down.
    """

    def __init__(self, write: Callable[[], Path], path: Path) -> None:
        self.path = path
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"hora-save-{path.name}")
        self._thread.start()

    def _run(self, write: Callable[[], Path]) -> None:
        try:
            self._result = write()
        except BaseException as e:  # noqa: BLE001 - handed to wait() or the next save
            self._error = e
            log.error("asynchronous save of %s failed: %s", self.path, e)

    def done(self) -> bool:
        """True once the checkpoint is in place, or the save failed."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait for the save; the checkpoint's path.

        Raises:
            CheckpointError: the save failed (as a synchronous save would have).
            TimeoutError: ``timeout`` seconds passed first.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the asynchronous save of {self.path} is still writing after {timeout} s")
        global _pending
        if _pending is self:
            _pending = None
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def wait_pending() -> None:
    """Wait for this process's asynchronous save in flight, if any (raising its error)."""
    if _pending is not None:
        _pending.wait()


# -- restore -------------------------------------------------------------------------------------------------------
def restore_sharded(directory: str | os.PathLike[str], *, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, rng: bool = True,
                    weights_only: bool = True, **extra: Any) -> int | None:
    """Load the newest sharded checkpoint every rank can read into what you pass; its step, or None when there is
    none yet. Call it on every rank, with any number of ranks (the checkpoint may come from another number).

    Args:
        directory: the checkpoints' directory.
        model: loaded in place, tensor by tensor, into its own storage (so a model materialised from the meta
            device, :func:`hora.meta.materialize`, needs no other copy).
        optimizer: gets the state of the parameters this rank owns (all of them unless sharded).
        scheduler: gets the saved scheduler's state.
        rng: put this rank's saved random generators back (ranks the checkpoint did not have keep theirs).
        weights_only: load the non-tensor values with ``torch.load(weights_only=True)`` (the default): plain
            values, never code. False: only for checkpoints your own jobs wrote.
        **extra: the dicts (refilled with the saved values) and objects (``load_state_dict``) saved under these
            names.

    Raises:
        CheckpointError: the checkpoint is another user's, holds more than plain values, lacks something you
            asked for, or holds another model (the message names it); a rank does not see it (the directory is
            not shared); or no checkpoint in ``directory`` can be read.
    """
    parts = Parts(model=model, optimizer=optimizer, scheduler=scheduler, rng=rng, extra=extra)
    wait_pending()
    rank, size = _rank_and_size()
    names: list[str] | None = None
    if rank == 0:
        clear_stale_sharded(directory)
        names = [str(p) for _, p in reversed(sharded_checkpoints(directory))]
    names = _from_root(names, "hora.checkpoint.restore_sharded", size)
    assert names is not None
    unreadable: list[str] = []
    for attempt, chosen in enumerate(names):
        loaded, problem = _load(chosen, parts, rank, weights_only)
        problems = _gather(problem, f"hora.checkpoint.restore_sharded.{attempt}", size)
        refused = [(r, p[1]) for r, p in enumerate(problems) if p is not None and p[0] == "refused"]
        if refused:
            who, why = refused[0]
            raise CheckpointError(f"rank {who}: sharded checkpoint {chosen} was not loaded: {why}")
        missing = [r for r, p in enumerate(problems) if p is not None and p[0] == "missing"]
        if missing:
            raise CheckpointError(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}: rank 0 "
                                  f"chose sharded checkpoint {chosen} but cannot read it there; {directory} must be "
                                  "storage shared by every host (a PVC, NFS, a volume)")
        bad = [(r, p[1]) for r, p in enumerate(problems) if p is not None]
        if not bad:
            assert loaded is not None
            step = apply(loaded, parts, rank)
            log.info("resumed from sharded checkpoint %s", chosen)
            return step
        who, why = bad[0]
        unreadable.append(f"{chosen} ({why})")
        if rank == 0:
            log.warning("sharded checkpoint %s cannot be read (rank %d: %s): it is damaged; going back to the "
                        "previous one. It is left in place", chosen, who, why)
    if unreadable:
        raise CheckpointError(f"rank {rank}: no sharded checkpoint in {directory} can be read: "
                              f"{'; '.join(unreadable)}. Move the damaged ones out of the directory to start afresh")
    return None


def _load(path: str, parts: Parts, rank: int, weights_only: bool) -> tuple[dict[str, Any] | None, Any]:
    """``(loaded, None)``, or ``(None, ("missing" | "refused" | "unreadable", why))``."""
    try:
        reader = TrustedReader(path)
        metadata = reader.read_metadata()
        loaded = template(metadata, parts, rank)
        planner = TrustedLoadPlanner(weights_only)
        planner.set_up_planner(loaded, metadata, rank == 0)
        reader.set_up_storage_reader(metadata, rank == 0, rank=rank, use_collectives=True)
        plan = reader.prepare_global_plan([reader.prepare_local_plan(planner.create_local_plan())])[0]
        reader.read_data(planner.finish_plan(plan), planner).wait()
        return loaded, None
    except FileNotFoundError as e:
        return None, ("missing", str(e))
    except CheckpointError as e:  # another user's, or not what the caller asked for
        return None, ("refused", str(e))
    except UnsafeToLoad as e:
        return None, ("refused", f"{e}; restore_sharded(..., weights_only=False) loads it, and can run code: only "
                                 "for checkpoints your own jobs wrote (or allow the classes on every rank with "
                                 "torch.serialization.add_safe_globals([...]))")
    except _UNREADABLE as e:
        return None, ("unreadable", _why(e))
