"""A CUDA tensor on another device than the one hora bound the rank to is refused at submit, naming both
devices and the fix (the check is pure: torch.device objects need no GPU; tests/gpu runs it on real ones)."""

from __future__ import annotations

import pytest
import torch

from hora.calls.submit import _validate_device
from hora.errors import InvalidCallError

WHERE = "allreduce 'grads' on rank 0"


def test_a_tensor_on_another_gpu_is_refused_with_both_devices_named() -> None:
    with pytest.raises(InvalidCallError) as info:
        _validate_device(torch.device("cuda", 1), torch.device("cuda", 0), WHERE)
    message = str(info.value)
    assert message.startswith(f"{WHERE}: the tensor is on cuda:1, but this rank's collectives run on cuda:0")
    assert "tensor.to('cuda:0')" in message and "CUDA_VISIBLE_DEVICES" in message


def test_a_cuda_tensor_without_cuda_at_init_is_refused() -> None:
    with pytest.raises(InvalidCallError, match="hora was initialised without CUDA"):
        _validate_device(torch.device("cuda", 0), None, WHERE)


def test_the_bound_device_passes() -> None:
    _validate_device(torch.device("cuda", 3), torch.device("cuda", 3), WHERE)
