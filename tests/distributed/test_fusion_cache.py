"""Many ops in flight at once (fusion must keep them apart) and names reused (the response cache), under the
default knobs and with fusion and the cache turned down or off."""

from __future__ import annotations

import pytest
import torch

import hora as hvd
from tests.distributed.expect import close, rank_input, reduce
from tests.distributed.harness import run_ranks

DTYPES = [torch.float32, torch.float64, torch.int32, torch.float16, torch.bfloat16, torch.uint8]
OPS = [hvd.Sum, hvd.Average, hvd.Max, hvd.Min, hvd.Product]


def _case(i: int, size: int) -> tuple[list[torch.Tensor], hvd.ReduceOp, float, float]:
    dtype = DTYPES[i % len(DTYPES)]
    op = OPS[i % len(OPS)]
    if not dtype.is_floating_point and op == hvd.Average:
        op = hvd.Sum
    pre, post = ((1.0, 1.0), (0.5, 2.0), (2.0, 1.0), (1.0, 0.25))[i % 4] if dtype.is_floating_point else (1.0, 1.0)
    return [rank_input(r, (i % 7 + 1, 2), dtype, salt=i) for r in range(size)], op, pre, post


def _mixed_in_flight(rank: int, size: int) -> int:
    odd = hvd.add_process_set([r for r in range(size) if r % 2 == 1] or [0])
    handles = []
    for i in range(36):
        inputs, op, pre, post = _case(i, size)
        name = f"mix{i}" if i % 3 else None  # named and unnamed side by side
        if i % 9 == 4 and odd.included():
            h = hvd.allreduce_async(inputs[rank], op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                    process_set=odd)
            handles.append((h, reduce([inputs[r] for r in odd.ranks], op, pre, post), f"#{i} on {odd.ranks}"))
        elif i % 9 != 4:
            t = inputs[rank].clone()
            async_fn = hvd.allreduce_async_ if i % 2 else hvd.allreduce_async
            h = async_fn(t, op=op, name=name, prescale_factor=pre, postscale_factor=post)
            handles.append((h, reduce(inputs, op, pre, post), f"#{i} {inputs[0].dtype} {op.name} {pre} {post}"))
    for h, want, what in reversed(handles):
        tol = {"atol": 2e-2, "rtol": 2e-2} if want.dtype in (torch.float16, torch.bfloat16) else {}
        close(hvd.synchronize(h), want, what, **tol)
    return len(handles)


KNOB_SETS = {
    "default": {},
    "tiny fusion buffer": {"HORA_FUSION_THRESHOLD": "64"},
    "fusion off": {"HORA_FUSION_THRESHOLD": "0"},
    "cache off": {"HORA_DISABLE_CACHE": "1"},
}


@pytest.mark.parametrize("knobs", list(KNOB_SETS))
def test_many_small_ops_in_flight_are_kept_apart(knobs: str) -> None:
    counts = run_ranks(_mixed_in_flight, 3, env=KNOB_SETS[knobs])
    assert counts == [32, 36, 32]  # rank 1 is the only member of the odd set


def _reused_names(rank: int, size: int) -> list[str]:
    seen = []
    for step in range(4):  # identical metadata: answered from the cache after the first time
        x = [rank_input(r, (3,), torch.float32, salt=step) for r in range(size)]
        close(hvd.allreduce(x[rank], op=hvd.Sum, name="w"), reduce(x, hvd.Sum), f"cached name, step {step}")
    for shape, dtype in (((5,), torch.float32), ((5,), torch.float64), ((2, 2), torch.int64)):
        x = [rank_input(r, shape, dtype, salt=9) for r in range(size)]
        close(hvd.allreduce(x[rank], op=hvd.Sum, name="w"), reduce(x, hvd.Sum), f"name reused as {shape} {dtype}")
    # rank 0 repeats metadata the cache knows, the others send something new: still a mismatch
    shape = (2, 2) if rank == 0 else (4,)
    with pytest.raises(hvd.CollectiveMismatchError) as info:
        hvd.allreduce(torch.ones(shape, dtype=torch.int64), op=hvd.Sum, name="w")
    seen.append(",".join(info.value.fields))
    x = [rank_input(r, (2, 2), torch.int64, salt=3) for r in range(size)]
    close(hvd.allreduce(x[rank], op=hvd.Sum, name="w"), reduce(x, hvd.Sum), "the name works after the mismatch")
    # the same name as a different kind, consistently on every rank, is fine
    close(hvd.allgather(x[rank], name="w"), torch.cat(x), "name reused by an allgather")
    return seen


@pytest.mark.parametrize("knobs", ["default", "cache off"])
def test_reused_names_with_new_metadata(knobs: str) -> None:
    assert run_ranks(_reused_names, 2, env=KNOB_SETS[knobs]) == [["shape"], ["shape"]]


def _hundreds_at_once(rank: int, size: int) -> bool:
    n = 300  # one round's requests far exceed the control plane's fixed slot
    handles = [hvd.allreduce_async(torch.full((i % 3 + 1,), float(i + rank)), op=hvd.Sum) for i in range(n)]
    sums = [hvd.synchronize(h) for h in handles]
    gathers = [hvd.allgather_async(torch.full((rank + 1,), float(i)), name=f"g{i}") for i in range(n)]
    for i in reversed(range(n)):
        close(hvd.synchronize(gathers[i]), torch.full((size * (size + 1) // 2,), float(i)), f"allgather #{i}")
        close(sums[i], torch.full((i % 3 + 1,), float(size * i + size * (size - 1) // 2)), f"allreduce #{i}")
    return True


def test_hundreds_of_ops_submitted_at_once() -> None:
    assert run_ranks(_hundreds_at_once, 2) == [True, True]
