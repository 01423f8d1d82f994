"""Helpers every Horovod script calls once: start all ranks from the same weights, share Python objects.

``broadcast_parameters`` packs tensors into flat buffers per (dtype, device), of at most
:data:`BROADCAST_CHUNK_BYTES` each (a larger tensor travels alone, in place), so a ResNet-50 state dict costs a
few collectives, not 320, and a large model's start needs no second copy of its weights.
``broadcast_optimizer_state`` sends the root's ``optimizer.state_dict()`` (state and options such as ``lr``) and
loads it everywhere, so it works before the first step without Horovod's trick of a fake zero-gradient step.

Example:
    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)   # doctest: +SKIP
    >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)       # doctest: +SKIP
    >>> cfg = hvd.broadcast_object(cfg if hvd.rank() == 0 else None) # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hora.api import ops, param_layout
from hora.api.object_wire import ObjectWire, encode
from hora.common.process_sets import ProcessSet, global_process_set
from hora.engine.scheduling.handles import synchronize
from hora.errors import ModelMismatchError, ObjectAuthError
from hora.runtime import lifecycle as runtime

log = logging.getLogger(__name__)


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    """``params`` as (name, tensor) pairs in a rank-independent order; unnamed tensors are ``#i``."""
    if isinstance(params, Mapping):
        return sorted(params.items(), key=lambda kv: kv[0])
    out = []
    for i, item in enumerate(params):
        name, t = (str(item[0]), item[1]) if isinstance(item, tuple) and len(item) == 2 else (f"#{i}", item)
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"broadcast_parameters takes a state_dict, a list of tensors or (name, tensor) pairs; got {item!r}"
            )
        out.append((name, t))
    return out


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """Overwrite ``params`` in place with the root rank's values.

    Raises :class:`~hora.errors.ModelMismatchError` on every rank, naming the parameters, when the ranks'
    models differ (other shapes, dtypes or parameters): the model was built differently on some ranks.

    Args:
        params: ``model.state_dict()``, ``model.parameters()`` or ``model.named_parameters()``.
        root_rank: global rank whose values everyone receives.
        process_set: ranks taking part (all by default).
    """
    named = _named_tensors(params)
    _check_same_layout(named, root_rank, process_set)
    by_kind: dict[tuple[torch.dtype, str], list[torch.Tensor]] = {}
    for _, t in named:
        if t.numel() > 0:
            by_kind.setdefault((t.dtype, t.device.type), []).append(t)
    with torch.no_grad():
        for (dtype, device), group in sorted(by_kind.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            # The device type, not the device: rank i's cuda:i must pair with every other rank's buffer.
            base = f"hora.broadcast_parameters.{str(dtype).removeprefix('torch.')}.{device}"
            for i, chunk in enumerate(_chunks(group, BROADCAST_CHUNK_BYTES)):
                _broadcast_chunk(chunk, root_rank, f"{base}.{i}" if i else base, process_set)


# broadcast_parameters' most extra memory: small tensors travel packed in flat buffers of up to this size, one
# buffer at a time, and a tensor this large or larger travels alone in place. A model's worth of flat copy would
# double its memory at start (docs/large-models.md).
BROADCAST_CHUNK_BYTES = 64 * 1024 * 1024


def _chunks(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut into runs of at most ``cap`` bytes (a larger tensor is a run by itself)."""
    out: list[list[torch.Tensor]] = []
    size = cap
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if size + nbytes > cap or nbytes >= cap:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


def _broadcast_chunk(chunk: list[torch.Tensor], root_rank: int, name: str, process_set: ProcessSet) -> None:
    if len(chunk) == 1 and chunk[0].is_contiguous():
        synchronize(ops.broadcast_async_(chunk[0].detach(), root_rank, name=name, process_set=process_set))
        return
    flat = torch.cat([t.detach().reshape(-1) for t in chunk])
    flat = synchronize(ops.broadcast_async_(flat, root_rank, name=name, process_set=process_set))
    offset = 0
    for t in chunk:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _check_same_layout(named: list[tuple[str, torch.Tensor]], root_rank: int, process_set: ProcessSet) -> None:
    """Raise ModelMismatchError on every member when the members' models differ (one 8-byte allgather when
    they agree; the full layouts only when they do not)."""
    mine = param_layout.layout(named)
    prints = ops.allgather(torch.tensor([param_layout.fingerprint(mine)], dtype=torch.int64),
                           name="hora.broadcast_parameters.layout", process_set=process_set)
    if bool((prints == prints[0]).all()):
        return
    gathered = allgather_object((runtime.rank(), mine), name="hora.broadcast_parameters.layouts",
                                process_set=process_set)
    raise ModelMismatchError(param_layout.describe_mismatch(dict(gathered), root_rank))


def _cpu(obj: Any) -> Any:
    """``obj`` with every tensor moved to the CPU (so any rank can load it, whatever its GPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Give every rank the root's optimizer state and options (``lr``, ``momentum``...).

    Works before the first step (an empty state stays empty everywhere; parameters that require grad and
    have none get a zero gradient, as Horovod leaves them), and with parameters that have no state or
    ``None`` entries in it. ``model`` is accepted for Horovod compatibility and not needed.

    A sharded ``DistributedOptimizer`` (``sharding=...``) gets only the root's options: each rank's state
    belongs to the parameters it owns, and stays (docs/large-models.md).
    """
    if getattr(optimizer, "sharding", None) is not None:
        _broadcast_options(optimizer, root_rank, process_set)
        return
    if not optimizer.state:
        _zero_missing_grads(optimizer)
    state = _cpu(optimizer.state_dict()) if runtime.rank() == root_rank else None
    state = broadcast_object(state, root_rank, name="hora.broadcast_optimizer_state", process_set=process_set)
    optimizer.load_state_dict(state)


def _broadcast_options(optimizer: torch.optim.Optimizer, root_rank: int, process_set: ProcessSet) -> None:
    """Every group's options (``lr``, ``betas``...) from the root, in place."""
    groups = optimizer.param_groups
    options = [{k: v for k, v in g.items() if k != "params"} for g in groups] if runtime.rank() == root_rank else None
    options = broadcast_object(_cpu(options), root_rank, name="hora.broadcast_optimizer_state.options",
                               process_set=process_set)
    if len(options) != len(groups):
        raise ValueError(f"broadcast_optimizer_state: rank {root_rank}'s optimizer has {len(options)} parameter "
                         f"groups, this rank's has {len(groups)}: build the optimizer the same way on every rank")
    for group, values in zip(groups, options):
        group.update(values)


def _zero_missing_grads(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's broadcast_optimizer_state leaves every parameter that requires grad with a gradient (zeros
    where none was computed yet; sparse for SparseAdam), so code that reads ``p.grad`` right after it works
    the same here. Parameters that do not require grad keep ``None``; gradients already there are kept."""
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    zeros = torch.zeros_like(p)
                    p.grad = zeros.to_sparse() if sparse else zeros


_wire: tuple[runtime.Runtime, ObjectWire] | None = None  # the object path's seal in the live world


def _object_wire() -> ObjectWire:
    """The live world's :class:`ObjectWire` (a new world numbers its calls afresh)."""
    global _wire
    rt = runtime.state("broadcast_object / allgather_object")
    if _wire is None or _wire[0] is not rt:
        _wire = (rt, ObjectWire(rt.store.secret, rt.world))
    return _wire[1]


def _members(process_set: ProcessSet) -> list[int]:
    """The global ranks of ``process_set``, in its order."""
    return list(process_set.ranks) if process_set.ranks else list(range(runtime.size()))


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Return the root rank's ``obj`` on every rank (any picklable object; tensors arrive on the CPU).

    The bytes are authenticated with the job's secret before anything is unpickled (docs/security.md); in a
    job without a secret only tensors and plain values may be sent (:class:`~hora.errors.UnsafeObjectError`
    names the fix).

    Example:
        >>> epoch = hvd.broadcast_object(epoch if hvd.rank() == 0 else None, root_rank=0)  # doctest: +SKIP
    """
    base = name or "hora.broadcast_object"
    wire = _object_wire()
    call = wire.call("broadcast", process_set.process_set_id or 0, base)
    is_root = runtime.rank() == root_rank
    sealed = wire.seal(call, root_rank, encode(obj)) if is_root else b""
    length = torch.tensor([len(sealed)], dtype=torch.int64)
    ops.broadcast_(length, root_rank, name=f"{base}.len", process_set=process_set)
    n = int(length.item())
    if n < 1:
        raise ObjectAuthError(f"{call.label}: rank {root_rank} announced {n} bytes: not what hora sends (a stranger "
                              "on the data plane's network?); nothing was unpickled")
    payload = (torch.frombuffer(bytearray(sealed), dtype=torch.uint8) if is_root
               else torch.empty(n, dtype=torch.uint8))
    ops.broadcast_(payload, root_rank, name=f"{base}.data", process_set=process_set)
    if is_root:
        wire.raise_if_refused(call, root_rank, sealed)  # as every member does, with the same message
        return obj
    return wire.open(call, root_rank, payload.numpy().data, mine=False)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return the list of every rank's ``obj``, in rank order (of the process set); tensors arrive on the CPU.

    Checked as :func:`broadcast_object`'s object is, per sender.
    """
    base = name or "hora.allgather_object"
    wire = _object_wire()
    call = wire.call("allgather", process_set.process_set_id or 0, base)
    me = runtime.rank()
    sealed = wire.seal(call, me, encode(obj))
    lengths = ops.allgather(torch.tensor([len(sealed)], dtype=torch.int64), name=f"{base}.len",
                            process_set=process_set)
    data = ops.allgather(torch.frombuffer(bytearray(sealed), dtype=torch.uint8), name=f"{base}.data",
                         process_set=process_set).numpy().data
    out, offset = [], 0
    for sender, n in zip(_members(process_set), lengths.tolist(), strict=True):
        out.append(wire.open(call, sender, data[offset:offset + n], mine=sender == me))
        offset += n
    return out
