"""The negotiator: matches collectives across ranks by name, then runs them in one agreed order.

In each *round* every rank contributes the requests it submitted since the last round, in one allgather on
the control plane (:mod:`hora.engine.mesh`, or :class:`hora.engine.control.GlooPlane` for very large
jobs); every rank adds them to the same :class:`hora.engine.plan.Table` and reaches the same decision
(ready / mismatched, and the order to run them). Whichever thread runs the round (it holds the round lock)
issues hora's data-plane collectives (:mod:`hora.engine.dispatch`), in that order, on hora's own groups:
the negotiator thread, or a thread about to wait for its own synchronous op (``drive``), which saves two
thread hand-offs per op.

Rounds are event-driven. Between rounds the negotiator thread blocks on the plane's bell: a local submit
rings it, and on the mesh so does a peer's frame (a peer started a round). No busy loop, no fixed cycle, no
CPU while idle. A rank whose answer cannot advance a round that peers started holds it until it submits
(``_may_defer``), so ranks reaching an op at slightly different times still run it in one round. A peer
whose process goes is noticed at once (its mesh connections close, or the death watch), so nobody waits
for a dead rank.

A name seen before with identical metadata is sent as a small integer (the response cache), so steady-state
rounds carry a few bytes. The stall inspector lives here too: the table knows which ranks have not submitted
a pending name and since when.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from hora import fusion
from hora.diagnostics import inflight
from hora.diagnostics import stall as stall_mod
from hora.diagnostics import timeline as timeline_mod
from hora.diagnostics.board import Board
from hora.diagnostics.stall_inspector import StallInspector
from hora.engine.control import DeathWatch, Watchdog, advertised_address, make_control_plane
from hora.engine.dispatch import Dispatcher, LocalOp
from hora.engine.mesh import Mesh, PeerLost
from hora.engine.plan import JOIN, SHUTDOWN, Decision, Request, Table
from hora.engine.response_cache import UNNAMED, ResponseCache
from hora.errors import CollectiveError, CollectiveTimeoutError
from hora.handles import Handle

if TYPE_CHECKING:
    from hora.runtime import Runtime

log = logging.getLogger(__name__)

_UNNAMED = UNNAMED
_DEFER_MAX_S = 1.0
_IDLE_WAIT_S = 3600.0  # store waits time out noisily in c10d's C++ log: wake only when rung


class Negotiator:
    """See the module docstring. Created by ``init()``; ``submit()`` is the only call ops make."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.rank = rt.topo.rank
        self.size = rt.topo.size
        self.table = Table(self.size)
        self._stall = StallInspector(self.table, stall_mod.StallPolicy.from_knobs(rt.knobs), self.rank,
                                     rt.topo.hostnames)
        self._lock = threading.RLock()  # _break() may run while a submitter holds it
        self._outbox: list[LocalOp] = []
        self._rejected: list[Request] = []  # calls rejected on this rank, announced in the next round
        self._mine: dict[str, LocalOp] = {}  # submitted, not yet launched or failed
        self._in_flight: set[str] = set()  # names whose handle has not been synchronized
        self._flags: dict[str, Any] = {}
        self._broken: BaseException | None = None
        self._stall_shutdown = False  # a stalled collective was failed: do not wait for peers at stop()
        self._idle_round: int | None = None  # the round whose bell the negotiator thread waits for, if idle
        self._rung = False
        self._round_lock = threading.Lock()  # held by whichever thread runs a round (see drive())
        self._round_no = 0
        self._woken = False  # the gloo plane's bell rang: join that round
        self._defer_until: float | None = None
        self._seq: dict[int, int] = {}
        self.site_check = rt.knobs.call_site_check  # unnamed ops carry their call site's fingerprint
        self._cache = ResponseCache(self.rank, enabled=not rt.knobs.disable_cache)
        self._dispatch = Dispatcher(self.rank, rt.process_sets, self._take_local, rt.knobs.fusion_threshold)
        self._stopped = threading.Event()
        self._exit_requested = False
        self._plane = make_control_plane(rt)
        self._inline_ok = self._plane.inline_rounds
        self._board = Board(getattr(rt.store, "underlying_store", None), rt.env.board_id, self.rank)
        self._round_warned = -1  # the round whose silent peers were reported
        inflight.configure(self._board, self.rank, self._stall.policy)  # data transfers a frozen peer holds up
        if isinstance(self._plane, Mesh):
            self._plane.on_wait = self._round_wait
        # how long a rank may hold back its answer to a round it cannot advance (see _may_defer); well
        # under the stall warning time, so stall reports are not delayed noticeably
        self._defer_s = min(_DEFER_MAX_S, rt.knobs.stall_check_time_seconds / 4)
        self._watchdog = Watchdog(self._on_watchdog)
        # after a synchronous op ran its round on the caller's thread, peers' next frames do not wake the
        # idle negotiator thread for a while: the caller's next op usually answers them (see drive())
        self._listen_timer = Watchdog(self._on_listen_timer)
        self._closing = False  # a shutdown is under way: peers closing their connections is expected
        self._death_watch = (DeathWatch(self.rank, self.size, rt.store, advertised_address(rt.env.store_addr),
                                        rt.knobs.start_timeout, self._on_peer_lost)
                             if self.size > 1 and not self._plane.watches_peers else None)
        self._thread = threading.Thread(target=self._run, name="hora-negotiator", daemon=True)

    # --- user side ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._watchdog.start()
        if self._inline_ok:
            self._listen_timer.start()
        if self._death_watch is not None:
            self._death_watch.start()

    def unnamed(self, ps_id: int) -> str:
        """A sequence name for an unnamed op: shared by every kind in a process set, so a rank calling a
        different collective than its peers is a mismatch at once, not a silent hang."""
        with self._lock:
            n = self._seq.get(ps_id, 0)
            self._seq[ps_id] = n + 1
        return f"{_UNNAMED}ps{ps_id}.{n}"

    def in_flight(self, name: str) -> bool:
        with self._lock:
            return name in self._in_flight

    def reject(self, reqs: list[Request]) -> None:
        """Announce calls this rank rejected before sending them (requests with ``error`` set): each took its
        place (a sequence number, a name), so the peers' matching ops fail with the reason instead of
        pairing with this rank's next op or waiting for it."""
        reqs = [r for r in reqs if any(m != self.rank for m in r.ps)]  # a set of one: nobody to tell
        if not reqs:
            return
        with self._lock:
            if self._broken is not None:
                return
            self._rejected.extend(reqs)
            self._ring_if_idle()

    def submit(self, op: LocalOp) -> Handle:
        return self.submit_many([op])[0]

    def submit_many(self, ops: list[LocalOp], waiting: bool = False) -> list[Handle]:
        """Queue ops for the next round, all in the same round (grouped ops stay together).

        ``waiting``: the caller synchronizes at once, so on the mesh its ``wait()`` runs the round itself
        (``drive``) and the negotiator thread is not woken for it."""
        with self._lock:
            if self._broken is not None:
                raise CollectiveError(f"hora cannot run {ops[0].req.kind} {ops[0].req.name!r}: {self._broken}"
                                      ) from self._broken
            names = [op.req.name for op in ops]
            for name in names:
                if name in self._in_flight or names.count(name) > 1:
                    raise ValueError(
                        f"collective name {name!r} is still in flight on rank {self.rank}: synchronize() its "
                        "handle before submitting the name again, or use a different name"
                    )
            now = time.perf_counter()
            for op in ops:
                self._in_flight.add(op.req.name)
                op.submitted_at = now
                self._mine[op.req.name] = op
                self._outbox.append(op)
            if not (waiting and self._inline_ok):
                self._ring_if_idle()
        return [op.handle for op in ops]

    def done(self, handle: Handle) -> None:
        """Called when a handle is synchronized: its name may be used again."""
        with self._lock:
            self._in_flight.discard(handle.name)

    def stop(self, timeout: float = 30.0) -> None:
        """Collective shutdown: wait (up to ``timeout``) until every rank stops, then end the thread.

        With ``timeout`` 0 (a crashing process) nothing is negotiated: the thread, a daemon blocked on the
        bell, ends with the process, and the peers learn of it when its connections close.
        """
        with self._lock:
            self._closing = True
        if timeout > 0 and self._broken is None and not self._stall_shutdown and self._thread.is_alive():
            h = Handle("__shutdown__", SHUTDOWN, lambda: None, self.done)
            req = Request("__shutdown__", SHUTDOWN, "", (), ps=tuple(range(self.size)))
            try:
                self.submit(LocalOp(req, h, lambda launch: None))
                deadline = time.monotonic() + timeout
                while not h.poll() and time.monotonic() < deadline and self._thread.is_alive():
                    time.sleep(0.01)
                if not h.poll():
                    log.warning("rank %d: peers did not shut down within %.0fs; leaving anyway", self.rank, timeout)
            except CollectiveError:
                pass
        with self._lock:
            self._exit_requested = True  # never ring for this: peers would wait in a round we never join
        self._thread.join(timeout=1.0)
        self._watchdog.stop()
        self._listen_timer.stop()
        if self._death_watch is not None:
            self._death_watch.close()
        self._plane.close()
        self._abandon()

    def _abandon(self) -> None:
        """After shutdown nothing this rank submitted can complete: fail what is still pending, so a
        ``synchronize()`` of its handle (now or after a new ``init()``) raises instead of waiting forever."""
        with self._lock:
            pending = list(self._mine.values()) + [op for op in self._outbox if op.req.name not in self._mine]
            self._mine.clear()
            self._outbox = []
        for op in pending:
            op.handle.fail(CollectiveError(
                f"{op.req.kind} {op.req.name!r} did not complete on rank {self.rank} before hvd.shutdown(): "
                "every member of its process set must submit it before any of them shuts down (synchronize "
                "async handles before hvd.shutdown())"))

    def _ring_if_idle(self) -> None:  # caller holds self._lock
        if self._idle_round is not None and not self._rung:
            self._rung = True
            try:
                self._plane.ring(self._idle_round)
            except Exception as e:  # the store is gone: the launcher died
                self._break(CollectiveError(f"rank {self.rank} lost the rendezvous store: {e}"))

    # --- negotiator thread --------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)  # thread-local: collectives never record autograd history
        if self.rt.device is not None:
            torch.cuda.set_device(self.rt.device)
        try:
            while True:
                with self._round_lock:
                    with self._lock:
                        self._idle_round = None
                    if self._run_due_rounds():
                        return  # the shutdown round ran
                    with self._lock:
                        if self._exit_requested and not self._outbox:
                            return
                    round_no = self._round_no
                    timeout = self._go_idle(round_no)
                try:
                    self._woken = self._plane.wait(round_no, timeout)
                finally:
                    self._watchdog.disarm()
        except Exception as e:  # any failure ends negotiation; users see it on their handles
            self._break(self._peer_loss(e))
        finally:
            self._stopped.set()

    def _go_idle(self, round_no: int) -> float:
        """Before blocking on the bell (round lock held): arm the stall watchdog, let submitters ring, and
        return how long to block."""
        if self.rank == 0 and round_no > 0:
            self._plane.clear(round_no - 1)  # everyone is past that bell: they all took part in its round
        delay = self._stall.check_in()
        if delay is not None:
            self._watchdog.arm(round_no, delay)
        self._plane.quiet(False)  # this thread answers peers itself from now on
        with self._lock:
            self._idle_round = round_no
            self._rung = False
            if self._outbox or self._flags or self._rejected:
                # more to send (the gloo plane: ring the next round at once, so busy ranks run back to back;
                # the mesh: a submitter that meant to run the round itself found this thread busy)
                self._ring_if_idle()
        if self._defer_until is not None:
            return max(self._defer_until - time.monotonic(), 0.0)
        return _IDLE_WAIT_S

    def _run_due_rounds(self) -> bool:
        """Run the rounds that are due now (round lock held); True once the shutdown round ran.

        Gloo plane: the round whose bell woke us (every rank joins every rung round). Mesh: a round is due
        when this rank has something to send, or peers started one that this rank can advance (see
        ``_may_defer``), or this rank has deferred its answer long enough.
        """
        if not self._inline_ok:
            if not self._woken:
                return False
            self._woken = False
            return self._round()
        while True:
            self._plane.receive_ready()
            with self._lock:
                local = bool(self._outbox or self._flags or self._rejected)
            if not local:
                if not self._plane.has_input():
                    return False
                now = time.monotonic()
                if self._defer_until is None or now < self._defer_until:
                    if self._may_defer():
                        if self._defer_until is None:
                            self._defer_until = now + self._defer_s
                        return False
            if self._round():
                return True

    def drive(self, handle: Handle) -> None:
        """Called by a thread about to block on ``handle``: if the op has not been sent and no round is under
        way, run the round on this thread (mesh only), saving the hand-offs to and from the negotiator
        thread; otherwise make sure that thread is woken. At most one round: if peers have not submitted
        the op yet, their rounds wake the negotiator thread as usual."""
        if self._inline_ok and self._round_lock.acquire(blocking=False):
            try:
                with self._lock:
                    unsent = self._broken is None and any(op.handle is handle for op in self._outbox)
                if unsent:
                    self._plane.quiet(True)
                    try:
                        self._round()  # its allgather reads what peers sent: no need to look first
                    finally:
                        self._listen_after_round()
            except Exception as e:  # a round cut short leaves the ranks out of step: negotiation is over
                error = self._peer_loss(e)
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
            # wake the negotiator thread if there is more to send, if ops still wait for peers (it re-arms
            # the stall watchdog for them), or if a peer's next frame arrived during this round: it was read
            # off the socket, so nothing else would wake that thread to answer it
            inline_left = self._inline_ok and (bool(self.table.entries) or self._plane.has_input())
            if self._outbox or self._flags or self._rejected or inline_left:
                self._ring_if_idle()

    def _listen_after_round(self) -> None:
        """After a round on the caller's thread (round lock held): in the steady state of a synchronous loop
        (nothing pending, nothing early) keep the negotiator thread deaf to peers for up to ``_defer_s``:
        the next frame is a peer's next op, which this rank would only defer, and the caller's next op
        answers it without waking that thread, whose wake-up would compete with the caller for the CPU. The
        timer restores it, so an answer is never later than a deferral would make it. Otherwise listen now."""
        if self.table.entries or self._plane.has_input() or self._broken is not None:
            self._plane.quiet(False)
        else:
            self._listen_timer.arm(self._round_no, self._defer_s)

    def _on_listen_timer(self, round_no: int) -> None:
        self._plane.quiet(False)

    def _may_defer(self) -> bool:
        """True when peers started a round that this rank's answer cannot advance yet: everything they sent
        waits for this rank's own submission. Answering with nothing would cost every rank a round that
        decides nothing, and the op another round once this rank submits; deferring the answer until this
        rank has something (or ``_defer_s`` passes) runs the op in one round. Only the peers' frames and the
        table (identical everywhere) are read, and an answer changes only when a round ends, not what it
        decides, so every rank still reaches the same decisions."""
        with self._lock:
            if self._outbox or self._flags or self._rejected or self._exit_requested or self._closing:
                return False
        frames = self._plane.peek()
        table = self.table
        if not frames or "__join__" in table.entries or "__shutdown__" in table.entries:
            return False
        for rank, raw in frames.items():
            entries, _inline, flags = pickle.loads(raw)
            if flags:
                return False
            for item in entries:
                req = self._cache.decode(item, rank)
                if (req.kind in (JOIN, SHUTDOWN) or req.error or req.name in table.tombstones
                        or self.rank not in req.ps):
                    return False
                entry = table.entries.get(req.name)
                if entry is not None and self.rank in entry.requests:
                    return False  # this request may complete (or contradict) ours: answer now
        return True

    def _on_peer_lost(self, peer: int, error: str) -> None:
        """The death watch saw ``peer`` go: say so in the store for every rank's error message, and ring a
        round, which fails on every rank instead of leaving them waiting for the dead peer."""
        with self._lock:
            if self._closing or self._stopped.is_set() or self._broken is not None:
                return
        host = self.rt.topo.hostnames[peer] if peer < len(self.rt.topo.hostnames) else "?"
        log.info("rank %d: rank %d on %s is gone (%s)", self.rank, peer, host, error)
        try:
            self.rt.store.compare_set("lost", "", f"{peer}")  # the first loss is the root cause: keep it
        except Exception:  # the store is gone too: the round below fails anyway
            pass
        with self._lock:
            self._ring_if_idle()

    def _round_wait(self, missing: list[int], waited: float) -> None:
        """Called every second while a round on the mesh waits for ``missing`` peers' frames (round lock held).

        A peer whose process cannot run Python (stopped, in a native call holding the GIL, cut off) never
        answers, so its own stall inspector cannot speak: the waiting ranks do, on the same deadlines. A peer
        that ``hora run`` saw exit (while a process it forked holds its connections open) is lost at once.
        Raising ends the round on this rank; the error reaches every pending op."""
        ended = self._board.ended(missing)
        if ended:
            peer, how = min(ended.items())
            self._board.blame(peer, f"exited ({how}) while its peers waited for it in a collective; a process it "
                                    "started (fork, multiprocessing) kept its connections open, hiding the exit")
            raise PeerLost(peer, f"stayed open, but rank {peer}'s process has exited ({how}): a process it started "
                                 "holds the connection")
        policy = self._stall.policy
        if not policy.enabled or waited < policy.warning_s:
            return
        hosts = self.rt.topo.hostnames
        silent = {r: hosts[r] if r < len(hosts) else "?" for r in missing}
        if self._round_warned != self._round_no:
            self._round_warned = self._round_no
            if self.rank == min(set(range(self.size)) - set(missing)):  # one report per side of a partition
                log.error("%s", stall_mod.format_silent_report(self.rank, silent, waited, policy.shutdown_s,
                                                               self._board.active))
            self._board.post_waiting(missing, waited, self._round_no)
        if policy.shutdown_s > 0 and waited >= policy.shutdown_s:
            self._board.blame(missing[0], f"did not answer its peers for {waited:.0f} s "
                                          f"(--stall-check-shutdown-time-seconds {policy.shutdown_s:g})")
            self._stall_shutdown = True  # the silent peers will not join a collective shutdown
            raise CollectiveTimeoutError(stall_mod.format_silent_report(self.rank, silent, waited,
                                                                        policy.shutdown_s, False))

    def _peer_loss(self, error: BaseException) -> CollectiveError:
        """The error every pending op gets when a round fails: name the lost rank if some rank saw it go
        (the backend's own text then goes to the debug log); otherwise quote the backend. A stall shutdown's
        report stays as it is."""
        if isinstance(error, CollectiveTimeoutError):
            return error
        if isinstance(error, PeerLost):  # the mesh saw it: record it as the root cause unless one is known
            try:
                self.rt.store.compare_set("lost", "", f"{error.peer}")
            except Exception:
                pass
        try:
            if self.rt.store.check(["lost"]):
                peer = int(self.rt.store.get("lost"))
                log.debug("rank %d: round failed after rank %d was lost: %s", self.rank, peer, error)
                return CollectiveError(
                    f"rank {self.rank}: rank {peer} on host {self.rt.topo.hostnames[peer]} is gone (its process "
                    "exited or its link broke), so collectives cannot continue: see that rank's log for the root "
                    "cause")
        except Exception:  # the store may be gone with the launcher
            pass
        return CollectiveError(f"rank {self.rank}: negotiation with peers failed: {error}. A peer process probably "
                               "died or lost its network link: see the other ranks' logs for the root cause.")

    def _on_watchdog(self, round_no: int) -> None:
        """Runs on the watchdog thread when a stall deadline passes while this rank is idle. The table is
        read under the round lock; if a round is under way (on any thread), the negotiator thread re-arms
        the watchdog when it next goes idle, so skipping this firing loses nothing."""
        if not self._round_lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                due = self._stall.due()
                if self._idle_round == round_no and due:
                    self._flags["stall_query"] = due
                    self._ring_if_idle()
        finally:
            self._round_lock.release()

    def _round(self) -> bool:
        """One negotiation round (round lock held): send what this rank has, decide on what every rank
        sent, launch what is ready. True when it was the shutdown round."""
        round_no = self._round_no
        self._round_no += 1
        self._defer_until = None
        with self._lock:
            outgoing, self._outbox = self._outbox, []
            flags, self._flags = self._flags, {}
            rejected, self._rejected = self._rejected, []
        inline = [fusion.inline_bytes(op.req, op.wire) for op in outgoing]
        sent: list[Any] = [self._cache.encode(op.req) for op in outgoing]
        if rejected:  # never cached: they travel in full, once
            sent += rejected
            inline += [None] * len(rejected)
        payload = pickle.dumps((sent, inline, flags), protocol=5)
        t0 = time.perf_counter()
        gathered = [pickle.loads(b) for b in self._plane.allgather(payload)]
        tl = timeline_mod.active()
        if tl is not None and tl.mark_cycles:
            tl.instant("round", t0, row="negotiator", round=round_no)
        now = time.monotonic()
        decision = Decision()
        for rank, (entries, inline, _flags) in enumerate(gathered):
            for item, data in zip(entries, inline):
                fresh = isinstance(item, Request)
                req = self._cache.decode(item, rank)
                self.table.add(rank, req, round_no, now, decision, fresh=fresh, data=data)
        self.table.decide(decision)
        self._apply(decision)
        if any(f for _, _, f in gathered):
            self._handle_flags(gathered)
        return any(e.first.kind == SHUTDOWN for e in decision.ready)

    def _apply(self, decision: Decision) -> None:
        joined = self.table.joined
        for entry, error in decision.failed:
            self._fail_local(entry.name, error)
            if self.rank in joined and entry.name.startswith(_UNNAMED):
                self._advance_sequence(entry.name)
        for rank, name, error in decision.late_failures:
            if rank == self.rank:
                self._fail_local(name, error)
        self._dispatch.run(decision.ready, joined)
        for entry in decision.ready:
            self._cache.remember(entry)
            if self.rank in joined and entry.name.startswith(_UNNAMED):
                self._advance_sequence(entry.name)

    def _advance_sequence(self, name: str) -> None:
        """A joined rank took part in (or saw fail) an unnamed op it never submitted: keep its sequence in
        step. ``name`` is ``noname.ps<id>.<n>``, or ``noname.ps<id>.<n>.<part>`` (a sparse allreduce)."""
        ps_part, n, *_ = name[len(_UNNAMED):].split(".")
        ps_id = int(ps_part.removeprefix("ps"))
        with self._lock:
            self._seq[ps_id] = max(self._seq.get(ps_id, 0), int(n) + 1)

    def _take_local(self, name: str) -> LocalOp | None:
        with self._lock:
            return self._mine.pop(name, None)

    def _fail_local(self, name: str, error: BaseException) -> None:
        op = self._take_local(name)
        if op is not None:
            op.handle.fail(error)

    # --- stall inspector ----------------------------------------------------------------------------
    def _handle_flags(self, gathered: list[Any]) -> None:
        """Stall queries and answers travel as round flags (most rounds carry none)."""
        answer = self._stall.answer_queries([f for _, _, f in gathered])
        if answer is not None:  # every rank says where it is, in the next round
            with self._lock:
                self._flags["where"] = answer
        for name, error in self._stall.report({r: f["where"] for r, (_, _, f) in enumerate(gathered) if "where" in f}):
            self._stall_shutdown = True  # the stalled peers will not join a collective shutdown
            if self._stall.culprit is not None:
                self._board.blame(*self._stall.culprit)
            self._fail_local(name, error)

    def _break(self, error: BaseException) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = error
                log.error("%s", error)
            pending = list(self._mine.values()) + self._outbox
            self._mine.clear()
            self._outbox = []
        for op in pending:
            op.handle.fail(error)
