"""What one process holds and has sent, read from the kernel (Linux): its file descriptors by kind, its threads
by name (hora's, torch's and Gloo's C++ threads alike), its private memory, and for each TCP connection the
data segments and payload bytes it sent and received (``TCP_INFO``: exact, whatever code sent them).

``hora bench control`` takes a census of every rank before ``hora.init()``, after it and around the
negotiation rounds it measures; differences between two censuses are what happened in between.

Example:
    >>> before = take()
    >>> import socket
    >>> a, b = socket.socketpair()
    >>> take().diff(before).fds["unix"]
    2
"""

from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Census", "Traffic", "cpu_seconds", "take"]

# struct tcp_info (linux/tcp.h): tcpi_bytes_received, tcpi_data_segs_in, tcpi_data_segs_out, tcpi_bytes_sent
_BYTES_RECEIVED = struct.Struct("<Q"), 128
_DATA_SEGS = struct.Struct("<II"), 152
_BYTES_SENT = struct.Struct("<Q"), 200
_TCP_INFO_LEN = 208


@dataclass(frozen=True)
class Traffic:
    """Data segments (TCP packets carrying data; a small message is one) and payload bytes, each way."""

    segs_out: int = 0
    segs_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.segs_out + other.segs_out, self.segs_in + other.segs_in,
                       self.bytes_out + other.bytes_out, self.bytes_in + other.bytes_in)

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.segs_out - other.segs_out, self.segs_in - other.segs_in,
                       self.bytes_out - other.bytes_out, self.bytes_in - other.bytes_in)

    def as_dict(self) -> dict[str, int]:
        return {"segs_out": self.segs_out, "segs_in": self.segs_in, "bytes_out": self.bytes_out,
                "bytes_in": self.bytes_in}


@dataclass
class Census:
    """A process's descriptors and threads at one moment.

    ``fds``: counts by kind (``tcp-peer`` a connection to anything but the store ports, ``tcp-store``,
    ``tcp-listen``, ``unix``, ``epoll``, ``pipe``, ``eventfd``, ``file``, ``other``); ``threads``: counts by
    the kernel's name (``comm``: torch's and Gloo's C++ threads by theirs, every Python thread as the
    interpreter's), ``py_threads``: the Python threads by their names; ``tcp``: each TCP connection's kind and
    traffic so far, by socket inode; ``private_kb``: private resident memory."""

    fds: Counter[str] = field(default_factory=Counter)
    threads: Counter[str] = field(default_factory=Counter)
    py_threads: Counter[str] = field(default_factory=Counter)
    tcp: dict[int, tuple[str, Traffic]] = field(default_factory=dict)
    private_kb: int = 0

    def traffic(self, kind: str = "tcp-peer", since: Census | None = None) -> Traffic:
        """The traffic of this census's ``kind`` connections, less what ``since`` saw on the same ones
        (connections that ``since`` did not have count in full)."""
        total = Traffic()
        for inode, (k, t) in self.tcp.items():
            if k == kind:
                old = since.tcp.get(inode) if since is not None else None
                total = total + (t - old[1] if old is not None else t)
        return total

    def talked(self, kind: str = "tcp-peer", since: Census | None = None) -> int:
        """How many of this census's ``kind`` connections carried data since ``since``."""
        count = 0
        for inode, (k, t) in self.tcp.items():
            if k == kind:
                old = since.tcp.get(inode) if since is not None else None
                moved = t - old[1] if old is not None else t
                count += int(moved.segs_out > 0 or moved.segs_in > 0)
        return count

    def diff(self, before: Census) -> Census:
        """What this census holds beyond ``before`` (descriptors and threads; counts may go negative)."""
        fds, threads, py_threads = Counter(self.fds), Counter(self.threads), Counter(self.py_threads)
        fds.subtract(before.fds)
        threads.subtract(before.threads)
        py_threads.subtract(before.py_threads)
        new = {i: v for i, v in self.tcp.items() if i not in before.tcp}
        return Census(fds, threads, py_threads, new, self.private_kb - before.private_kb)

    def as_dict(self) -> dict[str, Any]:
        return {"fds": {k: v for k, v in sorted(self.fds.items()) if v}, "fds_total": sum(self.fds.values()),
                "threads": {k: v for k, v in sorted(self.threads.items()) if v},
                "threads_total": sum(self.threads.values()),
                "py_threads": {k: v for k, v in sorted(self.py_threads.items()) if v}, "private_kb": self.private_kb}


def take(store_ports: Collection[int] = ()) -> Census:
    """This process's census now; TCP connections whose remote port is in ``store_ports`` count as
    ``tcp-store``."""
    py_threads = Counter(re.sub(r"[-_]?\d+$", "", t.name) for t in threading.enumerate())
    census = Census(threads=_threads(), py_threads=py_threads, private_kb=_private_kb())
    for fd, target in _fds():
        kind = _kind(target)
        if kind == "socket":
            inode = int(target[8:-1])
            kind, traffic = _socket(fd, store_ports)
            if traffic is not None:
                census.tcp[inode] = (kind, traffic)
        census.fds[kind] += 1
    return census


def cpu_seconds() -> float:
    """CPU time of this process, every thread, user and system."""
    return time.process_time()


def _fds() -> Iterable[tuple[int, str]]:
    for name in os.listdir("/proc/self/fd"):
        try:
            yield int(name), os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue


def _kind(target: str) -> str:
    if target.startswith("socket:["):
        return "socket"
    if target.startswith("pipe:"):
        return "pipe"
    if target.startswith("anon_inode:"):
        name = target[len("anon_inode:"):].strip("[]")
        return "epoll" if name == "eventpoll" else name if name in ("eventfd",) else "other"
    return "file" if target.startswith("/") else "other"


def _socket(fd: int, store_ports: Collection[int]) -> tuple[str, Traffic | None]:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return "other", None
    try:
        if sock.family == socket.AF_UNIX:
            return "unix", None
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return "other", None
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return "tcp-listen", None
        try:
            remote = sock.getpeername()[1]
        except OSError:  # not connected (yet, or any more)
            return "tcp-peer", None
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        if len(raw) < _TCP_INFO_LEN:  # a kernel older than 4.19 lacks the byte counts
            return "tcp-peer", None
        segs_in, segs_out = _DATA_SEGS[0].unpack_from(raw, _DATA_SEGS[1])
        traffic = Traffic(segs_out, segs_in, _BYTES_SENT[0].unpack_from(raw, _BYTES_SENT[1])[0],
                          _BYTES_RECEIVED[0].unpack_from(raw, _BYTES_RECEIVED[1])[0])
        return ("tcp-store" if remote in store_ports else "tcp-peer"), traffic
    finally:
        sock.close()  # the duplicate only


def _threads() -> Counter[str]:
    names: Counter[str] = Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[re.sub(r"\d+$", "#", f.read().strip())] += 1
        except OSError:
            continue
    return names


def _private_kb() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return 0
    return sum(int(m) for m in re.findall(r"^Private_(?:Clean|Dirty):\s+(\d+) kB", text, re.M))
