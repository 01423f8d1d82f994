"""The output paths of a running job: a second job started with the same ones is refused, not mixed in.

``--output-filename DIR`` and ``--timeline-filename FILE`` name paths two jobs could share by mistake (the same
command started twice). While a job runs it holds an exclusive ``flock`` on a lock file for each
(``DIR/.hora-job.lock``; ``.FILE.hora-job.lock`` next to the timeline), with who holds it written inside. A
second job that finds one held stops before anything starts, naming the job that holds it. The kernel drops a
``flock`` when its process ends however it ends, so a killed launcher leaves nothing that blocks the next job;
the lock file is removed when the job ends. A job started after the first one ended writes where it did, as
horovodrun does (its logs replace the earlier job's). On a full disk (or quota) the job still runs: one
warning names the file that could not be written, and the lock is held without its record, or not at all.

Example:
    >>> held = OutputLock.hold(lock_paths("/tmp/logs", None), "ab12")  # doctest: +SKIP
    >>> held.release()  # doctest: +SKIP
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from hora.errors import SetupError
from hora.launcher import output

log = logging.getLogger(__name__)

LOCK_NAME = ".hora-job.lock"


def lock_paths(output_dir: str | None, timeline: str | None) -> list[tuple[str, str, str]]:
    """``(flag, path, lock file)`` for each output path a job writes."""
    found = []
    if output_dir:
        found.append(("--output-filename", output_dir, os.path.join(output_dir, LOCK_NAME)))
    if timeline:
        folder, name = os.path.split(os.path.abspath(timeline))
        found.append(("--timeline-filename", timeline, os.path.join(folder, f".{name}{LOCK_NAME}")))
    return found


@dataclass
class OutputLock:
    """The locks one job holds (see the module docstring)."""

    held: list[tuple[int, str]] = field(default_factory=list)  # (fd, lock file)

    @classmethod
    def hold(cls, paths: Sequence[tuple[str, str, str]], job_id: str) -> OutputLock:
        """Lock every ``(flag, path, lock file)`` for job ``job_id``.

        Raises:
            SetupError: (exit code 2) another running job holds one of them; nothing stays locked.
        """
        lock = cls()
        try:
            for flag, path, lock_file in paths:
                try:
                    os.makedirs(os.path.dirname(lock_file), exist_ok=True)
                except OSError as exc:
                    if full(exc):
                        output.note(f"warning: {flag} {path}: cannot create {os.path.dirname(lock_file)} "
                                    f"({exc.strerror}); the job runs without it, the console output goes on")
                        continue
                    raise SetupError(f"{flag} {path}: cannot create {os.path.dirname(lock_file)} "
                                     f"({exc.strerror or exc}); give a writable path") from None
                fd = _acquire(lock_file)
                if fd is None:
                    raise SetupError(f"{flag} {path}: {_holder(lock_file)} is writing there; two jobs would "
                                     "overwrite each other's files. Give this job another path, or wait for that "
                                     "job to end")
                if fd >= 0:
                    lock.held.append((fd, lock_file))
                    _record(fd, lock_file, job_id)
        except BaseException:
            lock.release()
            raise
        return lock

    def release(self) -> None:
        """Remove the lock files and drop the locks (the removal comes first, under the lock: see ``_acquire``)."""
        for fd, lock_file in self.held:
            try:
                os.unlink(lock_file)
            except OSError:
                pass
            os.close(fd)
        self.held.clear()


def full(exc: OSError) -> bool:
    """Whether ``exc`` says a filesystem is full (or a quota is spent): what a job survives with a warning."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _record(fd: int, lock_file: str, job_id: str) -> None:
    """Write who holds the lock into it; on a full disk the lock holds without it (one warning)."""
    record = json.dumps({"job": job_id, "pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
    try:
        os.ftruncate(fd, 0)
        os.write(fd, record.encode())
    except OSError as exc:
        if not full(exc):
            raise
        output.note(f"warning: cannot write {lock_file} ({exc.strerror}): its filesystem is full; the job runs, and "
                    "a second job started with the same path is still refused (without naming this one)")


def _acquire(lock_file: str) -> int | None:
    """The locked file's descriptor; None when another process holds it; -1 when the filesystem cannot lock
    (the job goes on unprotected)."""
    while True:
        try:
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            log.debug("cannot create %s: %s", lock_file, exc)
            return -1
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:  # e.g. ENOLCK, EOPNOTSUPP on some network filesystems
            os.close(fd)
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                log.debug("cannot lock %s: %s", lock_file, exc)
            return -1
        try:  # the holder removes the file before it lets go: a lock on a removed file is no lock
            if os.stat(lock_file).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _holder(lock_file: str) -> str:
    """Who holds ``lock_file``, in words: ``job 3fa2c1 (hora run, pid 412 on host node1, started 14:02:11)``."""
    try:
        with open(lock_file) as fh:
            info = json.loads(fh.read() or "{}")
        started = time.strftime("%H:%M:%S", time.localtime(float(info["started"])))
        return f"job {info['job']} (hora run, pid {info['pid']} on host {info['host']}, started {started})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another running job"
