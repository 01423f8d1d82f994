"""allreduce against locally computed results: every op and dtype, scaling, compression, all variants, grads."""

from __future__ import annotations

import pytest
import torch

import hora as hvd
from hora.calls import submit as collectives
from hora.calls.call import Call
from hora.datapath.kinds.op import Kind
from hora.datapath.wire import POOL_MIN_BYTES, CastCompressor
from hora.runtime import lifecycle as runtime
from tests.distributed.expect import ALL, FLOATS, close, ops_for, rank_input, reduce
from tests.distributed.harness import run_ranks
from tests.polling import wait_until

SHAPE = (3, 5)


def _every_op_and_dtype(rank: int, size: int) -> int:
    checked = 0
    for dtype in ALL:
        inputs = [rank_input(r, SHAPE, dtype) for r in range(size)]
        for op in ops_for(dtype):
            x = inputs[rank].clone()
            out = hvd.allreduce(x, op=op)
            close(out, reduce(inputs, op), f"allreduce {dtype} {op.name}")
            close(x, inputs[rank], f"allreduce {dtype} {op.name} left its input alone")
            checked += 1
    # default op is Average; a 0-d tensor and a 1-element tensor work too
    close(hvd.allreduce(torch.tensor(float(rank))), torch.tensor((size - 1) / 2), "default op on a 0-d tensor")
    close(hvd.allreduce(torch.tensor([rank], dtype=torch.int64), op=hvd.Sum),
          torch.tensor([size * (size - 1) // 2]), "1-element int64 Sum")
    return checked


@pytest.mark.parametrize("nprocs", [2, 3])
def test_allreduce_every_op_and_dtype(nprocs: int) -> None:
    checked = run_ranks(_every_op_and_dtype, nprocs)
    assert checked == [4 * 5 + 5 * 4 + 2] * nprocs  # every case ran on every rank


def _scaling_and_compression(rank: int, size: int) -> None:
    for dtype in FLOATS:
        inputs = [rank_input(r, SHAPE, dtype) for r in range(size)]
        tol = {"atol": 2e-2, "rtol": 2e-2} if dtype in (torch.float16, torch.bfloat16) else {}
        for op in (hvd.Sum, hvd.Average):
            out = hvd.allreduce(inputs[rank], op=op, prescale_factor=0.5, postscale_factor=3.0)
            close(out, reduce(inputs, op, prescale=0.5, postscale=3.0), f"{dtype} {op.name} pre 0.5 post 3", **tol)
    x32 = [rank_input(r, SHAPE, torch.float32) * 1.25 for r in range(size)]
    for name, comp in (("fp16", hvd.Compression.fp16), ("bf16", hvd.Compression.bf16)):
        for op in (hvd.Sum, hvd.Average):
            out = hvd.allreduce(x32[rank], op=op, compression=comp)
            close(out, reduce(x32, op), f"{name} compression {op.name} returns float32", atol=2e-2, rtol=2e-2)
    ints = [rank_input(r, SHAPE, torch.int32) for r in range(size)]
    close(hvd.allreduce(ints[rank], op=hvd.Sum, compression=hvd.Compression.fp16), reduce(ints, hvd.Sum),
          "fp16 compression leaves integers exact")
    # Horovod's deprecated spelling
    f = [rank_input(r, SHAPE, torch.float64) for r in range(size)]
    close(hvd.allreduce(f[rank], average=True), reduce(f, hvd.Average), "average=True means Average")
    close(hvd.allreduce(f[rank], average=False), reduce(f, hvd.Sum), "average=False means Sum")
    with pytest.raises(ValueError, match="average"):
        hvd.allreduce(f[rank], average=True, op=hvd.Sum)


def test_allreduce_scaling_compression_and_deprecated_average() -> None:
    run_ranks(_scaling_and_compression, 2)


class _FreshCast(CastCompressor):
    """The built-in cast through the generic compress/decompress path (a fresh 16-bit tensor per call)."""


BIG = (2500, 1000)  # 5 MB on a 16-bit wire: a reused buffer (above POOL_MIN_BYTES), sent in 2 pieces


def _large_compressed(rank: int, size: int) -> int:
    assert 2500 * 1000 * 2 >= POOL_MIN_BYTES
    x = torch.randn(BIG, generator=torch.Generator().manual_seed(rank)) * 100
    cases = [(comp, op, pre, post) for comp in (hvd.Compression.fp16, hvd.Compression.bf16)
             for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Average, 0.5, 4.0))]

    def one_pass() -> None:
        for comp, op, pre, post in cases:
            fresh, pooled, again = (hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post, compression=c)
                                    for c in (_FreshCast(comp.wire_dtype), comp, comp))  # type: ignore[attr-defined]
            assert pooled.dtype == torch.float32 and pooled.data_ptr() != again.data_ptr(), "results are new tensors"
            # factors that are powers of 2: the same bits whether scaled in 16 bits or after the cast back
            assert torch.equal(pooled, fresh), f"{comp} {op.name} {pre} {post}: reused wire = generic path, bitwise"
            assert torch.equal(again, pooled), "a later call did not overwrite an earlier result"
            y = x.clone()  # in place (the DistributedOptimizer's private entry): cast back into the tensor
            call = Call(Kind.ALLREDUCE, y, "", hvd.global_process_set, reduce_op=op, prescale=pre, postscale=post,
                        compression=comp, inplace=True)
            assert hvd.synchronize(collectives.submit(call)) is y and torch.equal(y, fresh), "in place"
        # another factor: the float32 product of the 16-bit sum (the generic path scales the 16-bit values)
        third = hvd.allreduce(x, op=hvd.Sum, postscale_factor=1 / 3, compression=hvd.Compression.fp16)
        assert torch.equal(third, hvd.allreduce(x, op=hvd.Sum, compression=_FreshCast(torch.float16)) * (1 / 3))
        # two in flight at once take two buffers; both right
        outs = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum, compression=hvd.Compression.bf16)
        want = hvd.allreduce(x, op=hvd.Sum, compression=_FreshCast(torch.bfloat16))
        assert torch.equal(outs[0], want) and torch.equal(outs[1], want * 2)
        # reducescatter leases its wire too, and gives it back
        rs = hvd.reducescatter(x, op=hvd.Sum, compression=hvd.Compression.fp16)
        assert torch.equal(rs, hvd.reducescatter(x, op=hvd.Sum, compression=_FreshCast(torch.float16)))

    one_pass()
    pool = runtime.state().wire_buffers
    made = pool.allocated
    one_pass()
    assert pool.allocated == made, f"the second pass allocated {pool.allocated - made} wire buffers"
    return made


def test_large_compressed_allreduce_reuses_its_wire_buffers_and_matches_the_generic_path() -> None:
    """fp16/bf16 of large CPU tensors: the 16-bit wire is a reused buffer (no allocation in a steady loop) and the
    result is bitwise the generic compress/sum/scale/decompress path's, out of place, in place, grouped, scattered."""
    made = run_ranks(_large_compressed, 2)
    assert made[0] == made[1] and made[0] >= 2


def _pieces_match_on_every_rank(rank: int, size: int) -> None:
    """A large 16-bit CPU allreduce goes in pieces, decided from the request alone: a rank with its own
    compressor (no reused buffer), a rank sending raw fp16, and a joined rank all issue the same calls."""
    n = 1600  # 1600 x 1600 as fp16: 5 MB, two pieces
    x = torch.randn(n, n, generator=torch.Generator().manual_seed(rank))
    comp = _FreshCast(torch.float16) if rank == 0 else hvd.Compression.fp16
    out = hvd.allreduce(x, op=hvd.Sum, compression=comp, name="mixed")
    others = [torch.randn(n, n, generator=torch.Generator().manual_seed(r)) for r in range(size)]
    want = sum((o.to(torch.float16) for o in others), torch.zeros(n, n))
    close(out, want, "pieces with one rank on the generic path", atol=0.1, rtol=1e-2)
    raw = (x * 0 + rank).to(torch.float16)  # uncompressed fp16: sent in the same pieces
    close(hvd.allreduce_(raw, op=hvd.Sum, name="raw16"), torch.full((n, n), float(sum(range(size)))).half(), "raw fp16")
    if rank == 1:
        hvd.join()  # contributes zeros to rank 0's pieces, in pieces
    else:
        alone = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.bf16, name="joined")
        close(alone, x.to(torch.bfloat16).float(), "rank 1 joined: its zeros came in the same pieces")
        hvd.join()


def test_sixteen_bit_allreduce_pieces_match_across_ranks_and_a_joined_rank() -> None:
    run_ranks(_pieces_match_on_every_rank, 2, timeout=60)


def _variants(rank: int, size: int) -> None:
    inputs = [rank_input(r, SHAPE, torch.float32) for r in range(size)]
    want_sum, want_avg = reduce(inputs, hvd.Sum), reduce(inputs, hvd.Average)
    # in place: returns the same tensor object, filled with the result
    t = inputs[rank].clone()
    out = hvd.allreduce_(t, op=hvd.Sum, name="inplace")
    assert out is t, "allreduce_ returns its argument"
    close(t, want_sum, "allreduce_")
    # async + poll + synchronize, out of place and in place
    x = inputs[rank].clone()
    h = hvd.allreduce_async(x, op=hvd.Average, name="async")
    assert wait_until(lambda: hvd.poll(h), timeout=60, step=0.001), "poll() never said the allreduce is done"
    close(hvd.synchronize(h), want_avg, "allreduce_async")
    close(x, inputs[rank], "allreduce_async left its input alone")
    y = inputs[rank].clone()
    h = hvd.allreduce_async_(y, op=hvd.Sum)
    res = hvd.synchronize(h)
    assert res is y
    close(y, want_sum, "allreduce_async_")
    _grouped_and_sparse(rank, size)


def _grouped_and_sparse(rank: int, size: int) -> None:
    # grouped: mixed dtypes and shapes in one group
    group_inputs = [[rank_input(r, (4,), torch.float64), rank_input(r, (2, 3), torch.int32, salt=1),
                     rank_input(r, (1,), torch.float32, salt=2)] for r in range(size)]
    mine = [t.clone() for t in group_inputs[rank]]
    outs = hvd.grouped_allreduce(mine, op=hvd.Sum, name="grp")
    assert isinstance(outs, list) and len(outs) == 3
    for i, o in enumerate(outs):
        close(o, reduce([g[i] for g in group_inputs], hvd.Sum), f"grouped_allreduce[{i}]")
    floats = [[g[0], g[2]] for g in group_inputs]
    mine = [t.clone() for t in floats[rank]]
    outs = hvd.synchronize(hvd.grouped_allreduce_async(mine, op=hvd.Average))
    for i, o in enumerate(outs):
        close(o, reduce([g[i] for g in floats], hvd.Average), f"grouped_allreduce_async[{i}]")
    mine = [t.clone() for t in floats[rank]]
    outs = hvd.grouped_allreduce_(mine, op=hvd.Max)
    for i, (o, m) in enumerate(zip(outs, mine)):
        assert o is m
        close(m, reduce([g[i] for g in floats], hvd.Max), f"grouped_allreduce_[{i}]")
    mine = [t.clone() for t in floats[rank]]
    hvd.synchronize(hvd.grouped_allreduce_async_(mine, op=hvd.Min))
    for i, m in enumerate(mine):
        close(m, reduce([g[i] for g in floats], hvd.Min), f"grouped_allreduce_async_[{i}]")
    # many unnamed ops in flight at once, finished in reverse order
    handles = [hvd.allreduce_async(rank_input(rank, (i + 1,), torch.float32), op=hvd.Sum) for i in range(20)]
    for i in reversed(range(20)):
        close(hvd.synchronize(handles[i]), reduce([rank_input(r, (i + 1,), torch.float32) for r in range(size)],
                                                  hvd.Sum), f"unnamed async #{i}")


    # sparse: each rank holds different rows of a (6, 2) matrix; the result is the dense reduction, coalesced
    dense = [torch.zeros(6, 2, dtype=torch.float64) for _ in range(size)]
    for r in range(size):
        dense[r][[r, r + 2, 5]] = rank_input(r, (3, 2), torch.float64, salt=3)
    for op in (hvd.Average, hvd.Sum):
        out = hvd.synchronize(hvd.sparse_allreduce_async(dense[rank].to_sparse(), name=f"sparse.{op.name}", op=op))
        assert out.is_sparse and out.is_coalesced()
        close(out.to_dense(), reduce(dense, op), f"sparse_allreduce_async {op.name}")


def test_allreduce_inplace_async_grouped_variants() -> None:
    run_ranks(_variants, 2)


def _grads(rank: int, size: int) -> None:
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 4.0), (hvd.Average, 2.0, 0.25)):
        x = rank_input(rank, SHAPE, torch.float64).requires_grad_()
        y = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
        upstream = [rank_input(r, SHAPE, torch.float64, salt=5) for r in range(size)]
        y.backward(upstream[rank])
        # grad = allreduce of the upstream grads with the same op and factors
        close(x.grad, reduce(upstream, op, prescale=pre, postscale=post), f"allreduce grad {op.name} {pre} {post}")
    x = rank_input(rank, SHAPE, torch.float32).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16) * 2).sum().backward()
    close(x.grad, torch.full(SHAPE, 2.0 * size), "allreduce grad through fp16 compression")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_allreduce_gradients(nprocs: int) -> None:
    run_ranks(_grads, nprocs)
