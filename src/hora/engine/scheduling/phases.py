"""The negotiator's states (:class:`Phase`) and the moves between them (:mod:`hora.engine.scheduling.negotiator`
changes its phase only under its lock, and only along ``NEXT``).

States (:class:`Phase`, changed only under the negotiator's lock)::

    ROUND ──▶ IDLE ──▶ ROUND          the thread parks on the bell, wakes, runs what is due
    ROUND ──▶ DEFERRING ──▶ ROUND     ... parks with a deadline, holding back an answer (see below)
    IDLE | DEFERRING | ROUND ──▶ CLOSING ──▶ STOPPED      shutdown() (CLOSING runs the shutdown round)
    IDLE | DEFERRING | ROUND | CLOSING ──▶ BROKEN ──▶ STOPPED   a round failed or was interrupted

- ROUND: the negotiator thread is awake and holds the round lock: it runs the rounds that are due.
- IDLE: the thread waits on the plane's bell (no CPU). A local submit rings it; on the mesh so does a
  peer's frame (a peer started a round), and the death watch rings it on the Gloo plane when a peer dies.
- DEFERRING: as IDLE, but until a deadline: peers started a round this rank's answer cannot advance (all
  they sent waits for this rank's own submission), so it answers once it has something, or at the deadline
  (``Rounds.may_defer``). Ranks reaching an op at slightly different times then run it in one round.
- CLOSING: ``stop()`` submitted the shutdown request; the thread runs rounds and parks as before (the
  round it parks on is ``_parked_round``) until the shutdown round ran. Peers closing is expected now.
- BROKEN: negotiation is over (a round failed, Ctrl-C interrupted one, the store went): every pending and
  later op fails with ``error``; the thread ends. ``shutdown()`` + ``init()`` starts a fresh negotiator.
- STOPPED: ``stop()`` ended the thread, the timers and the plane. Terminal.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """The negotiator's state; see the module docstring for the transitions."""

    ROUND = "round"
    IDLE = "idle"
    DEFERRING = "deferring"
    CLOSING = "closing"
    BROKEN = "broken"
    STOPPED = "stopped"


ACTIVE = (Phase.ROUND, Phase.IDLE, Phase.DEFERRING)  # before shutdown and before any failure
NEXT: dict[Phase, tuple[Phase, ...]] = {
    Phase.ROUND: (Phase.IDLE, Phase.DEFERRING, Phase.CLOSING, Phase.BROKEN),
    Phase.IDLE: (Phase.ROUND, Phase.CLOSING, Phase.BROKEN),
    Phase.DEFERRING: (Phase.ROUND, Phase.CLOSING, Phase.BROKEN),
    Phase.CLOSING: (Phase.BROKEN, Phase.STOPPED),
    Phase.BROKEN: (Phase.STOPPED,),
    Phase.STOPPED: (),
}
