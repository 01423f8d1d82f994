"""Which failure is the root cause.

When one rank dies, its peers often fail a moment later with follow-on errors (a collective whose peer
vanished). The driver therefore collects the failures seen within a short settle window and picks the rank
whose Python traceback began first (its stderr lines carry the agent's timestamps), else the one that
exited first. That rank's report is printed, ahead of the others' output.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from hora.launcher.hosts import SlotInfo

SETTLE_S = 0.5


@dataclass
class RankState:
    """What the driver knows about one rank."""

    slot: SlotInfo
    done: bool = False
    code: int | None = None
    sig: int | None = None
    stopped: bool = False  # hora stopped it (its exit is not a failure)
    exit_ts: float = 0.0  # wall-clock time the agent saw it exit
    how: str | None = None  # overrides the exit description (e.g. "lost: ...")
    killed: float = 0.0  # still running when this grace (seconds) after SIGTERM ran out: its agent SIGKILLed it

    @property
    def failed(self) -> bool:
        return self.done and not self.stopped and (bool(self.sig) or self.code != 0)


class RootCause:
    """Collects failures for :data:`SETTLE_S` seconds after the first, then names the root cause."""

    def __init__(self, settle: float = SETTLE_S) -> None:
        self._settle = settle
        self.candidates: list[RankState] = []
        self.deadline: float | None = None
        self.chosen: RankState | None = None

    def offer(self, state: RankState) -> None:
        """A rank failed (before anything was decided)."""
        if self.chosen is not None:
            return
        self.candidates.append(state)
        if self.deadline is None:
            self.deadline = time.monotonic() + self._settle

    def extend(self, settle: float) -> None:
        """Keep the window open at least ``settle`` seconds from now (a lost host: others may follow)."""
        if self.chosen is None and self.deadline is not None:
            self.deadline = max(self.deadline, time.monotonic() + settle)

    def due(self, all_done: bool) -> bool:
        """True when it is time to decide: the window is over, or nothing else can fail."""
        return self.chosen is None and self.deadline is not None and (all_done or time.monotonic() >= self.deadline)

    def choose(self, traceback_ts: Mapping[int, float], follow_ons: Collection[int] = ()) -> RankState:
        """The root cause among the failures seen.

        A rank killed by a signal or lost with its host comes first (follow-on failures raise exceptions,
        they are not killed); then a rank that did not fail because another was gone (``follow_ons``: they
        raised ``PeerLostError``; the agents' timestamps of two ranks' output can come in either order on a
        busy host); then the rank whose traceback started first, else which exited first.
        """
        def when(state: RankState) -> tuple[int, int, float, float]:
            violent = 0 if state.sig or state.how else 1
            follow_on = 1 if state.slot.rank in follow_ons else 0
            return (violent, follow_on, traceback_ts.get(state.slot.rank, state.exit_ts or float("inf")),
                    state.exit_ts)

        self.chosen = min(self.candidates, key=when)
        return self.chosen

    def culprit(self, traceback_ts: Mapping[int, float], follow_ons: Collection[int] = ()) -> int | None:
        """A rank (perhaps still alive, stuck in teardown) whose traceback began before the chosen rank
        exited with an error code: the exception that set the failures off (never a ``follow_ons`` rank).
        None when there is none, or when the chosen rank was killed or lost (that is the cause)."""
        chosen = self.chosen
        traceback_ts = {r: ts for r, ts in traceback_ts.items() if r not in follow_ons}
        if chosen is None or chosen.sig or chosen.how or not traceback_ts:
            return None
        first = min(traceback_ts, key=lambda rank: traceback_ts[rank])
        mine = traceback_ts.get(chosen.slot.rank, chosen.exit_ts or float("inf"))
        return first if first != chosen.slot.rank and traceback_ts[first] < mine else None
