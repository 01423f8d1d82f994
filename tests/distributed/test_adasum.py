"""Adasum as Horovod runs it: vector halving, distance doubling, the tensor combined in place without any rank
holding the others' copies. Its result is the binary tree of Adasum pairs over the members (the reference,
computed here from every rank's input), on 2 and 4 ranks, for sizes below, at and above the member count and
across the float64 arithmetic's pieces, in place or not, on a process set; and with the first level summing
(GPU Adasum's within-host sum, run here on CPU tensors through the same code) it is the Adasum of the hosts'
sums."""

from __future__ import annotations

import pytest
import torch

import hora as hvd
from hora.datapath.kinds import adasum
from hora.errors import UnsupportedCallError
from hora.runtime import lifecycle as runtime
from tests.distributed.expect import close
from tests.distributed.harness import run_ranks

SIZES = (1, 3, 4, 7, 1000, (1 << 20) + 3)  # the last one: more than one float64 piece per half on 2 ranks


def _inputs(n: int, size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(100 * n + r)).to(dtype) for r in range(size)]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-3, "rtol": 2e-3} if dtype == torch.float16 else {"atol": 1e-5, "rtol": 1e-5}


def _against_the_tree(rank: int, size: int) -> int:
    checked = 0
    for dtype in (torch.float32, torch.float64, torch.float16):
        for n in SIZES if dtype != torch.float16 else SIZES[:5]:
            xs = _inputs(n, size, dtype)
            want = adasum.adasum_tree(torch.stack(xs))
            mine = xs[rank].clone()
            close(hvd.allreduce(mine, op=hvd.Adasum, name=f"ada.{dtype}.{n}"), want, f"{dtype} {n}", **_tol(dtype))
            assert torch.equal(mine, xs[rank]), "allreduce(op=Adasum) changed its input"
            hvd.allreduce_(mine, op=hvd.Adasum, name=f"ada_.{dtype}.{n}")
            close(mine, want, f"in place, {dtype} {n}", **_tol(dtype))
            checked += 1
    if size == 4:  # a process set of two: the pair alone
        pair = hvd.add_process_set([1, 3])
        if rank in (1, 3):
            xs = _inputs(33, size, torch.float32)
            close(hvd.allreduce(xs[rank], op=hvd.Adasum, process_set=pair, name="pair"),
                  adasum.adasum_pair(xs[1], xs[3]), "process set [1, 3]")
            checked += 1
    return checked


@pytest.mark.parametrize("size", [2, 4])
def test_adasum_by_vector_halving_equals_the_binary_tree(size: int) -> None:
    counts = run_ranks(_against_the_tree, size, timeout=180)
    assert min(counts) >= 16


def _hosts_summed_first(rank: int, size: int) -> list[float]:
    """Two "hosts" of two ranks: the first level sums (as GPU Adasum does within a host), the second combines
    the hosts' sums."""
    rt = runtime.state()
    xs = _inputs(1001, size, torch.float32)
    mine = xs[rank].clone()
    group = rt.process_sets[0].group
    adasum.vhdd(mine, list(range(size)), rank, group, summed=1)
    want = adasum.adasum_pair(xs[0] + xs[1], xs[2] + xs[3])
    close(mine, want, "Adasum of the two hosts' sums")
    return mine[:3].tolist()


def test_summed_levels_add_within_a_host_and_combine_the_hosts_sums() -> None:
    results = run_ranks(_hosts_summed_first, 4)
    assert all(r == results[0] for r in results), "ranks ended with different results"


def test_gpu_adasum_sums_within_hosts_of_the_whole_job_only() -> None:
    try:
        adasum.set_hosts(((0, 1), (2, 3)))
        assert adasum.summed_levels([0, 1, 2, 3], cuda=True) == 1  # 2 ranks per host: one summing level
        assert adasum.summed_levels([0, 1, 2, 3], cuda=False) == 0  # CPU tensors: Adasum over every rank
        assert adasum.summed_levels([0, 2], cuda=True) == 0  # a process set: Adasum over its members
        adasum.set_hosts(((0, 2), (1, 3)))  # ranks not numbered host by host: no within-host halving
        with pytest.raises(UnsupportedCallError, match="numbered host by host"):
            adasum.summed_levels([0, 1, 2, 3], cuda=True)
    finally:
        adasum.set_hosts(())
