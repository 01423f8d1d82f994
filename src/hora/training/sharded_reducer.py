"""The gradient reducer of ``DistributedOptimizer(sharding="gradients")`` (ZeRO-2): each rank keeps only the
reduced gradients of the parameters it owns (:mod:`hora.training.sharding`), so gradient memory per rank is
about ``1/size`` of the model plus a few buckets.

Per backward pass, as the unsharded reducer does but with buffers that are lent, not kept:

1. **fill** (gradient hooks): a bucket takes a flat buffer from a small pool at its first gradient; each
   gradient is copied (scaled, cast when compressing) into its slot, laid out by owner
   (:func:`hora.training.shard_plan.layout`), and ``p.grad`` is dropped at once, so autograd's gradient of a
   parameter lives only until its hook ran. A full bucket is submitted at once.
2. **end of the pass** (autograd's final callback): buckets not yet submitted this pass (parameters that got
   no gradient) are completed with zeros (or what ``p.grad`` holds) and submitted, as Horovod does.
3. **land** (when a buffer is needed again, and in ``synchronize()``): the reduced owned slots are written (or
   added, for the later passes of ``backward_passes_per_step``) into this rank's owned gradients, and the
   buffer goes back to the pool.

``backward_passes_per_step`` therefore reduces *every* pass and accumulates the owned results: gradient
memory stays ``1/size`` during accumulation, at one reduction per pass (``sharding="optimizer"`` accumulates
locally and reduces once per step instead). After ``synchronize()`` the owned parameters' ``.grad`` hold the
reduced gradients and the others' are ``None``.

The collective per bucket is an allreduce, or a reduce-scatter of equal owner segments
(``HORA_SHARDED_REDUCE``): Gloo's reduce-scatter measured slower than its allreduce on loopback
(docs/performance.md), so ``auto`` reduce-scatters CUDA buckets only, and never a bucket whose equal
segments would be mostly padding (one large parameter).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora.calls.call import Call
from hora.calls.submit import submit
from hora.datapath.kinds.op import Kind
from hora.datapath.reduce_ops import ReduceOp
from hora.datapath.wire import cast_scaled, wire_dtype
from hora.engine.scheduling import handles
from hora.errors import ConfigError
from hora.runtime import lifecycle as runtime
from hora.training.reducer import GradientReducer, Step
from hora.training.shard_plan import ShardLayout, layout
from hora.training.sharding import Sharding

log = logging.getLogger(__name__)

REDUCE_MODES = ("auto", "allreduce", "reducescatter")
POOL_BUFFERS = 2  # buffers per (dtype, device): one filling while one is on the wire (docs/performance.md)
PADDING_LIMIT = 1.25  # a reduce-scatter bucket may be at most this much longer than its gradients


class ShardBucket:
    """One bucket of a sharded reducer: its layout and name, and per pass the buffer it borrowed."""

    __slots__ = ("buffer", "ctx", "filled", "handle", "landed", "layout", "mine", "name", "pending", "scatter",
                 "sent", "views", "wire")

    def __init__(self, lay: ShardLayout, name: str, member: int, scatter: bool) -> None:
        self.layout = lay
        self.name = name
        self.scatter = scatter  # reduce-scatter (equal owner segments) rather than allreduce
        self.mine = [k for k, owner in enumerate(lay.owners) if owner == member]  # positions this rank owns
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.filled = [False] * len(lay.params)
        self.pending = len(lay.params)
        self.handle: Any = None
        self.ctx: Any = None
        self.wire: torch.Tensor | None = None
        self.sent = False  # submitted in this pass
        self.landed = False  # some pass of this step landed already: later ones add

    @property
    def key(self) -> tuple[torch.dtype, torch.device]:
        return self.layout.dtype, self.layout.device

    def lend(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.views = [buffer.narrow(0, o, n) for o, n in zip(self.layout.offsets, self.layout.numels)]

    def reset(self) -> None:
        """Forget this pass (a reset of the world): no buffer, nothing in flight."""
        self.buffer, self.views, self.handle, self.ctx, self.wire = None, [], None, None, None
        self.filled = [False] * len(self.layout.params)
        self.pending = len(self.layout.params)
        self.sent = self.landed = False


class BufferPool:
    """Flat buffers lent to buckets, per (wire dtype, device), each as long as that key's longest bucket."""

    def __init__(self) -> None:
        self.free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self.made: dict[tuple[torch.dtype, torch.device], int] = {}
        self.numel: dict[tuple[torch.dtype, torch.device], int] = {}

    def plan(self, buckets: Sequence[ShardBucket], dtype_of: Callable[[ShardBucket], torch.dtype]) -> None:
        self.free, self.made, self.numel = {}, {}, {}
        for b in buckets:
            key = (dtype_of(b), b.layout.device)
            self.numel[key] = max(self.numel.get(key, 0), b.layout.numel)

    def take(self, key: tuple[torch.dtype, torch.device]) -> torch.Tensor | None:
        free = self.free.get(key)
        return free.pop() if free else None

    def can_make(self, key: tuple[torch.dtype, torch.device]) -> bool:
        return self.made.get(key, 0) < POOL_BUFFERS

    def make(self, key: tuple[torch.dtype, torch.device]) -> torch.Tensor:
        self.made[key] = self.made.get(key, 0) + 1
        return torch.empty(self.numel[key], dtype=key[0], device=key[1])

    def give(self, key: tuple[torch.dtype, torch.device], buffer: torch.Tensor) -> None:
        self.free.setdefault(key, []).append(buffer)


class ShardedGradientReducer(GradientReducer):
    """Reduces gradients in lent buckets; keeps only the owned parameters' reduced gradients."""

    sharding: Sharding  # set by DistributedOptimizer right after both are built

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buckets: list[ShardBucket] = []  # type: ignore[assignment]
        self.slots: list[tuple[ShardBucket, int] | None] = [None] * len(self.params)  # type: ignore[assignment]
        self.pool = BufferPool()
        self.owned_grads: dict[int, torch.Tensor] = {}
        self._in_flight: list[ShardBucket] = []
        self._pass_open = False

    # -- planning ---------------------------------------------------------------------------------------
    def ensure_plan(self) -> None:
        part = self.sharding.partition()
        key = (tuple(p.requires_grad for p in self.params), len(self._sparse_seen), part.world)
        if key == self._plan_key:
            return
        self._plan_key = key  # type: ignore[assignment]
        self.register_hooks()
        self._generation += 1
        mode = runtime.state("DistributedOptimizer's first backward").knobs.sharded_reduce
        if mode not in REDUCE_MODES:
            raise ConfigError(f"HORA_SHARDED_REDUCE={mode!r}: use one of {', '.join(REDUCE_MODES)}")
        self.slots = [None] * len(self.params)
        self.buckets = []
        for b, plan in enumerate(self.sharding.trainable_plans(self._caps())):  # autotune's caps, if it runs
            scatter = self._scatters(mode, plan.device) and self._cast_only
            lay = layout(plan, part.owners, part.size, padded=scatter)
            if scatter and lay.numel > PADDING_LIMIT * sum(lay.numels):
                scatter, lay = False, layout(plan, part.owners, part.size)
            bucket = ShardBucket(lay, self.naming.bucket(self._generation, b), part.member, scatter)
            self.buckets.append(bucket)
            for k, index in enumerate(lay.params):
                self.slots[index] = (bucket, k)
        self.pool.plan(self.buckets, self._wire_dtype)
        owned = {i for b in self.buckets for i in (b.layout.params[k] for k in b.mine)}
        self.owned_grads = {i: self.owned_grads.get(i, torch.zeros_like(self.params[i])) for i in sorted(owned)}
        self._in_flight = []

    def step_bytes(self) -> int:
        """Bytes of gradient this reducer puts on the wire in a backward pass (autotune's score)."""
        if not self._reduce:
            return 0
        return sum(b.layout.numel * self._wire_dtype(b).itemsize for b in self.buckets)

    @staticmethod
    def _scatters(mode: str, device: torch.device) -> bool:
        return mode == "reducescatter" or (mode == "auto" and device.type == "cuda")

    def _wire_dtype(self, bucket: ShardBucket) -> torch.dtype:
        return wire_dtype(self.compression, bucket.layout.dtype) if self._cast_only else bucket.layout.dtype

    def _take_ddp(self, modules: list[Any]) -> None:
        super()._take_ddp(modules)
        if self._ddp:
            raise ValueError("sharding='gradients' cannot leave gradients to DistributedDataParallel (the model is "
                             "also wrapped in DDP): drop the DDP wrapper, or use sharding='optimizer'")

    # -- fill, from the hooks ---------------------------------------------------------------------------
    def _on_grad(self, index: int) -> None:
        if self.state is not Step.FILLING or self.process_set.group is not self._group:
            self._begin_step()
        if not self._reduce:
            return  # alone: every parameter is this rank's, its gradient stays as autograd made it
        n = self.passes[index] + 1
        self.passes[index] = n
        if n > self.bpps:
            raise ValueError(
                f"gradient of {self.names[index]!r} was computed {n} times before optimizer.step(), more than "
                f"backward_passes_per_step={self.bpps}: pass backward_passes_per_step=<passes per step> to "
                "DistributedOptimizer (or call set_backward_passes_per_step) to accumulate")
        if not self._pass_open:
            self._pass_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)  # type: ignore[attr-defined]
        slot = self.slots[index]
        if slot is None:
            return  # no longer requires grad
        bucket, k = slot
        self._put(bucket, k)
        if bucket.pending == 0:
            self._submit_bucket(bucket)

    def _put(self, bucket: ShardBucket, k: int) -> None:
        """Copy parameter ``k``'s gradient into the bucket (borrowing a buffer first) and drop ``p.grad``."""
        if bucket.handle is not None:  # its previous pass is still in flight under the same name
            self._land(bucket)
        if bucket.buffer is None:
            self._lend(bucket)
        index = bucket.layout.params[k]
        p = self.params[index]
        grad = p.grad
        view = bucket.views[k]
        if grad is None:
            view.zero_()
        else:
            if grad.is_sparse:
                if not self.sparse_as_dense:
                    raise ValueError(f"parameter {self.names[index]!r} has a sparse gradient: sharding='gradients' "
                                     "reduces dense gradients only; pass sparse_as_dense=True")
                grad = grad.to_dense()
            cast_scaled(grad, view, self.scale_in)
            p.grad = None  # this rank keeps no unreduced gradient
        if not bucket.filled[k]:
            bucket.filled[k] = True
            bucket.pending -= 1

    def _lend(self, bucket: ShardBucket) -> None:
        """Give ``bucket`` a buffer: a free one, else one freed by landing a finished (or, at the pool's limit,
        the oldest) bucket in flight, else a new one."""
        key = (self._wire_dtype(bucket), bucket.layout.device)
        buffer = self.pool.take(key)
        while buffer is None:
            done = next((b for b in self._in_flight if b.key == bucket.key and handles.poll(b.handle)), None)
            if done is None and not self.pool.can_make(key):
                done = next((b for b in self._in_flight if b.key == bucket.key), None)
            if done is None:
                buffer = self.pool.make(key)
                break
            self._land(done)
            buffer = self.pool.take(key)
        bucket.lend(buffer)

    def _submit_bucket(self, bucket: ShardBucket) -> None:
        assert bucket.buffer is not None
        wire = bucket.buffer.narrow(0, 0, bucket.layout.numel)
        if not self._cast_only:
            wire, bucket.ctx = self.compression.compress(wire)
        bucket.wire = wire
        kind = Kind.REDUCESCATTER if bucket.scatter else Kind.ALLREDUCE
        bucket.handle = submit(Call(kind, wire, bucket.name, self.process_set, reduce_op=ReduceOp.SUM,
                                    inplace=not bucket.scatter))
        bucket.sent = True
        self._in_flight.append(bucket)

    def _end_pass(self) -> None:
        """After each backward: submit the buckets this pass did not fill (zeros where no gradient came)."""
        self._pass_open = False
        for bucket in self.buckets:
            if bucket.sent:
                continue
            for k in range(len(bucket.layout.params)):
                if not bucket.filled[k]:
                    self._put(bucket, k)
            self._submit_bucket(bucket)
        for bucket in self.buckets:
            bucket.sent = False
            bucket.filled = [False] * len(bucket.layout.params)
            bucket.pending = len(bucket.layout.params)

    # -- land -------------------------------------------------------------------------------------------
    def _land(self, bucket: ShardBucket) -> None:
        """Wait for the bucket's collective, write (or add) the owned gradients, give the buffer back."""
        out = handles.synchronize(bucket.handle)
        self._in_flight.remove(bucket)
        if not self._cast_only:
            out = self.compression.decompress(out, bucket.ctx)
        lay = bucket.layout
        base = lay.segments[self.sharding.partition().member][0] if bucket.scatter else 0
        for k in bucket.mine:
            src = out.narrow(0, lay.offsets[k] - base, lay.numels[k])
            dst = self.owned_grads[lay.params[k]]
            if bucket.landed:
                dst.view(-1).add_(src, alpha=self.scale_out)  # a 16-bit wire is widened by the add
            else:
                cast_scaled(src, dst, self.scale_out)
        bucket.landed = True
        assert bucket.buffer is not None
        self.pool.give((self._wire_dtype(bucket), lay.device), bucket.buffer)
        bucket.buffer, bucket.views, bucket.handle, bucket.ctx, bucket.wire = None, [], None, None, None

    def synchronize(self, on_reduced: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Submit what this step has not, land every bucket, hand out the owned gradients (others: ``None``)."""
        if self.state is Step.SYNCED:
            return
        if self.state is Step.IDLE:  # no hook ran (gradients set by hand): this is the step's one pass
            self._refresh()
            if self._reduce:
                self._end_pass()
        failed: BaseException | None = None
        if self._reduce:
            if self._pass_open:  # a backward still running? only a synchronize() inside it gets here
                self._end_pass()
            member = self.sharding.partition().member
            for bucket in self.buckets:
                if bucket.handle is not None:
                    self._land(bucket)
                for k, index in enumerate(bucket.layout.params):
                    self.params[index].grad = self.owned_grads[index] if bucket.layout.owners[k] == member else None
                bucket.landed = False
                if on_reduced is not None and failed is None:
                    try:
                        on_reduced([self.params[i] for i in bucket.layout.params])
                    except BaseException as exc:  # noqa: BLE001 - re-raised once every bucket has landed
                        failed = exc
        self.passes = [0] * len(self.params)
        self.state = Step.SYNCED
        if failed is not None:
            raise failed

    def in_flight(self) -> bool:
        self._drop_if_reinitialized()
        return any(b.handle is not None or b.buffer is not None for b in self.buckets)

    def release(self) -> None:
        """zero_grad(): nothing kept to free (non-owned gradients were dropped in their hooks)."""

    def _drop_if_reinitialized(self) -> None:
        if self.process_set.group is not self._group:
            self._in_flight = []
            self._pass_open = False
        super()._drop_if_reinitialized()
