"""Shared pytest set-up.

The pytest process itself must never join a process group: distributed tests fork their ranks with
``tests.distributed.harness.run_ranks``. The autouse guard below fails any test that leaves the parent with
an initialised default group, so the rule cannot erode silently.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _parent_never_joins_a_process_group() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test initialised a process group in the pytest process; run ranks with run_ranks()")
