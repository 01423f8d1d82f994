"""Bucket planning and bucket names for DistributedOptimizer (hora.training.buckets; pure: no process group);
names from what every rank shares, never from how many optimizers a process built."""

from __future__ import annotations

import torch

from hora.training.buckets import BucketNames, FlatBucket, ParamSpec, fingerprint, plan_buckets, split_groups

CPU = torch.device("cpu")


def _specs(numels, dtype=torch.float32, groups=None):
    groups = groups or [-1] * len(numels)
    return [ParamSpec(i, n, dtype, CPU, g) for i, (n, g) in enumerate(zip(numels, groups))]


def test_reverse_order_small_first_bucket_then_cap():
    # 4-byte floats: first bucket closes at >= 400 B (100 elements), later ones at >= 800 B
    plan = plan_buckets(_specs([100, 100, 100, 100, 100]), first_cap_bytes=400, cap_bytes=800)
    assert [b.params for b in plan] == [(4,), (3, 2), (1, 0)]
    assert [b.offsets for b in plan] == [(0,), (0, 100), (0, 100)]
    assert [b.numel for b in plan] == [100, 200, 200]


def test_every_parameter_in_exactly_one_bucket_with_contiguous_slices():
    numels = [7, 300, 1, 64, 5000, 3, 3]
    plan = plan_buckets(_specs(numels), first_cap_bytes=100, cap_bytes=2000)
    seen = sorted(i for b in plan for i in b.params)
    assert seen == list(range(len(numels)))
    for b in plan:
        ends = [o + n for o, n in zip(b.offsets, b.numels)]
        assert list(b.offsets[1:]) == ends[:-1]
        assert [numels[i] for i in b.params] == list(b.numels)


def test_dtypes_never_share_a_bucket():
    specs = [ParamSpec(0, 10, torch.float32, CPU), ParamSpec(1, 10, torch.float16, CPU),
             ParamSpec(2, 10, torch.float32, CPU)]
    plan = plan_buckets(specs, first_cap_bytes=10**6, cap_bytes=10**6)
    assert {(b.dtype, b.params) for b in plan} == {(torch.float32, (2, 0)), (torch.float16, (1,))}


def test_zero_cap_gives_one_bucket_per_parameter():
    plan = plan_buckets(_specs([5, 6, 7]), first_cap_bytes=0, cap_bytes=0)
    assert [b.params for b in plan] == [(2,), (1,), (0,)]


def test_explicit_groups_share_one_bucket_regardless_of_cap():
    plan = plan_buckets(_specs([100, 100, 100, 100], groups=[0, -1, 0, 1]), first_cap_bytes=4, cap_bytes=4)
    assert [b.params for b in plan] == [(1,), (3,), (2, 0)]  # groups in order of first appearance, backwards


def test_split_groups_like_horovod():
    assert split_groups(5, 2) == [0, 0, 0, 1, 1]
    assert split_groups(3, 0) == [-1, -1, -1]


def test_flat_bucket_views_are_slices_of_one_buffer():
    plan = plan_buckets(_specs([3, 2]), first_cap_bytes=10**6, cap_bytes=10**6)[0]
    bucket = FlatBucket(plan, "b", torch.float16)
    bucket.views[0].fill_(1.0)
    bucket.views[1].fill_(2.0)
    assert bucket.buffer.dtype == torch.float16
    assert bucket.buffer.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0]  # param 1 first (reverse order), then 0



def test_the_fingerprint_depends_on_parameter_names_and_ranks_only() -> None:
    assert fingerprint(["a", "b"], [0, 1]) == fingerprint(["a", "b"], [0, 1])
    assert fingerprint(["a", "b"], [0, 1]) != fingerprint(["b", "a"], [0, 1])
    assert fingerprint(["a", "b"], [0, 1]) != fingerprint(["a", "b"], [0, 2])


def test_only_optimizers_that_step_claim_a_name_in_the_order_of_their_first_step() -> None:
    names = ["unit.test.w", "unit.test.b"]
    built_never_used = BucketNames(names, lambda: [0, 1])
    first, second = BucketNames(names, lambda: [0, 1]), BucketNames(names, lambda: [0, 1])
    digest = fingerprint(names, [0, 1])
    assert first.bucket(0, 2) == f"hora.opt.{digest}.g0.bucket.2"
    assert second.bucket(1, 0) == f"hora.opt.{digest}.1.g1.bucket.0"  # a second copy of the same model
    assert first.prefix == f"hora.opt.{digest}"  # fixed once claimed
    assert built_never_used is not None
