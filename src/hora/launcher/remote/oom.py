"""Was a worker killed by the kernel's out-of-memory killer? The agent asks when a worker dies of SIGKILL.

A rank the OOM killer ends looks like any SIGKILL from outside. Two places tell: the kernel log (``/dev/kmsg``,
readable by root unless ``dmesg_restrict``), whose "Killed process <pid>" record names the exact process and
the memory cgroup whose limit was hit; and the worker's memory cgroup, whose ``oom_kill`` counter (cgroup v2
``memory.events``, v1 ``memory.oom_control``) goes up with every kill in it. The cgroup is read when the worker
starts and every few seconds after (a dead process's cgroup can no longer be read), and its limit is the
smallest ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1) from it up to the hierarchy's root.

Standard library only (the agent imports this).

Example:
    >>> watch = OomWatch()
    >>> watch.track(os.getpid())
    >>> watch.explain(os.getpid()) is None  # this process was not OOM-killed
    True
"""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_UNLIMITED = 1 << 60  # v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages)
_KILLED = re.compile(r"Killed process (\d+) \(")
_CONSTRAINT = re.compile(r"oom-kill:constraint=(\w+),.*?(?:oom_memcg=([^,]*),)?.*?,pid=(\d+),")


@dataclass(frozen=True)
class MemoryCgroup:
    """A memory cgroup on disk: its directory, the hierarchy's mount point, and which cgroup version."""

    path: str
    mount: str  # where the hierarchy is mounted
    root: str  # the cgroup the mount shows at its top ("/" unless in a cgroup namespace)
    v2: bool

    def oom_kills(self) -> int:
        """How many processes the OOM killer has killed in this cgroup (and below it)."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            with open(os.path.join(self.path, name)) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def limit_mb(self) -> int | None:
        """The memory limit that applies here (the smallest from this cgroup up to the root), in MB."""
        name = "memory.max" if self.v2 else "memory.limit_in_bytes"
        limits = []
        here, top = os.path.normpath(self.path), os.path.normpath(self.mount)
        while True:
            try:
                with open(os.path.join(here, name)) as fh:
                    text = fh.read().strip()
                if text.isdigit() and int(text) < _UNLIMITED:
                    limits.append(int(text))
            except OSError:
                pass
            parent = os.path.dirname(here)
            if here == top or parent == here or not parent.startswith(top):
                break
            here = parent
        return round(min(limits) / (1 << 20)) if limits else None

    def at(self, cgroup: str) -> MemoryCgroup:
        """Another cgroup of the same hierarchy, by its name in the kernel's words (``/kubepods/pod1``)."""
        return MemoryCgroup(_on_disk(cgroup, self.root, self.mount), self.mount, self.root, self.v2)


def _mounts() -> dict[str, tuple[str, str]]:
    """The memory controller's hierarchies: ``"v1"``/``"v2"`` -> (mount root, mount point)."""
    found: dict[str, tuple[str, str]] = {}
    try:
        with open("/proc/self/mountinfo") as fh:
            lines = fh.readlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup2" and "v2" not in found:
            found["v2"] = (fields[3], fields[4])
        elif fstype == "cgroup" and "memory" in options and "v1" not in found:
            found["v1"] = (fields[3], fields[4])
    return found


def _on_disk(cgroup: str, root: str, mount: str) -> str:
    rel = cgroup[len(root):] if root != "/" and cgroup.startswith(root) else cgroup
    return os.path.join(mount, rel.lstrip("/"))


def memory_cgroup(pid: int) -> MemoryCgroup | None:
    """The memory cgroup of process ``pid`` (v1's memory controller, else v2's unified hierarchy)."""
    try:
        with open(f"/proc/{pid}/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    mounts = _mounts()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and "v1" in mounts:
            root, mount = mounts["v1"]
            return MemoryCgroup(_on_disk(path, root, mount), mount, root, v2=False)
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "" and "v2" in mounts:
            root, mount = mounts["v2"]
            where = _on_disk(path, root, mount)
            if os.path.exists(os.path.join(where, "memory.events")):
                return MemoryCgroup(where, mount, root, v2=True)
    return None


def _kernel_log(pid: int) -> tuple[str, str] | None:
    """``(constraint, memory cgroup)`` from the kernel log's record of the OOM killer killing ``pid``, if the log
    is readable and has it (``("CONSTRAINT_MEMCG", "/kubepods/...")``; a machine-wide OOM: ``CONSTRAINT_NONE``)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    constraint: tuple[str, str] | None = None
    killed = False
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while reading: go on with the next
                    continue
                break
            text = record.partition(";")[2]
            found = _CONSTRAINT.search(text)
            if found and int(found.group(3)) == pid:
                constraint = (found.group(1), found.group(2) or "")
            found_kill = _KILLED.search(text)
            if found_kill and int(found_kill.group(1)) == pid:
                killed = True
    finally:
        os.close(fd)
    if not killed:
        return None
    return constraint or ("", "")


@dataclass
class OomWatch:
    """The memory cgroups of one agent's workers and their OOM kill counters (see the module docstring)."""

    cgroups: dict[int, MemoryCgroup | None] = field(default_factory=dict)  # by worker pid
    seen: dict[str, int] = field(default_factory=dict)  # cgroup path -> the kills already accounted for

    def track(self, pid: int) -> None:
        """Note (again) which memory cgroup worker ``pid`` is in."""
        cg = memory_cgroup(pid)
        if cg is None:
            if pid not in self.cgroups:
                self.cgroups[pid] = None
            return
        self.cgroups[pid] = cg
        if cg.path not in self.seen:
            self.seen[cg.path] = cg.oom_kills()

    def explain(self, pid: int) -> str | None:
        """For a worker that died of SIGKILL: ``"killed by the kernel's out-of-memory killer (cgroup limit 512
        MB)"`` when it was the OOM killer, else None."""
        cg = self.cgroups.get(pid)
        found = _kernel_log(pid)
        if found is not None:
            constraint, memcg = found
            if constraint == "CONSTRAINT_NONE":
                return "killed by the kernel's out-of-memory killer (the machine ran out of memory)"
            self._account(cg)  # the kill is this worker's: the counter must not give it to another one
            return _words(cg.at(memcg) if memcg and cg is not None else cg)
        if cg is None:
            return None
        now = cg.oom_kills()
        if now > self.seen.get(cg.path, now):
            self.seen[cg.path] += 1
            return _words(cg)
        return None

    def _account(self, cg: MemoryCgroup | None) -> None:
        if cg is not None and cg.path in self.seen and cg.oom_kills() > self.seen[cg.path]:
            self.seen[cg.path] += 1


def _words(cg: MemoryCgroup | None) -> str:
    limit = cg.limit_mb() if cg is not None else None
    where = f"cgroup limit {limit} MB" if limit is not None else "a memory cgroup limit"
    return f"killed by the kernel's out-of-memory killer ({where})"
