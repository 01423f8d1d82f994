"""Shared pytest set-up.

The pytest process itself must never join a process group: distributed tests fork their ranks with
``tests.distributed.harness.run_ranks``. The autouse guard below fails any test that leaves the parent with
an initialised default group, so the rule cannot erode silently.

The suite's own plugins (``tests/plugins``): under CI a skip fails unless the test is marked ``gpu``; a test
that leaves a process running fails; a failure is named in the log as it happens.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

pytest_plugins = ("tests.plugins.skips", "tests.plugins.leaks", "tests.plugins.progress")


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


@pytest.fixture
def memory_limit() -> Iterator[Callable[[int], Callable[[], None]]]:
    """A factory of memory cgroups: ``enter = memory_limit(256)`` makes a cgroup limited to 256 MB (no swap),
    below this process's own, and returns a ``preexec_fn`` that moves a child process into it.

    Works with cgroup v1's memory controller and with v2 where the memory controller is delegated to this
    process's cgroup; needs root. Every cgroup is emptied (SIGKILL) and removed after the test.
    """
    from hora.launcher.remote.oom import memory_cgroup

    made: list[Path] = []

    def make(mb: int) -> Callable[[], None]:
        if os.geteuid() != 0:
            pytest.skip("a memory cgroup needs root")
        mine = memory_cgroup(os.getpid())
        if mine is None:
            pytest.skip("this kernel shows no memory cgroup (neither v1's memory controller nor v2's)")
        where = Path(mine.path) / f"hora-test-{os.getpid()}-{len(made)}"
        where.mkdir()
        made.append(where)
        limits = [("memory.max", str(mb << 20)), ("memory.swap.max", "0")] if mine.v2 else [
            ("memory.limit_in_bytes", str(mb << 20)), ("memory.memsw.limit_in_bytes", str(mb << 20))]
        for name, value in limits:
            if (where / name).exists():
                (where / name).write_text(value)
            elif name in ("memory.max", "memory.limit_in_bytes"):
                pytest.skip(f"{where} has no {name}: the memory controller is not delegated here")
        procs = str(where / "cgroup.procs")

        def enter() -> None:
            with open(procs, "w") as fh:
                fh.write(str(os.getpid()))

        return enter

    yield make
    for where in made:
        for _ in range(100):
            pids = [int(p) for p in (where / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        where.rmdir()
