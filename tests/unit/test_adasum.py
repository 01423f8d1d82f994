"""The Adasum combination rule against values computed by hand (pure: no process group)."""

from __future__ import annotations

import pytest
import torch

from hora.datapath.kinds.adasum import adasum_pair, adasum_tree


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


# Horovod 0.28.1 keeps a coefficient at 1 only when its vector's squared norm (in float64) is below
# sqrt(DBL_MIN), about 1.5e-154 (common/ops/adasum/adasum.h); hora used 1e-8 and summed small vectors.
_SQRT_DBL_MIN = 2.2250738585072014e-308 ** 0.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_small_equal_vectors_are_combined_not_summed_like_horovod_028(dtype: torch.dtype) -> None:
    """Adasum of two equal vectors is the vector, however small, down to the dtype's smallest normal number
    (and float16's subnormals), as long as the squared norm stays above Horovod's sqrt(DBL_MIN)."""
    tiny = torch.finfo(dtype).tiny
    values = [1e-5, 1e-20, tiny] if dtype != torch.float16 else [1e-3, 1e-5, tiny, 2.0 ** -24]
    for value in values:
        v = torch.tensor([value, 0.0], dtype=dtype)
        if float(v[0].double()) ** 2 < _SQRT_DBL_MIN:
            continue  # float64's tiny: checked below
        assert adasum_pair(v, v.clone()).tolist() == v.tolist(), f"{dtype} {value}"
        assert adasum_tree(torch.stack([v] * 4)).tolist() == v.tolist(), f"{dtype} {value} over 4 ranks"


def test_float64_vectors_below_horovods_threshold_are_summed_like_horovod_028() -> None:
    """Horovod's threshold is on the squared norm: float64 vectors with values just above DBL_MIN ** 0.25
    (about 1.2e-77) are combined, just below it (and at the smallest normal, whose square is 0) summed."""
    edge = 2.2250738585072014e-308 ** 0.25
    above = torch.tensor([edge * 1.01, 0.0], dtype=torch.float64)
    below = torch.tensor([edge * 0.99, 0.0], dtype=torch.float64)
    tiny = torch.tensor([torch.finfo(torch.float64).tiny, 0.0], dtype=torch.float64)
    assert adasum_pair(above, above.clone()).tolist() == above.tolist()
    assert adasum_pair(below, below.clone()).tolist() == (2 * below).tolist()
    assert adasum_pair(tiny, tiny.clone()).tolist() == (2 * tiny).tolist()
