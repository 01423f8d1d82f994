"""Fusion planning (hora.engine.scheduling.dispatch): which allreduces travel together, and the inline reduction every
rank computes on the same bytes; pure logic every rank runs on the same inputs."""

from __future__ import annotations

import torch

from hora.datapath.reduce_ops import ReduceOp
from hora.engine.scheduling.dispatch import inline_bytes, plan_batches, reduce_inline
from hora.engine.scheduling.table import Entry, Request


def _request(name: str, nbytes: int, op: int = 1, dtype: str = "float32") -> Request:
    return Request(name, "allreduce", dtype, (nbytes // 4,), reduce_op=op, ps=(0, 1))


def test_fusion_groups_consecutive_small_compatible_allreduces_only() -> None:
    reqs = [_request("a", 64), _request("b", 64), _request("big", 4 << 20), _request("c", 64),
            _request("d", 64, op=int(ReduceOp.MAX)), _request("e", 64, op=int(ReduceOp.MAX))]
    batches = plan_batches(reqs, threshold=64 << 20)
    assert [[reqs[i].name for i in b] for b in batches] == [["a", "b"], ["big"], ["c"], ["d", "e"]]
    assert [[reqs[i].name for i in b] for b in plan_batches(reqs[:2], threshold=0)] == [["a"], ["b"]]


def test_inline_reduction_is_the_same_arithmetic_on_every_rank() -> None:
    r = Request("x", "allreduce", "float32", (2,), reduce_op=int(ReduceOp.SUM), ps=(0, 1, 2))
    entry = Entry("x", {0: r, 1: r, 2: r}, 0, 0.0)
    for rank in range(3):
        entry.inline[rank] = inline_bytes(r, torch.tensor([rank + 1.0, -rank]))  # type: ignore[assignment]
    assert reduce_inline(entry.first, entry.inline).tolist() == [6.0, -3.0]
    big = Request("y", "allreduce", "float32", (1024,), ps=(0, 1))
    assert inline_bytes(big, torch.zeros(1024)) is None  # too large: goes on the data plane
