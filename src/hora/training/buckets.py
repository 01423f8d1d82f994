"""Gradient buckets for :class:`hora.DistributedOptimizer`: planning (pure), their names, reused flat buffers.

A plan groups parameters into buckets the way DDP does: in reverse registration order (roughly the order
backward produces their gradients), one bucket per (dtype, device) at a time, the first one small
(``first_cap_bytes``, so communication starts early in backward) and the rest up to ``cap_bytes``.
Parameters given an explicit group (Horovod's ``groups``/``num_groups``) share one bucket per group.
Every rank computes the same plan from the same parameter list, so bucket ``i`` names the same
collective everywhere.

A bucket's collective name (:class:`BucketNames`) must say *which* collective it is in terms every rank
shares, never how many objects a process happened to build before: a rank that builds one extra optimizer (an
EMA copy, an evaluation model) must not shift its names against its peers'. So the prefix is a fingerprint of
what every rank's optimizer has in common (its parameters' names, in order, and the process set's ranks),
fixed at the optimizer's first step:

    hora.opt.<fingerprint>.g<generation>.bucket.<index>

``generation`` counts re-plans (parameters starting or stopping to require grad, a resized process set).
Names belong to one world: after ``shutdown()``/``init()`` (an elastic reset) the prefix is taken afresh
from the new world's ranks, as a worker that joined at that reset takes it.
Two optimizers *used* in one process with the same fingerprint (two copies of one model) get ``.1``, ``.2``
... in the order of their first step, which every rank follows. One that is built and never stepped claims
nothing.

Example:
    >>> import torch
    >>> specs = [ParamSpec(i, 1000, torch.float32, torch.device("cpu")) for i in range(4)]
    >>> [b.params for b in plan_buckets(specs, first_cap_bytes=4000, cap_bytes=8000)]
    [(3,), (2, 1), (0,)]
    >>> names = BucketNames(["fc.weight", "fc.bias"], ranks=lambda: [0, 1])
    >>> names.bucket(0, 3)  # doctest: +ELLIPSIS
    'hora.opt....g0.bucket.3'
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What the planner needs to know about one parameter."""

    index: int  # position in the optimizer's flattened parameter list
    numel: int
    dtype: torch.dtype
    device: torch.device
    group: int = -1  # explicit group (``groups``/``num_groups``); -1 = none


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """One bucket: which parameters, where each sits in the flat buffer."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        return self.offsets[-1] + self.numels[-1] if self.params else 0


def _close(members: list[ParamSpec]) -> BucketPlan:
    offsets, total = [], 0
    for spec in members:
        offsets.append(total)
        total += spec.numel
    first = members[0]
    return BucketPlan(
        params=tuple(s.index for s in members),
        offsets=tuple(offsets),
        numels=tuple(s.numel for s in members),
        dtype=first.dtype,
        device=first.device,
    )


def plan_buckets(specs: Sequence[ParamSpec], first_cap_bytes: int, cap_bytes: int) -> tuple[BucketPlan, ...]:
    """Group parameters into buckets.

    Args:
        specs: parameters in registration order; they are bucketed in reverse.
        first_cap_bytes: size at which the first bucket of each (dtype, device) closes.
        cap_bytes: size at which later buckets close. ``0`` gives one bucket per parameter.

    Returns:
        Buckets in the order they closed, then the still-open ones; explicit groups come last, in
        order of first appearance. Deterministic for a given ``specs``.
    """
    done: list[BucketPlan] = []
    open_: dict[tuple[torch.dtype, torch.device], list[ParamSpec]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed_count: dict[tuple[torch.dtype, torch.device], int] = {}
    groups: dict[tuple[int, torch.dtype, torch.device], list[ParamSpec]] = {}
    for spec in reversed(specs):
        if spec.group >= 0:
            groups.setdefault((spec.group, spec.dtype, spec.device), []).append(spec)
            continue
        key = (spec.dtype, spec.device)
        members = open_.setdefault(key, [])
        members.append(spec)
        open_bytes[key] = open_bytes.get(key, 0) + spec.numel * spec.dtype.itemsize
        limit = first_cap_bytes if closed_count.get(key, 0) == 0 else cap_bytes
        if open_bytes[key] >= limit:
            done.append(_close(members))
            closed_count[key] = closed_count.get(key, 0) + 1
            open_[key], open_bytes[key] = [], 0
    done.extend(_close(m) for m in open_.values() if m)
    done.extend(_close(m) for m in groups.values())
    return tuple(done)


def split_groups(num_params: int, num_groups: int) -> list[int]:
    """Horovod's ``num_groups``: split ``num_params`` parameters into that many contiguous groups.

    Returns the group index of each parameter (earlier groups get the extra one, as Horovod's
    ``split_list`` does).
    """
    if num_groups <= 0:
        return [-1] * num_params
    base, extra = divmod(num_params, num_groups)
    out: list[int] = []
    for g in range(num_groups):
        out.extend([g] * (base + (1 if g < extra else 0)))
    return out


class FlatBucket:
    """A bucket's flat buffer, allocated once and reused every step, plus its per-step state.

    ``views[k]`` is the slice of the buffer that holds parameter ``plan.params[k]``'s gradient.
    """

    __slots__ = ("buffer", "ctx", "handle", "name", "pending", "plan", "views", "wire")

    def __init__(self, plan: BucketPlan, name: str, wire_dtype: torch.dtype) -> None:
        self.plan = plan
        self.name = name
        # (numel,) in the dtype that crosses the wire: a cast compressor casts on the copy in.
        self.buffer = torch.zeros(plan.numel, dtype=wire_dtype, device=plan.device)
        self.views = [self.buffer.narrow(0, o, n) for o, n in zip(plan.offsets, plan.numels)]
        self.pending = len(plan.params)
        self.handle: object | None = None
        self.ctx: object | None = None
        self.wire: torch.Tensor | None = None  # what was handed to allreduce (the buffer or a compressed copy)

    def reset(self) -> None:
        self.pending = len(self.plan.params)
        self.handle = None
        self.ctx = None
        self.wire = None

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
