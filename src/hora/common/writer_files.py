"""Files and directories written under a temporary name that says who writes them, then renamed into place.

A checkpoint is written as ``.<final name>.tmp.<host>.<pid>`` (:func:`writer_id`) and renamed to its final name
only once complete, so a reader never sees a torn one. A writer that dies mid-way (a SIGKILL, a lost node)
leaves its temporary behind; :func:`is_stale` tells such leftovers from a live writer's: on the same host, the
process is gone (or a younger process has its pid); from another host, or named by pid alone, the entry has not
changed for :data:`STALE_AFTER_S`.

Example:
    >>> name = f".ckpt-000000003.pt.tmp.{writer_id()}"
    >>> is_stale(name.rsplit(".", 2)[-2], os.getpid(), time.time())
    False
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path
from typing import IO, Any

STALE_AFTER_S = 3600.0  # a temporary from another host untouched this long belongs to a dead writer


def writer_id() -> str:
    """This process as a temporary name's suffix: ``<host>.<pid>``."""
    host = re.sub(r"[^A-Za-z0-9_-]+", "-", socket.gethostname()) or "host"
    return f"{host}.{os.getpid()}"


def is_stale(host: str | None, pid: int, changed: float, stale_after_s: float = STALE_AFTER_S) -> bool:
    """Whether the temporary of writer ``<host>.<pid>``, last changed at ``changed`` (wall clock), is a dead
    writer's leftover."""
    if host == writer_id().rsplit(".", 1)[0]:
        return not alive_since(pid, changed)
    return time.time() - changed > stale_after_s


def dead_writers_temporaries(directory: str | os.PathLike[str], pattern: re.Pattern[str]) -> list[Path]:
    """The entries of ``directory`` named by ``pattern`` (with groups ``host`` and ``pid``) whose writer is dead
    (:func:`is_stale`); none when the directory cannot be listed. The caller removes them."""
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    dead = []
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None:
            continue
        try:
            changed = entry.stat().st_mtime
        except OSError:
            continue  # gone meanwhile (renamed into place)
        if is_stale(m.group("host"), int(m.group("pid")), changed):
            dead.append(entry)
    return dead


def alive_since(pid: int, changed: float) -> bool:
    """Process ``pid`` exists and started before ``changed`` (a wall-clock time), so it may be that file's writer."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as fh:
            boot = next(float(line.split()[1]) for line in fh if line.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields[0] in ("Z", "X"):
        return False
    started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return started <= changed + 1.0  # start times are in clock ticks, boot time in seconds


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename in ``directory`` durable (best effort: some filesystems do not open directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class RememberingFile:
    """A binary file (any attribute passes through) that remembers the OSError its ``write`` raised: ``torch.save``
    reports a failed write (a full disk) as its own ``RuntimeError`` ("unexpected pos ..."); the caller raises
    :attr:`error` instead, which says what happened."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)
