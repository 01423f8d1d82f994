"""This process's peak resident memory over a stretch of code (Linux): the kernel's high-water mark, reset first
(benchmarks/large_model_start.py, and the tests that show a start holds its weights once).

Example:
    >>> with PeakMemory() as peak:  # doctest: +SKIP
    ...     model = build()
    >>> peak.growth  # bytes above what was resident when the block began
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
from types import TracebackType

_FIELD = re.compile(r"^(VmRSS|VmHWM):\s+(\d+) kB$", re.M)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _fresh_heap() -> None:
    """Make large allocations show in the resident size: glibc raises its mmap threshold after large frees (up to
    32 MiB) and then serves them from heap memory still resident from earlier tests, which no high-water mark sees.
    Fix the threshold at its 128 KiB default and hand the free heap back to the kernel."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    libc.malloc_trim(0)


def _status() -> dict[str, int]:
    with open("/proc/self/status") as fh:
        return {k: int(v) * 1024 for k, v in _FIELD.findall(fh.read())}


class PeakMemory:
    """``growth``: the peak resident bytes during the block minus the resident bytes at its start."""

    def __enter__(self) -> PeakMemory:
        gc.collect()
        _fresh_heap()
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current VmRSS
        self._start = _status()["VmRSS"]
        self.growth = 0
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.growth = _status()["VmHWM"] - self._start
