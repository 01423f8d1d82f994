"""One negotiation round, without scheduling: outbox -> frame -> allgather -> table -> decision -> dispatch.

Whoever holds the negotiator's round lock calls :meth:`Rounds.run`; when and why a round runs is
:mod:`hora.engine.scheduling.negotiator`'s business. Every rank adds every rank's requests to the same
:class:`~hora.engine.scheduling.table.Table` in rank order, so every rank reaches the same decision; this rank then
launches, in the agreed order, what it takes part in (:class:`~hora.engine.scheduling.dispatch.Dispatcher`).

A name seen before with identical metadata travels as a small integer (the response cache), so
steady-state frames are a few bytes. Stall queries and answers, and notices (values every rank gets at the
same notice point, :mod:`hora.engine.scheduling.notices`), ride in the frames' flags.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hora.common.names import JOIN_NAME, SHUTDOWN_NAME
from hora.diagnostics import stall_report as stall_mod
from hora.diagnostics import timeline as timeline_mod
from hora.diagnostics.inflight import InflightWatch
from hora.engine.codec import FrameError
from hora.engine.context import EngineContext
from hora.engine.scheduling.dispatch import Dispatcher, inline_bytes
from hora.engine.scheduling.frames import ResponseCache, decode_round, encode_round
from hora.engine.scheduling.notices import Notices
from hora.engine.scheduling.pending import Pending
from hora.engine.scheduling.stall_inspector import StallInspector
from hora.engine.scheduling.table import JOIN, SHUTDOWN, UNNAMED, Decision, Request, Table
from hora.engine.transport.faults import BadFrame, PeerLost
from hora.engine.transport.plane import ControlPlane
from hora.engine.transport.round_schedule import FULL
from hora.errors import CollectiveError, CollectiveTimeoutError, PeerLostError, StoreAuthError

log = logging.getLogger(__name__)


class Rounds:
    """The table, the response cache and the dispatcher of one rank, and the round that feeds them."""

    def __init__(self, ctx: EngineContext, pending: Pending, plane: ControlPlane, notices: Notices) -> None:
        self.ctx = ctx
        self.rank = ctx.rank
        self.pending = pending
        self.plane = plane
        self.notices = notices
        self.table = Table(ctx.size)
        self.stall = StallInspector(self.table, stall_mod.StallPolicy.from_knobs(ctx.knobs), ctx.rank, ctx.hostnames)
        self.cache = ResponseCache(ctx.rank, enabled=not ctx.knobs.disable_cache)
        self.inflight = InflightWatch(ctx.board, ctx.rank, self.stall.policy)  # transfers a frozen peer holds up
        self.dispatch = Dispatcher(ctx.rank, ctx.process_sets, pending.take, ctx.knobs.fusion_threshold,
                                   self.inflight, ctx.device, ctx.hierarchy)
        self.number = 0  # the next round's number (the same on every rank)
        self.stall_failed = False  # a stalled collective was failed: the silent peers will not join a shutdown
        self._warned = -1  # the round whose wait was posted on the board
        self._reported = -1  # the round whose silent peers were reported
        # the full exchange waits only for ranks that sent nothing; recursive doubling may wait for a peer
        # that itself waits for another
        self._full_exchange = plane.plan.shape == FULL

    # --- the round ----------------------------------------------------------------------------------
    def run(self) -> bool:
        """One round (round lock held): send what this rank has, decide on what every rank sent, launch
        what is ready. True when it was the shutdown round."""
        round_no = self.number
        self.number += 1
        outgoing, flags, rejected = self.pending.take_outgoing()
        inline = [inline_bytes(op.req, op.wire) for op in outgoing]
        sent: list[Any] = [self.cache.encode(op.req) for op in outgoing]
        if rejected:  # never cached: they travel in full, once
            sent += rejected
            inline += [None] * len(rejected)
        # one process has no peers: its own frame never needs encoding (nor decoding, on any rank)
        payload = encode_round(sent, inline, flags) if self.ctx.size > 1 else b""
        t0 = time.perf_counter()
        raw = self.plane.allgather(payload)
        gathered = [(sent, inline, flags) if rank == self.rank else self._decode(rank, frame)
                    for rank, frame in enumerate(raw)]
        tl = timeline_mod.active()
        if tl is not None and tl.mark_cycles:
            tl.instant("round", t0, row="negotiator", round=round_no)
        now = time.monotonic()
        decision = Decision()
        for rank, (entries, data_of, _flags) in enumerate(gathered):
            for item, data in zip(entries, data_of):
                fresh = isinstance(item, Request)
                try:
                    req = self.cache.decode(item, rank)
                except (IndexError, KeyError):
                    raise self._bad(rank, f"names response-cache entry {item!r}, which it never had") from None
                self.table.add(rank, req, round_no, now, decision, fresh=fresh, data=data)
        self.table.decide(decision)
        self._apply(decision)
        if any(f for _, _, f in gathered):
            self._handle_flags(gathered)
        return any(e.first.kind == SHUTDOWN for e in decision.ready)

    def _decode(self, rank: int, frame: bytes) -> tuple[list[Any], list[bytes | None], dict[str, Any]]:
        try:
            return decode_round(frame)
        except FrameError as e:
            raise self._bad(rank, f"sent a round frame this rank cannot read ({e})") from None

    def _bad(self, rank: int, why: str) -> BadFrame:
        return BadFrame(self.rank, rank, f"host {self.ctx.hostname(rank)}", why)

    def _apply(self, decision: Decision) -> None:
        joined = self.table.joined
        for entry, error in decision.failed:
            self.pending.fail(entry.name, error)
            if self.rank in joined and entry.name.startswith(UNNAMED):
                self.pending.advance_sequence(entry.name)
        for rank, name, error in decision.late_failures:
            if rank == self.rank:
                self.pending.fail(name, error)
        self.dispatch.run(decision.ready, joined)
        for entry in decision.ready:
            self.cache.remember(entry)
            if self.rank in joined and entry.name.startswith(UNNAMED):
                self.pending.advance_sequence(entry.name)

    def _handle_flags(self, gathered: list[Any]) -> None:
        """Stall queries and answers, and notices (:mod:`hora.engine.scheduling.notices`), travel as round flags (most
        rounds carry none)."""
        flags = [f for _, _, f in gathered]
        self.notices.on_round(flags)
        answer = self.stall.answer_queries(flags)
        if answer is not None:  # every rank says where it is, in the next round
            with self.pending.lock:
                self.pending.flags["where"] = answer
        for name, error in self.stall.report({r: f["where"] for r, (_, _, f) in enumerate(gathered) if "where" in f}):
            self.stall_failed = True
            if self.stall.culprit is not None:
                self.ctx.board.blame(*self.stall.culprit)
            self.pending.fail(name, error)

    # --- reading peers before answering --------------------------------------------------------------
    def may_defer(self) -> bool:
        """True when peers started a round that this rank's answer cannot advance yet: everything they sent
        waits for this rank's own submission. Answering with nothing would cost every rank a round that
        decides nothing, and the op another round once this rank submits; deferring the answer until this
        rank has something (or the deferral ends) runs the op in one round. Only the peers' frames and the
        table (identical everywhere) are read, and an answer changes only when a round ends, not what it
        decides, so every rank still reaches the same decisions."""
        frames = self.plane.peek()
        table = self.table
        if not frames or JOIN_NAME in table.entries or SHUTDOWN_NAME in table.entries:
            return False
        for rank, raw in frames.items():
            entries, _inline, flags = self._decode(rank, raw)
            if flags:
                return False
            for item in entries:
                try:
                    req = self.cache.decode(item, rank)
                except (IndexError, KeyError):
                    return False  # the round itself names the bad peer
                if (req.kind in (JOIN, SHUTDOWN) or req.error or req.name in table.tombstones
                        or self.rank not in req.ps):
                    return False
                entry = table.entries.get(req.name)
                if entry is not None and self.rank in entry.requests:
                    return False  # this request may complete (or contradict) ours: answer now
        return True

    # --- peers that do not answer --------------------------------------------------------------------
    def on_wait(self, missing: list[int], waited: float) -> None:
        """Called every second while a round on the mesh waits for ``missing`` peers' frames.

        A peer whose process cannot run Python (stopped, in a native call holding the GIL, cut off) never
        answers, so its own stall inspector cannot speak: the waiting ranks do, on the same deadlines. A peer
        that ``hora run`` saw exit (while a process it forked holds its connections open) is lost at once.
        Raising ends the round on this rank; the error reaches every pending op."""
        board = self.ctx.board
        ended = board.ended(missing)
        if ended:
            peer, how = min(ended.items())
            board.blame(peer, f"exited ({how}) while its peers waited for it in a collective; a process it "
                              "started (fork, multiprocessing) kept its connections open, hiding the exit")
            raise PeerLost(peer, f"stayed open, but rank {peer}'s process has exited ({how}): a process it started "
                                 "holds the connection")
        policy = self.stall.policy
        if not policy.enabled or waited < policy.warning_s:
            return
        round_no = self.number  # as posted since the board began: the number after the waiting round's
        if self._warned != round_no:  # whom this rank waits for, for the launcher and for the ranks behind it
            self._warned = round_no
            board.post_waiting(missing, waited, round_no)
            if not self._full_exchange:
                return  # the peers this rank waits for post theirs meanwhile (within a tick)
        silent_ranks = missing if self._full_exchange else self._silent(missing, round_no)
        silent = {r: self.ctx.hostname(r) for r in silent_ranks}
        if self._reported != round_no:
            self._reported = round_no
            if self.rank == min(set(range(self.ctx.size)) - set(silent)):  # one report per side of a partition
                log.error("%s", stall_mod.format_silent_report(self.rank, silent, waited, policy.shutdown_s,
                                                               board.active))
        if policy.shutdown_s > 0 and waited >= policy.shutdown_s:
            board.blame(silent_ranks[0], f"did not answer its peers for {waited:.0f} s "
                                         f"(--stall-check-shutdown-time-seconds {policy.shutdown_s:g})")
            self.stall_failed = True
            raise CollectiveTimeoutError(stall_mod.format_silent_report(self.rank, silent, waited,
                                                                        policy.shutdown_s, False))

    def _silent(self, waiting_for: list[int], round_no: int) -> list[int]:
        """The ranks that hold up this round, from the peers this rank waits for (recursive doubling: a peer
        may itself wait for another). Follows the ranks' posts on the board: a rank that posted no wait for
        this round (or the one before: a peer may still finish it) is silent. Without the board, or when the
        posts go round in a circle (a partition), the peers themselves."""
        silent: list[int] = []
        seen = set(waiting_for) | {self.rank}
        todo = list(waiting_for)
        while todo:
            rank = todo.pop(0)
            waits = self.ctx.board.waits_of(rank, round_no - 1)
            if waits is None:
                silent.append(rank)
                continue
            fresh = [r for r in waits if r not in seen]
            seen.update(fresh)
            todo += fresh
        return sorted(silent) or waiting_for

    def peer_loss(self, error: BaseException) -> CollectiveError:
        """The error every pending op gets when a round fails: name the lost rank if some rank saw it go
        (the backend's own text then goes to the debug log); otherwise quote the backend. A stall shutdown's
        report stays as it is."""
        if isinstance(error, (CollectiveTimeoutError, BadFrame)):  # its message names the peer already
            return error
        store = self.ctx.store
        if isinstance(error, PeerLost):  # the mesh saw it: record it as the root cause unless one is known
            record_lost(store, error.peer)
        try:
            if store.check(["lost"]):
                peer = int(store.get("lost"))
                log.debug("rank %d: round failed after rank %d was lost: %s", self.rank, peer, error)
                return self._lost_error(peer)
        except StoreAuthError as e:  # a stranger wrote the key: who was lost is not known
            return CollectiveError(f"rank {self.rank}: negotiation with peers failed: {error}; {e}")
        except Exception:  # the store may be gone with the launcher
            pass
        if isinstance(error, PeerLost):  # the mesh (or a peer's loss notice) named it
            return self._lost_error(error.peer)
        return CollectiveError(f"rank {self.rank}: negotiation with peers failed: {error}. A peer process probably "
                               "died or lost its network link: see the other ranks' logs for the root cause.")

    def _lost_error(self, peer: int) -> PeerLostError:
        return PeerLostError(f"rank {self.rank}: rank {peer} on host {self.ctx.hostname(peer)} is gone (its process "
                             "exited or its link broke), so collectives cannot continue: see that rank's log for the "
                             "root cause", peer)


def record_lost(store: Any, peer: int) -> None:
    """Say in the store that ``peer`` is gone, unless a loss is recorded already (the first is the root cause)."""
    try:
        store.compare_set("lost", "", f"{peer}")
    except Exception:  # the store is gone too: the round fails anyway
        pass
