"""The built-in casts' reused wire buffers, their pieces and the cast back (hora.datapath.wire)."""

from __future__ import annotations

import torch

import hora as hvd
from hora.datapath import wire
from hora.datapath.wire import CastCompressor, WireBuffers, cast_scaled, lease_wire, pipeline_ranges


def test_buffers_are_reused_and_bounded() -> None:
    pool = WireBuffers(per_size=2, sizes=2)
    a, b = pool.take(torch.float16, 10), pool.take(torch.float16, 10)
    assert a.data_ptr() != b.data_ptr() and pool.allocated == 2  # two in use at once: two buffers
    pool.give(a)
    pool.give(b)
    pool.give(torch.empty(10, dtype=torch.float16))  # a third idle one of that size is dropped
    assert {pool.take(torch.float16, 10).data_ptr() for _ in range(2)} == {a.data_ptr(), b.data_ptr()}
    assert pool.allocated == 2
    for n in (1, 2, 3):  # only the 2 most recently used sizes keep idle buffers
        pool.give(torch.empty(n, dtype=torch.bfloat16))
    made = pool.allocated
    pool.take(torch.bfloat16, 1)
    assert pool.allocated == made + 1  # size 1 was dropped
    pool.take(torch.bfloat16, 3)
    assert pool.allocated == made + 1  # size 3 was kept


def test_only_large_contiguous_cpu_floats_under_a_built_in_cast_lease_a_buffer() -> None:
    big = torch.zeros(wire.POOL_MIN_BYTES // 2)  # wire.POOL_MIN_BYTES on a 16-bit wire
    pool = WireBuffers()
    assert lease_wire(hvd.Compression.fp16, big, pool) is not None
    assert lease_wire(hvd.Compression.bf16, big, pool).dtype == torch.bfloat16  # type: ignore[union-attr]
    assert lease_wire(hvd.Compression.fp16, big[:-1], pool) is None  # one element short
    assert lease_wire(hvd.Compression.none, big, pool) is None
    assert lease_wire(hvd.Compression.fp16, big.view(2, -1).t(), pool) is None  # not contiguous
    assert lease_wire(hvd.Compression.fp16, big.to(torch.int32), pool) is None
    assert lease_wire(hvd.Compression.fp16, big.half(), pool) is None  # nothing to cast

    class Mine(CastCompressor):
        pass

    assert lease_wire(Mine(torch.float16), big, pool) is None  # a user's compressor keeps its own compress()


def test_pieces_cover_the_tensor_in_order() -> None:
    for numel in (0, 1, 10, 2**20, 2**20 + 1, 3 * 2**20 + 7, 50 * 2**20):
        ranges = pipeline_ranges(numel, torch.float16, "cpu")
        assert ranges[0][0] == 0 and ranges[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert 1 <= len(ranges) <= wire.PIPELINE_MAX
        assert len(ranges) == 1 or min(b - a for a, b in ranges) * 2 >= 2 << 20
    assert len(pipeline_ranges(50 * 2**20, torch.float32, "cpu")) == 1  # only 16-bit wires go in pieces
    assert len(pipeline_ranges(50 * 2**20, torch.float16, "cuda")) == 1


def test_cast_back_widens_then_scales() -> None:
    half = (torch.randn(3 * 2**19 + 5) * 1000).half()
    for scale in (1.0, 0.5, 1.5, 1 / 3):
        out = torch.empty(half.shape)
        cast_scaled(half, out, scale)
        assert torch.equal(out, half.float() * scale), scale  # the float32 product of the 16-bit sum
    grad = torch.randn(2000, 3)
    view = torch.empty(6000)
    cast_scaled(grad, view, 0.25)  # same dtype (a bucket's copy in): one multiply
    assert torch.equal(view, (grad * 0.25).view(-1))
    strided = torch.empty(3, 2000).t()
    cast_scaled(half[:6000], strided, 2.0)
    assert torch.equal(strided, (half[:6000].float() * 2.0).view(2000, 3))
