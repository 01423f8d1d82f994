"""The gradient reducer for ``DistributedOptimizer(op=hvd.Adasum)``, chosen once when the optimizer is built.

As in Horovod, Adasum combines each rank's optimizer *update*, not its gradient: in a parameter's gradient
hook the wrapped optimizer takes a local step on that parameter alone, the update (after - before) goes into
the parameter's own bucket (Adasum is defined per tensor: one bucket per parameter) and the parameter is put
back; ``synchronize()`` adds the combined update (so ``step()`` does not step again). Everything else
(hooks, passes, the step state, re-planning, shutdown/init) is :class:`hora.training.reducer.GradientReducer`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora.calls.call import Call
from hora.calls.submit import submit
from hora.datapath.kinds.op import Kind
from hora.datapath.reduce_ops import Adasum, ReduceOp
from hora.datapath.wire import Compressor
from hora.errors import UnsupportedCallError
from hora.training.buckets import FlatBucket
from hora.training.reducer import GradientReducer


class AdasumReducer(GradientReducer):
    """Reduces each parameter's local update with Adasum across ``process_set`` (a power-of-two size).

    Args:
        local_step: the wrapped optimizer's step on one parameter alone.
    """

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], groups: Sequence[int], *,
                 compression: Compressor, sparse_as_dense: bool, process_set: Any, backward_passes_per_step: int,
                 local_step: Callable[[torch.Tensor], None]) -> None:
        size = process_set.size()
        if size & (size - 1):
            raise UnsupportedCallError(f"op=hvd.Adasum needs a power-of-two number of ranks, got {size}: run "
                                       "with 2, 4, 8... ranks or use op=hvd.Average")
        super().__init__(params, names, groups, compression=compression, op=Adasum, gradient_predivide_factor=1.0,
                         sparse_as_dense=sparse_as_dense, process_set=process_set,
                         backward_passes_per_step=backward_passes_per_step)
        self.local_step = local_step
        self._starts: dict[int, torch.Tensor] = {}  # parameter values before the local step

    @property
    def updates_params(self) -> bool:
        return True

    def _caps(self) -> tuple[int, int]:
        return 0, 0  # one bucket per parameter

    @torch.no_grad()
    def _fill(self, bucket: FlatBucket, k: int, index: int) -> None:
        """Put this parameter's local update (after - before its own optimizer step) in its slot."""
        view = bucket.views[k]
        p = self.params[index]
        if p.grad is None:
            view.zero_()
            return
        start = self._starts.get(index)
        if start is None:
            start = self._starts[index] = torch.empty_like(p)
        start.copy_(p)
        self.local_step(p)
        torch.sub(p.reshape(-1), start.reshape(-1), out=view)
        p.copy_(start)  # unchanged until synchronize() adds the combined update

    def _launch(self, name: str, wire: torch.Tensor) -> Any:
        return submit(Call(Kind.ADASUM, wire, name, self.process_set, reduce_op=ReduceOp.ADASUM, inplace=True))

    @torch.no_grad()
    def _write_back(self, bucket: FlatBucket, out: torch.Tensor) -> None:
        for k, index in enumerate(bucket.plan.params):
            p = self.params[index]
            p.add_(out.narrow(0, bucket.plan.offsets[k], bucket.plan.numels[k]).view_as(p))
