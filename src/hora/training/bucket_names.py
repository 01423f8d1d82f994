"""Collective names of a DistributedOptimizer's gradient buckets, the same on every rank.

A name must say *which* collective it is in terms every rank shares, never how many objects a process
happened to build before: a rank that builds one extra optimizer (an EMA copy, an evaluation model) must not
shift its names against its peers'. So the prefix is a fingerprint of what every rank's optimizer has in
common (its parameters' names, in order, and the process set's ranks), fixed at the optimizer's first step:

    hora.opt.<fingerprint>.g<generation>.bucket.<index>

``generation`` counts re-plans (parameters starting or stopping to require grad, a resized process set).
Names belong to one world: after ``shutdown()``/``init()`` (an elastic reset) the prefix is taken afresh
from the new world's ranks, as a worker that joined at that reset takes it.
Two optimizers *used* in one process with the same fingerprint (two copies of one model) get ``.1``, ``.2``
... in the order of their first step, which every rank follows. One that is built and never stepped claims
nothing.

Example:
    >>> names = BucketNames(["fc.weight", "fc.bias"], ranks=lambda: [0, 1])
    >>> names.bucket(0, 3)  # doctest: +ELLIPSIS
    'hora.opt....g0.bucket.3'
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence

PREFIX = "hora.opt"
_lock = threading.Lock()
_claimed: dict[tuple[int, str], int] = {}  # (world, fingerprint) -> how many optimizers of this process used it


def fingerprint(names: Sequence[str], ranks: Sequence[int]) -> str:
    """A short digest of the parameter names and the process set's ranks (equal on every rank)."""
    text = "\n".join(names) + "\n@" + ",".join(map(str, ranks))
    return hashlib.blake2b(text.encode(), digest_size=5).hexdigest()


class BucketNames:
    """Names one optimizer's buckets; the prefix is claimed at the first name asked for.

    Args:
        names: the parameters' names, in the optimizer's order.
        ranks: the process set's ranks, read at the first step (the set may be registered after the optimizer
            is built).
        world: the number of the world (``init()``) names are asked in; a new one takes the prefix afresh.
    """

    def __init__(self, names: Sequence[str], ranks: Callable[[], Sequence[int]],
                 world: Callable[[], int] = lambda: 0) -> None:
        self._names = tuple(names)
        self._ranks = ranks
        self._world = world
        self._prefix: str | None = None
        self._prefix_world = 0

    @property
    def prefix(self) -> str:
        """``hora.opt.<fingerprint>`` (``.<n>`` for the n-th further optimizer with the same fingerprint)."""
        world = self._world()
        if self._prefix is None or world != self._prefix_world:
            digest = fingerprint(self._names, self._ranks())
            with _lock:
                n = _claimed.get((world, digest), 0)
                _claimed[(world, digest)] = n + 1
            self._prefix = f"{PREFIX}.{digest}" + (f".{n}" if n else "")
            self._prefix_world = world
        return self._prefix

    def bucket(self, generation: int, index: int) -> str:
        """The name of bucket ``index`` of plan ``generation``."""
        return f"{self.prefix}.g{generation}.bucket.{index}"
