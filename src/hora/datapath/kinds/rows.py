"""The steps of the kinds whose members send different numbers of rows: allgather and alltoall.

Both send the caller's rows as they are (an int16 is widened) and learn at launch how many rows each member
sends (:meth:`~hora.datapath.kinds.op.Peers.rows`, :meth:`~hora.datapath.kinds.op.Peers.received_rows`); a
joined member sends none.
"""

from __future__ import annotations

import torch

from hora.datapath import c10d as dataplane
from hora.datapath import streams
from hora.datapath.c10d import Work
from hora.datapath.kinds.op import Op, Peers
from hora.datapath.wire import from_wire, to_wire


def _prepare_rows(op: Op) -> None:
    """The caller's rows as they are (an int16 is widened): a gather or an exchange only reads them."""
    op.wire = to_wire(op.call.tensor, copy=False)


class Allgather:
    prepare = staticmethod(_prepare_rows)

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work:
        op.rows = rows = peers.rows()
        op.out, work = dataplane.gather_rows(op.wire, rows, peers.group)
        return work

    @staticmethod
    def launch_joined(peers: Peers) -> Work:
        return dataplane.gather_rows(peers.zeros(rows=0), peers.rows(), peers.group)[1]

    @staticmethod
    def finish(op: Op) -> torch.Tensor:
        call = op.call
        streams.consumed_here(op.out)
        return from_wire(dataplane.unpad_rows(op.out, op.rows), call.tensor.dtype,  # type: ignore[arg-type]
                         call.reduce_op)


class Alltoall:
    prepare = staticmethod(_prepare_rows)

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work:
        call = op.call
        op.rows = recv = peers.received_rows(op.index)
        rest = tuple(op.wire.shape[1:])
        op.out = torch.empty((sum(recv), *rest), dtype=op.wire.dtype, device=op.wire.device)
        return dataplane.alltoall(op.out, op.wire, recv, list(call.splits or ()), peers.group)

    @staticmethod
    def launch_joined(peers: Peers) -> Work:
        """Sends no rows; receives (and drops) the rows the members send it."""
        recv = peers.received_rows(peers.index())
        out = peers.zeros(rows=sum(recv))
        return dataplane.alltoall(out, peers.zeros(rows=0), recv, [0] * len(peers.agreed.ps), peers.group)

    @staticmethod
    def finish(op: Op) -> tuple[torch.Tensor, torch.Tensor]:
        call = op.call
        streams.consumed_here(op.out)
        return from_wire(op.out, call.tensor.dtype, call.reduce_op), torch.tensor(op.rows, dtype=torch.int32)
