"""The broadcast's steps: the root's tensor, received in place by every other member (a copy of the caller's
tensor unless the call is in place)."""

from __future__ import annotations

import torch

from hora.datapath import c10d as dataplane
from hora.datapath.c10d import Work
from hora.datapath.kinds.op import Op, Peers
from hora.datapath.wire import copy_out, from_wire, to_wire


class Broadcast:
    @staticmethod
    def prepare(op: Op) -> None:
        call = op.call
        op.wire = to_wire(call.tensor, copy=not call.inplace)

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work | None:
        if op.wire.numel() == 0:
            return None
        return dataplane.broadcast(op.wire, op.call.root, peers.group)

    @staticmethod
    def launch_joined(peers: Peers) -> Work | None:
        req = peers.agreed
        if torch.Size(req.shape).numel() == 0:
            return None  # the members skip empty tensors too
        return dataplane.broadcast(peers.zeros(), req.root, peers.group)

    @staticmethod
    def finish(op: Op) -> torch.Tensor:
        call = op.call
        return copy_out(from_wire(op.wire, call.tensor.dtype, call.reduce_op), call.tensor, call.inplace)
