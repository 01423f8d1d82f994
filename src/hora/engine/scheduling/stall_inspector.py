"""The stall inspector: the negotiator's table knows which ranks have not submitted a pending name, and
since when. Past the warning time, one round asks every rank where it is; the next round's answers become
one report, logged once by the lowest rank that arrived. Past the shutdown time, the pending collectives fail
with that report (``CollectiveTimeoutError``), so the job stops with it as the root cause.

Pure bookkeeping over the table: the negotiator moves the query and the answers in its round flags.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hora.diagnostics import where
from hora.diagnostics.stall_report import StallAction, StallPolicy, format_stall_report
from hora.engine.scheduling.table import JOIN, SHUTDOWN, Entry, Table
from hora.errors import CollectiveTimeoutError

log = logging.getLogger(__name__)

_NOT_COLLECTIVES = (JOIN, SHUTDOWN)  # waiting in join()/shutdown() for the others is not a stall


class StallInspector:
    """Stall deadlines and reports over a negotiation :class:`Table` (identical on every rank)."""

    def __init__(self, table: Table, policy: StallPolicy, rank: int, hostnames: Sequence[str]) -> None:
        self.table = table
        self.policy = policy
        self.rank = rank
        self.hostnames = hostnames
        self.culprit: tuple[int, str] | None = None  # the first missing rank of the first stall shut down, and how

    def check_in(self) -> float | None:
        """Seconds until the next stall deadline, or None. Entries are in order of first appearance, so the
        oldest entry carries the earliest shutdown deadline and the oldest unreported one the earliest
        warning: usually the first entry answers both (a reported name must not hide a younger one)."""
        if not self.policy.enabled:
            return None
        now = time.monotonic()
        oldest: Entry | None = None
        for e in list(self.table.entries.values()):
            if e.first.kind in _NOT_COLLECTIVES:
                continue
            if oldest is None:
                oldest = e
            if not e.reported:
                warn = self.policy.next_check_s(now - e.first_time, False)
                if e is oldest:
                    return warn
                late = self.policy.next_check_s(now - oldest.first_time, True)
                return min((d for d in (warn, late) if d is not None), default=None)
        return None if oldest is None else self.policy.next_check_s(now - oldest.first_time, True)

    def due(self) -> list[tuple[str, str]]:
        """The names to ask about now, with what to do (``report`` or ``shutdown``)."""
        now = time.monotonic()
        due = []
        for e in self.table.entries.values():
            if e.first.kind in _NOT_COLLECTIVES:
                continue
            action = self.policy.decide(now - e.first_time, e.reported)
            if action is not StallAction.NONE:
                due.append((e.name, action.value))
        if any(action == "shutdown" for _, action in due):
            # the job is being stopped: fail every pending collective now, so every waiting rank ends with
            # the stall report, not with a follow-on "connection closed" once the first rank has left
            due = [(e.name, "shutdown") for e in self.table.entries.values() if e.first.kind not in _NOT_COLLECTIVES]
        return due

    @staticmethod
    def answer_queries(flags: Sequence[Mapping[str, Any]]) -> tuple[str, dict[str, str]] | None:
        """If some rank asked, this rank's answer: where its main thread is, and what was asked."""
        queries = [f["stall_query"] for f in flags if f.get("stall_query")]
        if not queries:
            return None
        return where.describe_location(threading.main_thread().ident), dict(queries[0])

    def report(self, answers: Mapping[int, tuple[str, dict[str, str]]]) -> list[tuple[str, CollectiveTimeoutError]]:
        """Log one report per stalled name; return the names to fail (past the shutdown time)."""
        if not answers:
            return []
        asked: dict[str, str] = {}
        for _, (_, names) in sorted(answers.items()):
            for name, action in names.items():
                if asked.get(name) != "shutdown":
                    asked[name] = action
        now = time.monotonic()
        failed = []
        for name, action in asked.items():
            entry = self.table.entries.get(name)
            if entry is None:
                continue  # it ran meanwhile
            arrived = sorted(entry.requests)
            missing = [r for r in entry.first.ps if r not in entry.requests]
            text = format_stall_report(
                entry.first.kind, name, entry.first_round, now - entry.first_time, arrived,
                {r: (self.hostnames[r], answers.get(r, ("(no answer)", {}))[0]) for r in missing},
            )
            if not entry.reported and self.rank == arrived[0]:
                log.error("%s", text)
            entry.reported = True
            if action == "shutdown":
                del self.table.entries[name]
                failed.append((name, CollectiveTimeoutError(text)))
                if self.culprit is None and missing:
                    where_ = answers.get(missing[0], ("no answer", {}))[0]
                    self.culprit = (missing[0], f"did not call {where.describe_op(entry.first.kind, name)} within "
                                                f"--stall-check-shutdown-time-seconds {self.policy.shutdown_s:g} s "
                                                f"({where_})")
        return failed
