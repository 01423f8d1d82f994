"""The steps of the kinds without data: barrier and join."""

from __future__ import annotations

from hora.datapath import c10d as dataplane
from hora.datapath.c10d import Work
from hora.datapath.kinds.op import Op, Peers


class Barrier:
    @staticmethod
    def prepare(op: Op) -> None:
        op.wire = op.call.tensor

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work:
        return dataplane.barrier(peers.group)

    @staticmethod
    def launch_joined(peers: Peers) -> Work:
        return dataplane.barrier(peers.group)

    @staticmethod
    def finish(op: Op) -> None:
        return None


class Join:
    """Ready once every rank has joined; the result is the rank whose join arrived last."""

    @staticmethod
    def prepare(op: Op) -> None:
        op.wire = op.call.tensor

    @staticmethod
    def launch(op: Op, peers: Peers) -> None:
        op.last_joined = peers.last_joined()

    @staticmethod
    def launch_joined(peers: Peers) -> None:
        return None

    @staticmethod
    def finish(op: Op) -> int:
        return op.last_joined
