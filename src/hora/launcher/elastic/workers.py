"""The elastic driver's records: one worker process (:class:`Worker`), why a job fails, the job's counters, and
the driver's own lines (:func:`note`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from hora.launcher import output
from hora.launcher.supervision.loop import Handle
from hora.launcher.supervision.root_cause import RankState

log = logging.getLogger(__name__)


def note(message: str) -> None:
    """One line of the elastic driver's own (``hora run: elastic: ...``)."""
    output.note(f"elastic: {message}")


@dataclass
class Worker:
    """One worker process of the job (its id may be reused by a later process on the same slot)."""

    wid: str
    host: str
    number: int  # its name in the output and the agent messages, unique in the job
    agent: Handle  # what started it: its host's agent, or its Ray actor's handle
    state: RankState  # its start values, and how it ended
    ready: int | None = None  # the last value seen in its ready key
    leaving: bool = False  # its host (or slot) is gone or blacklisted: no world will hold it again
    leave_by: float | None = None  # stop it at this time if it is still running
    announced: bool = False  # an update told the members it is ready to join
    stalled: str = ""  # why the stall inspector had it stopped (its exit is then a failure, not a stop)
    started_at: float = field(default_factory=time.monotonic)

    @property
    def alive(self) -> bool:
        return not self.state.done


# The exit status of a job the launcher ended at one of its limits (--reset-limit, --elastic-timeout), rather
# than the status of some worker the job may have survived long before: sysexits' EX_TEMPFAIL (the job may go on
# when retried, e.g. with more hosts).
LIMIT_EXIT = 75


@dataclass
class JobFailure:
    """Why the job fails: the one line, and the worker whose report explains it (if any)."""

    summary: str
    worker: Worker | None = None
    code: int = 1


@dataclass
class Stats:
    """The job's counters: the worlds published after the first, the processes started, the failures seen."""

    resets: int = 0
    started: int = 0
    failures: list[str] = field(default_factory=list)
