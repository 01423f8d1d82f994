"""The GPU suite's set-up: tests marked ``gpu`` (``gpu(n)``: at least n devices) skip, with one reason, where
there are fewer CUDA devices, and the pytest process never initialises CUDA (its ranks are forked: a child of a
process that initialised CUDA cannot use it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.gpu.common import cuda_devices


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    need = int(marker.args[0]) if marker.args else 1
    have = cuda_devices()
    if have == 0:
        pytest.skip("no CUDA device here (torch.cuda.device_count() == 0); run `make test-gpu` on a GPU machine")
    if have < need:
        pytest.skip(f"needs {need} CUDA devices, this machine has {have}")


@pytest.fixture(autouse=True)
def _parent_never_initialises_cuda() -> Iterator[None]:
    if torch.version.cuda is not None and torch.cuda.is_initialized():
        pytest.fail("CUDA is initialised in the pytest process: its forked ranks could not use it. Something in "
                    "the parent (a test module, a fixture) touched CUDA; do it inside the ranks")
    yield
