"""Processes and signals: own process groups, parent-death signals, stopping groups, naming exits.

Standard library only (the agent imports this).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - exotic libc
        _libc = None


def die_with_parent() -> None:
    """In a child before exec: ask Linux to SIGKILL us when our parent dies (second line of defence).

    The first line is the agent killing its workers' process groups when the driver goes away.
    """
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def child_setup(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn``: die with the parent; exit at once if the parent is already gone."""

    def setup() -> None:
        die_with_parent()
        if os.getppid() != parent_pid:
            os._exit(1)

    return setup


def signal_groups(pgids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each process group; groups already gone are skipped."""
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_name(signum: int) -> str:
    """``9`` -> ``'SIGKILL'``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: int | None, sig: int | None) -> str:
    """Human words for how a process ended: ``exit code 3`` or ``signal SIGKILL (9)``."""
    if sig:
        return f"signal {signal_name(sig)} ({sig})"
    return f"exit code {code}"


def exit_status(code: int | None, sig: int | None) -> int:
    """The shell-style status for an exit: the code, or 128 + signal number."""
    if sig:
        return 128 + sig
    return code if code is not None else 1
