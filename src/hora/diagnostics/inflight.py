"""Data transfers this rank launched that have not finished: how a peer frozen mid-transfer gets reported.

A rank stopped (SIGSTOP, a debugger) or inside a native call that holds the GIL while a large allreduce is on
the wire leaves its peers blocked inside the communication backend, not in a negotiation round, so the
round's stall checks never run. Its peers still know which data ops they launched and that have not
finished. The dispatcher records each launched op in the engine's :class:`InflightWatch` (``launched``, a dict
store) and a handle forgets it when it is synchronized (``finished``, a dict pop): no store round trip per op.

A watchdog thread, which exists only while ops are in flight and wakes a few times per warning period
(at most once a second), looks for ops in flight for longer than ``--stall-check-warning-time-seconds``.
For those it:

- logs one warning (on the two lowest ranks of the op's process set, so a large job does not print one
  line per rank);
- posts them on the board (``inflight/<rank>``, :mod:`hora.protocol.messages`), where ``hora run``'s driver
  finds the members that posted nothing, asks their agents what ``/proc`` says about them, and prints the
  ``stall:`` line;
- posts again once the op has been in flight for ``--stall-check-shutdown-time-seconds``: the driver then
  ends the job, naming the frozen rank. The blocked ranks cannot end themselves: a c10d wait cannot be
  interrupted.

When the ops finish after all (a native call that returned), the post is withdrawn and the job goes on.

Example:
    >>> from hora.diagnostics.stall_report import StallPolicy
    >>> InflightWatch(Board(None, "", 0), 0, StallPolicy(enabled=False)).blocking(object(), ())  # watches nothing
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hora.diagnostics.board import Board
from hora.diagnostics.stall_report import StallPolicy
from hora.diagnostics.where import describe_op

log = logging.getLogger(__name__)

MAX_TICK_S = 1.0  # the watchdog wakes at least this often while ops are in flight, at most 4 times per warning


class OpRequest(Protocol):
    """What this module reads of a request (:class:`hora.plan.Request`)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def ps(self) -> tuple[int, ...]: ...


@dataclass(slots=True)
class _Op:
    reqs: Sequence[OpRequest]  # several for a fused batch
    work: Any  # the c10d Work (None: a thread waits for it, and calls finished(), see blocking())
    since: float  # time.monotonic() at launch


@dataclass
class _Config:
    board: Board
    rank: int
    warning_s: float
    shutdown_s: float  # 0: never


class InflightWatch:
    """This rank's data transfers in flight and the watchdog thread over them (the module docstring); one per
    engine, made with the board, this rank and the stall policy (a disabled policy, ``--no-stall-check``, watches
    nothing)."""

    def __init__(self, board: Board, rank: int, policy: StallPolicy) -> None:
        self._config: _Config | None = \
            _Config(board, rank, policy.warning_s, policy.shutdown_s) if policy.enabled else None
        self._ops: dict[int, _Op] = {}  # id(key) -> op; written by the dispatching and the synchronizing threads
        self._lock = threading.Lock()  # guards the start and end of the watchdog thread, not the dict
        self._running = False
        self._wake = threading.Event()  # set by stop(): the watchdog thread ends at once, not after its sleep
        self._thread: threading.Thread | None = None

    def stop(self, timeout: float = 2.0) -> None:
        """Stop watching (called at ``shutdown()``): forget every op and end the watchdog thread before
        returning, so a shut-down runtime leaves no thread behind."""
        self._config = None
        self._ops.clear()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._wake.clear()

    def launched(self, key: object, reqs: Sequence[OpRequest], work: Any) -> None:
        """The op ``key`` (its handle) is on the wire: ``reqs`` are its requests, ``work`` its c10d Work (None:
        the data is in place already, nothing to watch). Its handle calls :meth:`finished`; an op nobody
        synchronizes is dropped once its work completes."""
        if work is not None and self._config is not None:
            self._ops[id(key)] = _Op(reqs, work, time.monotonic())
            if not self._running:
                self._start()

    def blocking(self, key: object, reqs: Sequence[OpRequest]) -> None:
        """The calling thread is about to wait for a transfer of ``reqs`` (a fused batch); it calls
        :meth:`finished` with the same ``key`` (an object alive until then) when the wait returns or fails."""
        if self._config is not None:
            self._ops[id(key)] = _Op(reqs, None, time.monotonic())
            if not self._running:
                self._start()

    def finished(self, key: object) -> None:
        """The op ``key`` is over (synchronized, or its blocking wait returned or failed)."""
        self._ops.pop(id(key), None)

    def _start(self) -> None:
        with self._lock:
            if self._running:
                return
            self._running = True
            self._thread = threading.Thread(target=self._watch, name="hora-inflight-watch", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        """The watchdog thread: runs while ops are in flight (see the module docstring)."""
        posted: tuple[tuple[str, ...], bool] | None = None  # what the board shows: the stuck ops' names, expired
        warned: set[str] = set()
        config = self._config
        last = time.monotonic()
        ops = self._ops
        while config is not None:
            tick = min(MAX_TICK_S, config.warning_s / 4)
            if self._wake.wait(tick):  # stop(): shutdown() ends the watch
                with self._lock:
                    self._running = False
                break
            now = time.monotonic()
            # slept much longer than asked: this process was frozen itself (stopped, or a native call held the
            # GIL); that time does not count against its own transfers, which it held up rather than waited for
            frozen = now - last - tick if now - last > 2 * tick + 0.5 else 0.0
            last = now
            stuck: list[_Op] = []
            for key, op in list(ops.items()):
                op.since += frozen
                if op.work is not None and _completed(op.work):
                    ops.pop(key, None)  # nobody synchronized it yet; it no longer holds anything up
                elif now - op.since >= config.warning_s:
                    stuck.append(op)
            if stuck:
                waited = now - min(op.since for op in stuck)
                expired = config.shutdown_s > 0 and waited >= config.shutdown_s
                for op in stuck:
                    if op.reqs[0].name not in warned:
                        warned.add(op.reqs[0].name)
                        if config.rank in sorted(op.reqs[0].ps)[:2]:  # one line or two, not one per rank
                            log.warning("%s", format_report(config.rank, op, now - op.since, config.shutdown_s,
                                                            config.board.active))
                names = tuple(sorted(req.name for op in stuck for req in op.reqs))
                if posted != (names, expired):
                    posted = (names, expired)
                    config.board.post_inflight([_describe(op, now) for op in stuck], waited, expired,
                                               config.shutdown_s)
            elif posted is not None:  # they finished after all: withdraw the post
                posted = None
                warned.clear()
                config.board.post_inflight([], 0.0, False, config.shutdown_s)
            if not ops and self._may_end():
                break
            config = self._config
        else:
            with self._lock:
                self._running = False

    def _may_end(self) -> bool:
        """Nothing is in flight: end the watchdog thread unless an op came in meanwhile (launched() starts a
        new thread whenever it finds none running)."""
        with self._lock:
            self._running = False
        if not self._ops:
            return True
        with self._lock:
            if self._running:  # launched() saw none running and started another thread
                return True
            self._running = True
            return False


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # a work whose backend is gone: it holds nothing up any more
        return True


def _nbytes(req: OpRequest) -> int:
    dtype = getattr(torch, req.dtype, None)
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 0
    return math.prod(int(d) for d in req.shape) * itemsize


def _describe(op: _Op, now: float) -> dict[str, Any]:
    first = op.reqs[0]
    return {"kind": first.kind, "name": first.name, "op": _what(op), "ps": list(first.ps),
            "bytes": sum(_nbytes(r) for r in op.reqs), "age": round(now - op.since, 1)}


def _what(op: _Op) -> str:
    first = op.reqs[0]
    if len(op.reqs) > 1:
        return f"a fused {first.kind} of {len(op.reqs)} tensors ({describe_op(first.kind, first.name)}, ...)"
    return describe_op(first.kind, first.name)


def format_bytes(n: int) -> str:
    """``format_bytes(3 << 20)`` -> ``"3.0 MB"``."""
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_report(rank: int, op: _Op, age_s: float, shutdown_s: float, launcher: bool) -> str:
    """The worker's warning about an op stuck on the wire."""
    ps = sorted(op.reqs[0].ps)
    members = f"ranks {ps[0]}-{ps[-1]}" if ps == list(range(ps[0], ps[-1] + 1)) else f"ranks {ps}"
    lines = [f"hora stall: rank {rank}: {_what(op)} ({format_bytes(sum(_nbytes(r) for r in op.reqs))} on "
             f"{members}) has been in the communication backend for {age_s:.0f} s and has not finished. A member "
             "of its process set has probably frozen in the middle of the transfer (stopped by SIGSTOP, Ctrl-Z or "
             "a debugger; inside a native call that holds the GIL) or is cut off from its peers by the network."]
    if launcher:
        lines.append("hora run asks the hosts what the members' processes are doing (see the launcher's "
                     "'stall:' line).")
    if shutdown_s > 0 and launcher:
        lines.append(f"The job stops when the transfer has taken {shutdown_s:g} s "
                     "(--stall-check-shutdown-time-seconds).")
    elif shutdown_s > 0:  # no driver to end it: a blocked c10d wait cannot be interrupted from here
        lines.append("Without hora run nothing can interrupt the transfer: it ends at the communication backend's "
                     "timeout (HORA_COLLECTIVE_TIMEOUT, 600 s by default).")
    else:
        lines.append("It waits on (no --stall-check-shutdown-time-seconds).")
    return " ".join(lines)
