"""A Chrome-trace timeline of every collective, one file per rank, merged at the end of the job.

The file is a JSON array of trace events (the format chrome://tracing and https://ui.perfetto.dev open).
Each rank is a process row (``pid`` = rank, named ``rank N``); inside it each collective name is a thread
row, and its phases are slices: ``negotiate`` (waiting for peers), ``compress``, ``communicate``,
``copy_in``, ``copy_out``, ``decompress``, with the name, bytes, dtype and shape as arguments. Unnamed ops
(generated names) share a few rows per kind instead of one row each.

The file is valid JSON at every moment, even if the process is killed: events are appended with one
``pwrite`` that overwrites the closing ``]`` and writes a new one, so a reader never sees a half-written
array. Events are buffered and flushed every 0.5 s (a small daemon thread) or every 512 events.

Per-rank files: with a world of N > 1 ranks and ``HORA_TIMELINE=t.json`` rank r of job j writes
``t.<j>.rank<r>.json`` (:func:`rank_path`; ``t.rank<r>.json`` when the launcher gave no job id), so two jobs
with one timeline path never share a file; :func:`finish_job_timeline` (called by the launcher at job end)
merges a job's files into ``t.json``. A single process writes ``t.json`` directly.

Cost when off: ``active()`` returns None; callers do ``tl = active()`` and ``if tl is not None``.

Example:
    >>> tl = start_timeline("/tmp/t.json", rank=0, size=1)  # doctest: +SKIP
    >>> t0 = time.perf_counter(); ...; tl.span("grad.bucket.0", "communicate", t0, time.perf_counter(),
    ...                                        bytes=4096, dtype="float32", shape=[1024])  # doctest: +SKIP
    >>> stop_timeline()  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import threading
import time
from typing import Any

from hora.common.env import WorkerEnv
from hora.common.names import UNNAMED_PREFIX

# reading and merging live in merge.py; re-exported here (the launcher calls timeline.finish_job_timeline)
from hora.diagnostics.merge import (
    finish_job_timeline,
    load_events,
    main,
    merge_timelines,
    rank_parts,
    rank_path,
)
from hora.errors import ConfigError  # generated names: these ops share a few pooled rows

log = logging.getLogger(__name__)

PHASES = ("negotiate", "compress", "communicate", "copy_in", "copy_out", "decompress")
LAST_PHASE = "copy_out"  # every op that completes ends with it (the handle's finish)
_FLUSH_EVENTS = 512
_FLUSH_SECONDS = 0.5
_encode = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


def _closing_bracket(fd: int) -> int | None:
    """Offset of the closing ``]`` of a timeline file (always preceded by its events), or None."""
    size = os.fstat(fd).st_size
    start = max(size - 16, 0)
    tail = os.pread(fd, size - start, start).rstrip()
    return start + len(tail) - 1 if tail.endswith(b"]") and size > 16 else None


class Timeline:
    """One rank's timeline file. Thread-safe; use :func:`start_timeline` rather than building one.

    Times passed to :meth:`span`, :meth:`instant` and :meth:`counter` are ``time.perf_counter()`` seconds;
    they are written as wall-clock microseconds so files from different ranks line up when merged.
    """

    def __init__(self, path: str, rank: int = 0, mark_cycles: bool = False, append: bool = False) -> None:
        self.path = path
        self.rank = rank
        self.mark_cycles = mark_cycles
        self._lock = threading.Lock()
        self._buf: list[dict[str, Any]] = []
        self._rows: dict[str, int] = {}
        self._lanes: dict[str, list[int]] = {}  # unnamed ops: label -> its rows
        self._busy: set[int] = set()  # rows held by an unnamed op in flight
        self._bound: dict[str, int] = {}  # unnamed op in flight -> its row
        self._offset_us = (time.time() - time.perf_counter()) * 1e6
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | (0 if append else os.O_TRUNC), 0o644)
        head = [
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
        ]
        end = _closing_bracket(self._fd) if append else None
        if end is None:  # a new file
            body = "[\n" + ",\n".join(json.dumps(e, separators=(",", ":")) for e in head)
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, (body + "\n]\n").encode(), 0)
            end = len(body.encode())
        else:  # this process's earlier timeline in the same file (init() after shutdown(), elastic)
            self._buf.extend(head)
        self._end = end  # where the closing bracket (and what follows it) starts: the next flush writes here
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="hora-timeline", daemon=True)
        self._flusher.start()

    # -- recording ------------------------------------------------------------------------------------
    def _row(self, name: str) -> int:
        tid = self._rows.get(name)
        if tid is None:
            tid = self._rows[name] = len(self._rows) + 1
            self._buf.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                              "args": {"name": name}})
            self._buf.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid,
                              "args": {"sort_index": tid}})
        return tid

    def _pooled_row(self, name: str, label: str, last: bool) -> int:
        """A row for an unnamed op: the first free lane labelled ``label`` (a new one if all are busy), held
        until its last phase, so unnamed ops share a few rows instead of one row each."""
        tid = self._bound.get(name)
        if tid is None:
            lanes = self._lanes.setdefault(label, [])
            tid = next((t for t in lanes if t not in self._busy), 0)
            if not tid:
                tid = self._row(label if not lanes else f"{label} ({len(lanes) + 1})")
                lanes.append(tid)
            self._busy.add(tid)
            self._bound[name] = tid
        if last:
            del self._bound[name]
            self._busy.discard(tid)
        return tid

    def _add(self, event: dict[str, Any], pool: str | None = None) -> None:
        with self._lock:
            if pool is not None:
                event["tid"] = self._pooled_row(event.pop("row"), pool, event["name"] == LAST_PHASE)
            elif event["ph"] != "C":
                event["tid"] = self._row(event.pop("row"))
            self._buf.append(event)
            full = len(self._buf) >= _FLUSH_EVENTS
        if full:
            self.flush()

    def span(self, name: str, phase: str, start_s: float, end_s: float, row: str | None = None,
             **args: Any) -> None:
        """Record one phase of a collective as a slice.

        Args:
            name: the collective's name (``grad.bucket.3``); the row it goes to unless ``row`` is given.
                Generated names (``noname.*``) share a few rows per kind ("unnamed allreduce"), each op
                holding its row until its ``copy_out`` phase, so a long job does not get a row per step.
            phase: one of :data:`PHASES`, or the op kind for a slice that encloses all its phases.
            start_s: ``time.perf_counter()`` at the start.
            end_s: ``time.perf_counter()`` at the end.
            row: put the slice on this row instead (e.g. one row for all unnamed allreduces).
            **args: shown when the slice is selected: ``bytes``, ``dtype``, ``shape``...
        """
        args["name"] = name
        pool = f"unnamed {args.get('kind', 'ops')}" if row is None and name.startswith(UNNAMED_PREFIX) else None
        self._add({"name": phase, "cat": "hora", "ph": "X", "pid": self.rank, "row": row or name,
                   "ts": round(start_s * 1e6 + self._offset_us, 3),
                   "dur": round(max(end_s - start_s, 0.0) * 1e6, 3), "args": args}, pool)

    def instant(self, name: str, at_s: float | None = None, row: str | None = None, **args: Any) -> None:
        """A marker at ``at_s`` (default now), e.g. a negotiation round with ``--timeline-mark-cycles``."""
        at = time.perf_counter() if at_s is None else at_s
        self._add({"name": name, "cat": "hora", "ph": "i", "s": "t", "pid": self.rank, "row": row or name,
                   "ts": round(at * 1e6 + self._offset_us, 3), "args": args})

    def counter(self, name: str, at_s: float | None = None, **values: float) -> None:
        """A counter sample (a graph in the rank's row), e.g. ``counter("pending", ops=3)``."""
        at = time.perf_counter() if at_s is None else at_s
        self._add({"name": name, "ph": "C", "pid": self.rank, "tid": 0,
                   "ts": round(at * 1e6 + self._offset_us, 3), "args": values})

    # -- writing --------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write buffered events; the file stays a valid JSON array before and after."""
        with self._lock:
            events, self._buf = self._buf, []
            if not events or self._fd is None:
                return
            # One encode of the whole batch (half the cost of one per event); a newline before each event
            # keeps the file readable (whitespace between JSON tokens is always valid).
            data = (",\n" + _encode(events)[1:-1].replace('},{"name":', '},\n{"name":')).encode()
            # One write: the old closing bracket is overwritten by the new events and a new bracket.
            try:
                os.pwrite(self._fd, data + b"\n]\n", self._end)
            except OSError as e:  # a full disk must not kill training: stop recording, say so once
                log.warning("timeline %s: cannot write (%s); timeline stopped", self.path, e)
                os.close(self._fd)
                self._fd = None
                return
            self._end += len(data)

    def _flush_loop(self) -> None:
        while not self._stop.wait(_FLUSH_SECONDS) and self._fd is not None:
            self.flush()

    def close(self) -> None:
        """Flush and close the file. Later calls record nothing."""
        self._stop.set()
        self.flush()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


_active: Timeline | None = None
_written: set[str] = set()  # files this process started: a restart appends instead of truncating
_active_lock = threading.Lock()
_world: tuple[int, int] | None = None  # (rank, size) while hora is initialised (set_world)
_job: str | None = None  # the job id while hora is initialised (set_world)


def active() -> Timeline | None:
    """The running timeline, or None when none is on (the only cost the core pays when off)."""
    return _active


def start_timeline(file_path: str, mark_cycles: bool = False, *, rank: int | None = None,
                   size: int | None = None) -> Timeline | None:
    """Start writing this rank's timeline (Horovod's ``hvd.start_timeline``).

    Args:
        file_path: the job's timeline file (Horovod's argument name). With more than one rank this rank
            writes ``rank_path(file_path, rank)``.
        mark_cycles: also mark each negotiation round.
        rank: this process's rank; default hora's rank (or 0 before ``init()``).
        size: the world size; default hora's size (or 1).

    Returns:
        The running :class:`Timeline` (a second call restarts it on the new path); None when the file's
        filesystem is full (one warning names the file; training goes on without a timeline).

    Raises:
        ConfigError: the file cannot be written for another reason (no such directory, no permission).
    """
    global _active
    path = file_path
    if rank is None or size is None:
        rank, size = _topology(rank, size)
    target = rank_path(path, rank, _job_id()) if size > 1 else path
    with _active_lock:
        if _active is not None:
            _active.close()
        try:
            _active = Timeline(target, rank=rank, mark_cycles=mark_cycles, append=target in _written)
        except OSError as e:
            _active = None
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk must not stop training (as in flush())
                log.warning("timeline %s: rank %d cannot write %s (%s); this rank records no timeline, training "
                            "goes on", path, rank, target, e.strerror)
                with contextlib.suppress(OSError):  # the empty file it made, which no merge should look for
                    if os.path.getsize(target) == 0:
                        os.unlink(target)
                return None
            raise ConfigError(
                f"timeline {path!r} (--timeline-filename / HORA_TIMELINE): rank {rank} cannot write {target!r} "
                f"({e.strerror or e}); give a path in a writable directory"
            ) from None
        _written.add(target)
    log.info("timeline of rank %d -> %s", rank, target)
    return _active


def stop_timeline() -> None:
    """Stop the timeline and close its file (Horovod's ``hvd.stop_timeline``). No-op when none runs."""
    global _active
    with _active_lock:
        tl, _active = _active, None
    if tl is not None:
        tl.close()


def set_world(world: tuple[int, int] | None, job: str = "") -> None:
    """(rank, size) and the job id of the running hora, set by ``init()`` and cleared by ``shutdown()`` (the
    runtime sits above the diagnostics, so it tells them instead of being asked)."""
    global _world, _job
    _world = world
    _job = job if world is not None else None


def _job_id() -> str:
    return _job if _job is not None else WorkerEnv.from_environ().job_id


def _topology(rank: int | None, size: int | None) -> tuple[int, int]:
    if _world is not None:
        return (_world[0] if rank is None else rank, _world[1] if size is None else size)
    env = WorkerEnv.from_environ()
    return (env.rank if rank is None else rank, env.size if size is None else size)


def _forget_in_child() -> None:
    """A process forked from a rank (a DataLoader worker) must never append to that rank's file."""
    global _active
    _active = None


atexit.register(stop_timeline)
os.register_at_fork(after_in_child=_forget_in_child)


__all__ = ["PHASES", "Timeline", "active", "finish_job_timeline", "load_events", "main", "merge_timelines",
           "rank_parts", "rank_path", "start_timeline", "stop_timeline"]
