"""The gradient reducer behind :class:`hora.DistributedOptimizer` (Average and Sum; Adasum:
:mod:`hora.training.adasum_reducer`).

Per step, in three visible phases:

1. **fill** (during backward): a post-accumulate-grad hook copies each gradient into its slice of a
   preallocated flat bucket (casting on the copy when compression is a cast); the moment a bucket's last
   gradient arrives its async allreduce is submitted under a fixed name
   (:class:`hora.training.buckets.BucketNames`), which the negotiator matches across ranks and caches after the
   first step.
2. **finish** (``synchronize()``): buckets that never filled (parameters without a gradient this step) are
   completed with zeros or whatever ``p.grad`` holds, as Horovod does, and submitted; then every handle is
   waited on.
3. **write back**: uncompressed, each parameter's ``.grad`` becomes its slice of the reduced bucket (no copy;
   autograd's own gradient tensors are kept until ``zero_grad()`` so the allocator reuses them); on a
   compressed wire the slice is cast back into ``.grad`` with the rest of Average's scaling in the same copy.

Average's division costs no pass of its own: uncompressed, ``1/size`` is applied on the copy in; on a
compressed wire Horovod's split is kept (``1/predivide`` in, ``predivide/size`` out). The collective itself
is a plain sum, submitted through the private entry :func:`hora.calls.submit.submit` (no public wrapper).

Where a step stands is one :class:`Step`. The plan (bucket sizes: the runtime's knobs) is rebuilt, under a
new generation of names, only when the parameters requiring grad or the process set's size change.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from hora.api.sparse import sparse_allreduce_async
from hora.calls.call import Call
from hora.calls.submit import submit
from hora.datapath.kinds.op import Kind
from hora.datapath.reduce_ops import ReduceOp, Sum, bucket_scales
from hora.datapath.wire import CastCompressor, Compressor, NoneCompressor, cast_scaled, wire_dtype
from hora.diagnostics import timeline
from hora.engine.scheduling import handles
from hora.runtime import lifecycle as runtime
from hora.training import autotune
from hora.training.buckets import BucketNames, FlatBucket, ParamSpec, plan_buckets

log = logging.getLogger(__name__)

_MB = 1024 * 1024


class Step(enum.Enum):
    """Where the reducer is in a training step. The transitions, and what causes each::

        IDLE    --first gradient hook of a backward-->  FILLING
        FILLING --synchronize() (from step() or by hand)-->  SYNCED
        SYNCED  --step() applied the gradients-->  IDLE
        SYNCED  --a gradient hook (another backward before step())-->  FILLING
        IDLE    --synchronize() with no hook run (gradients set by hand)-->  SYNCED

    ``synchronize()`` in SYNCED does nothing; ``step()`` in SYNCED without ``skip_synchronize()`` warns.
    """

    IDLE = "idle"
    FILLING = "filling"
    SYNCED = "synced"


class GradientReducer:
    """Reduces the gradients of ``params`` across ``process_set`` in overlapped, reused flat buckets."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        groups: Sequence[int],
        *,
        compression: Compressor,
        op: Any,
        gradient_predivide_factor: float,
        sparse_as_dense: bool,
        process_set: Any,
        backward_passes_per_step: int,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.groups = list(groups)
        self.compression = compression
        self.op = op
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.bpps = backward_passes_per_step
        self.predivide = gradient_predivide_factor
        self._cast_only = isinstance(compression, (NoneCompressor, CastCompressor))
        self.naming = BucketNames(self.names, lambda: process_set.ranks, runtime.world_generation)
        self.state = Step.IDLE
        self._world: tuple[bool, int] | None = None  # (included, size) the plan and scales were made for
        self._group: Any = None  # the process set's group when we last looked: a new one means a new init()
        self.scale_in = self.scale_out = 1.0
        self.passes = [0] * len(self.params)
        self.slots: list[tuple[FlatBucket, int] | None] = [None] * len(self.params)
        self.buckets: list[FlatBucket] = []
        self.sparse: dict[int, Any] = {}  # param index -> handle of its sparse allreduce this step
        self._sparse_seen: set[int] = set()
        self._hooks: dict[int, Any] = {}
        self._plan_key: tuple[tuple[bool, ...], int] | None = None
        self._generation = -1
        self._caps_override: tuple[int, int] | None = None  # autotune's (first, later) bucket bytes
        self._ddp_watch: DdpWatch | None = DdpWatch()  # until the first step: DDP modules that ran forward
        self._ddp: dict[int, int] = {}  # param index -> world size of the DDP module that reduces it
        self._retired: list[torch.Tensor] = []  # gradients replaced by bucket slices, freed at zero_grad()
        self._lock = threading.Lock()

    @property
    def prefix(self) -> str:
        """The names' common prefix (``hora.opt.<fingerprint>``), for log lines and sparse ops."""
        return self.naming.prefix

    @property
    def synced(self) -> bool:
        """True between ``synchronize()`` and the next ``step()`` or backward."""
        return self.state is Step.SYNCED

    @property
    def updates_params(self) -> bool:
        """True when synchronize() applies the update itself (Adasum): step() must not step again."""
        return False

    @property
    def _reduce(self) -> bool:
        """This rank takes part and there is someone to reduce with."""
        return self._world is not None and self._world[0] and self._world[1] > 1

    def _caps(self) -> tuple[int, int]:
        """(first bucket, later buckets) in bytes: autotune's, else the runtime's knobs."""
        if self._caps_override is not None:
            return self._caps_override
        knobs = runtime.state("DistributedOptimizer's first backward").knobs
        return int(knobs.first_bucket_mb * _MB), int(knobs.bucket_cap_mb * _MB)

    def replan(self, caps: tuple[int, int] | None) -> None:
        """Autotune's entry point: plan the buckets anew with ``caps`` (first bucket, later buckets, in bytes; None:
        the knobs') at the next step's first gradient, under a new generation of names. Called at a step
        boundary that every rank agreed on (:mod:`hora.training.autotune`), so every rank replans at the same
        step."""
        if caps != self._caps_override:
            self._caps_override = caps
            self._plan_key = None

    def step_bytes(self) -> int:
        """Bytes of gradient this reducer puts on the wire in a step (autotune's score)."""
        return sum(b.buffer.nbytes for b in self.buckets) if self._reduce else 0

    # -- phase 1: fill, from the hooks ------------------------------------------------------------------
    def _on_grad(self, index: int) -> None:
        if self.state is not Step.FILLING or self.process_set.group is not self._group:  # first grad, or a reset
            self._begin_step()
        if not self._reduce:
            return
        n = self.passes[index] + 1
        self.passes[index] = n
        if n < self.bpps:
            return
        if n > self.bpps:
            raise ValueError(
                f"gradient of {self.names[index]!r} was computed {n} times before optimizer.step(), more than "
                f"backward_passes_per_step={self.bpps}: pass backward_passes_per_step=<passes per step> to "
                "DistributedOptimizer (or call set_backward_passes_per_step) to accumulate locally"
            )
        slot = self.slots[index]
        if slot is None:  # reduced by DDP, sparse (allgathered on its own), or no longer requires grad
            grad = self.params[index].grad
            if index in self._sparse_seen and grad is not None and grad.is_sparse:
                self._submit_sparse(index, grad)
            return
        bucket, k = slot
        self._fill(bucket, k, index)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._submit(bucket)

    def _begin_step(self) -> None:
        with self._lock:  # CPU and CUDA gradients' hooks run on different autograd threads
            if self.state is Step.FILLING and self.process_set.group is self._group:
                return
            self._refresh()
            self.state = Step.FILLING

    def _refresh(self) -> None:
        """Re-read the process set after a re-initialization (an elastic reset changes its size; its ranks are
        fixed between inits), and the parameters requiring grad."""
        if self._ddp_watch is not None:
            self._take_ddp(self._ddp_watch.stop())
            self._ddp_watch = None
        self._drop_if_reinitialized()
        if self._world is None:
            world = self._world = (self.process_set.included(), self.process_set.size())
            uncompressed = isinstance(self.compression, NoneCompressor)
            self.scale_in, self.scale_out = bucket_scales(self.op, world[1], self.predivide, uncompressed)
            self._plan_key = None  # new buckets under new names
        if self._reduce:
            self.ensure_plan()

    def _fill(self, bucket: FlatBucket, k: int, index: int) -> None:
        view = bucket.views[k]
        grad = self.params[index].grad
        if grad is None:
            view.zero_()
            return
        if grad.is_sparse:
            if not self.sparse_as_dense:
                self._submit_sparse(index, grad)
                self._sparse_seen.add(index)  # the next plan leaves it out of the dense buckets
                view.zero_()  # this step its dense slot carries zeros
                return
            grad = grad.to_dense()
        tl = timeline.active()  # diagnostics: the bucket's copy_in slices
        t0 = time.perf_counter() if tl is not None else 0.0
        if grad.data_ptr() == view.data_ptr():  # p.grad is last step's slice, accumulated in place
            if self.scale_in != 1.0:
                view.mul_(self.scale_in)
        else:
            cast_scaled(grad, view, self.scale_in)  # scale and cast in the one copy
        if tl is not None:
            tl.span(bucket.name, "copy_in", t0, time.perf_counter(), kind="allreduce", param=self.names[index],
                    bytes=view.nbytes)

    def _submit(self, bucket: FlatBucket) -> None:
        wire = bucket.buffer
        if not self._cast_only:
            tl = timeline.active()
            t0 = time.perf_counter() if tl is not None else 0.0
            wire, bucket.ctx = self.compression.compress(bucket.buffer)
            if tl is not None:
                tl.span(bucket.name, "compress", t0, time.perf_counter(), kind="allreduce", bytes=wire.nbytes)
        bucket.wire = wire
        bucket.handle = self._launch(bucket.name, wire)

    def _launch(self, name: str, wire: torch.Tensor) -> Any:
        """Start the bucket's collective. Average's division is folded into the copies in and out
        (scale_in, scale_out): a plain in-place sum here."""
        return submit(Call(Kind.ALLREDUCE, wire, name, self.process_set, reduce_op=ReduceOp.SUM, inplace=True))

    def _submit_sparse(self, index: int, grad: torch.Tensor) -> None:
        self.sparse[index] = sparse_allreduce_async(
            grad, name=f"{self.prefix}.sparse.{self.names[index]}", op=self.op, process_set=self.process_set
        )

    # -- phase 2 and 3: finish and write back -----------------------------------------------------------
    def synchronize(self, on_reduced: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Submit what never fired, wait for every bucket, write the reduced gradients back.

        ``on_reduced``, when given, is called with each bucket's parameters as soon as their reduced
        gradients are in ``.grad``, while later buckets are still in flight (the optimizer's step overlapped
        with the wire); buckets that landed together come in one call. If it raises, the remaining buckets
        are still waited for and written back, then the error is raised.
        """
        if self.state is Step.SYNCED:
            return  # nothing arrived since the last synchronize(): the gradients are already reduced
        if self.state is Step.IDLE:  # no hook ran (gradients set by hand): plan now; never re-plan mid-step
            self._refresh()
        failed: BaseException | None = None
        if self._reduce:
            self._retired.clear()  # normally empty already: zero_grad() freed them; bounds it if not called
            for bucket in self.buckets:
                if bucket.handle is None:
                    for k, index in enumerate(bucket.plan.params):
                        if self.passes[index] < self.bpps:
                            self._fill(bucket, k, index)
                    self._submit(bucket)
            ready: list[torch.Tensor] = []
            for i, bucket in enumerate(self.buckets):
                self._write_back(bucket, handles.synchronize(bucket.handle))  # type: ignore[arg-type]
                bucket.reset()
                if on_reduced is None or failed is not None:
                    continue
                ready += [self.params[j] for j in bucket.plan.params if j not in self._sparse_seen]
                later = self.buckets[i + 1].handle if i + 1 < len(self.buckets) else None
                if later is not None and handles.poll(later):  # type: ignore[arg-type]  # landed too: one call
                    continue
                try:
                    on_reduced(ready)
                except BaseException as exc:  # noqa: BLE001 - re-raised below, once every bucket is back
                    failed = exc
                ready = []
            for index, handle in self.sparse.items():
                self.params[index].grad = handles.synchronize(handle)
            self.sparse.clear()
        self._scale_ddp_sums()
        self.passes = [0] * len(self.params)
        self.state = Step.SYNCED
        if failed is not None:
            raise failed

    @property
    def overlaps_step(self) -> bool:
        """True when it is worth stepping the optimizer bucket by bucket: this rank reduces, in more than
        one bucket, and the knob ``HORA_STEP_OVERLAP`` is on."""
        return (self._reduce and len(self.buckets) > 1
                and runtime.state("DistributedOptimizer.step()").knobs.step_overlap)

    def _write_back(self, bucket: FlatBucket, out: torch.Tensor) -> None:
        scale = self.scale_out
        tl = timeline.active()  # diagnostics: decompress and copy_out slices of the bucket
        t0 = time.perf_counter() if tl is not None else 0.0
        if not self._cast_only:
            out = self.compression.decompress(out, bucket.ctx)
            if tl is not None:
                tl.span(bucket.name, "decompress", t0, time.perf_counter(), kind="allreduce", bytes=out.nbytes)
                t0 = time.perf_counter()
        handout = out is bucket.buffer and scale == 1.0  # uncompressed: p.grad becomes its slice, no copy
        for k, index in enumerate(bucket.plan.params):
            if index in self._sparse_seen:
                continue
            p = self.params[index]
            src = out.narrow(0, bucket.plan.offsets[k], bucket.plan.numels[k]).view_as(p)
            if p.grad is not None and p.grad.is_sparse:  # sparse_as_dense: reduced dense, handed back sparse
                # (as Horovod does), so optimizers that need sparse gradients (SparseAdam) keep working
                self._retired.append(p.grad)
                p.grad = src.to(p.dtype).mul(scale).to_sparse(p.grad.sparse_dim())
            elif handout and src.dtype == p.dtype:
                if p.grad is not None and p.grad.data_ptr() != src.data_ptr():
                    self._retired.append(p.grad)
                p.grad = src
            elif p.grad is None:
                p.grad = src.to(p.dtype, copy=True).mul_(scale)
            else:
                cast_scaled(src, p.grad, scale)  # cast back and scale in the one copy
        if tl is not None:
            tl.span(bucket.name, "copy_out", t0, time.perf_counter(), kind="allreduce", bytes=out.nbytes)
        # Handing out slices saves a copy back, but freeing autograd's gradient tensors here, mid-step, lets
        # glibc return their memory to the OS and the next backward page-faults it all again. So they are kept
        # (_retired) until zero_grad() frees them, when a copy back would have: the allocator then reuses them
        # (docs/performance.md, "The measurements behind design choices").

    def release(self) -> None:
        """zero_grad() ran: free autograd's gradient tensors that bucket slices replaced as p.grad."""
        self._retired.clear()

    def in_flight(self) -> bool:
        """True when some bucket was submitted and not yet synchronized."""
        self._drop_if_reinitialized()
        return any(b.handle is not None for b in self.buckets) or bool(self.sparse)

    def _drop_if_reinitialized(self) -> None:
        """After shutdown()/init() (an elastic reset) nothing submitted before can complete: forget it."""
        group = self.process_set.group
        if group is self._group:
            return
        if self._group is not None:
            log.info("%s: hora was re-initialized; dropping this step's pending gradient reductions", self.prefix)
        self._group = group
        for bucket in self.buckets:
            bucket.reset()
        self.sparse.clear()
        self.passes = [0] * len(self.params)
        # new buckets for the new world's size, named as a process that never saw the old world names them
        # (a worker that joined at the reset plans its first buckets under generation 0 too)
        self.state = Step.IDLE
        self._world = None
        self._plan_key = None
        self._generation = -1

    def stepped(self) -> None:
        """The optimizer applied the gradients; the next synchronize() reduces afresh. With autotune on, this is
        its step boundary."""
        if self.state is Step.SYNCED:
            self.state = Step.IDLE
        if runtime.state("optimizer.step()").knobs.autotune:
            tuner = autotune.tuner_for(self)  # this world's (an elastic job makes a new world at each reset)
            if tuner is not None and tuner.active:
                tuner.step_boundary()

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.bpps = passes
        self.passes = [0] * len(self.params)

    # -- planning ---------------------------------------------------------------------------------------
    def register_hooks(self) -> None:
        """Hook every parameter that requires grad and is not hooked yet."""
        for index, p in enumerate(self.params):
            if p.requires_grad and index not in self._hooks:
                self._hooks[index] = p.register_post_accumulate_grad_hook(
                    lambda _p, i=index: self._on_grad(i)  # type: ignore[misc]
                )

    def ensure_plan(self) -> None:
        """(Re)build the buckets if the set of parameters requiring grad changed since the last plan."""
        key = (tuple(p.requires_grad for p in self.params), len(self._sparse_seen))
        if key == self._plan_key:
            return
        self._plan_key = key
        self.register_hooks()
        specs = [
            ParamSpec(i, p.numel(), p.dtype, p.device, self.groups[i])
            for i, p in enumerate(self.params)
            if p.requires_grad and i not in self._ddp and i not in self._sparse_seen
        ]
        self._generation += 1
        self.slots = [None] * len(self.params)
        self.buckets = []
        for b, plan in enumerate(plan_buckets(specs, *self._caps())):
            name = self.naming.bucket(self._generation, b)
            bucket = FlatBucket(plan, name, wire_dtype(self.compression, plan.dtype) if self._cast_only else plan.dtype)
            self.buckets.append(bucket)
            for k, index in enumerate(plan.params):
                self.slots[index] = (bucket, k)
        if self._generation:
            log.info("%s: parameters requiring grad changed; rebuilt %d buckets", self.prefix, len(self.buckets))

    # -- a model also wrapped in DistributedDataParallel ------------------------------------------------
    def _take_ddp(self, modules: list[Any]) -> None:
        """Leave to DDP the parameters of the DDP modules that ran forward before our first step."""
        self._ddp = ddp_reduced(modules, self.params)
        if self._ddp:
            self._plan_key = None

    def _scale_ddp_sums(self) -> None:
        if self.op is Sum and self._ddp:
            undo_ddp_average(self.params, self._ddp)  # DDP averaged; the user asked for a sum


# --- DDP: noticing a model also wrapped in DistributedDataParallel -------------------------------------------------

class DdpWatch:
    """Collects the DDP modules that run forward until :meth:`stop`."""

    def __init__(self) -> None:
        self._seen: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
        seen = self._seen  # the hook holds the set, not the watch: a dropped watch is collected

        def note(module: torch.nn.Module, _inputs: Any) -> None:
            if isinstance(module, DistributedDataParallel):
                seen.add(module)

        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(note)
        weakref.finalize(self, self._handle.remove)

    def stop(self) -> list[DistributedDataParallel]:
        """Remove the hook; the DDP modules seen so far."""
        self._handle.remove()
        return list(self._seen)


def ddp_reduced(modules: list[DistributedDataParallel], params: Sequence[torch.Tensor]) -> dict[int, int]:
    """Which of ``params`` (by position) the DDP ``modules`` already average, each with its DDP world size;
    logs a warning naming how many when there are some."""
    index_of = {id(p): i for i, p in enumerate(params)}
    owned: dict[int, int] = {}
    for module in modules:
        world = module.process_group.size() if module.process_group is not None else 1
        for p in getattr(module, "_module_parameters", None) or list(module.module.parameters()):
            if id(p) in index_of:
                owned[index_of[id(p)]] = world
    if owned:
        log.warning(
            "the model is wrapped in DistributedDataParallel and its optimizer in hora's "
            "DistributedOptimizer: DDP already averages %d of %d parameters' gradients, so hora does not "
            "reduce them again (drop one of the two wrappers to silence this)",
            len(owned), len(params),
        )
    return owned


def undo_ddp_average(params: Sequence[torch.Tensor], owned: dict[int, int]) -> None:
    """Turn DDP's averages back into sums (the DistributedOptimizer was asked for ``op=Sum``)."""
    with torch.no_grad():
        for index, world in owned.items():
            grad = params[index].grad
            if grad is not None:
                grad.mul_(world)
