"""This process's peak resident memory over a stretch of code (Linux): the kernel's high-water mark, reset first.

Example:
    >>> with PeakMemory() as peak:  # doctest: +SKIP
    ...     model = build()
    >>> peak.growth  # bytes above what was resident when the block began
"""

from __future__ import annotations

import gc
import re
from types import TracebackType

_FIELD = re.compile(r"^(VmRSS|VmHWM):\s+(\d+) kB$", re.M)


def _status() -> dict[str, int]:
    with open("/proc/self/status") as fh:
        return {k: int(v) * 1024 for k, v in _FIELD.findall(fh.read())}


class PeakMemory:
    """``growth``: the peak resident bytes during the block minus the resident bytes at its start."""

    def __enter__(self) -> PeakMemory:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current VmRSS
        self._start = _status()["VmRSS"]
        self.growth = 0
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.growth = _status()["VmHWM"] - self._start
