"""Who owns each parameter's optimizer state, and buckets laid out by owner (hora.training.shard_plan)."""

from __future__ import annotations

import torch

from hora.training.buckets import ParamSpec, plan_buckets
from hora.training.shard_plan import assign_owners, layout

CPU = torch.device("cpu")


def specs(numels: list[int], dtype: torch.dtype = torch.float32) -> list[ParamSpec]:
    return [ParamSpec(i, n, dtype, CPU) for i, n in enumerate(numels)]


def loads(numels: list[int], owners: tuple[int, ...], size: int) -> list[int]:
    out = [0] * size
    for n, o in zip(numels, owners):
        out[o] += n
    return out


def test_each_member_owns_about_an_equal_share() -> None:
    numels = [4096, 4096, 64, 1024, 1024, 64, 512, 512, 8, 300, 300, 10] * 4
    for size in (2, 3, 4, 8):
        owners = assign_owners(specs(numels), size, first_cap_bytes=1 << 20, cap_bytes=1 << 20)
        got = loads(numels, owners, size)
        assert max(got) - min(got) <= max(numels), (size, got)
        assert set(owners) == set(range(size))


def test_every_bucket_is_balanced_by_itself() -> None:
    numels = [1000, 10, 900, 20, 800, 30, 700, 40] * 3
    ps = specs(numels)
    owners = assign_owners(ps, 2, first_cap_bytes=8000, cap_bytes=16000)
    for plan in plan_buckets(ps, 8000, 16000):
        sizes = [numels[i] for i in plan.params]
        here = loads([numels[i] for i in plan.params], tuple(owners[i] for i in plan.params), 2)
        assert max(here) - min(here) <= max(sizes), (plan.params, here)


def test_the_same_inputs_give_the_same_owners() -> None:
    numels = [7, 7, 7, 3, 3, 100]
    a = assign_owners(specs(numels), 3, 1 << 20, 1 << 20)
    b = assign_owners(specs(numels), 3, 1 << 20, 1 << 20)
    assert a == b


def test_one_member_owns_everything() -> None:
    assert assign_owners(specs([5, 6, 7]), 1, 1 << 20, 1 << 20) == (0, 0, 0)


def test_a_layout_puts_each_members_parameters_in_one_segment() -> None:
    numels = [6, 2, 3, 1, 5]
    ps = specs(numels)
    owners = assign_owners(ps, 2, 1 << 20, 1 << 20)
    lay = layout(plan_buckets(ps, 1 << 20, 1 << 20)[0], owners, 2)
    assert sorted(lay.params) == list(range(5))
    assert lay.numel == sum(numels)
    for k, index in enumerate(lay.params):
        start, stop = lay.segments[lay.owners[k]]
        assert start <= lay.offsets[k] and lay.offsets[k] + lay.numels[k] <= stop
        assert lay.owners[k] == owners[index]
    assert lay.segments[0][1] == lay.segments[1][0]  # back to back


def test_a_padded_layout_has_equal_segments() -> None:
    numels = [6, 2, 3, 1, 5]
    ps = specs(numels)
    owners = assign_owners(ps, 3, 1 << 20, 1 << 20)
    lay = layout(plan_buckets(ps, 1 << 20, 1 << 20)[0], owners, 3, padded=True)
    width = lay.numel // 3
    assert lay.numel == 3 * width
    for m, (start, stop) in enumerate(lay.segments):
        assert start == m * width and stop - start <= width


def test_a_member_without_parameters_in_a_bucket_has_an_empty_segment() -> None:
    lay = layout(plan_buckets(specs([10]), 1 << 20, 1 << 20)[0], (1,), 3)
    assert lay.segments == ((0, 0), (0, 10), (10, 10))
