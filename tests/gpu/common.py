"""What the GPU tests share: the device a rank works on, the two kinds of world they run in, and checks.

- :func:`gloo_world`: ranks that may share one GPU, with a Gloo default group made by the "script" before
  ``hvd.init()`` (as under torchrun with ``init_process_group("gloo")``): hora joins it, binds each rank to
  ``local_rank % device_count`` and sends CUDA tensors through Gloo (staged through host memory). This is
  how one GPU runs a 2-rank job.
- :func:`nccl_world`: plain ``hvd.init()``; with CUDA it builds ``cpu:gloo,cuda:nccl`` groups, so CUDA
  tensors go through NCCL. One rank per GPU (NCCL refuses two ranks on one device).

The dry run (``HORA_GPU_SUITE_ON_CPU=1``) runs the same bodies on CPU tensors over Gloo: it checks the tests'
own logic on a machine without a GPU, nothing about CUDA (docs/testing.md).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import hora as hvd
from hora.testing import run_ranks
from tests.distributed.harness import as_host

ON_CPU = os.environ.get("HORA_GPU_SUITE_ON_CPU", "") not in ("", "0")
TIMEOUT_S = 300.0  # the first CUDA call of a rank (context, NCCL communicators) can take many seconds


@functools.cache
def cuda_devices() -> int:
    """CUDA devices of this machine, asked in a subprocess (torch.cuda.device_count() may initialise the driver
    when NVML is not there, and the pytest process must not: its ranks are forked). 0 with torch's CPU build."""
    if ON_CPU:
        return 4  # the dry run's CPU "devices"
    if torch.version.cuda is None:
        return 0
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip().isdigit() else 0


def device() -> torch.device:
    """The device this rank's tensors live on: the one hora bound it to at init()."""
    if ON_CPU:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _in_gloo_world(rank: int, size: int, fn: Callable[..., Any], *args: Any) -> Any:
    base = dist.TCPStore(os.environ["HORA_STORE_ADDR"], int(os.environ["HORA_STORE_PORT"]), is_master=False,
                         wait_for_workers=False)
    store = dist.PrefixStore(f"gloo-world/{os.environ['HORA_JOB_ID']}", base)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    try:
        hvd.init()
        try:
            if not ON_CPU:
                assert device().type == "cuda", "hora did not bind this rank to a GPU"
            return fn(rank, size, *args)
        finally:
            hvd.shutdown()
    finally:
        dist.destroy_process_group()


def gloo_world(fn: Callable[..., Any], nprocs: int, *args: Any, env: dict[str, str | None] | None = None) -> list[Any]:
    """``fn(rank, size, *args)`` on ``nprocs`` ranks whose CUDA tensors go through Gloo (one GPU is enough)."""
    return run_ranks(_in_gloo_world, nprocs, fn, *args, init=False, timeout=TIMEOUT_S, env=env)


def _in_nccl_world(rank: int, size: int, fn: Callable[..., Any], *args: Any) -> Any:
    hvd.init()
    try:
        if not ON_CPU:
            assert device() == torch.device("cuda", rank % torch.cuda.device_count())
            backend = dist.get_backend()
            assert "nccl" in str(backend), f"CUDA tensors would not go through NCCL (backend {backend})"
        return fn(rank, size, *args)
    finally:
        hvd.shutdown()


def nccl_world(fn: Callable[..., Any], nprocs: int, *args: Any, env: dict[str, str | None] | None = None) -> list[Any]:
    """``fn(rank, size, *args)`` on ``nprocs`` ranks, one GPU each, CUDA tensors through NCCL."""
    return run_ranks(_in_nccl_world, nprocs, fn, *args, init=False, timeout=TIMEOUT_S, env=env)


def as_hosts(rank: int, per_host: list[int], hierarchical: bool = True) -> None:
    """Make this forked rank one of ``per_host[h]`` ranks on "host" h, as hora run's variables would say, before
    ``hvd.init()``; each such host sees its own GPU, as separate machines would (CUDA is not initialised yet in
    the forked rank, so ``CUDA_VISIBLE_DEVICES`` still counts): a local rank then never shares one."""
    as_host(rank, per_host, "1" if hierarchical else "0")
    if not ON_CPU:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)


def same(got: torch.Tensor, want: torch.Tensor, what: str, exact: bool = False, on: torch.device | None = None) -> None:
    """``got`` (on this rank's device, or ``on``) equals ``want`` (computed on the CPU): bitwise, or to the
    dtype's rounding for floating point."""
    on = device() if on is None else on
    assert got.device == on, f"{what}: result on {got.device}, expected {on}"
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
    cpu = got.cpu()
    if exact or not want.dtype.is_floating_point:
        assert torch.equal(cpu, want), f"{what}: {cpu} != {want}"
        return
    tol = 1e-2 if want.dtype in (torch.float16, torch.bfloat16) else 1e-5
    torch.testing.assert_close(cpu, want, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")
