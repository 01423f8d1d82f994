"""Which failure is the root cause: one rule for every driver (``hora run``'s fixed and elastic jobs, ``hora.ray``,
``hora.spark``), and the report that names it.

When one rank dies its peers often fail a moment later with follow-on errors (a collective whose peer vanished).
A driver therefore collects the failures seen within a short window (:class:`RootCause`), then names one by one
rule, in this order:

1. a rank that ended without a chance to raise (:func:`silenced`): killed by a signal, lost with its host, agent
   or actor, or stopped by the driver as frozen. Follow-on failures raise exceptions; they are not killed.
2. a rank that raised an error of its own, before one that raised a follow-on error (:data:`FOLLOW_ON_ERRORS`:
   it failed because another rank was gone).
3. the rank whose traceback began first (the agents timestamp each line they read), else the one that exited
   first; then the lowest rank.

The window closes :data:`SETTLE_S` after the first failure, or when every rank has ended; it stays open while
every failure so far is a follow-on (up to :data:`FOLLOW_ON_GRACE_S`: the rank that set them off may be seen to
end last, as Ray sees a killed actor after its peers raised) or for a host lost (:meth:`RootCause.extend`).

:func:`decide` turns the choice into a :class:`Verdict` (a rank still in teardown that raised first, the rank a
waiting rank waited for, several hosts lost at once); :func:`report` prints it: the root cause's line, its
traceback once, one line for the ranks that raised the same error and one for those that followed.

Example:
    >>> is_follow_on("PeerLostError"), is_follow_on("ValueError")
    (True, False)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from hora.launcher import output, procs
from hora.launcher.hosts import SlotInfo

SETTLE_S = 0.5  # failures seen within this long of the first are weighed together
FOLLOW_ON_GRACE_S = 5.0  # how long a driver waits for the root cause while it has only seen follow-on errors

# What a rank raises because another rank failed first: hora's "rank N ... is gone" (PeerLostError), a new elastic
# world's member that ended (WorldMemberLostError), and a round or a transfer that failed without naming whom it
# lost (a bare CollectiveError; HorovodInternalError is its Horovod name). Never the root cause while a rank failed
# otherwise. CollectiveError's other kinds (a mismatch, a timeout, another hora build) are each rank's own error.
FOLLOW_ON_ERRORS = frozenset({"PeerLostError", "WorldMemberLostError", "CollectiveError", "HorovodInternalError"})


def is_follow_on(type_name: str | None) -> bool:
    """Whether an exception of this type (its ``__name__``) reports a peer's failure rather than its own."""
    return type_name in FOLLOW_ON_ERRORS


@dataclass
class RankState:
    """What a driver knows about one process of the job."""

    slot: SlotInfo
    done: bool = False
    code: int | None = None
    sig: int | None = None
    stopped: bool = False  # the driver stopped it (its exit is not a failure)
    exit_ts: float = 0.0  # wall-clock time its end was seen
    how: str | None = None  # overrides the exit description (e.g. "lost: ...")
    killed: float = 0.0  # still running when this grace (seconds) after SIGTERM ran out: its agent SIGKILLed it
    raised: str | None = None  # the type name of what it raised, where its framework says (hora.ray, hora.spark)

    @property
    def failed(self) -> bool:
        return self.done and not self.stopped and (bool(self.sig) or self.code != 0)

    @classmethod
    def ended(cls, rank: int, where: str, *, code: int | None = 1, sig: int | None = None, exit_ts: float = 0.0,
              how: str | None = None, raised: str | None = None) -> RankState:
        """The end of a rank a cluster framework placed (``hora.ray``, ``hora.spark``), where only its number and
        where it ran are known of its slot."""
        slot = SlotInfo(rank=rank, size=0, local_rank=0, local_size=1, cross_rank=0, cross_size=1, hostname=where,
                        host_index=0)
        return cls(slot, done=True, code=code, sig=sig, exit_ts=exit_ts, how=how, raised=raised)

    def describe(self) -> str:
        """How it ended, in words: ``how`` if the driver or its framework said, else its exit."""
        return self.how or procs.describe_exit(self.code, self.sig)


def silenced(state: RankState) -> bool:
    """It ended without a chance to raise: a signal, a loss, the driver's stop (``how`` set, nothing raised)."""
    return bool(state.sig) or (state.how is not None and state.raised is None)


def follow_ons(tails: Mapping[int, Iterable[str]], raised: Mapping[int, str] | None = None) -> set[int]:
    """The ranks that failed because another was gone: by the type their framework said they raised, else by the
    last traceback in their output (``tails``: rank -> its stderr lines)."""
    raised = raised or {}
    ranks = set(tails) | set(raised)
    return {rank for rank in ranks if is_follow_on(raised.get(rank) or output.error_type(list(tails.get(rank, ()))))}


class RootCause:
    """Collects failures for a short window after the first, then names the root cause (see the module
    docstring)."""

    def __init__(self, settle: float = SETTLE_S, grace: float = FOLLOW_ON_GRACE_S) -> None:
        self._settle, self._grace = settle, grace
        self.candidates: list[RankState] = []
        self.deadline: float | None = None
        self._first = 0.0
        self.chosen: RankState | None = None

    def offer(self, state: RankState) -> None:
        """A rank failed (before anything was decided)."""
        if self.chosen is not None:
            return
        self.candidates.append(state)
        if self.deadline is None:
            self._first = time.monotonic()
            self.deadline = self._first + self._settle

    def extend(self, settle: float) -> None:
        """Keep the window open at least ``settle`` seconds from now (a lost host: others may follow)."""
        if self.chosen is None and self.deadline is not None:
            self.deadline = max(self.deadline, time.monotonic() + settle)

    def due(self, all_done: bool, follows: Collection[int] = ()) -> bool:
        """True when it is time to decide: every rank has ended, or the window is over and a failure other than a
        follow-on one (``follows``) was seen, or the follow-on grace is over too."""
        if self.chosen is not None or self.deadline is None:
            return False
        if all_done:
            return True
        now = time.monotonic()
        if now < self.deadline:
            return False
        only_follow_ons = all(c.slot.rank in follows and not silenced(c) for c in self.candidates)
        return not only_follow_ons or now >= self._first + self._grace

    def choose(self, traceback_ts: Mapping[int, float], follows: Collection[int] = ()) -> RankState:
        """The root cause among the failures seen, by the rule of the module docstring (``traceback_ts``: when
        each rank's traceback began; ``follows``: the ranks that raised a follow-on error)."""
        def order(state: RankState) -> tuple[bool, bool, float, float, int]:
            rank = state.slot.rank
            return (not silenced(state), rank in follows, traceback_ts.get(rank, state.exit_ts or float("inf")),
                    state.exit_ts, rank)

        self.chosen = min(self.candidates, key=order)
        return self.chosen

    def culprit(self, traceback_ts: Mapping[int, float], follows: Collection[int] = ()) -> int | None:
        """A rank (perhaps still alive, stuck in teardown) whose traceback began before the chosen rank
        exited with an error code: the exception that set the failures off (never a ``follows`` rank).
        None when there is none, or when the chosen rank was silenced (that is the cause)."""
        chosen = self.chosen
        traceback_ts = {r: ts for r, ts in traceback_ts.items() if r not in follows}
        if chosen is None or silenced(chosen) or not traceback_ts:
            return None
        first = min(traceback_ts, key=lambda rank: traceback_ts[rank])
        mine = traceback_ts.get(chosen.slot.rank, chosen.exit_ts or float("inf"))
        return first if first != chosen.slot.rank and traceback_ts[first] < mine else None


@dataclass
class Verdict:
    """The root cause, as the driver reports it."""

    state: RankState  # the failure chosen: the job's exit status is its
    rank: int  # the rank blamed (the chosen one, or the rank it waited for, or one that raised first)
    how: str  # what happened to it
    summary: str  # the verdict in one line, repeated as the driver's last words


def decide(root: RootCause, console: output.Console, ranks: Mapping[int, RankState], where: Callable[[int], str],
           waited_for: Callable[[], tuple[int, str] | None] = lambda: None) -> Verdict:
    """Choose the root cause among ``root``'s candidates and say it (``where(rank)``: ``"host h"``, or the
    framework's words for where a rank runs; ``waited_for()``: the rank the waiting ranks blamed on the board
    and how, when the driver reads one)."""
    tails = console.tails
    follows = follow_ons(tails, {r: s.raised for r, s in ranks.items() if s.raised})
    state = root.choose(console.traceback_ts, follows)
    rank, how = state.slot.rank, state.describe()
    verdict = Verdict(state, rank, how, f"rank {rank} on {where(rank)}: {how}")
    culprit = root.culprit(console.traceback_ts, follows)
    found = waited_for() if not silenced(state) else None
    lost = [c for c in root.candidates if c.how and c.how.startswith("lost")]
    if found is not None and found[0] in ranks:
        # a waiting rank failed (a stall shutdown, an init() timeout, a peer that exited): blame the rank it
        # waited for, as the waiting rank itself named it (or the partition the driver found)
        blamed, found_how = found
        raised = output.exception_name(output.traceback_of(list(tails[rank])))
        by = "it" if blamed == rank else f"rank {rank} on {where(rank)} waited for it and"
        verdict = Verdict(state, blamed, f"{found_how} ({by} {raised})",
                          f"rank {blamed} on {where(blamed)}: {found_how}")
    elif len({c.slot.hostname for c in lost}) > 1:  # several hosts went at once: name them all
        names = sorted({c.slot.hostname for c in lost})
        hosts = f"hosts {', '.join(names[:-1])} and {names[-1]}"
        gone = sorted(r for r, s in ranks.items() if s.slot.hostname in names)
        verdict = Verdict(state, rank, f"lost: {hosts} stopped answering: their ssh connections ended before ranks "
                          f"{', '.join(map(str, gone))} exited (the hosts went down, their network links broke, or "
                          "their hora agents were killed)", f"{hosts} lost")
    elif culprit is not None:  # it raised first, its peers failed before it finished exiting
        how = f"raised an exception (traceback below); then rank {rank} on {where(rank)} ended with {how}"
        verdict = Verdict(state, culprit, how, f"rank {culprit} on {where(culprit)} {how}")
    return verdict


def report(verdict: Verdict, console: output.Console, ranks: Mapping[int, RankState],
           where: Callable[[int], str]) -> None:
    """Print the verdict: its line and the root cause's traceback once; the other ranks' held tracebacks as one
    line for those that raised the same error, one for those that followed, the others as they printed them."""
    rank = verdict.rank
    others = sum(1 for r in ranks.values() if not r.done and r.slot.rank != rank)
    console.flush()
    finished = [r.slot.rank for r in ranks.values() if r.done and r.code == 0 and not r.sig]
    tb = output.traceback_of(list(console.tails[rank])) or []
    console.take_held(rank)
    same = [r for r in console.held_ranks() if output.same_error(console.held(r), tb)]
    # the failure chosen, when it blames another rank (it waited for it), is the verdict's evidence: shown whole
    followed = [r for r in console.held_ranks() if r not in same and r != verdict.state.slot.rank
                and is_follow_on(output.error_type(console.held(r)))]
    for r in console.held_ranks():
        if r in same or r in followed:
            console.take_held(r)
        else:
            console.release(r)
    followed_by = sorted({output.error_type(list(console.tails[r])) or "PeerLostError" for r in followed})
    output.print_lines(output.failure_report(rank, ranks[rank].slot.hostname if rank in ranks else "?", verdict.how,
                                             list(console.tails[rank]), others, finished, same, followed,
                                             where=where(rank), followed_by=followed_by))

