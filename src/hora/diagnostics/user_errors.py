"""How a rank shows an uncaught hora error and hora's warnings: in the user's terms.

An uncaught :class:`~hora.errors.HoraError` is printed as a Python traceback of the user's own frames only
(hora's and torch's frames are left out), and a collective's error names the call as the user wrote it and
where: ``hvd.allreduce(t) at train.py:41``, not hora's internal sequence name (``noname.ps0.0``). With
``HORA_FULL_TRACEBACKS=1`` (``hora run --verbose``) Python's full traceback is printed instead. Other
exceptions are left to Python.

hora's log records of level WARNING and above print as ``hora: warning: <message>`` (``hora: error: ...``) on
stderr, each on a line of its own (a message with its own ``hora ...`` prefix, like a stall report, as it
is): a progress bar being drawn on that stream is ended first (``\\r``; on a terminal the bar's line is also
cleared), so the message never lands on the bar's line.

Example (what a rank prints for a shape mismatch)::

    Traceback (most recent call last):
      File "/home/me/train.py", line 41, in main
        hvd.allreduce(t)
    hora.CollectiveMismatchError: hvd.allreduce(t) at train.py:41: ranks disagree on shape.
      rank 0: allreduce dtype=float32 shape=[4] op=Average process_set=[0, 1] device=cpu
      ...
    (hora's own frames are not shown: HORA_FULL_TRACEBACKS=1, or hora run --verbose, shows them)
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from types import TracebackType
from typing import IO

import torch

from hora.errors import CollectiveMismatchError, HoraError

_HORA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/hora (this is diagnostics/...)
_HIDDEN = (_HORA_DIR + os.sep, os.path.dirname(torch.__file__ or "") + os.sep)
_HINT = "(hora's own frames are not shown: HORA_FULL_TRACEBACKS=1, or hora run --verbose, shows them)"
_previous_hook = sys.excepthook


def install(full_tracebacks: bool, under_launcher: bool, with_time: bool = False) -> None:
    """Set the excepthook and hora's warning handler for this process (idempotent); ``with_time``
    (``HOROVOD_LOG_HIDE_TIME=0``, ``hora run --log-with-timestamp``) starts each warning line with the time."""
    global _full
    _full = full_tracebacks
    if sys.excepthook is not _hook:
        _remember(sys.excepthook)
        sys.excepthook = _hook
    logger = logging.getLogger("hora")
    for handler in logger.handlers:
        if isinstance(handler, WarningHandler):
            handler.with_time = with_time
    if not any(isinstance(h, WarningHandler) for h in logger.handlers) and not logging.getLogger().handlers:
        logger.addHandler(WarningHandler(sys.stderr, under_launcher, with_time))
        logger.propagate = False  # no second copy through Python's last-resort handler


_full = False


def _remember(hook: object) -> None:
    global _previous_hook
    _previous_hook = hook  # type: ignore[assignment]


def _hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if _full or not isinstance(exc, HoraError):
        _previous_hook(exc_type, exc, tb)
        return
    sys.stderr.write(format_user_error(exc, tb))
    sys.stderr.flush()


def user_frames(tb: TracebackType | None) -> list[traceback.FrameSummary]:
    """The traceback's frames outside hora and torch (the user's script and its other libraries)."""
    return [f for f in traceback.extract_tb(tb) if not f.filename.startswith(_HIDDEN)]


def format_user_error(exc: BaseException, tb: TracebackType | None) -> str:
    """The traceback of ``exc`` as the user should read it (see the module docstring)."""
    frames = user_frames(tb)
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)] if frames else []
    name = type(exc).__name__
    public = sys.modules.get("hora")  # what hora exports (the package is imported by the time errors are shown)
    qualified = f"hora.{name}" if getattr(public, name, None) is type(exc) else f"{type(exc).__module__}.{name}"
    lines.append(f"{qualified}: {user_message(exc, frames[-1] if frames else None)}\n")
    lines.append(_HINT + "\n")
    return "".join(lines)


def user_message(exc: BaseException, call: traceback.FrameSummary | None) -> str:
    """``exc``'s message, with a collective named by the user's call and its place instead of hora's name."""
    text = str(exc)
    if isinstance(exc, CollectiveMismatchError) and call is not None:
        where = f"{(call.line or '').strip() or call.name} at {os.path.basename(call.filename)}:{call.lineno}"
        cut = text.find("ranks disagree")  # after hora's label of the op ("collective 'x'", "unnamed ...")
        return f"{where}: {text[cut:] if cut >= 0 else text}"
    return text


class WarningHandler(logging.Handler):
    """``hora: warning: <message>`` lines on a stream, never on a progress bar's line."""

    def __init__(self, stream: IO[str], under_launcher: bool, with_time: bool = False) -> None:
        super().__init__(logging.WARNING)
        self.stream = stream
        self._under_launcher = under_launcher
        self.with_time = with_time  # "[2024-05-01 12:00:00.123]" before each line, as Horovod's log lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            # a message that names hora itself ("hora stall: ...") keeps its own prefix
            message = text if text.startswith(("hora ", "hora:")) else f"hora: {record.levelname.lower()}: {text}"
            if record.exc_info:
                message += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
            if self.with_time:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
                message = f"[{stamp}.{int(record.msecs):03d}] {message}"
            start = "\r\x1b[K" if _isatty(self.stream) else "\r" if self._under_launcher else ""
            self.stream.write(start + message + "\n")
            self.stream.flush()
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
