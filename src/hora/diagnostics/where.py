"""Where is this process right now? The stall inspector's answer for one rank.

Two sources, cheapest first:

* a slot that hora's blocking waits fill (``set_waiting("allreduce 'grad.bucket.3'")`` before a wait,
  ``set_waiting(None)`` after): the rank is inside a hora collective;
* otherwise the main thread's Python stack from ``sys._current_frames()``, innermost user frame first, with
  hora's and torch's own frames left out.

Both work from any thread (the negotiator thread asks while the main thread is busy in user code).

Example:
    >>> set_waiting("allreduce 'loss'")
    >>> describe_location().startswith("waiting in allreduce 'loss'")
    True
    >>> set_waiting(None)
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import threading
import traceback
from types import FrameType

from hora.common.names import parse_unnamed

log = logging.getLogger(__name__)

# Thread ident -> what that thread waits in: a description, or (kind, name) described only when read (the
# per-op cost of a wait is then one dict store). A dict item assignment is atomic under the GIL, so the setter
# needs no lock; readers take a snapshot with dict.get.
_waiting: dict[int, str | tuple[str, str]] = {}
_get_ident = threading.get_ident

_THIS_FILE = os.path.abspath(__file__)
_HORA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torch_dir() -> str | None:
    mod = sys.modules.get("torch")
    path = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) if path else None


def describe_op(kind: str, name: str) -> str:
    """How a user reads a collective: ``allreduce 'loss'``, or ``unnamed allreduce #17`` for a generated
    name (``noname.ps0.17``: the 17th unnamed collective of process set 0), ``... #3 of process set 2``."""
    parsed = parse_unnamed(name)
    if parsed is not None and name.count(".") == 2:
        ps, n = parsed
        where = "" if ps == 0 else f" of process set {ps}"
        return f"unnamed {kind} #{n}{where}"
    return f"{kind} {name!r}"


def set_waiting(desc: str | tuple[str, str] | None) -> None:
    """Record (or clear, with None) the hora collective the calling thread is blocked in.

    Called by hora's handles around blocking waits; costs one dict store.

    Args:
        desc: e.g. ``"allreduce 'grad.bucket.3'"``, or ``(kind, name)`` to be described by
            :func:`describe_op` when read; None when the wait is over.
    """
    if desc is None:
        _waiting.pop(_get_ident(), None)
    else:
        _waiting[_get_ident()] = desc


def waiting_in(thread_id: int | None = None) -> str | None:
    """What the given thread (default: the main thread) is waiting in, or None."""
    ident = threading.main_thread().ident if thread_id is None else thread_id
    return _described(_waiting.get(ident)) if ident is not None else None


def _described(desc: str | tuple[str, str] | None) -> str | None:
    return describe_op(*desc) if isinstance(desc, tuple) else desc


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(sorted(d + os.sep for d in dirs))


_LIBRARY_DIRS = _library_dirs()


def _internal(path: str, torch_dir: str | None) -> bool:
    return path.startswith(_HORA_DIR + os.sep) or (torch_dir is not None and path.startswith(torch_dir + os.sep))


def _library(path: str) -> bool:
    return path.startswith(_LIBRARY_DIRS) or "site-packages" in path or "dist-packages" in path


def user_frames(frame: FrameType | None, limit: int = 4) -> tuple[list[str], str | None]:
    """The stack of ``frame`` as ``file:line function`` strings, innermost first.

    hora's, torch's, standard-library and installed-package frames are left out, except the call the
    innermost user frame is making: the outermost of those frames below it (``queue.py:180 get``, or
    ``hora ops.py:92 allreduce``), returned apart.

    Args:
        frame: the innermost frame of the stack to describe.
        limit: at most this many user frames.

    Returns:
        (user frames, the call the innermost one is in, or None). When the stack has no user frame at all,
        the library frames take the user frames' place.
    """
    if frame is None:
        return [], None
    torch_dir = _torch_dir()
    users: list[str] = []
    below: list[str] = []  # non-user frames inside the innermost user frame, innermost first
    for fs in reversed(traceback.extract_stack(frame)):
        path = os.path.abspath(fs.filename)
        if path == _THIS_FILE:  # describing the calling thread itself
            continue
        text = f"{os.path.basename(fs.filename)}:{fs.lineno} {fs.name}"
        internal = _internal(path, torch_dir)
        if internal or _library(path):
            if not users:
                below.append(("hora " if path.startswith(_HORA_DIR + os.sep) else "") + text)
            continue
        users.append(text)
        if len(users) >= limit:
            break
    if not users:
        return [f for f in below if not f.startswith("hora ")][:limit], None
    return users, (below[-1] if below else None)


def describe_location(thread_id: int | None = None, limit: int = 4) -> str:
    """One line saying what the main thread (or ``thread_id``) is doing right now.

    Returns ``"waiting in allreduce 'x' (called from train.py:12 step)"`` when it is blocked in a hora
    collective, else ``"running train.py:41 load_batch <- train.py:88 main (in queue.py:180 get)"``: the user frames
    innermost first, then the library (or hora) call the innermost one is making, if any.

    Args:
        thread_id: the thread to describe; default the main thread.
        limit: how many stack frames to show.
    """
    ident = threading.main_thread().ident if thread_id is None else thread_id
    if ident is None:
        return "main thread not started"
    frame = sys._current_frames().get(ident)
    if frame is None:
        return "main thread has exited"
    frames, lib = user_frames(frame, limit)
    desc = _described(_waiting.get(ident))
    if desc is not None:
        return f"waiting in {desc}" + (f" (called from {frames[0]})" if frames else "")
    if not frames:
        return "running inside hora or torch (no user frame on the stack)"
    return "running " + " <- ".join(frames) + (f" (in {lib})" if lib else "")
