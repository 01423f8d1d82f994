"""The op path's records (calls/call.py, datapath/kinds/op.py): a Call is frozen once built, what the steps compute
lives on its Op, and a stack trace through the engine's launch names the kind's step, never a lambda."""

from __future__ import annotations

import dataclasses
import traceback
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hora.calls.call import Call, Site
from hora.common.process_sets import global_process_set
from hora.datapath.kinds import KINDS
from hora.datapath.kinds.op import Kind, Op, Peers
from hora.datapath.reduce_ops import ReduceOp
from hora.diagnostics.board import Board
from hora.diagnostics.inflight import InflightWatch
from hora.diagnostics.stall_report import StallPolicy
from hora.engine.scheduling.dispatch import Dispatcher
from hora.engine.scheduling.handles import Handle
from hora.engine.scheduling.pending import local_op
from hora.engine.scheduling.table import Entry, Request
from hora.errors import CollectiveError


def test_a_call_is_frozen_and_its_op_holds_what_the_steps_compute() -> None:
    tensor = torch.tensor([1.0, 2.0, 3.0])
    call = Call(Kind.ALLREDUCE, tensor, "x", global_process_set, reduce_op=ReduceOp.SUM)
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.name = "y"  # type: ignore[misc]
    op = Op(call, KINDS[Kind.ALLREDUCE], members=1)
    op.steps.prepare(op)
    assert op.wire.data_ptr() != tensor.data_ptr()  # not in place: the caller's tensor is never the wire
    op.wire.mul_(2)  # what a 2-rank sum of equal tensors would leave in the wire
    assert op.steps.finish(op).tolist() == [2.0, 4.0, 6.0]
    assert tensor.tolist() == [1.0, 2.0, 3.0] and call.tensor is tensor


def test_given_keeps_every_field_but_the_name_and_site() -> None:
    """submit() names a call with Call.given, which lists the fields by hand: a field added later must be
    passed on too."""
    from hora.datapath.wire import Compression

    call = Call(Kind.ALLREDUCE, torch.ones(2), "", global_process_set, reduce_op=ReduceOp.AVERAGE, root=1,
                prescale=2.0, postscale=3.0, splits=(1, 1), compression=Compression.fp16, inplace=True,
                rejected=ValueError("x"))
    site = Site(7, "here.py:1")
    named = call.given("n", site)
    assert (named.name, named.site) == ("n", site)
    kept = [f.name for f in dataclasses.fields(Call) if f.name not in ("name", "site")]
    assert [getattr(named, f) for f in kept] == [getattr(call, f) for f in kept]


class _Failing:
    """A kind whose launch fails, and keeps the stack it was called from."""

    stack: list[traceback.FrameSummary] = []

    @staticmethod
    def prepare(op: Op) -> None:
        op.wire = op.call.tensor

    @staticmethod
    def launch(op: Op, peers: Peers) -> Any:
        _Failing.stack = traceback.extract_stack()
        raise RuntimeError("the backend refused")

    @staticmethod
    def launch_joined(peers: Peers) -> Any:
        return None

    @staticmethod
    def finish(op: Op) -> Any:
        return op.wire


def test_a_launch_failure_reaches_the_handle_and_the_stack_names_the_kinds_step() -> None:
    """The engine's dispatcher calls the kind's launch itself (no lambda, no wrapper between them), and a launch
    that fails fails its handle with the reason."""
    op = Op(Call(Kind.ALLREDUCE, torch.zeros(1), "x", global_process_set), _Failing)  # type: ignore[arg-type]
    op.steps.prepare(op)
    request = Request("x", "broadcast", "float32", (1,), ps=(0,))  # not fused, not inline: one launch
    handle = Handle("x", "broadcast", op, on_done=lambda h: None)
    mine = local_op(request, op, handle)
    group = object()
    ps = SimpleNamespace(ranks=[0], group=group)
    unwatched = InflightWatch(Board(None, "", 0), 0, StallPolicy(enabled=False))
    dispatcher = Dispatcher(0, {0: ps}, lambda name: mine, fusion_threshold=0, inflight=unwatched)
    dispatcher.run([Entry("x", {0: request}, 0, 0.0, arrival={0: 0})], frozenset())
    with pytest.raises(CollectiveError, match="broadcast 'x' could not start on rank 0: the backend refused"):
        handle.wait()
    hora = [f.name for f in _Failing.stack if "/src/hora/" in f.filename]
    assert [f.name for f in _Failing.stack[-2:]] == ["_launch_one", "launch"] and "<lambda>" not in hora
    assert _Failing.stack[-2].filename.endswith("engine/scheduling/dispatch.py")


def test_peers_show_each_members_rows_not_the_table() -> None:
    a = Request("g", "allgather", "float32", (2, 3), ps=(0, 1, 2))
    b = Request("g", "allgather", "float32", (5, 3), ps=(0, 1, 2))
    peers = Peers(None, 0, a, {0: a, 2: b}, {0: 1, 2: 3})  # type: ignore[arg-type]  # rank 1 has joined
    assert peers.rows() == [2, 0, 5]
    assert peers.last_joined() == 2
