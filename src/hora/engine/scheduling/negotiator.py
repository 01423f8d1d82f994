"""The negotiator: matches collectives across ranks by name, then runs them in one agreed order.

In each *round* every rank sends the requests it submitted since the last round, in one allgather on the
control plane (:mod:`hora.engine.transport.mesh`, or :class:`hora.engine.transport.gloo_plane.GlooPlane` for very large
jobs), and every rank reaches the same decision (:mod:`hora.engine.scheduling.rounds`, the round itself). This module is
the *scheduling*: who runs the next round, when, and why.

States: :class:`~hora.engine.scheduling.phases.Phase` (ROUND, IDLE, DEFERRING, CLOSING, BROKEN, STOPPED), changed only
under the negotiator's lock; :mod:`hora.engine.scheduling.phases` says what each means and which moves are allowed.

Besides ops, a round carries flags: stall queries and answers, and notices (``announce`` / ``notice_point``,
:mod:`hora.engine.scheduling.notices`: a value every rank gets at the same notice point, agreed in two rounds).

A round also runs on a caller's thread (``drive``, mesh only) while the negotiator thread stays parked;
rounds run on one thread at a time (the round lock). Threads: the negotiator's, one timer thread
(:mod:`hora.engine.scheduling.timers`: stall check, listen timer), and on the Gloo plane the death watch and rank 0's
bell janitor.

Latency tricks, for tiny synchronous ops: ``drive`` (a round on the caller's thread, no hand-off to this
thread), DEFERRING (one round per op when ranks arrive apart) and the deaf spell after a round run on the
caller's thread (``_listen_after_round``). Each is kept because ``benchmarks/op_overhead.py`` and
``benchmarks/allreduce_bench.py`` (1 element) are slower without it
(docs/performance.md, "The measurements behind design choices").
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hora.common.names import SHUTDOWN_NAME
from hora.datapath.kinds.op import Op
from hora.engine import codec
from hora.engine.context import EngineContext
from hora.engine.scheduling.handles import Handle
from hora.engine.scheduling.notices import NOTICE, Notices
from hora.engine.scheduling.pending import LocalOp, Pending, local_op
from hora.engine.scheduling.phases import ACTIVE, NEXT, Phase
from hora.engine.scheduling.rounds import Rounds, record_lost
from hora.engine.scheduling.table import SHUTDOWN, Request, Table
from hora.engine.scheduling.timers import TimerThread
from hora.engine.transport.death_watch import death_watch
from hora.engine.transport.plane import make_control_plane
from hora.errors import CollectiveError, PeerLostError

log = logging.getLogger(__name__)

_DEFER_MAX_S = 1.0
_IDLE_WAIT_S = 3600.0  # store waits time out noisily in c10d's C++ log: wake only when rung


@dataclass(frozen=True)
class EngineSnapshot:
    """See :meth:`Negotiator.snapshot`."""

    phase: str
    sequence: dict[int | None, int]  # process set id -> the next unnamed op's number
    submitted: list[str]  # submitted, not yet launched or failed
    in_flight: list[str]  # handles not yet synchronized
    outbox: list[str]  # not yet sent in a round
    rejected: list[str]  # rejected here, to be announced
    cached: int  # requests the response cache knows
    entries: list[str]  # names in the table, waiting for members
    tombstones: list[str]  # names that failed, remembered for late members
    fusion_threshold: int  # bytes up to which ready allreduces are fused (autotune changes it)


class Negotiator:
    """See the module docstring. Created by ``init()``; ops call ``submit_many()`` and their handles
    ``drive()`` / ``done()``."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx
        self.rank = ctx.rank
        self.size = ctx.size
        self.site_check = ctx.knobs.call_site_check  # unnamed ops carry their call site's fingerprint
        self._pending = Pending(self.rank)
        self._lock = self._pending.lock  # guards the phase and what is pending (a re-entrant lock)
        self._phase = Phase.ROUND  # the thread starts awake: it looks at what is due, then parks
        self.error: BaseException | None = None  # why negotiation broke (BROKEN)
        self._parked_round: int | None = None  # the round whose bell the parked thread waits on
        self._rung = False  # that bell was rung already
        self._defer_until: float | None = None  # while a deferral runs: when it ends
        self._round_lock = threading.Lock()  # held by whichever thread runs a round
        self._stopped = threading.Event()  # the negotiator thread has ended
        self._plane = make_control_plane(ctx)
        self._inline_ok = self._plane.inline_rounds
        self._notices = Notices(self._pending, wake=self._ring_if_parked)
        self._rounds = Rounds(ctx, self._pending, self._plane, self._notices)
        self._plane.on_wait = self._rounds.on_wait
        # how long a rank may hold back its answer to a round it cannot advance; well under the stall
        # warning time, so stall reports are not delayed noticeably
        self._defer_s = min(_DEFER_MAX_S, ctx.knobs.stall_check_time_seconds / 4)
        self._timers = TimerThread()
        self._stall_timer = self._timers.timer(self._on_stall_timer)
        self._listen_timer = self._timers.timer(self._on_listen_timer)
        self._death_watch = death_watch(ctx, self._plane, self._on_peer_lost)
        self._thread = threading.Thread(target=self._run, name="hora-negotiator", daemon=True)

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def control_plane(self) -> str:
        """The control plane's kind (its class: ``Mesh``, ``GlooPlane``, ``LocalPlane``), for reports."""
        return type(self._plane).__name__

    @property
    def round_peers(self) -> list[int]:
        """The ranks this rank's rounds exchange frames with directly: every other rank on the full exchange,
        its recursive-doubling partners above ``HORA_MESH_FULL_UPTO`` ranks; every rank on the Gloo plane."""
        return list(self._plane.plan.peers)

    @property
    def rounds_run(self) -> int:
        """How many rounds this rank has taken part in (the same number on every rank): benchmarks count
        messages per round with it."""
        return self._rounds.number

    @property
    def table(self) -> Table:  # read it under rounds_held()
        return self._rounds.table

    @contextlib.contextmanager
    def rounds_held(self) -> Iterator[None]:
        """No round starts on this rank while inside: what is submitted meanwhile travels in the next round
        together (how a busy rank's ops meet in one round, made certain for a test or a debugger)."""
        with self._round_lock:
            yield

    def snapshot(self) -> EngineSnapshot:
        """What this rank's engine holds now, as plain values, for tests and debugging: the phase, the unnamed
        ops' sequence numbers per process set, the names submitted / in flight / queued / rejected, the
        response cache's size, the table's pending names and tombstones (as of the last round: a round
        running meanwhile may change them), and the fusion threshold."""
        with self._pending.lock:
            pending = self._pending.snapshot()
        return EngineSnapshot(phase=self._phase.name, cached=len(self._rounds.cache),
                              entries=sorted(self._rounds.table.entries),
                              tombstones=sorted(self._rounds.table.tombstones),
                              fusion_threshold=self._rounds.dispatch.fusion_threshold, **pending)

    def _move(self, to: Phase) -> bool:
        """Change phase (lock held); True when it changed. Once CLOSING or BROKEN the thread still runs and
        parks, and a failure may still come after STOPPED: those moves are ignored. Any other move not in
        ``NEXT`` is a bug."""
        if to is self._phase or self._phase is Phase.STOPPED or (to in ACTIVE and self._phase not in ACTIVE):
            return False
        if to not in NEXT[self._phase]:
            raise AssertionError(f"negotiator phase {self._phase.name} -> {to.name} is not allowed")
        self._phase = to
        return True

    # --- user side ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._timers.start()
        if self._death_watch is not None:
            self._death_watch.start()

    def unnamed(self, ps_id: int | None) -> str:  # the next sequence name of an unnamed op in set ps_id
        return self._pending.unnamed(ps_id)

    def in_flight(self, name: str) -> bool:  # submitted and not yet synchronized
        return self._pending.in_flight(name)

    def reject(self, reqs: list[Request]) -> None:
        """Announce calls this rank rejected before sending them (``error`` set): each took its place, so the
        peers' matching ops fail with the reason instead of pairing with this rank's next op or waiting."""
        reqs = [r for r in reqs if any(m != self.rank for m in r.ps)]  # a set of one: nobody to tell
        if not reqs:
            return
        with self._lock:
            if self._phase in (Phase.BROKEN, Phase.STOPPED):
                return
            self._pending.rejected.extend(reqs)
            self._ring_if_parked()

    def submit_many(self, ops: list[tuple[Request, Op]], waiting: bool = False) -> list[Handle]:
        """Queue ``(request, op)`` pairs for the next round, all in the same round (grouped ops stay together);
        each op's kind has prepared it. Returns their handles.

        ``waiting``: the caller synchronizes at once, so on the mesh its ``wait()`` runs the round itself
        (``drive``) and the negotiator thread is not woken for it."""
        return self._queue([local_op(req, op, Handle(req.name, req.kind, op, self.done, self.drive,
                                                          self._rounds.inflight))
                            for req, op in ops], waiting)

    def _queue(self, ops: list[LocalOp], waiting: bool) -> list[Handle]:
        with self._lock:
            if self._phase in (Phase.BROKEN, Phase.STOPPED):
                error = self.error or CollectiveError("hora has shut down")
                message = f"hora cannot run {ops[0].req.kind} {ops[0].req.name!r}: {error}"
                if isinstance(error, PeerLostError):  # still a consequence of the lost peer, not a cause
                    raise PeerLostError(message, error.peer) from error
                raise CollectiveError(message) from error
            self._pending.add(ops)
            if not (waiting and self._inline_ok):
                self._ring_if_parked()
        return [op.handle for op in ops]

    def announce(self, value: Any, channel: str = "elastic") -> None:
        """Give ``value`` to every rank at the same notice point of ``channel`` (:meth:`notice_point`,
        :mod:`hora.engine.scheduling.notices`): it goes out in this rank's next round. Any thread; does nothing once
        negotiation is over.

        Raises:
            FrameError: ``value`` is not made of plain values (:mod:`hora.engine.codec`), so no frame can carry it.
        """
        codec.encode(value)  # refused here, on the caller's thread, not later in a round every rank waits on
        with self._lock:
            if self._phase in (Phase.BROKEN, Phase.STOPPED):
                return
            self._pending.flags.setdefault(NOTICE, []).append([channel, value])
            self._ring_if_parked()

    def notice_point(self, channel: str = "elastic") -> list[Any]:
        """Pass one notice point of ``channel``: every rank makes the same notice points; an announced value
        comes out at the same call on every rank (usually []: no message, no wait). See
        :mod:`hora.engine.scheduling.notices`."""
        return self._notices.notice_point(channel)

    def listen(self, channel: str, listener: Callable[[Any], None] | None) -> None:
        """``listener(value)`` for each value announced on ``channel``, in the round that carries it (the same
        round on every rank, on the thread running it)."""
        self._notices.listen(channel, listener)

    def set_fusion_threshold(self, threshold: int) -> None:
        """Bytes up to which ready allreduces are fused from the next round on; call it from the round thread
        (a :meth:`listen` listener), so every rank changes it at the same round."""
        self._rounds.dispatch.set_fusion_threshold(threshold)

    def done(self, handle: Handle) -> None:
        """Called when a handle is synchronized: its name may be used again."""
        self._pending.release(handle.name)

    def drive(self, handle: Handle) -> None:
        """Called by a thread about to block on ``handle``: if the op is unsent and no round is under way, run
        the round on this thread (mesh only), saving the hand-offs to and from the negotiator thread; else
        make sure that thread is woken. At most one round: peers' later rounds wake that thread as usual."""
        if self._inline_ok and self._round_lock.acquire(blocking=False):
            try:
                with self._lock:
                    unsent = (self._phase not in (Phase.BROKEN, Phase.STOPPED)
                              and any(op.handle is handle for op in self._pending.outbox))
                if unsent:
                    self._plane.quiet(True)
                    try:
                        self._round()  # its allgather reads what peers sent: no need to look first
                    finally:
                        self._listen_after_round()
            except Exception as e:  # a round cut short leaves the ranks out of step: negotiation is over
                error = self._rounds.peer_loss(e)
                self._break(error)
                raise error from e
            except BaseException as e:  # Ctrl-C in the middle of a round
                self._break(CollectiveError(
                    f"rank {self.rank}: a negotiation round was interrupted ({e!r}), so this process is out of step "
                    "with its peers; to go on, call hvd.shutdown() then hvd.init() on every rank"))
                raise
            finally:
                self._round_lock.release()
        with self._lock:
            # wake the negotiator thread if there is more to send, if ops wait for peers (it re-arms the stall
            # check), or if a peer's next frame came during this round (read off the socket: nothing else would)
            inline_left = self._inline_ok and (bool(self._rounds.table.entries) or self._plane.has_input())
            if self._pending.has_outgoing() or inline_left:
                self._ring_if_parked()

    def stop(self, timeout: float = 30.0) -> None:
        """Collective shutdown: wait (up to ``timeout``) until every rank stops, then end the threads and
        close the plane. Pending ops fail.

        With ``timeout`` 0 (a crashing process) nothing is negotiated: the peers learn of it when this
        process's connections close."""
        with self._lock:
            negotiate = self._phase in ACTIVE and timeout > 0 and not self._rounds.stall_failed
            if self._phase in ACTIVE:
                self._move(Phase.CLOSING)
        try:  # Ctrl-C while waiting for the peers still ends the threads and closes the plane
            if negotiate and self._thread.is_alive():
                self._negotiate_shutdown(timeout)
        finally:
            with self._lock:
                self._move(Phase.STOPPED)
                self.error = None  # its traceback may hold a frame of this negotiator: no cycle for the collector
            self._plane.wake()  # a parked thread sees STOPPED and ends (a local wake-up: peers see nothing)
            self._thread.join(timeout=1.0)
            self._timers.stop()
            self._rounds.inflight.stop()
            self._notices.fail(CollectiveError("hora has shut down"))
            if self._death_watch is not None:
                self._death_watch.close()
            self._plane.close()
            for op in self._pending.take_all():  # nothing left can complete: synchronize() raises, now or later
                op.handle.fail(CollectiveError(
                    f"{op.req.kind} {op.req.name!r} did not complete on rank {self.rank} before hvd.shutdown(): "
                    "every member of its process set must submit it before any of them shuts down (synchronize "
                    "async handles before hvd.shutdown())"))

    def _negotiate_shutdown(self, timeout: float) -> None:
        h = Handle(SHUTDOWN_NAME, SHUTDOWN, None, self.done)
        req = Request(SHUTDOWN_NAME, SHUTDOWN, "", (), ps=tuple(range(self.size)))
        try:
            self._queue([local_op(req, None, h)], waiting=False)
        except CollectiveError:
            return
        deadline = time.monotonic() + timeout
        while not h.poll() and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        if not h.poll():
            log.warning("rank %d: peers did not shut down within %.0fs; leaving anyway", self.rank, timeout)

    def _ring_if_parked(self) -> None:  # caller holds self._lock
        if self._parked_round is not None and not self._rung:
            self._rung = True
            try:
                self._plane.ring(self._parked_round)
            except Exception as e:  # the store is gone: the launcher died
                self._break(CollectiveError(f"rank {self.rank} lost the rendezvous store: {e}"))

    # --- the negotiator thread -----------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)  # thread-local: collectives never record autograd history
        pin_to_core(self.ctx.knobs.thread_affinity, self.ctx)
        if self.ctx.device is not None:
            torch.cuda.set_device(self.ctx.device)
        woken = False
        try:
            while True:
                with self._round_lock:
                    if not self._wake_up():
                        return
                    if self._run_due_rounds(woken):
                        return  # the shutdown round ran
                    round_no = self._rounds.number
                    timeout = self._park(round_no)
                    if timeout is None:
                        return
                try:
                    woken = self._plane.wait(round_no, timeout)
                finally:
                    self._stall_timer.disarm()
        except Exception as e:  # any failure ends negotiation; users see it on their handles
            self._break(self._rounds.peer_loss(e))
        finally:
            self._stopped.set()

    def _wake_up(self) -> bool:
        """The thread woke (round lock held): False when it should end (BROKEN or STOPPED)."""
        with self._lock:
            self._parked_round = None
            self._move(Phase.ROUND)
            return self._phase not in (Phase.BROKEN, Phase.STOPPED)

    def _park(self, round_no: int) -> float | None:
        """Before blocking on the bell (round lock held): arm the stall check, let submitters ring, and
        return how long to block (None: stop() or a failure came meanwhile, end the thread)."""
        if self.rank == 0 and round_no > 0:
            self._plane.clear(round_no - 1)  # everyone is past that bell: they all took part in its round
        delay = self._rounds.stall.check_in()
        if delay is not None:
            self._stall_timer.arm(delay, round_no)
        self._plane.quiet(False)  # this thread answers peers itself from now on
        with self._lock:
            if self._phase in (Phase.BROKEN, Phase.STOPPED):
                return None
            self._move(Phase.IDLE if self._defer_until is None else Phase.DEFERRING)
            self._parked_round = round_no
            self._rung = False
            if self._pending.has_outgoing():  # gloo: busy ranks run rounds back to back; mesh: a submitter
                self._ring_if_parked()  # that meant to run the round itself found this thread busy
        if self._defer_until is not None:
            return max(self._defer_until - time.monotonic(), 0.0)
        return _IDLE_WAIT_S

    def _run_due_rounds(self, woken: bool) -> bool:
        """Run the rounds due now (round lock held); True once the shutdown round ran. Gloo plane: the round
        whose bell woke us (every rank joins every rung round). Mesh: when this rank has something to send,
        or peers started one that it can advance, or it has deferred its answer long enough."""
        if not self._inline_ok:
            return woken and self._round()
        while True:
            self._plane.receive_ready()
            with self._lock:
                local = self._pending.has_outgoing()
                closing = self._phase is not Phase.ROUND
            if not local:
                if not self._plane.has_input():
                    return False
                now = time.monotonic()
                if self._defer_until is None or now < self._defer_until:
                    if not closing and self._rounds.may_defer():
                        if self._defer_until is None:
                            self._defer_until = now + self._defer_s
                        return False
            if self._round():
                return True

    def _round(self) -> bool:
        self._defer_until = None
        return self._rounds.run()

    def _listen_after_round(self) -> None:
        """After a round on the caller's thread (round lock held): in the steady state of a synchronous loop
        (nothing pending, nothing early) keep the negotiator thread deaf to peers for up to ``_defer_s``:
        the next frame is a peer's next op, which this rank would only defer, and the caller's next op
        answers it without waking that thread, whose wake-up would compete with the caller for the CPU. The
        timer restores it, so an answer is never later than a deferral would make it. Otherwise listen now."""
        if self._rounds.table.entries or self._plane.has_input() or self._phase is Phase.BROKEN:
            self._plane.quiet(False)
        else:
            self._listen_timer.arm(self._defer_s, self._rounds.number)

    # --- timers and the death watch (other threads) ---------------------------------------------------
    def _on_listen_timer(self, round_no: int) -> None:
        self._plane.quiet(False)

    def _on_stall_timer(self, round_no: int) -> None:
        """A stall deadline passed while this rank is parked. If a round is under way (on any thread), the
        thread re-arms the check when it next parks, so skipping this firing loses nothing."""
        if not self._round_lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                due = self._rounds.stall.due()
                if self._parked_round == round_no and due:
                    self._pending.flags["stall_query"] = due
                    self._ring_if_parked()
        finally:
            self._round_lock.release()

    def _on_peer_lost(self, peer: int, error: str) -> None:
        """The death watch saw ``peer`` go: say so in the store for every rank's error message, and ring a
        round, which fails on every rank instead of leaving them waiting for the dead peer."""
        with self._lock:
            if self._phase not in ACTIVE or self._stopped.is_set():
                return
        log.info("rank %d: rank %d on %s is gone (%s)", self.rank, peer, self.ctx.hostname(peer), error)
        record_lost(self.ctx.store, peer)
        with self._lock:
            self._ring_if_parked()

    def _break(self, error: BaseException) -> None:
        with self._lock:
            broke = self._move(Phase.BROKEN)
            if broke:
                self.error = error
                # the text: a kept log record must not keep the error's frames. A lost peer is not this rank's
                # error to print: the peer is the cause (hora run names it) and every collective raises it here
                log.log(logging.INFO if isinstance(error, PeerLostError) else logging.ERROR, "%s", f"{error}")
        self._notices.fail(error)
        for op in self._pending.take_all():
            op.handle.fail(error)
        if broke and isinstance(error, PeerLostError):
            self._abandon_running(error)

    def _abandon_running(self, error: PeerLostError) -> None:
        """A peer is gone: what was launched with it and has not completed never will. Those handles fail
        (``synchronize()`` raises ``error`` rather than hand out a result that never arrived), then, on a GPU,
        the data groups' NCCL communicators are aborted, so their kernels end and nothing (a later ``.item()``,
        torch's watchdog) waits for the peer until the group's timeout."""
        for handle in self._pending.running():
            handle.abandon(error)
        if self.ctx.abort_data_plane is not None:
            try:
                self.ctx.abort_data_plane()
            except Exception as e:  # noqa: BLE001 - the reset aborts the groups again
                log.warning("rank %d: aborting the NCCL communicators after the loss of a peer failed: %s",
                            self.rank, e)


def pin_to_core(affinity: str, ctx: EngineContext) -> None:
    """``HOROVOD_THREAD_AFFINITY``: pin the calling thread to the core listed for this rank's local rank (the
    list has one core per local rank, as Horovod's). A bad list is reported once and ignored, as Horovod does."""
    if not affinity.strip():
        return
    local_rank = sum(1 for r in range(ctx.rank) if ctx.hostname(r) == ctx.hostname(ctx.rank))
    try:
        cores = [int(c) for c in affinity.split(",")]
        core = cores[local_rank]
        os.sched_setaffinity(threading.get_native_id(), {core})
    except (ValueError, IndexError, OSError) as e:
        log.warning("HOROVOD_THREAD_AFFINITY=%s: cannot pin local rank %d's negotiator thread (%s); left unpinned",
                    affinity, local_rank, e)
        return
    log.info("negotiator thread of rank %d pinned to core %d", ctx.rank, core)
