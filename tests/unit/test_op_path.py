"""The op path's records (datapath/kinds.py): a Call is frozen once built, what the steps compute lives on its Op,
and a stack trace through the engine's launch names the kind, never a lambda."""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

import pytest
import torch

from hora.common.process_sets import global_process_set
from hora.datapath.kinds import KINDS, Call, Kind, Op, Peers, Request
from hora.datapath.reduce_ops import ReduceOp


def test_a_call_is_frozen_and_its_op_holds_what_the_steps_compute() -> None:
    tensor = torch.tensor([1.0, 2.0, 3.0])
    call = Call(Kind.ALLREDUCE, tensor, "x", global_process_set, op=ReduceOp.SUM)
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.name = "y"  # type: ignore[misc]
    op = Op(call, KINDS[Kind.ALLREDUCE], members=1)
    op.prepare()
    assert op.wire.data_ptr() != tensor.data_ptr()  # not in place: the caller's tensor is never the wire
    op.wire.mul_(2)  # what a 2-rank sum of equal tensors would leave in the wire
    assert op.finish().tolist() == [2.0, 4.0, 6.0]
    assert tensor.tolist() == [1.0, 2.0, 3.0] and call.tensor is tensor


def test_given_keeps_every_field_but_the_name_and_site() -> None:
    """submit() names a call with Call.given, which lists the fields by hand: a field added later must be
    passed on too."""
    from hora.datapath.compression import Compression
    from hora.diagnostics import callsite

    call = Call(Kind.ALLREDUCE, torch.ones(2), "", global_process_set, op=ReduceOp.AVERAGE, root=1, prescale=2.0,
                postscale=3.0, splits=(1, 1), compression=Compression.fp16, inplace=True,
                rejected=ValueError("x"))
    site = callsite.Site(7, "here.py:1")
    named = call.given("n", site)
    assert (named.name, named.site) == ("n", site)
    kept = [f.name for f in dataclasses.fields(Call) if f.name not in ("name", "site")]
    assert [getattr(named, f) for f in kept] == [getattr(call, f) for f in kept]


class _Failing:
    """A kind whose launch fails, to see what a stack trace through the engine shows."""

    @staticmethod
    def prepare(op: Op) -> None:
        op.wire = op.call.tensor

    @staticmethod
    def launch(op: Op, peers: Peers) -> Any:
        raise RuntimeError("the backend refused")

    @staticmethod
    def launch_joined(peers: Peers) -> Any:
        return None

    @staticmethod
    def finish(op: Op) -> Any:
        return op.wire


def test_a_launch_failure_names_the_kind_in_its_stack() -> None:
    op = Op(Call(Kind.ALLREDUCE, torch.zeros(1), "x", global_process_set), _Failing)  # type: ignore[arg-type]
    request = Request("x", "allreduce", "float32", (1,), ps=(0,))
    with pytest.raises(RuntimeError) as caught:
        op.launch(Peers(None, 0, request, {0: request}, {0: 1}))  # type: ignore[arg-type]
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert [f.name for f in frames[-2:]] == ["launch", "launch"] and "<lambda>" not in [f.name for f in frames]
    assert frames[-2].filename.endswith("kinds.py") and frames[-2].line == "return self.steps.launch(self, peers)"
    assert frames[-1].filename == __file__  # the kind's own launch


def test_peers_show_each_members_rows_not_the_table() -> None:
    a = Request("g", "allgather", "float32", (2, 3), ps=(0, 1, 2))
    b = Request("g", "allgather", "float32", (5, 3), ps=(0, 1, 2))
    peers = Peers(None, 0, a, {0: a, 2: b}, {0: 1, 2: 3})  # type: ignore[arg-type]  # rank 1 has joined
    assert peers.rows() == [2, 0, 5]
    assert peers.last_joined() == 2
