"""Shared pytest set-up.

The pytest process itself must never join a process group: distributed tests fork their ranks with
``tests.distributed.harness.run_ranks``. The autouse guard below fails any test that leaves the parent with
an initialised default group, so the rule cannot erode silently.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _parent_never_joins_a_process_group() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test initialised a process group in the pytest process; run ranks with run_ranks()")


@pytest.fixture
def small_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[int], Path]]:
    """A factory of small filesystems to fill up: ``small_disk(64)`` mounts a 64 KiB tmpfs and returns its path.

    Needs root (``mount``); every filesystem is unmounted after the test, whatever happened in it.
    """
    mounted: list[Path] = []

    def make(kib: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("a small filesystem needs root to mount a tmpfs")
        where = tmp_path_factory.mktemp("small_disk")
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0755", "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)
