"""Which rank owns each parameter's optimizer state, and how the parameters are laid out by owner (pure).

``DistributedOptimizer(sharding=...)`` partitions *whole* parameters among the members of the process set
(torch's ``ZeroRedundancyOptimizer`` does the same), never flat slices of them: each parameter is stepped by
exactly one rank with the real optimizer, so an optimizer whose update depends on a parameter's shape
(Adafactor's row and column statistics) stays exact. The partition is balanced bucket by bucket: the
parameters are grouped as the gradient buckets are (:func:`hora.training.buckets.plan_buckets`: reverse
registration order, the same caps), and inside each bucket the largest parameter goes first to the member with
the least of that bucket, ties to the member with the least overall, then the lowest index. So every bucket's
owners hold nearly equal segments, and over the whole model each member owns about ``1/n`` of the bytes.

A :class:`ShardLayout` then lays a bucket out *by owner*: member 0's parameters, then member 1's ..., so that
each member's part of the bucket is one contiguous segment (what one broadcast from that member, or one
reduce-scatter slice, carries). ``padded=True`` gives every segment the length of the largest (a
reduce-scatter's equal slices).

Example:
    >>> import torch
    >>> specs = [ParamSpec(i, n, torch.float32, torch.device("cpu")) for i, n in enumerate([6, 2, 3, 1])]
    >>> owners = assign_owners(specs, 2, first_cap_bytes=1 << 20, cap_bytes=1 << 20)
    >>> owners
    (0, 1, 1, 1)
    >>> lay = layout(plan_buckets(specs, 1 << 20, 1 << 20)[0], owners, 2)
    >>> lay.params, lay.segments
    ((0, 3, 2, 1), ((0, 6), (6, 12)))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hora.training.buckets import BucketPlan, ParamSpec, plan_buckets


def assign_owners(specs: Sequence[ParamSpec], size: int, first_cap_bytes: int, cap_bytes: int) -> tuple[int, ...]:
    """The owning member (0 .. ``size``-1) of each parameter, indexed by ``ParamSpec.index``.

    ``specs`` lists every parameter of the optimizer (``index`` runs over 0 .. len-1); the same ``specs``,
    ``size`` and caps give the same answer on every rank.
    """
    if size < 1:
        raise ValueError(f"a partition needs at least one member, got {size}")
    owners = [0] * len(specs)
    total = [0] * size  # bytes each member owns so far
    for bucket in plan_buckets(specs, first_cap_bytes, cap_bytes):
        here = [0] * size
        itemsize = bucket.dtype.itemsize
        ranked = sorted(zip(bucket.params, bucket.numels), key=lambda pn: (-pn[1], pn[0]))
        for index, numel in ranked:
            member = min(range(size), key=lambda m: (here[m], total[m], m))
            owners[index] = member
            here[member] += numel
            total[member] += numel * itemsize
    return tuple(owners)


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """One bucket laid out by owner: ``params[k]`` (owned by member ``owners[k]``) sits at ``offsets[k]``
    (``numels[k]`` elements) of a flat buffer of ``numel`` elements; ``segments[m]`` is member ``m``'s
    (start, stop) in it (start == stop where the member owns nothing of this bucket)."""

    params: tuple[int, ...]
    owners: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    segments: tuple[tuple[int, int], ...]
    numel: int
    dtype: torch.dtype
    device: torch.device


def layout(plan: BucketPlan, owners: Sequence[int], size: int, padded: bool = False) -> ShardLayout:
    """``plan``'s parameters grouped by owner (in bucket order within each owner), one segment per member.

    Args:
        plan: a bucket from :func:`~hora.training.buckets.plan_buckets`.
        owners: the owner of every parameter (:func:`assign_owners`), indexed by parameter index.
        size: the number of members.
        padded: every segment as long as the longest (equal reduce-scatter slices); else back to back.
    """
    by_member: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    for index, numel in zip(plan.params, plan.numels):
        by_member[owners[index]].append((index, numel))
    loads = [sum(n for _, n in members) for members in by_member]
    width = max(loads) if loads else 0
    params, members_of, offsets, numels, segments = [], [], [], [], []
    cursor = 0
    for m, members in enumerate(by_member):
        start = m * width if padded else cursor
        cursor = start
        for index, numel in members:
            params.append(index)
            members_of.append(m)
            offsets.append(cursor)
            numels.append(numel)
            cursor += numel
        segments.append((start, start + loads[m]))
    total = width * size if padded else cursor
    return ShardLayout(tuple(params), tuple(members_of), tuple(offsets), tuple(numels), tuple(segments), total,
                       plan.dtype, plan.device)
