"""Handles of asynchronous collectives: ``poll(handle)`` and ``synchronize(handle)``.

A handle is returned by every ``*_async`` op. The negotiator thread *launches* it (issues the c10d call) once
every rank has submitted the op; ``synchronize`` waits for the c10d work and then *finishes* it on the calling
thread (decompress, scale, copy out), so the negotiator never does per-op arithmetic.

Example:
    >>> h = hvd.allreduce_async(torch.ones(3), name="x")   # doctest: +SKIP
    >>> hvd.poll(h)                                         # doctest: +SKIP
    False
    >>> hvd.synchronize(h)                                  # doctest: +SKIP
    tensor([1., 1., 1.])
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from hora.datapath.kinds.op import Op
from hora.diagnostics import timeline, where
from hora.diagnostics.inflight import InflightWatch
from hora.errors import CollectiveError

_UNSET = object()


def _released(handle: Handle) -> None:
    """``on_done`` of a handle already synchronized once."""


class Latch:
    """A one-shot gate: closed until :meth:`open` (from any thread, any number of times), then open for good.

    A bare lock held while closed, not a ``threading.Event``: one is made per op, so it must cost next to
    nothing to make (docs/performance.md, "The measurements behind design choices")."""

    __slots__ = ("_lock", "is_open")

    def __init__(self) -> None:
        self.is_open = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def open(self) -> None:
        if not self.is_open:
            self.is_open = True
            try:
                self._lock.release()
            except RuntimeError:  # opened twice at once (a failure racing a launch): once is enough
                pass

    def wait(self, timeout: float) -> bool:
        """Block until open or ``timeout`` seconds pass; True when open."""
        if self.is_open:
            return True
        if self._lock.acquire(timeout=timeout):
            try:
                self._lock.release()  # let every other waiter through too
            except RuntimeError:  # a racing second open() released it already
                pass
        return self.is_open


class Handle:
    """One submitted collective. Thread-safe: launched by the negotiator, finished by the user's thread."""

    __slots__ = ("_drive", "_error", "_gate", "_inflight", "_lock", "_on_done", "_result", "_work", "kind", "name",
                 "op")

    def __init__(self, name: str, kind: str, op: Op | None, on_done: Callable[[Handle], None],
                 drive: Callable[[Handle], None] | None = None, inflight: InflightWatch | None = None) -> None:
        self.name = name
        self.kind = kind
        self.op = op  # the op it finishes (None: nothing to finish, the engine's own shutdown request); what its
        # kind computed (an allgather's rows) is there after wait()
        self._gate = Latch()  # opens once the op is launched or failed
        self._work: Any = None
        self._error: BaseException | None = None
        self._result: Any = _UNSET
        self._on_done = on_done
        self._drive = drive  # runs the negotiation round on the waiting thread when it can (Negotiator.drive)
        self._lock = threading.Lock()
        self._inflight = inflight  # the engine's watch over transfers in flight, which a launched work joined

    # --- called by the negotiator thread ---------------------------------------------------------------
    def launched(self, work: Any = None) -> None:
        """The c10d call is issued (``work`` is its Work, or None when the data is already in place)."""
        self._work = work
        self._gate.open()

    def fail(self, error: BaseException) -> None:
        """The op will never run: ``synchronize`` raises ``error``."""
        self._error = error
        self._gate.open()

    def abandon(self, error: BaseException) -> None:
        """A peer of this op is gone. Launched and not complete, it never will be: ``synchronize`` raises
        ``error`` (a work already complete keeps its result; one not launched yet is failed by the engine)."""
        work = self._work
        if self._gate.is_open and self._error is None and work is not None and not _completed(work):
            self._error = error

    # --- called by the user's thread -------------------------------------------------------------------
    def poll(self) -> bool:
        if not self._gate.is_open:
            return False
        if self._error is not None or self._work is None:
            return True
        return bool(self._work.is_completed())

    def wait(self) -> Any:
        with self._lock:
            if self._result is not _UNSET:
                return self._result
            try:
                self._wait_launched()
                if self._error is not None:
                    raise self._error
                if self._work is not None:
                    try:
                        _wait_work(self._work, self.name, self.kind)
                    except CollectiveError:
                        if self._error is not None:  # abandoned: the lost peer is the cause, name it
                            raise self._error from None
                        raise
                if self._error is not None:  # abandoned while it ran (a NCCL wait returns at once)
                    raise self._error
                tl = timeline.active()
                t0 = time.perf_counter() if tl is not None else 0.0
                op = self.op
                self._result = op.steps.finish(op) if op is not None else None
                if tl is not None:  # scale, decompress, copy out (diagnostics)
                    tl.span(self.name, "copy_out", t0, time.perf_counter(), kind=self.kind)
                return self._result
            finally:
                if self._work is not None and self._inflight is not None:  # it watched only launched works
                    self._inflight.finished(self)
                # the name is free again; and the engine is no longer referred to, so a handle kept (say, by
                # an error's traceback) does not keep a runtime that shut down alive, with its sockets
                self._on_done(self)
                self._on_done, self._drive = _released, None

    def _wait_launched(self) -> None:
        if self._gate.is_open:
            return
        where.set_waiting((self.kind, self.name))
        try:
            if self._drive is not None and not self._gate.is_open:
                self._drive(self)
            while not self._gate.wait(1.0):  # a timeout loop keeps Ctrl-C responsive
                pass
        finally:
            where.set_waiting(None)

    def __repr__(self) -> str:
        state = "failed" if self._error else "launched" if self._gate.is_open else "pending"
        return f"<hora.Handle {self.kind} {self.name!r} {state}>"


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work that failed is not complete
        return False


def _wait_work(work: Any, name: str, kind: str) -> None:
    try:
        work.wait()
    except Exception as e:  # c10d reports peer loss as RuntimeError or DistError
        raise CollectiveError(
            f"{kind} {name!r} failed in the communication backend: {e}. A peer process probably died or lost "
            "its network link; see that rank's log for the root cause."
        ) from e


class GroupHandle:
    """Several handles that finish together (grouped ops, sparse allreduce). ``wait`` returns the list of
    results, or ``combine(results)`` when given."""

    def __init__(self, handles: list[Any], combine: Callable[[list[Any]], Any] | None = None) -> None:
        self.handles = handles
        self._combine = combine

    def poll(self) -> bool:
        return all(h.poll() for h in self.handles)

    def wait(self) -> Any:
        results = [h.wait() for h in self.handles]
        return self._combine(results) if self._combine is not None else results

    __call__ = wait  # Horovod's sparse handles were callables


class DoneHandle:
    """A handle whose result is already known (an op that ran synchronously, e.g. Adasum)."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def poll(self) -> bool:
        return True

    def wait(self) -> Any:
        return self._result


def poll(handle: Handle | GroupHandle | DoneHandle) -> bool:
    """True when ``synchronize(handle)`` would return without blocking."""
    return handle.poll()


def synchronize(handle: Handle | GroupHandle | DoneHandle) -> Any:
    """Wait for an async collective and return its output (a tensor, or a tuple for alltoall with splits)."""
    return handle.wait()
