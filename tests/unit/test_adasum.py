"""The Adasum combination rule against values computed by hand (pure: no process group)."""

from __future__ import annotations

import pytest
import torch

from hora.adasum import adasum_pair, adasum_tree


def test_pair_hand_computed() -> None:
    # a.b = 1, |a|^2 = 1, |b|^2 = 2: (1 - 1/2) a + (1 - 1/4) b
    got = adasum_pair(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert got.tolist() == pytest.approx([1.25, 0.75])


def test_orthogonal_vectors_add_and_equal_vectors_average() -> None:
    assert adasum_pair(torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])).tolist() == [3.0, 4.0]
    assert adasum_pair(torch.tensor([2.0, 2.0]), torch.tensor([2.0, 2.0])).tolist() == [2.0, 2.0]


def test_zero_vector_keeps_the_other() -> None:
    assert adasum_pair(torch.zeros(2), torch.tensor([1.0, -2.0])).tolist() == [1.0, -2.0]


def test_four_ranks_pair_as_a_binary_tree() -> None:
    rows = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0], [0.0, 2.0]])
    # (0,1) -> [1.25, 0.75]; (2,3) -> [0, 2]; then a=[1.25,0.75], b=[0,2]: a.b=1.5, |a|^2=2.125, |b|^2=4
    # -> (1 - 1.5/4.25) a + (1 - 1.5/8) b
    a, b = torch.tensor([1.25, 0.75]), torch.tensor([0.0, 2.0])
    want = (1 - 1.5 / 4.25) * a + (1 - 1.5 / 8) * b
    torch.testing.assert_close(adasum_tree(rows), want)


def test_non_power_of_two_is_refused() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        adasum_tree(torch.ones(3, 2))
