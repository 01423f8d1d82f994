"""The messages between the driver and an agent, and how a worker's byte stream becomes lines.

The driver writes JSON lines to the agent's stdin: first the job spec, then commands (``stop``,
``ping``, ``probe``). The agent writes JSON lines to its stdout: ``started``, ``out`` (one output line of a
rank), ``exit`` (a rank's end), ``probe`` (what /proc says about a rank's process) and ``done``. Only the
standard library is used here: the agent imports this. An ``out`` message's ``k`` says whether its text is a
line (absent), a progress-bar state (``bar``) or a bar that erased itself (``erase``).

The ranks and the driver also share a few keys in the rendezvous store (:func:`board_key`): a rank whose
negotiation round waits for peers that do not answer posts who it waits for (``waiting/<rank>``, counted in
``waits``); the driver posts which ranks have exited (``ended/<rank>``), so a rank waiting for one that exited
(while a process it forked holds its connections open) stops waiting at once; the rank that knows the culprit
of a failure names it (``culprit``), so the launcher's headline names that rank rather than a waiting one; a
rank whose data
transfers have been on the wire past the stall warning time posts them (``inflight/<rank>``, also counted in
``waits``), so the driver finds the member frozen in the middle of a transfer and ends the job at the stall
shutdown time.
"""

from __future__ import annotations

import codecs
import json
from typing import Any

# Agent -> driver message kinds (PROBE also goes the other way: the question, then the answer).
STARTED, OUT, EXIT, DONE, PROBE = "started", "out", "exit", "done", "probe"
# Driver -> agent commands (a STOP with "r": [ranks] stops only those workers: an elastic job lets them go).
STOP, PING = "stop", "ping"
# Keys of the board the ranks and the driver share in the store (see the module docstring).
WAITING, WAITS, ENDED, CULPRIT = "waiting/{rank}", "waits", "ended/{rank}", "culprit"
ENDS = "ends"  # how many ``ended/<rank>`` keys there are: a waiting rank reads only this, until it changes
INFLIGHT = "inflight/{rank}"  # data transfers a rank launched that have not finished past the warning time


def board_key(job_id: str, key: str, **fields: object) -> str:
    """A board key of job ``job_id``: ``board_key("ab12", ENDED, rank=3)`` -> ``"hora/ab12/board/ended/3"``."""
    return f"hora/{job_id}/board/" + key.format(**fields)
# hora.run: store keys for the shipped function and each rank's outcome.
PYRUN_FN_KEY = "hora.run/fn"
PYRUN_RESULT_KEY = "hora.run/result/{rank}"
PYRUN_ERRORS_KEY = "hora.run/errors"  # a counter: how many ranks stored an error (watchers poll it, not every key)
# elastic hora.run: a returning rank's value by its world and rank there; a failing worker's error by its id
PYRUN_ELASTIC_RESULT_KEY = "hora.run/result/g{gen}/{rank}"
PYRUN_ELASTIC_ERROR_KEY = "hora.run/error/{worker_id}"


def encode(message: dict[str, Any]) -> bytes:
    """One message as a JSON line."""
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def decode(line: bytes | str) -> dict[str, Any] | None:
    """Parse one JSON line; None for anything that is not a message (e.g. a login banner)."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) and "t" in value else None


# What a piece of worker output is (the ``k`` of an ``out`` message; absent means LINE).
LINE, BAR, ERASE = "line", "bar", "erase"


class LineSplitter:
    """Turn a worker's output chunks into pieces: whole lines and progress-bar states.

    ``\\n`` ends a line. ``\\r`` ends a progress-bar state (``BAR``): those are thinned to one per
    ``interval`` seconds (the newest wins; :meth:`take_pending` and :meth:`due` hand out the newest one
    nobody saw) so a bar redrawn 100 times a second does not flood the link. A bar that blanks itself
    (tqdm's ``leave=False``) becomes one ``ERASE``; the bar's final state, ended by ``\\n``, is a LINE.

    Example:
        >>> s = LineSplitter(interval=10.0)
        >>> s.feed(b"a\\n\\r 1%\\r 2%\\r100%\\n", now=0.0)
        [('line', 'a'), ('bar', ' 1%'), ('line', '100%')]
    """

    def __init__(self, interval: float = 1.0, max_line: int = 1 << 20) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._pending: str | None = None
        self._shown = False  # a bar state went out since the last line or erase
        self._sent: str | None = None  # the last bar state that went out
        self._in_bar = False  # the text being written follows a "\\r": it is the bar's state being drawn
        self._last_progress = float("-inf")
        self.interval = interval
        self._max_line = max_line

    def feed(self, data: bytes, now: float) -> list[tuple[str, str]]:
        """Add bytes read at time ``now``; return the ``(kind, text)`` pieces they complete."""
        self._buf += self._decoder.decode(data)
        out: list[tuple[str, str]] = []
        start = 0
        buf = self._buf
        while True:
            i = _next_break(buf, start)
            if i < 0:
                break
            segment = buf[start:i]
            if buf[i] == "\r" and i + 1 == len(buf):
                if segment and not segment.strip():  # a bar blanked itself: no need to wait
                    self._in_bar, start = True, i + 1
                    self._progress(segment, now, out)
                break  # maybe the first half of "\r\n": wait for more
            if buf[i] == "\n" or buf[i + 1] == "\n":
                out.append((LINE, segment))
                self._pending, self._shown, self._sent, self._in_bar = None, False, None, False
                start = i + (2 if buf[i] == "\r" else 1)
                continue
            start = i + 1
            self._in_bar = True
            if segment:
                self._progress(segment, now, out)
        self._buf = buf[start:]
        if len(self._buf) > self._max_line:
            out.append((LINE, self._buf))
            self._buf = ""
        return out

    def _progress(self, segment: str, now: float, out: list[tuple[str, str]]) -> None:
        if not segment.strip():  # a bar erasing itself (tqdm's leave=False): gone, as on a terminal
            if self._shown:
                out.append((ERASE, ""))
            self._pending, self._shown = None, False
            return
        if segment == self._sent:
            self._pending = None  # redrawn unchanged (or already sent by due())
        elif now - self._last_progress >= self.interval:
            out.append((BAR, segment))
            self._last_progress, self._pending, self._shown, self._sent = now, None, True, segment
        else:
            self._pending = segment

    def _latest(self) -> str | None:
        """The bar's newest state: the text drawn since the last ``\\r`` (tqdm writes ``\\r`` + state), else
        the newest complete one held back."""
        drawing = self._buf.rstrip("\r") if self._in_bar else ""
        latest = drawing if drawing.strip() else self._pending
        return None if latest == self._sent else latest

    @property
    def has_pending(self) -> bool:
        """A bar state nobody saw is held back by the thinning."""
        return self._latest() is not None

    def take_pending(self, now: float) -> list[tuple[str, str]]:
        """The held-back bar state, now (before another stream's line of the same process)."""
        latest, self._pending = self._latest(), None
        if latest is None:
            return []
        self._last_progress, self._shown, self._sent = now, True, latest
        return [(BAR, latest)]

    def due(self, now: float) -> list[tuple[str, str]]:
        """The held-back bar state once its interval has passed (a bar that stopped redrawing)."""
        return self.take_pending(now) if now - self._last_progress >= self.interval else []

    def flush(self) -> list[tuple[str, str]]:
        """At end of stream: the unfinished line, or the last bar state nobody saw (as a line)."""
        rest = (self._buf + self._decoder.decode(b"", final=True)).rstrip("\r")
        self._buf = ""
        if rest.strip():
            return [(LINE, rest)]
        if rest and self._in_bar and self._shown:  # the last thing written blanked the bar
            return [(ERASE, "")]
        pending, self._pending = self._pending, None
        return [(LINE, pending)] if pending else []  # the stream ended: the bar's last state stays, as a line


def _next_break(text: str, start: int) -> int:
    n = text.find("\n", start)
    r = text.find("\r", start)
    if n < 0:
        return r
    return n if r < 0 else min(n, r)
