"""``hvd.sparse_allreduce_async``: a sparse COO tensor reduced by allgathering its indices and values.

Example:
    >>> h = hvd.sparse_allreduce_async(grad, name="emb", op=hvd.Average)   # doctest: +SKIP
    >>> hvd.synchronize(h)                                                 # doctest: +SKIP  (coalesced sparse)
"""

from __future__ import annotations

from typing import Any

import torch

from hora.calls.call import UNKNOWN, Call, current, resolved_op
from hora.calls.submit import submit_many
from hora.common.process_sets import ProcessSet, global_process_set
from hora.datapath.kinds.op import Kind
from hora.datapath.reduce_ops import ReduceOp, average_values
from hora.engine.scheduling.handles import GroupHandle
from hora.errors import InvalidCallError
from hora.runtime import newcomer


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = ReduceOp.AVERAGE,
                           process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Allreduce a sparse COO tensor by allgathering its indices and values; ``synchronize`` returns a
    coalesced sparse tensor. Average divides the values by the set's size."""
    neg = newcomer.join("hvd.sparse_allreduce_async()").negotiator
    site = current() if neg.site_check and not name else UNKNOWN
    rop, rejected = resolved_op(op, None)
    if rejected is None and rop not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        rejected = InvalidCallError(f"sparse allreduce supports Average and Sum, not {rop.name.capitalize()}")
    indices = values = torch.empty(0)
    try:
        t = tensor.coalesce()
        indices, values = t.indices().t().contiguous(), t.values().contiguous()
    except (AttributeError, RuntimeError, TypeError) as e:
        rejected = rejected or TypeError(f"sparse_allreduce_async needs a sparse COO tensor: {e}")
    # both allgathers are named after one sequence number, which a rejected call takes too (submit_many)
    member = process_set.process_set_id is not None and process_set.included()
    base = name or (neg.unnamed(process_set.process_set_id) if member else "")
    calls = [Call(Kind.ALLGATHER, part, f"{base}.{what}" if base else "", process_set, site=site,
                  rejected=rejected) for part, what in ((indices, "indices"), (values, "values"))]
    handles = submit_many(calls)
    n, shape = process_set.size(), tensor.shape

    def combine(results: list[torch.Tensor]) -> torch.Tensor:
        indices, values = results
        return torch.sparse_coo_tensor(indices.t(), average_values(values, rop, n), shape).coalesce()

    return GroupHandle(handles, combine)
