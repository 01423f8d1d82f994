"""Call-site fingerprints of unnamed collectives: which line of the user's code made the call.

Unnamed ops are matched across ranks by their place in a per-process-set sequence. A rank that skips or adds
a collective (a rank-dependent branch, an exception caught around one call) would pair its later ops with
the wrong ones; the fingerprint of the call site travels with each unnamed request, and ranks that reach
the same place in the sequence from different lines are told so (``plan.differing_fields``).

The call site is the first frame outside hora and torch: the user's line, also when the op is submitted by
a hora helper or from inside an autograd Function. The walk is cached by code object, and the result by
(code object, instruction), so a call costs a few dictionary lookups; the fingerprint is a CRC of the
module name and line, the same on every rank whatever path the script has on each host.

Example:
    >>> site = current()          # doctest: +SKIP
    >>> site.where                # doctest: +SKIP
    'train.py:42'
"""

from __future__ import annotations

import os
import sys
import zlib
from types import CodeType, FrameType
from typing import NamedTuple

import torch


class Site(NamedTuple):
    """A call site: ``fingerprint`` is compared across ranks (0: unknown, never compared), ``where`` is
    ``file:line`` for messages."""

    fingerprint: int
    where: str


UNKNOWN = Site(0, "")

_HORA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/hora (this is diagnostics/...)
_SKIP_DIRS = (_HORA_DIR + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
_skip: dict[CodeType, bool] = {}  # code object -> it belongs to hora or torch
_sites: dict[tuple[CodeType, int], Site] = {}  # (code object, last instruction) -> its site


def current() -> Site:
    """The site of the innermost frame outside hora and torch that led here (``UNKNOWN`` if none: an op
    submitted from a thread that only runs library code, such as a CUDA autograd worker)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        skip = _skip.get(code)
        if skip is None:
            skip = _skip[code] = code.co_filename.startswith(_SKIP_DIRS)
        if not skip:
            key = (code, frame.f_lasti)
            site = _sites.get(key)
            if site is None:
                site = _sites[key] = _site_of(frame)
            return site
        frame = frame.f_back
    return UNKNOWN


def _site_of(frame: FrameType) -> Site:
    line = frame.f_lineno or 0
    module = frame.f_globals.get("__name__", "?")
    fingerprint = zlib.crc32(f"{module}:{line}".encode()) or 1
    return Site(fingerprint, f"{frame.f_code.co_filename}:{line}")
