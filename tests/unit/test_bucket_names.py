"""Gradient bucket names: from what every rank shares, never from how many optimizers a process built."""

from __future__ import annotations

from hora.training.bucket_names import BucketNames, fingerprint


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
