"""The messages between the driver and an agent, and how a worker's byte stream becomes lines.

The driver writes JSON lines to the agent's stdin: first the job spec, then commands (``stop``,
``ping``, ``probe``). The agent writes JSON lines to its stdout: ``started``, ``out`` (one output line of a
rank), ``exit`` (a rank's end), ``probe`` (what /proc says about a rank's process) and ``done``. Only the
standard library is used here: the agent imports this.

The ranks and the driver also share a few keys in the rendezvous store (:func:`board_key`): a rank whose
negotiation round waits for peers that do not answer posts who it waits for (``waiting/<rank>``, counted in
``waits``); the driver posts which ranks have exited (``ended/<rank>``), so a rank waiting for one that exited
(while a process it forked holds its connections open) stops waiting at once; the rank that knows the culprit
of a failure names it (``culprit``), so the launcher's headline names that rank rather than a waiting one;
every rank marks its arrival at ``init()`` (``arrived/<rank>``), so a late one is named.
"""

from __future__ import annotations

import codecs
import json
from typing import Any

# Agent -> driver message kinds (PROBE also goes the other way: the question, then the answer).
STARTED, OUT, EXIT, DONE, PROBE = "started", "out", "exit", "done", "probe"
# Driver -> agent commands.
STOP, PING = "stop", "ping"
# Keys of the board the ranks and the driver share in the store (see the module docstring).
WAITING, WAITS, ENDED, CULPRIT, ARRIVED = "waiting/{rank}", "waits", "ended/{rank}", "culprit", "arrived/{gen}/{rank}"
ENDS = "ends"  # how many ``ended/<rank>`` keys there are: a waiting rank reads only this, until it changes


def board_key(job_id: str, key: str, **fields: object) -> str:
    """A board key of job ``job_id``: ``board_key("ab12", ENDED, rank=3)`` -> ``"hora/ab12/board/ended/3"``."""
    return f"hora/{job_id}/board/" + key.format(**fields)
# hora.run: store keys for the shipped function and each rank's outcome.
PYRUN_FN_KEY = "hora.run/fn"
PYRUN_RESULT_KEY = "hora.run/result/{rank}"


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


class LineSplitter:
    """Turn a worker's output chunks into whole lines.

    ``\\n`` ends a line. ``\\r`` ends a progress-bar update: those are thinned to one per ``interval``
    seconds (the newest wins) so a bar redrawn 100 times a second neither floods the console nor
    garbles other ranks' lines, and the bar's final state (ended by ``\\n``) always shows.

    Example:
        >>> s = LineSplitter(interval=10.0)
        >>> s.feed(b"a\\n\\r 1%\\r 2%\\r100%\\n", now=0.0)
        ['a', ' 1%', '100%']
    """

    def __init__(self, interval: float = 1.0, max_line: int = 1 << 20) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._pending: str | None = None
        self._last_progress = float("-inf")
        self._interval = interval
        self._max_line = max_line

    def feed(self, data: bytes, now: float) -> list[str]:
        """Add bytes read at time ``now``; return the lines they complete."""
        self._buf += self._decoder.decode(data)
        out: list[str] = []
        start = 0
        buf = self._buf
        while True:
            i = _next_break(buf, start)
            if i < 0:
                break
            if buf[i] == "\r" and i + 1 == len(buf):
                break  # maybe the first half of "\r\n": wait for more
            segment = buf[start:i]
            if buf[i] == "\n" or buf[i + 1] == "\n":
                out.append(segment)
                self._pending = None
                start = i + (2 if buf[i] == "\r" else 1)
                continue
            start = i + 1
            if segment:
                self._progress(segment, now, out)
        self._buf = buf[start:]
        if len(self._buf) > self._max_line:
            out.append(self._buf)
            self._buf = ""
        return out

    def _progress(self, segment: str, now: float, out: list[str]) -> None:
        if not segment.strip():  # a bar erasing itself (tqdm's leave=False): gone, as on a terminal
            self._pending = None
            return
        if now - self._last_progress >= self._interval:
            out.append(segment)
            self._last_progress = now
            self._pending = None
        else:
            self._pending = segment

    def flush(self) -> list[str]:
        """At end of stream: the unfinished line, or the last progress update nobody saw."""
        rest = (self._buf + self._decoder.decode(b"", final=True)).rstrip("\r")
        self._buf = ""
        if rest.strip():
            return [rest]
        pending, self._pending = self._pending, None
        return [pending] if pending else []


def _next_break(text: str, start: int) -> int:
    n = text.find("\n", start)
    r = text.find("\r", start)
    if n < 0:
        return r
    return n if r < 0 else min(n, r)
