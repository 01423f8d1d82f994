"""The stall inspector's pure parts: when to speak, and what to say.

The negotiator knows, for every pending collective, which ranks have submitted it and since when. When the
oldest one has waited past the warning time, it asks every rank where it is (see :mod:`where`) and one rank
logs :func:`format_stall_report`. :class:`StallPolicy` decides when: one report per stall (not one per rank,
not one per second), and a shutdown after the shutdown time when that is set.

Example:
    >>> policy = StallPolicy(warning_s=60.0, shutdown_s=0.0, enabled=True)
    >>> policy.decide(waited_s=61.0, reported=False)
    <StallAction.REPORT: 'report'>
    >>> policy.decide(waited_s=62.0, reported=True)
    <StallAction.NONE: 'none'>
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hora.common.knobs import Knobs
from hora.diagnostics.where import describe_op
from hora.errors import ConfigError

log = logging.getLogger(__name__)


class StallAction(enum.Enum):
    """What the negotiator should do about the oldest pending collective now."""

    NONE = "none"
    REPORT = "report"  # ask every rank where it is, log one report
    SHUTDOWN = "shutdown"  # report (if not yet) and stop the job with the report as the error


@dataclass(frozen=True, kw_only=True, slots=True)
class StallPolicy:
    """When the stall inspector reports and when it stops the job.

    Attributes:
        warning_s: seconds a collective may wait for missing ranks before one report names them.
        shutdown_s: seconds after which the job is stopped (0 = never). Counted, like ``warning_s``, from
            the first rank's submission of the collective.
        enabled: False turns the inspector off (``--no-stall-check``, ``HORA_STALL_CHECK_DISABLE=1``).
    """

    warning_s: float = 60.0
    shutdown_s: float = 0.0
    enabled: bool = True

    def __post_init__(self) -> None:
        if not self.warning_s > 0 or math.isinf(self.warning_s):
            raise ConfigError(
                f"stall warning time must be a positive number of seconds, got {self.warning_s} "
                "(HORA_STALL_CHECK_TIME_SECONDS / --stall-check-warning-time-seconds)"
            )
        if self.shutdown_s < 0:
            raise ConfigError(
                f"stall shutdown time must be >= 0 seconds (0 = never), got {self.shutdown_s} "
                "(HORA_STALL_SHUTDOWN_TIME_SECONDS / --stall-check-shutdown-time-seconds)"
            )

    @classmethod
    def from_knobs(cls, knobs: Knobs) -> StallPolicy:
        """The policy set by ``HORA_STALL_CHECK_*`` / ``HORA_STALL_SHUTDOWN_TIME_SECONDS``."""
        return cls(
            warning_s=knobs.stall_check_time_seconds,
            shutdown_s=knobs.stall_shutdown_time_seconds,
            enabled=not knobs.stall_check_disable,
        )

    def decide(self, waited_s: float, reported: bool) -> StallAction:
        """What to do, given how long the oldest pending collective waited and whether it was reported.

        Args:
            waited_s: seconds since the first rank submitted the oldest pending collective.
            reported: whether this stall (this collective) was already reported.
        """
        if not self.enabled:
            return StallAction.NONE
        if self.shutdown_s > 0 and waited_s >= self.shutdown_s:
            return StallAction.SHUTDOWN
        if waited_s >= self.warning_s and not reported:
            return StallAction.REPORT
        return StallAction.NONE

    def next_check_s(self, waited_s: float, reported: bool) -> float | None:
        """Seconds until :meth:`decide` may change its answer, or None if it never will.

        An idle negotiator blocks at most this long, so no timer thread and no polling are needed.
        """
        if not self.enabled:
            return None
        deadlines = [] if reported else [self.warning_s]
        if self.shutdown_s > 0:
            deadlines.append(self.shutdown_s)
        ahead = [d - waited_s for d in deadlines if d > waited_s]
        if ahead:
            return min(ahead)
        return 0.0 if self.decide(waited_s, reported) is not StallAction.NONE else None


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    items = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ", ".join(parts) if parts else "none"


def _hints(locations: list[str], op_kind: str) -> list[str]:
    hints = []
    if any(loc.startswith("waiting in ") for loc in locations):
        hints.append(
            f"Some missing ranks wait in another collective: every rank of the process set must call this "
            f"{op_kind} (same name, or the same place in the code for unnamed ones). Look for a rank that "
            "skips a collective or takes another branch."
        )
    if any(loc.startswith("running") for loc in locations):
        hints.append(
            f"Some missing ranks are busy in their own code and have not reached this {op_kind}: a slow or "
            "stuck step (data loading, I/O, a loop) or a branch that skips the collective."
        )
    if not hints:
        hints.append("The missing ranks did not say where they are: they may be dead or stuck outside Python.")
    return hints


def _op(op_kind: str, name: str, seq: int) -> str:
    op = describe_op(op_kind, name)
    return op if op.startswith("unnamed ") else f"{op} (#{seq})"  # an unnamed op's name is its number


def format_stall_report(
    op_kind: str,
    name: str,
    seq: int,
    waited_s: float,
    arrived: list[int],
    missing: Mapping[int, tuple[str, str]],
) -> str:
    """One readable, multi-line report of a stalled collective.

    Missing ranks stuck in the same place are grouped on one line, so a 512-rank job stays readable.

    Args:
        op_kind: e.g. ``"allreduce"``.
        name: the collective's name (explicit or generated).
        seq: its sequence number on this process set.
        waited_s: seconds since the first rank submitted it.
        arrived: ranks that submitted it.
        missing: rank -> (host, where it is), e.g. ``(1, ("node2", "running train.py:41 load_batch"))``.

    Example:
        >>> print(format_stall_report("allreduce", "loss", 3, 61.0, [0], {1: ("n2", "running t.py:4 f")}))
        ... # doctest: +ELLIPSIS
        hora stall: allreduce 'loss' (#3) has waited 61 s: 1 of 2 ranks arrived, 1 missing.
          arrived: rank 0
          missing: rank 1 on n2: running t.py:4 f
        Some missing ranks are busy ...
    """
    total = len(arrived) + len(missing)
    groups: dict[str, list[int]] = {}
    for r in sorted(missing):
        groups.setdefault(missing[r][1] or "no answer", []).append(r)
    lines = [
        (f"hora stall: {_op(op_kind, name, seq)} has waited {waited_s:.0f} s: "
         f"{len(arrived)} of {total} ranks arrived, {len(missing)} missing."),
        f"  arrived: {'rank' if len(arrived) == 1 else 'ranks'} {format_ranks(arrived)}",
    ]
    label = "  missing: "
    for loc, ranks in groups.items():
        hosts = sorted({missing[r][0] for r in ranks})
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
        where = hosts[0] if len(hosts) == 1 else ", ".join(hosts[:4]) + (" ..." if len(hosts) > 4 else "")
        lines.append(f"{label}{who} on {where}: {loc}")
        label = "           "
    lines.extend(_hints(list(groups), op_kind))
    return "\n".join(lines)


def format_silent_report(rank: int, missing: Mapping[int, str], waited_s: float, shutdown_s: float,
                         launcher: bool) -> str:
    """The report of a negotiation round that peers do not answer: their processes cannot run Python.

    Args:
        rank: the reporting rank (it waits).
        missing: rank -> host of the ranks that have not answered.
        waited_s: seconds the round has waited.
        shutdown_s: the stall shutdown time (0 = never).
        launcher: True under ``hora run`` (its agents look at the missing processes).

    Example:
        >>> print(format_silent_report(0, {2: "n3"}, 4.0, 0.0, False))  # doctest: +ELLIPSIS
        hora stall: rank 2 on n3 has not answered rank 0's negotiation round for 4 s. ...
    """
    groups: dict[str, list[int]] = {}
    for r in sorted(missing):
        groups.setdefault(missing[r], []).append(r)
    who = "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {format_ranks(rs)} on {host}"
                    for host, rs in groups.items())
    one = len(missing) == 1
    lines = [f"hora stall: {who} {'has' if one else 'have'} not answered rank {rank}'s negotiation round for "
             f"{waited_s:.0f} s. {'Its process' if one else 'Their processes'} cannot run Python (stopped by "
             "SIGSTOP, Ctrl-Z or a debugger; inside a native call that holds the GIL) or "
             f"{'is' if one else 'are'} cut off from this host by the network."]
    if launcher:
        lines.append("hora run asks that host what the process is doing (see the launcher's 'stall:' line).")
    if shutdown_s > 0:
        lines.append(f"The job stops when the round has waited {shutdown_s:g} s "
                     "(--stall-check-shutdown-time-seconds).")
    else:
        lines.append("It waits on (no --stall-check-shutdown-time-seconds): set one to stop such a job.")
    return " ".join(lines)
