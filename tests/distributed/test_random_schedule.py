"""A seeded random mix of named async collectives over overlapping process sets, submitted and synchronized
in a different random order on every rank: the negotiator must match them all by name and get every result
right (fusion, ordering and process sets together)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import hora as hvd
from tests.distributed.expect import close, rank_input, reduce, split_sizes
from tests.distributed.harness import run_ranks

SETS = {"all": None, "low": [0, 1], "high": [1, 2]}
DTYPES = [torch.float32, torch.float64, torch.int64, torch.float16, torch.int32]


def _plan(seed: int, size: int) -> list[dict[str, Any]]:
    """The same list of ops on every rank."""
    rng = random.Random(seed)
    ops = []
    for i in range(40):
        kind = rng.choice(["allreduce", "allreduce", "allgather", "broadcast", "alltoall", "reducescatter"])
        dtype = rng.choice(DTYPES)
        op = rng.choice([hvd.Sum, hvd.Max, hvd.Min] + ([hvd.Average] if dtype.is_floating_point else []))
        if kind == "reducescatter":
            op = hvd.Sum
        ops.append({"name": f"r{seed}.{i}", "kind": kind, "set": rng.choice(list(SETS)), "dtype": dtype, "op": op,
                    "rows": rng.randint(1, 5), "root_pick": rng.randrange(size), "salt": i})
    return ops


def _submit(spec: dict[str, Any], ps: hvd.ProcessSet, members: list[int], rank: int) -> tuple[Any, torch.Tensor]:
    """Submit one op; return its handle and the expected result on this rank."""
    n, me, dtype, salt = len(members), members.index(rank), spec["dtype"], spec["salt"]
    name, kind = spec["name"], spec["kind"]
    if kind == "allreduce":
        xs = {r: rank_input(r, (spec["rows"], 2), dtype, salt) for r in members}
        return (hvd.allreduce_async(xs[rank], op=spec["op"], name=name, process_set=ps),
                reduce([xs[r] for r in members], spec["op"]))
    if kind == "allgather":
        xs = {r: rank_input(r, (spec["rows"] + r, 3), dtype, salt) for r in members}
        return hvd.allgather_async(xs[rank], name=name, process_set=ps), torch.cat([xs[r] for r in members])
    if kind == "broadcast":
        root = members[spec["root_pick"] % n]
        xs = {r: rank_input(r, (spec["rows"],), dtype, salt) for r in members}
        return hvd.broadcast_async(xs[rank], root, name=name, process_set=ps), xs[root]
    if kind == "alltoall":
        xs = {r: rank_input(r, (n * spec["rows"], 2), dtype, salt) for r in members}
        want = torch.cat([xs[r][me * spec["rows"]:(me + 1) * spec["rows"]] for r in members])
        splits = [spec["rows"]] * n
        return hvd.alltoall_async(xs[rank], splits=splits, name=name, process_set=ps), want
    rows = n * spec["rows"] + 1
    xs = {r: rank_input(r, (rows, 2), dtype, salt) for r in members}
    counts = split_sizes(rows, n)
    start = sum(counts[:me])
    return (hvd.reducescatter_async(xs[rank], op=hvd.Sum, name=name, process_set=ps),
            reduce([xs[r] for r in members], hvd.Sum)[start:start + counts[me]])


def _random_schedule(rank: int, size: int, seed: int) -> int:
    sets = {"all": hvd.global_process_set, "low": hvd.add_process_set(SETS["low"]),
            "high": hvd.add_process_set(SETS["high"])}
    mine = [s for s in _plan(seed, size) if rank in sets[s["set"]].ranks]
    rng = random.Random(seed * 100 + rank)  # every rank its own order
    rng.shuffle(mine)
    pending: list[tuple[str, Any, torch.Tensor]] = []
    for spec in mine:
        ps = sets[spec["set"]]
        handle, want = _submit(spec, ps, ps.ranks, rank)
        pending.append((f"{spec['name']} {spec['kind']} {spec['dtype']} on {ps.ranks}", handle, want))
    rng.shuffle(pending)
    for what, handle, want in pending:
        out = hvd.synchronize(handle)
        if isinstance(out, tuple):  # alltoall with splits
            out = out[0]
        tol = {"atol": 1e-2, "rtol": 1e-2} if want.dtype == torch.float16 else {}
        close(out, want, what, **tol)
    return len(pending)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_mix_of_named_async_ops_in_random_orders(seed: int) -> None:
    counts = run_ranks(_random_schedule, 3, seed)
    plan = _plan(seed, 3)
    assert counts == [sum(1 for s in plan if r in (SETS[s["set"]] or [0, 1, 2])) for r in range(3)]
