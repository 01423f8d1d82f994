"""Everything the launcher prints: worker lines with their rank, per-rank log files, the failure report.

The only module of the launcher that writes to the console. Worker lines look like horovodrun's,
``[3]<stdout>:text`` (with ``--prefix-output-with-timestamp``, ``Mon Nov 30 05:35:48 2026[3]<stdout>:``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO

TAIL_LINES = 200  # stderr lines kept per rank for the failure report
HOLD_S = 10.0  # a running rank's traceback is shown after this long if no failure report took it
REPORT_LINES = 20  # shown when the rank printed no traceback
# torch prefixes an uncaught exception's lines with "[rankN]:" once a process group exists
_TRACEBACK_START = re.compile(r"^(\[rank\d+\]:\s?)?Traceback \(most recent call last\):")
_COLLECTIVE_ERROR = re.compile(r"\b(CollectiveError|CollectiveTimeoutError|HorovodInternalError|PeerLostError)\b")
# torch's c10d logs this when a peer's address has no name (e.g. after a host was lost); it is noise, not a
# cause, so it never takes the place of the rank's real last words in a failure report
_TAIL_NOISE = re.compile(r"hostname of the client socket cannot be retrieved")
_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '(torch|hora)'$")


OOM_KILLED = "killed by the kernel's out-of-memory killer"  # how the agents word it (hora.launcher.remote.oom)

_ERASE_LINE = "\r\x1b[2K"  # to the line's start, clear it
_UP = "\x1b[1A"


_LAUNCHER = "hora run: "
_speaker: tuple[str, Callable[[str], str]] | None = None  # see speaking_as


@contextlib.contextmanager
def speaking_as(program: str, translate: Callable[[str], str]) -> Iterator[None]:
    """Within the block, the launcher's own lines start with ``<program>: `` instead of ``hora run: `` and go
    through ``translate``: a cluster framework's driver (``hora.ray``'s elastic jobs) runs the launcher's drivers
    inside a user's program, whose parameters are not ``hora run``'s flags. One job at a time per process."""
    global _speaker
    previous, _speaker = _speaker, (program, translate)
    try:
        yield
    finally:
        _speaker = previous


def _spoken(text: str) -> str:
    """``text`` as the current speaker says it (:func:`speaking_as`)."""
    speaker = _speaker
    if speaker is None or not text.startswith(_LAUNCHER):
        return text
    return f"{speaker[0]}: {speaker[1](text[len(_LAUNCHER):])}"


def line(text: str, stream: IO[str] | None = None) -> None:
    """Print one line of the launcher's own (above any live progress bars)."""
    text = _spoken(text)
    out = stream or sys.stdout
    try:
        with _hold_bars(out):
            out.write(text + "\n")
            out.flush()
    except (OSError, ValueError):
        _reader_gone(out)


def _reader_gone(stream: IO[str]) -> None:
    """Nobody reads ``stream`` any more (`hora run ... | head` exited; the terminal hung up, EIO): what is
    written to it from now on goes to /dev/null, so the job, its log files and its exit status go on, and the
    interpreter's last flush at exit cannot fail."""
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):
        return
    try:
        os.dup2(null, fd)
    except OSError:
        pass
    finally:
        os.close(null)


def error_line(prog: str, message: str) -> None:
    """Print a one-line usage or launch error: ``hora run: error: <message>``."""
    line(f"{prog}: error: {message}", sys.stderr)


def note(message: str) -> None:
    """A launcher message on stderr: ``hora run: <message>``."""
    line(f"hora run: {message}", sys.stderr)


def warning(message: str) -> None:
    """A launcher warning on stderr: ``hora: warning: <message>``."""
    line(f"hora: warning: {message}", sys.stderr)


_active: Console | None = None  # the console drawing live bars, if any: other writers go above them


class _hold_bars:  # noqa: N801 - used as a context manager, named like one
    """Clear the live bars before writing a line to a terminal, and draw them again after."""

    def __init__(self, stream: IO[str]) -> None:
        self._console = _active if _active is not None and _isatty(stream) else None

    def __enter__(self) -> None:
        if self._console is not None:
            self._console._clear_bars()

    def __exit__(self, *_exc: object) -> None:
        if self._console is not None:
            self._console._draw_bars()


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Console:
    """Writes workers' lines to the console and to ``--output-filename`` logs; keeps each rank's stderr tail.

    Progress bars (a worker's ``\\r`` redraws, sent as ``bar`` pieces) behave as in a terminal when the
    console is one: each bar has one live line below the other output, redrawn in place; its final state
    stays (as a line) when the bar ends, a bar that erases itself leaves nothing, and lines from any rank
    or from the launcher print above the live bars. When the console is not a terminal (a file, a pipe,
    CI) each bar state that arrives (at most one a second per bar) is a plain line.
    """

    def __init__(self, *, prefix_timestamp: bool = False, output_dir: str | None = None,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                 terminal: bool | None = None) -> None:
        self._timestamp = prefix_timestamp
        self._dir = output_dir
        self._out = stdout or sys.stdout
        self._err = stderr or sys.stderr
        self._logs: dict[tuple[int, str], IO[str]] = {}
        self.tails: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES))
        self.traceback_ts: dict[int, float] = {}  # when each rank's first traceback began
        # the terminal the live bars are drawn on: stderr's, else stdout's (None: plain lines)
        tty = {name: _isatty(s) if terminal is None else terminal for name, s in
               (("stdout", self._out), ("stderr", self._err))}
        self._tty = tty
        self._term: IO[str] | None = self._err if tty["stderr"] else self._out if tty["stdout"] else None
        self._bars: dict[tuple[int, str], str] = {}  # (rank, stream) -> its live line, in first-seen order
        self._drawn = 0  # how many bar lines are on the screen now
        self._last: IO[str] | None = None  # the stream written last
        # a rank's traceback (stderr from "Traceback ..." on) is held back, not printed as it comes: if the rank
        # fails, the failure report shows the root cause's traceback once, instead of every rank's interleaved
        self._held: dict[int, list[tuple[str, float | None]]] = {}
        self._held_since: dict[int, float] = {}
        self._logs_lost = False  # a log file could not be written (a full disk): no more log writes

    @property
    def live(self) -> bool:
        """Bars are drawn live (the console is a terminal)."""
        return self._term is not None

    def _prefix(self, rank: int, stream: str, ts: float | None) -> str:
        prefix = f"[{rank}]<{stream}>:"
        if self._timestamp:
            prefix = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(ts or time.time())) + prefix
        return prefix

    def worker_line(self, rank: int, stream: str, text: str, ts: float | None = None, kind: str = "line") -> None:
        """One piece a worker printed, as the user sees it: a line, a bar's state or a bar's erasure."""
        target = self._err if stream == "stderr" else self._out
        live = self._term is not None and self._tty[stream]
        if kind == "erase":
            if live and self._bars.pop((rank, stream), None) is not None:
                self._redraw()
            return
        if kind == "line" and stream == "stderr" and (rank in self._held or _TRACEBACK_START.match(text)):
            self._held.setdefault(rank, []).append((text, ts))
            self._held_since.setdefault(rank, time.monotonic())
        elif kind == "bar" and live:
            self._bars[(rank, stream)] = self._prefix(rank, stream, ts) + text
            self._redraw()
        else:
            if rank in self._held:
                self.release(rank)  # the rank goes on printing: its traceback was not its last word
            if live:
                self._bars.pop((rank, stream), None)  # a bar's final state arrives as its line
            self._write(target, f"{self._prefix(rank, stream, ts)}{text}\n", live)
        if stream == "stderr" and kind == "line" and not _TAIL_NOISE.search(text):
            self.tails[rank].append(text)
            if _TRACEBACK_START.match(text) and rank not in self.traceback_ts:
                self.traceback_ts[rank] = ts or time.time()
        if self._dir is not None and not self._logs_lost:
            try:
                self._log(rank, stream).write(text + "\n")
            except OSError as exc:
                self._lose_logs(os.path.join(self._dir, f"rank.{rank}", stream), exc)

    def release(self, rank: int) -> None:
        """Print the rank's held-back traceback now."""
        live = self._term is not None and self._tty["stderr"]
        for text, ts in self._held.pop(rank, []):
            self._write(self._err, f"{self._prefix(rank, 'stderr', ts)}{text}\n", live)
        self._held_since.pop(rank, None)

    def release_stale(self, exited: Sequence[int] = ()) -> None:
        """Print held tracebacks of ranks still running after :data:`HOLD_S` (they caught it and went on)."""
        now = time.monotonic()
        for rank, since in list(self._held_since.items()):
            if rank not in exited and now - since > HOLD_S:
                self.release(rank)

    def take_held(self, rank: int) -> list[str]:
        """Drop the rank's held-back traceback (a report shows it instead); return its lines."""
        self._held_since.pop(rank, None)
        return [text for text, _ in self._held.pop(rank, [])]

    def held_ranks(self) -> list[int]:
        """Ranks whose traceback is held back now."""
        return sorted(self._held)

    def held(self, rank: int) -> list[str]:
        """The rank's held-back lines."""
        return [text for text, _ in self._held.get(rank, [])]

    def rank_done(self, rank: int, failed: bool = False) -> None:
        """A rank exited: its bars still live stay on screen as lines, as in a terminal; a rank that exited
        cleanly shows the traceback it printed (a failed one's waits for the failure report)."""
        if not failed:
            self.release(rank)
        for key in [k for k in self._bars if k[0] == rank]:
            text = self._bars.pop(key)
            self._write(self._err if key[1] == "stderr" else self._out, text + "\n", True)

    def _write(self, target: IO[str], text: str, live: bool) -> None:
        global _active
        try:
            if self._last is not None and self._last is not target:
                self._last.flush()  # stdout and stderr into one file or terminal: keep the order lines came in
            self._last = target
            if live and self._drawn:
                self._clear_bars()
            target.write(text)
            if live and self._bars:
                target.flush()
                self._draw_bars()
        except (OSError, ValueError):
            _reader_gone(target)  # `hora run ... | head`, a closed terminal: the job and its log files go on
        _active = self if self._bars else None

    def _redraw(self) -> None:
        global _active
        try:
            self._clear_bars()
            self._draw_bars()
        except (OSError, ValueError):
            if self._term is not None:
                _reader_gone(self._term)
        _active = self if self._bars else None

    def _clear_bars(self) -> None:
        if self._term is None or not self._drawn:
            return
        self._term.write(_ERASE_LINE + (_UP + _ERASE_LINE) * (self._drawn - 1))
        self._term.flush()
        self._drawn = 0

    def _draw_bars(self) -> None:
        if self._term is None or not self._bars:
            return
        width = _columns(self._term) - 1  # a line that wraps would break the count of lines to clear
        self._term.write("\n".join(text[:width] for text in self._bars.values()))
        self._term.flush()
        self._drawn = len(self._bars)

    def _log(self, rank: int, stream: str) -> IO[str]:
        key = (rank, stream)
        if key not in self._logs:
            assert self._dir is not None
            folder = os.path.join(self._dir, f"rank.{rank}")
            os.makedirs(folder, exist_ok=True)
            self._logs[key] = open(os.path.join(folder, stream), "w", buffering=1)  # noqa: SIM115 - open for the job
        return self._logs[key]

    def open_logs(self, ranks: range, strict: bool = True) -> None:
        """Create every rank's log files up front, so a silent rank still has (empty) ones.

        Raises:
            OSError: a file cannot be created (``strict=False``: the one warning of :meth:`_lose_logs` instead).
        """
        if self._dir is None or self._logs_lost:
            return
        for rank in ranks:
            for stream in ("stdout", "stderr"):
                try:
                    self._log(rank, stream)
                except OSError as exc:
                    if strict:
                        raise
                    self._lose_logs(os.path.join(self._dir, f"rank.{rank}", stream), exc)
                    return

    def _lose_logs(self, path: str, exc: OSError) -> None:
        """A log file cannot be written (a full disk, a quota): say so once, naming it, and write no more log
        lines; the console output, the job and its exit status go on."""
        self._logs_lost = True
        note(f"warning: cannot write the log file {path} ({exc.strerror or exc}); --output-filename {self._dir} "
             "gets no more lines from this job, the console output goes on")
        self._close_logs()

    def _close_logs(self) -> None:
        for fh in self._logs.values():
            try:
                fh.close()
            except OSError:  # its last lines could not be flushed: the warning above said so
                pass
        self._logs.clear()

    def flush(self) -> None:
        for stream in (self._out, self._err):
            try:
                stream.flush()
            except (OSError, ValueError):
                _reader_gone(stream)

    def close(self) -> None:
        global _active
        for rank in self.held_ranks():
            self.release(rank)
        for rank in sorted({k[0] for k in self._bars}):
            self.rank_done(rank)
        _active = None
        self.flush()
        for (rank, stream), fh in list(self._logs.items()):
            try:
                fh.flush()
            except OSError as exc:
                self._lose_logs(os.path.join(str(self._dir), f"rank.{rank}", stream), exc)
                break
        self._close_logs()


def traceback_of(tail: list[str]) -> list[str] | None:
    """The last Python traceback in a rank's stderr tail, if it has one."""
    starts = [i for i, text in enumerate(tail) if _TRACEBACK_START.match(text)]
    return tail[starts[-1]:][:80] if starts else None


def failure_report(rank: int, host: str, how: str, tail: list[str], others: int,
                   finished: Sequence[int] = (), same: Sequence[int] = (), followed: Sequence[int] = (), *,
                   where: str | None = None, followed_by: Sequence[str] = ("PeerLostError",)) -> list[str]:
    """The root-cause report: what failed first, where, and its traceback or last stderr lines.

    ``same`` lists the other ranks that raised the same error (their tracebacks were held back from the
    console): one line names them, so the root cause's traceback is shown once. ``followed`` lists the ranks
    whose collectives then failed because a rank was gone (they raised the follow-on errors ``followed_by``, held
    back too): one line. ``finished`` lists the ranks that had already exited with status 0: when the failure is
    a collective that lost its peers, they most likely ran fewer steps (uneven data without ``hvd.join()``).
    ``where`` says where the rank ran (default ``"host <host>"``; a cluster framework's words, e.g. a Ray node).
    """
    lines = [f"hora run: rank {rank} on {where or f'host {host}'} failed first: {how}"]
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
    if same:
        ranks = ", ".join(str(r) for r in sorted(same))
        lines.append(f"hora run: rank{'s' if len(same) > 1 else ''} {ranks} failed with the same error")
    if followed:
        ranks = ", ".join(str(r) for r in sorted(followed))
        many = len(followed) > 1
        lines.append(f"hora run: then rank{'s' if many else ''} {ranks} stopped: {'their' if many else 'its'} "
                     f"collectives could not go on without rank {rank} ({', '.join(followed_by)})")
    if how.startswith(OOM_KILLED):
        lines.append("hora run: hint: the rank needed more memory than its limit allows: use less per rank (a smaller "
                     "batch, fewer DataLoader workers), run fewer ranks per host, or raise the limit (a pod's "
                     "resources.limits.memory, Slurm's --mem, the container's --memory)")
    lines.extend(_missing_module_hint(tb or []))
    lines.extend(_finished_early_hint(tb or [], finished))
    return lines


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_TYPE = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def _error_line(tb: list[str]) -> str:
    """The ``Type: message`` line of a traceback (the first unindented line after the frames)."""
    for raw in tb[1:]:
        text = _RANK_PREFIX.sub("", raw)
        if text and not text[0].isspace():
            return text
    return _RANK_PREFIX.sub("", tb[-1]) if tb else ""


def error_type(lines: list[str]) -> str | None:
    """The type name (without its module) of the exception whose traceback ends ``lines`` (a rank's output), or
    None when they hold no traceback.

    >>> error_type(["Traceback (most recent call last):", '  File "t.py", line 1', "hora.PeerLostError: gone"])
    'PeerLostError'
    """
    tb = traceback_of(lines)
    found = _TYPE.match(_error_line(tb)) if tb else None
    return found.group(1).rsplit(".", 1)[-1] if found else None


def same_error(lines: list[str], tb: list[str]) -> bool:
    """``lines`` (a rank's output) end in a traceback whose error line is ``tb``'s."""
    other = traceback_of(lines)
    return bool(tb) and other is not None and _error_line(other) == _error_line(tb)


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


def grace_ran_out(who: Sequence[str], grace: float) -> str:
    """The line naming the ranks (``"rank 1 on host a"``) still running when the grace after SIGTERM ran out."""
    verb = "was" if len(who) == 1 else "were"
    return (f"{', '.join(who)} {verb} still running {grace:g}s after SIGTERM (--grace-period) and {verb} killed "
            "(SIGKILL); if they need longer to stop (a checkpoint saved on SIGTERM), give a longer --grace-period "
            "or HORA_GRACE_PERIOD, below your scheduler's own (Kubernetes' terminationGracePeriodSeconds, Slurm's "
            "KillWait)")


def print_lines(lines: list[str]) -> None:
    """Print launcher report lines on stderr (above any live progress bars)."""
    try:
        with _hold_bars(sys.stderr):
            for text in lines:
                sys.stderr.write(_spoken(text) + "\n")
            sys.stderr.flush()
    except (OSError, ValueError):
        _reader_gone(sys.stderr)


def _columns(stream: IO[str]) -> int:
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        columns = 0
    return columns if columns > 0 else 80  # a terminal that does not say its size


def exception_name(traceback: list[str] | None) -> str:
    """``"raised CollectiveTimeoutError"`` from a traceback, else ``"failed"``."""
    name = error_type(traceback or [])
    return f"raised {name}" if name else "failed"
