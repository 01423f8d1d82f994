"""benchmarks/wire16.py, the 16-bit-wire float32-sum allreduce the shaped-links benchmark compares with
Gloo's own 16-bit allreduce: its result is the float32 sum of the ranks' inputs rounded once (exactly), and
Gloo's to rounding, on 3 ranks with sizes 3 does not divide (padding) and a pipeline of several pieces."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.harness import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import wire16  # noqa: E402


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(numel, generator=g) * (rank + 1)).to(dtype)


def _job(rank: int, size: int) -> int:
    wire16.PIECE_BYTES = 64 * 1024  # several pipeline pieces
    checked = 0
    for dtype in (torch.float16, torch.bfloat16):
        for numel in (7, 100_001):  # one piece, padded; several pieces, the last padded
            t = _input(rank, numel, dtype)
            wire16.allreduce_async(t, dist.group.WORLD).wait()
            total = _input(0, numel, dtype).to(torch.float32)
            for r in range(1, size):
                total += _input(r, numel, dtype)
            assert torch.equal(t, total.to(dtype)), f"{dtype} {numel}: not the float32 sum rounded once"
            gloo = _input(rank, numel, dtype)
            dist.all_reduce(gloo)
            torch.testing.assert_close(t, gloo, rtol=2e-2, atol=5e-2)
            checked += 1
    return checked


def test_wire16_is_the_float32_sum_rounded_once() -> None:
    assert run_ranks(_job, 3, timeout=60) == [4, 4, 4]


def test_pieces_are_multiples_of_the_ranks() -> None:
    pieces = wire16.pieces_of(3 * 10**7 + 1, 2, 3)  # 60 MB of 16-bit values
    assert sum(n for _, n in pieces) == 3 * 10**7 + 1
    assert all(n % 3 == 0 for _, n in pieces[:-1]) and len(pieces) == wire16.MAX_PIECES
