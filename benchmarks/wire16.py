"""An experiment, not part of hora: a 16-bit allreduce whose wire is 16-bit but whose sum is float32.

The question it answers: is a compressed (``Compression.fp16``/``bf16``) allreduce on a 1 Gbit link slow
because Gloo sums 16-bit values on the CPU slowly? This path keeps the bytes on the wire 16-bit and does
the sum with torch in float32:

1. reduce-scatter as an alltoall: rank ``r`` receives every rank's chunk ``r`` (16-bit, ``(n-1)/n`` of the
   data over its link each way, as a ring's reduce-scatter);
2. sums those ``n`` chunks in float32, in rank order, and rounds once back to 16-bit;
3. allgathers the reduced chunks (16-bit, ``(n-1)/n`` again).

The wire carries what a ring allreduce carries; the result is the float32 sum rounded once. Large tensors
run as a pipeline of pieces: every piece's alltoall is issued first, then each piece is summed and its
allgather issued as soon as its alltoall is done. Every rank issues the same collectives in the same order.

The answer (benchmarks/shaped_links.py ``--only wire16``, docs/performance.md): no. With torch 2.13's Gloo a
16-bit allreduce of 100 MB (as float32) runs at the wire's speed on 1 Gbit links, and this path, with two
collectives and a Python-level sum, is slower there and on loopback; hora does not use it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["allreduce_async", "pieces_of"]

PIECE_BYTES = 4 * 2**20  # pipeline pieces (16-bit bytes); at most MAX_PIECES
MAX_PIECES = 8
calls = 0  # allreduces that took this path


class _Pipeline:
    """The allgathers of every piece (issued before this is returned); ``wait`` copies padded pieces back."""

    __slots__ = ("_copy_back", "_works")

    def __init__(self, works: list[Any], copy_back: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._works = works
        self._copy_back = copy_back

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait()
        for dst, src in self._copy_back:
            dst.copy_(src[: dst.numel()])
        self._copy_back = []
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works) and not self._copy_back

    def get_future(self) -> Any:
        return torch.futures.collect_all([work.get_future() for work in self._works])


def pieces_of(numel: int, element_size: int, n: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each pipeline piece; every length but the last a multiple of ``n``.

    >>> pieces_of(10, 2, 2)
    [(0, 10)]
    >>> len(pieces_of(64 * 2**20, 2, 3)), pieces_of(64 * 2**20, 2, 3)[0][1] % 3
    (8, 0)
    """
    count = max(1, min(MAX_PIECES, numel * element_size // PIECE_BYTES))
    step = -(-numel // count)
    step += -step % n
    return [(start, min(step, numel - start)) for start in range(0, numel, step)]


def allreduce_async(tensor: torch.Tensor, group: Any) -> Any:
    """Sum the contiguous 16-bit ``tensor`` in place over ``group`` (see the module). Returns a Work whose
    ``wait`` leaves the sum in ``tensor``."""
    global calls
    calls += 1
    n = group.size()
    flat = tensor.view(-1)
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    pieces: list[torch.Tensor] = []
    for start, length in pieces_of(flat.numel(), flat.element_size(), n):
        piece = flat[start : start + length]
        if length % n:  # pad to n equal chunks (only the last piece, and only when n does not divide it)
            padded = torch.zeros(length + (-length % n), dtype=flat.dtype)
            padded[:length].copy_(piece)
            copy_back.append((piece, padded))
            piece = padded
        pieces.append(piece)
    received = [torch.empty_like(p) for p in pieces]
    scatters = [dist.all_to_all_single(r, p, group=group, async_op=True) for r, p in zip(received, pieces)]
    gathers = []
    for piece, got, work in zip(pieces, received, scatters):
        work.wait()
        rows = got.view(n, -1)
        total = rows[0].to(torch.float32)
        for row in rows[1:]:
            total += row
        mine = total.to(piece.dtype)
        gathers.append(dist.all_gather_into_tensor(piece, mine, group=group, async_op=True))
    return _Pipeline(gathers, copy_back)
