"""Everything the launcher prints: worker lines with their rank, per-rank log files, the failure report.

The only module of the launcher that writes to the console. Worker lines look like horovodrun's,
``[3]<stdout>:text`` (with ``--prefix-output-with-timestamp``, ``Mon Nov 30 05:35:48 2026[3]<stdout>:``).
"""

from __future__ import annotations

import collections
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import IO

TAIL_LINES = 200  # stderr lines kept per rank for the failure report
REPORT_LINES = 20  # shown when the rank printed no traceback
# torch prefixes an uncaught exception's lines with "[rankN]:" once a process group exists
_TRACEBACK_START = re.compile(r"^(\[rank\d+\]:\s?)?Traceback \(most recent call last\):")
_COLLECTIVE_ERROR = re.compile(r"\b(CollectiveError|CollectiveTimeoutError|HorovodInternalError)\b")
# torch's c10d logs this when a peer's address has no name (e.g. after a host was lost); it is noise, not a
# cause, so it never takes the place of the rank's real last words in a failure report
_TAIL_NOISE = re.compile(r"hostname of the client socket cannot be retrieved")
_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '(torch|hora)'$")


def line(text: str, stream: IO[str] | None = None) -> None:
    """Print one line of the launcher's own."""
    out = stream or sys.stdout
    out.write(text + "\n")
    out.flush()


def error_line(prog: str, message: str) -> None:
    """Print a one-line usage or launch error: ``hora run: error: <message>``."""
    line(f"{prog}: error: {message}", sys.stderr)


def note(message: str) -> None:
    """A launcher message on stderr: ``hora run: <message>``."""
    line(f"hora run: {message}", sys.stderr)


class Console:
    """Writes workers' lines to the console and to ``--output-filename`` logs; keeps each rank's stderr tail."""

    def __init__(self, *, prefix_timestamp: bool = False, output_dir: str | None = None,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> None:
        self._timestamp = prefix_timestamp
        self._dir = output_dir
        self._out = stdout or sys.stdout
        self._err = stderr or sys.stderr
        self._logs: dict[tuple[int, str], IO[str]] = {}
        self.tails: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES))
        self.traceback_ts: dict[int, float] = {}  # when each rank's first traceback began

    def worker_line(self, rank: int, stream: str, text: str, ts: float | None = None) -> None:
        """One line a worker printed, as the user sees it."""
        prefix = f"[{rank}]<{stream}>:"
        if self._timestamp:
            prefix = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(ts or time.time())) + prefix
        try:
            (self._err if stream == "stderr" else self._out).write(f"{prefix}{text}\n")
        except (BrokenPipeError, ValueError):
            pass  # `hora run ... | head`: the reader left; the job and its log files go on
        if stream == "stderr" and not _TAIL_NOISE.search(text):
            self.tails[rank].append(text)
            if _TRACEBACK_START.match(text) and rank not in self.traceback_ts:
                self.traceback_ts[rank] = ts or time.time()
        if self._dir is not None:
            self._log(rank, stream).write(text + "\n")

    def _log(self, rank: int, stream: str) -> IO[str]:
        key = (rank, stream)
        if key not in self._logs:
            assert self._dir is not None
            folder = os.path.join(self._dir, f"rank.{rank}")
            os.makedirs(folder, exist_ok=True)
            self._logs[key] = open(os.path.join(folder, stream), "w", buffering=1)  # noqa: SIM115 - open for the job
        return self._logs[key]

    def open_logs(self, ranks: range) -> None:
        """Create every rank's log files up front, so a silent rank still has (empty) ones."""
        if self._dir is not None:
            for rank in ranks:
                for stream in ("stdout", "stderr"):
                    self._log(rank, stream)

    def flush(self) -> None:
        for stream in (self._out, self._err):
            try:
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass

    def close(self) -> None:
        self.flush()
        for fh in self._logs.values():
            fh.close()
        self._logs.clear()


def traceback_of(tail: list[str]) -> list[str] | None:
    """The last Python traceback in a rank's stderr tail, if it has one."""
    starts = [i for i, text in enumerate(tail) if _TRACEBACK_START.match(text)]
    return tail[starts[-1]:][:80] if starts else None


def failure_report(rank: int, host: str, how: str, tail: list[str], others: int,
                   finished: Sequence[int] = ()) -> list[str]:
    """The root-cause report: what failed first, where, and its traceback or last stderr lines.

    ``finished`` lists the ranks that had already exited with status 0: when the failure is a collective
    that lost its peers, they most likely ran fewer steps (uneven data without ``hvd.join()``).
    """
    lines = [f"hora run: rank {rank} on host {host} failed first: {how}"]
    if others:
        lines.append(f"hora run: stopping the other {others} rank{'s' if others != 1 else ''}")
    tb = traceback_of(tail)
    if tb is not None:
        lines.append(f"hora run: ---- traceback of rank {rank} ({host}) ----")
        lines.extend(f"[{rank}]: {text}" for text in tb)
    elif tail:
        shown = tail[-REPORT_LINES:]
        lines.append(f"hora run: ---- last {len(shown)} stderr lines of rank {rank} ({host}) ----")
        lines.extend(f"[{rank}]: {text}" for text in shown)
    else:
        lines.append(f"hora run: rank {rank} printed nothing on stderr")
    lines.append("hora run: ----")
    lines.extend(_missing_module_hint(tb or []))
    lines.extend(_finished_early_hint(tb or [], finished))
    return lines


def _finished_early_hint(tb: list[str], finished: Sequence[int]) -> list[str]:
    if not finished or not tb or not _COLLECTIVE_ERROR.search(tb[-1]):
        return []
    ranks = ", ".join(str(r) for r in sorted(finished))
    return [f"hora run: hint: rank{'s' if len(finished) > 1 else ''} {ranks} had already finished (exit code 0) "
            "while this rank waited in a collective: if ranks run different numbers of steps (uneven data), "
            "call hvd.join() after the training loop so finished ranks keep serving the others' collectives"]


def _missing_module_hint(tb: list[str]) -> list[str]:
    """A rank whose Python lacks torch or hora most likely ran another interpreter than the launcher's."""
    found = _MISSING_MODULE.search(tb[-1]) if tb else None
    if found is None:
        return []
    return [f"hora run: hint: the rank's Python cannot import '{found.group(1)}', but the launcher's Python "
            f"({sys.executable}) can: activate its environment, or name it in the command "
            f"(hora run ... {sys.executable} train.py)"]


def print_lines(lines: list[str]) -> None:
    """Print launcher report lines on stderr."""
    for text in lines:
        sys.stderr.write(text + "\n")
    sys.stderr.flush()
