"""What ``hora bench`` prints and writes: sizes in and out, a progress bar on rank 0, a Markdown table,
JSON, and a PNG plot when matplotlib is installed.

Example:
    >>> parse_sizes("1KB..16KB")
    [1024, 4096, 16384]
    >>> parse_sizes("1MB,64MB")
    [1048576, 67108864]
    >>> human_bytes(4 * 1024 * 1024)
    '4 MB'
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from hora.errors import ConfigError

log = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024**2, "MB": 1024**2, "MIB": 1024**2,
          "G": 1024**3, "GB": 1024**3, "GIB": 1024**3}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """``"4MB"`` -> 4194304 (powers of 1024, as nccl-tests count)."""
    m = _SIZE.match(text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"size {text!r}: write a number with an optional unit, e.g. 4KB, 16MB, 1GB")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_sizes(text: str, factor: int = 4) -> list[int]:
    """``"1KB..256MB"`` (every ``factor``-th power between the ends, both included) or ``"1MB,4MB"``."""
    if ".." in text:
        lo_text, hi_text = text.split("..", 1)
        lo, hi = parse_size(lo_text), parse_size(hi_text)
        if lo <= 0 or hi < lo:
            raise ConfigError(f"--sizes {text}: the range must run from a positive size up to a larger one")
        sizes = []
        size = lo
        while size < hi:
            sizes.append(size)
            size *= factor
        return [*sizes, hi]
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) <= 0:
        raise ConfigError(f"--sizes {text}: give positive sizes, e.g. 1KB..256MB or 1MB,16MB")
    return sizes


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} GB"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


NOISY_SPREAD = 0.25  # samples spread wider than this around their median: the figure is not one to quote


def noisy_mark(*spreads: float) -> str:
    """``" *"`` for a figure whose samples (any of ``spreads``) spread wider than :data:`NOISY_SPREAD`."""
    return " *" if any(s > NOISY_SPREAD for s in spreads) else ""


def noise_warning(marked: int, total: int) -> str:
    """The line under a table with ``marked`` noisy rows of ``total`` (empty when none is)."""
    if not marked:
        return ""
    which = "every row" if marked == total else f"{marked} of {total} rows"
    return (f"\nwarning: too noisy to quote: {which} (marked *) spread more than {NOISY_SPREAD:.0%} around "
            "the median, because other work shares the machine or the samples are too few; rerun on a quiet "
            "machine, or with more --repeats\n")


class Progress:
    """A one-line progress bar on stderr (rank 0 only; other ranks pass ``enabled=False``).

    On a terminal it redraws in place; through ``hora run``'s pipes (or any non-terminal) it prints a line
    at most every few seconds, so a log stays short.
    """

    def __init__(self, total: int, label: str, enabled: bool, stream: TextIO | None = None,
                 width: int = 30, every_s: float = 5.0) -> None:
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width, self.every_s = width, every_s
        self.done = 0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = 0.0
        self._start = time.monotonic()

    def step(self, what: str = "", n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if not self.enabled:
            return
        now = time.monotonic()
        if not self._tty and now - self._last < self.every_s and self.done < self.total:
            return
        self._last = now
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"{self.label} [{bar}] {self.done}/{self.total} {what} ({now - self._start:.0f} s)"
        self.stream.write(("\r" + text + "\x1b[K") if self._tty else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()


def write_json(path: str | Path, data: Any) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return out


def write_plot(path: str | Path, draw: Callable[[Any], None], size: tuple[float, float] = (8, 5)) -> Path | None:
    """Draw into a new matplotlib figure and save it as PNG; None (and a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("--plot %s: matplotlib is not installed (pip install matplotlib); no plot written", path)
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = plt.figure(figsize=size)
    draw(fig)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
