"""Counting one process's rendezvous-store traffic: every operation, by kind and by the part of hora (or torch)
whose key it touches, with the bytes of its keys and values.

:class:`CountingStore` is a ``torch.distributed.Store`` written in Python that passes each call to the client it
wraps and counts it first. torch calls a Python store from C++ as well (Gloo's rendezvous reads each peer's
address through it), so torch's own operations are counted with hora's. ``hora bench control`` installs it in
every rank with :func:`hora.common.rendezvous.wrap_clients` before ``hora.init()``.

Example:
    >>> from torch.distributed import HashStore
    >>> tally = StoreTally("job1")
    >>> store = tally.wrap(HashStore())
    >>> store.set("hora/job1/g1/mesh/0", "10.0.0.5:4100")
    >>> store.get("hora/job1/g1/mesh/0")
    b'10.0.0.5:4100'
    >>> counts = tally.take()
    >>> counts.ops, counts.by_family()
    (2, {'mesh': 2})
"""

from __future__ import annotations

import datetime
import re
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = ["FAMILIES", "CountingStore", "StoreCounts", "StoreTally", "family"]

# Which part of the system a key belongs to: the first of these path segments found in it. torch's keys (its
# rendezvous, Gloo's and NCCL's) are all under the "default" prefix hora gives init_process_group.
FAMILIES = (("torch", "/default/"), ("arrival", "/arriv"), ("mesh", "/mesh/"), ("watch", "/watch/"), ("bell", "/bell/"),
            ("board", "/board/"), ("elastic", "/elastic/"), ("lost", "/lost"))


def family(key: str) -> str:
    """The part of the system a store key belongs to (``"other"`` when none of :data:`FAMILIES` matches).

    >>> family("hora/ab12/g1/default/0//cpu//0/3"), family("hora/ab12/elastic/ready/h1:0"), family("x")
    ('torch', 'elastic', 'other')
    """
    for name, marker in FAMILIES:
        if marker in key:
            return name
    return "other"


def _size(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, Sequence):  # torch passes some values as lists of ints
        return len(value)
    return 0


@dataclass
class StoreCounts:
    """Counts over a stretch of time: ``calls[(op, family)]`` operations, ``keys`` the keys they named (a
    ``check`` or ``wait`` names several in one operation), ``bytes_out`` / ``bytes_in`` what the keys and values
    weigh each way, ``patterns[(op, key with its numbers as #)]`` for a closer look."""

    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    keys: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    patterns: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def ops(self) -> int:
        return sum(self.calls.values())

    def by_family(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for (_, fam), n in self.calls.items():
            out[fam] += n
        return dict(sorted(out.items()))

    def by_op(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for (op, _), n in self.calls.items():
            out[op] += n
        return dict(sorted(out.items()))

    def as_dict(self) -> dict[str, Any]:
        return {"ops": self.ops, "keys": self.keys, "bytes_out": self.bytes_out, "bytes_in": self.bytes_in,
                "by_family": self.by_family(), "by_op": self.by_op(),
                "patterns": {f"{op} {pattern}": n for (op, pattern), n in sorted(self.patterns.items())}}


class StoreTally:
    """The counts of every store client one process wrapped (see :meth:`wrap`); thread-safe.

    Args:
        job_id: written as ``<job>`` in the key patterns, so that patterns of different jobs compare.
    """

    def __init__(self, job_id: str = "") -> None:
        self._job = job_id
        self._lock = threading.Lock()
        self._counts = StoreCounts()
        self._made: list[CountingStore] = []  # torch's C++ holds only their C++ half: they live as long as this

    def wrap(self, client: dist.Store) -> CountingStore:
        """A store that counts into this tally and passes every call to ``client`` (it lives, and keeps its
        connection open, as long as this tally)."""
        store = CountingStore(client, self)
        self._made.append(store)
        return store

    def take(self) -> StoreCounts:
        """The counts since the last ``take()`` (or since this tally was made)."""
        with self._lock:
            counts, self._counts = self._counts, StoreCounts()
        return counts

    def count(self, op: str, keys: Iterable[str], bytes_out: int = 0, bytes_in: int = 0) -> None:
        keys = list(keys)
        first = keys[0] if keys else ""
        pattern = re.sub(r"\d+", "#", first.replace(self._job, "<job>") if self._job else first)
        with self._lock:
            c = self._counts
            c.calls[(op, family(first))] += 1
            c.patterns[(op, pattern)] += 1
            c.keys += len(keys)
            c.bytes_out += bytes_out + sum(len(k.encode()) for k in keys)
            c.bytes_in += bytes_in


class CountingStore(dist.Store):
    """A store that counts each operation into a :class:`StoreTally` and then performs it on ``client``.
    Setting the timeout is local to the client and not counted."""

    def __init__(self, client: dist.Store, tally: StoreTally) -> None:
        super().__init__()
        self.client: Any = client  # torch's type stubs lack several of Store's methods
        self.tally = tally
        dist.Store.set_timeout(self, getattr(client, "timeout"))  # noqa: B009 - missing from torch's type stubs

    def set(self, key: str, value: Any) -> None:
        self.tally.count("set", [key], _size(value))
        self.client.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.client.get(key)
        self.tally.count("get", [key], bytes_in=len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        self.tally.count("add", [key], 8, 8)
        return self.client.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        value = self.client.compare_set(key, expected, desired)
        self.tally.count("compare_set", [key], _size(expected) + _size(desired), len(value))
        return value

    def delete_key(self, key: str) -> bool:
        self.tally.count("delete_key", [key])
        return self.client.delete_key(key)

    def num_keys(self) -> int:
        self.tally.count("num_keys", [])
        return self.client.num_keys()

    def check(self, keys: list[str]) -> bool:
        self.tally.count("check", keys)
        return self.client.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self.tally.count("wait", keys)
        if timeout is None:
            self.client.wait(keys)
        else:
            self.client.wait(keys, timeout)

    def append(self, key: str, value: Any) -> None:
        self.tally.count("append", [key], _size(value))
        self.client.append(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.client.multi_get(keys)
        self.tally.count("multi_get", keys, bytes_in=sum(len(v) for v in values))
        return values

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.tally.count("multi_set", keys, sum(_size(v) for v in values))
        self.client.multi_set(keys, values)

    def queue_push(self, key: str, value: Any) -> None:
        self.tally.count("queue_push", [key], _size(value))
        self.client.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        value = self.client.queue_pop(key, block)
        self.tally.count("queue_pop", [key], bytes_in=len(value))
        return value

    def queue_len(self, key: str) -> int:
        self.tally.count("queue_len", [key])
        return self.client.queue_len(key)

    def list_keys(self) -> list[str]:
        keys = self.client.list_keys()
        self.tally.count("list_keys", [], bytes_in=sum(len(k.encode()) for k in keys))
        return keys

    def has_extended_api(self) -> bool:
        return bool(self.client.has_extended_api())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        dist.Store.set_timeout(self, timeout)
        self.client.set_timeout(timeout)

    def clone(self) -> CountingStore:
        """A new connection to the same server, counted into the same tally."""
        return self.tally.wrap(self.client.clone())
