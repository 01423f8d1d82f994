"""``hvd.DistributedOptimizer``: wrap any torch optimizer so ``step()`` applies gradients averaged over ranks.

The wrapper is an instance of a dynamic subclass of the wrapped optimizer's class, sharing its parameter
groups, state and defaults: ``isinstance`` checks, LR schedulers, ``state_dict()``/``load_state_dict()``,
gradient clipping and AMP's ``GradScaler`` keep working. The reduction itself lives in
:mod:`hora.training.reducer` (buckets filled by gradient hooks, overlapped with backward), or for ``op=hvd.Adasum``
in :mod:`hora.training.adasum_reducer`.

Example:
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())  # doctest: +SKIP
    >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
    ...                                compression=hvd.Compression.fp16)  # doctest: +SKIP
    >>> loss.backward(); opt.step()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from hora.common.process_sets import global_process_set
from hora.datapath.reduce_ops import Adasum, Average, Sum
from hora.datapath.wire import Compression, Compressor
from hora.training.adasum_reducer import AdasumReducer
from hora.training.buckets import split_groups
from hora.training.reducer import GradientReducer
from hora.training.sharded_reducer import ShardedGradientReducer
from hora.training.sharding import MODES, Sharding

log = logging.getLogger(__name__)

_classes: dict[type, type] = {}

# Horovod's warning, word for word (scripts and tests match on it). hora does not reduce twice in this case
# (the gradients are already reduced), but the step is still a sign of a missing skip_synchronize().
STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). "
    "This can cause training slowdown. You may want to consider using optimizer.skip_synchronize() context "
    "if you use optimizer.synchronize() in your code."
)


@dataclass(frozen=True)
class OptimizerSnapshot:
    """See :func:`snapshot`."""

    in_flight: bool  # some bucket was submitted and not yet synchronized
    updates_by_bucket: int  # optimizer updates applied to part of the parameters as their buckets landed


def snapshot(optimizer: torch.optim.Optimizer) -> OptimizerSnapshot:
    """What a :func:`DistributedOptimizer` holds now, as plain values, for tests and debugging: whether
    gradients are still being reduced, and how many updates ``step()`` has applied bucket by bucket since the
    optimizer was wrapped (0 when every step was one update over all the parameters)."""
    if not isinstance(optimizer, _DistributedOptimizer):
        raise TypeError(f"snapshot() takes an optimizer made by hvd.DistributedOptimizer, got {type(optimizer)}")
    return OptimizerSnapshot(in_flight=optimizer._hora_reducer.in_flight(),
                             updates_by_bucket=optimizer._hora_updates_by_bucket)


# torch.amp.GradScaler reads the gradients it unscales and checks for inf/NaN in one method, reached from
# unscale_(), from step() (which calls unscale_() when the user did not) and from step()'s path for fused
# optimizers (_check_inf_per_device): torch/amp/grad_scaler.py:246-300 (its loop over optimizer.param_groups
# at 266), 358, 444-445, 472-473, 707-708 in torch 2.13. torch.distributed.fsdp's ShardedGradScaler
# overrides it under the same name.
_GRAD_SCALER_READER = "_unscale_grads_"


class _DistributedOptimizer:
    """Methods mixed into the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    _hora_reducer: GradientReducer
    _hora_should_sync: bool
    _hora_base: type
    _hora_updates_by_bucket: int
    _hora_synced_for_scaler: bool  # the last reduction was made for a GradScaler: step() need not warn
    _hora_sharding: Sharding | None
    _hora_names: list[str]
    _hora_params: list[torch.Tensor]
    sharding: str | None  # the sharding mode (None: every rank keeps the whole state)

    def synchronize(self) -> None:
        """Finish reducing this step's gradients and write them into ``p.grad``.

        Call it before touching gradients between ``backward()`` and ``step()`` (clipping); ``step()`` then
        does not reduce again. ``torch.amp.GradScaler`` needs no call: it gets reduced gradients by itself
        (see :attr:`param_groups`).
        """
        self._hora_synced_for_scaler = False
        self._hora_reducer.synchronize()

    # --- AMP: a GradScaler reads reduced gradients --------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups. When ``torch.amp.GradScaler`` reads them to unscale the
        gradients (``scaler.unscale_(opt)``, or ``scaler.step(opt)`` without it) before this step's
        gradients were reduced, they are reduced first: every rank then unscales the same reduced
        gradients, so the scaler's inf/NaN check (``found_inf``), and with it the decision to skip the
        step and the next loss scale, is the same on every rank. torch's own recipe works unchanged;
        Horovod's (``synchronize()``, ``unscale_``, ``skip_synchronize()``) too."""
        groups: list[dict[str, Any]] = self.__dict__["param_groups"]
        reducer = self.__dict__.get("_hora_reducer")
        if (reducer is None or reducer.updates_params
                or sys._getframe(1).f_code.co_name != _GRAD_SCALER_READER):
            return groups
        if not reducer.synced:
            reducer.synchronize()
            self._hora_synced_for_scaler = True
        sharding = self.__dict__.get("_hora_sharding")
        if sharding is not None and sharding.mode == "gradients" and sharding.overflow_anywhere():
            # each rank holds only its own reduced gradients: one rank's inf/NaN is shown to every rank's
            # scaler as one more gradient that is not finite, so all of them skip the step together
            return [*groups, {"params": [sharding.overflow_marker()]}]
        return groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.__dict__["param_groups"] = groups  # where torch's own __setstate__ (load_state_dict) puts them

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not call ``synchronize()`` (Horovod's AMP pattern)."""
        self._hora_should_sync = False
        try:
            yield
        finally:
            self._hora_should_sync = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many ``backward()`` calls accumulate locally before gradients are reduced."""
        self._hora_reducer.set_backward_passes_per_step(passes)

    def step(self, closure: Any = None) -> Any:
        reducer = self._hora_reducer
        if self._hora_should_sync and reducer.synced and not self._hora_synced_for_scaler:
            warnings.warn(STEP_AFTER_SYNCHRONIZE, UserWarning, stacklevel=2)
        self._hora_synced_for_scaler = False
        if self._hora_sharding is not None:
            return self._hora_sharded_step(self._hora_sharding, closure)
        if reducer.updates_params:  # Adasum: the local steps ran in the hooks; apply the combined update
            loss = closure() if closure is not None else None
            if self._hora_should_sync:
                reducer.synchronize()
            reducer.stepped()
            return loss
        if self._hora_should_sync:
            if closure is None and not reducer.synced and _overlappable(self):
                self._hora_step_as_buckets_land()
                return None
            reducer.synchronize()
        reducer.stepped()
        return super().step(closure)  # type: ignore[misc]

    def _hora_step_as_buckets_land(self) -> None:
        """One step, applied bucket by bucket: each bucket's parameters are updated as soon as its reduced
        gradients are written back, while the later buckets are still on the wire; the parameters in no
        bucket (DDP's, sparse ones) are updated last. Only for optimizers in :data:`PER_PARAMETER`, whose
        update of a parameter reads nothing but that parameter, its gradient and its own state, so the
        result is the one step's bit for bit."""
        done: set[int] = set()

        def apply(params: list[torch.Tensor]) -> None:
            self._hora_updates_by_bucket += 1
            _step_on(self, params)
            done.update(id(p) for p in params)

        reducer = self._hora_reducer
        reducer.synchronize(on_reduced=apply)
        reducer.stepped()
        groups = self.param_groups  # type: ignore[attr-defined]
        rest = [p for group in groups for p in group["params"] if id(p) not in done]
        if rest:
            self._hora_updates_by_bucket += 1
            _step_on(self, rest)

    def _hora_sharded_step(self, sharding: Sharding, closure: Any) -> Any:
        """Reduce, update the parameters this rank owns (bucket by bucket as their gradients land, when the
        optimizer allows it), then send every owner's updates to the others (:mod:`hora.training.sharding`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        reducer = self._hora_reducer
        sent = sharding.begin_step()
        owned = sharding.partition().owners
        member = sharding.partition().member
        index_of = sharding.position
        done: set[int] = set()

        def apply(params: list[torch.Tensor]) -> None:
            indices = [index_of[id(p)] for p in params]
            mine = [i for i in indices if owned[i] == member]
            if mine:
                self._hora_updates_by_bucket += 1
                _step_on(self, [sharding.params[i] for i in mine])
            done.update(indices)
            sent.updated(mine)

        if self._hora_should_sync and not reducer.synced and _overlappable(self):
            reducer.synchronize(on_reduced=apply)
        elif self._hora_should_sync:
            reducer.synchronize()
        reducer.stepped()
        rest = [i for i in sharding.owned() if i not in done]
        if rest:
            _step_on(self, [sharding.params[i] for i in rest])
            sent.updated(rest)
        sent.finish()
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters, with the norm of the *reduced*
        gradients of the whole model on every rank, whatever the sharding (with ``sharding="gradients"`` a rank
        holds only its own parameters' gradients: the norm is combined over the ranks). Synchronizes first if
        this step's gradients are not reduced yet. Returns the total norm (before clipping).

        Example:
            >>> loss.backward()                        # doctest: +SKIP
            >>> opt.clip_grad_norm_(1.0)               # doctest: +SKIP
            >>> with opt.skip_synchronize():           # doctest: +SKIP
            ...     opt.step()
        """
        self.synchronize()
        params = self._hora_params
        sharding = self._hora_sharding
        if sharding is None or sharding.mode != "gradients":
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        total = sharding.grad_norm(float(norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot "
                               "be clipped; set error_if_nonfinite=False to clip anyway")
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        return total

    # -- the state: whole or sharded (docs/large-models.md) ---------------------------------------------------
    def owned_parameter_names(self) -> list[str]:
        """Names of the parameters whose optimizer state this rank keeps (all of them when not sharded)."""
        sharding = self._hora_sharding
        if sharding is None:
            return list(self._hora_names)
        return [self._hora_names[i] for i in sharding.owned()]

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the state: ``{"state": {name: {key: value}}, "param_groups": [...]}``.

        ``state`` holds the entries of the parameters :meth:`owned_parameter_names` lists (the optimizer's own
        tensors, not copies, as torch's ``state_dict()`` gives them); ``param_groups`` holds every group's
        hyperparameters as torch's ``state_dict()`` does, with the group's parameter *names* under
        ``"params"`` (every parameter of the group, owned or not: the same on every rank).
        """
        sharding = self._hora_sharding
        state: dict[Any, Any] = self.state  # type: ignore[attr-defined]
        if sharding is None:
            entries = {self._hora_names[i]: state[p] for i, p in enumerate(self._hora_params)
                       if p in state and state[p]}
        else:
            entries = sharding.owned_entries()
        name_of = {id(p): n for p, n in zip(self._hora_params, self._hora_names)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(p)] for p in g["params"]]}
                  for g in self.param_groups]  # type: ignore[attr-defined]
        return {"state": dict(entries), "param_groups": groups}

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`sharded_state_dict` (this rank's entries at least; entries of parameters this rank
        does not own are ignored, so a state saved at N ranks loads at M). Every group's hyperparameters are
        set from it; a parameter without an entry gets no state. Not a collective."""
        groups = state_dict.get("param_groups")
        entries = state_dict.get("state")
        if not isinstance(groups, list) or not isinstance(entries, dict):
            raise ValueError("load_sharded_state_dict takes a dict with 'state' (name -> entry) and "
                             "'param_groups' (a list), as sharded_state_dict() returns")
        live = self.param_groups  # type: ignore[attr-defined]
        if len(groups) != len(live):
            raise ValueError(f"the state has {len(groups)} parameter groups, this optimizer has {len(live)}")
        name_of = {id(p): n for p, n in zip(self._hora_params, self._hora_names)}
        for g, (saved, group) in enumerate(zip(groups, live)):
            names = {name_of[id(p)] for p in group["params"]}
            if set(saved.get("params", ())) != names:
                missing = sorted(names - set(saved.get("params", ())))[:5]
                extra = sorted(set(saved.get("params", ())) - names)[:5]
                raise ValueError(f"parameter group {g} of the state holds other parameters than this optimizer's "
                                 f"group {g} (missing: {missing}, unknown: {extra}): load a state saved from the "
                                 "same model and the same parameter groups")
        hyper = [{k: v for k, v in saved.items() if k != "params"} for saved in groups]
        sharding = self._hora_sharding
        owned = range(len(self._hora_params)) if sharding is None else sharding.owned()
        wanted = {i: entries[self._hora_names[i]] for i in owned if self._hora_names[i] in entries}
        _load_entries(self, wanted, hyper)
        if sharding is not None:
            sharding.loaded()

    def state_dict(self) -> dict[str, Any]:
        """torch's full ``state_dict()``. Sharded, it is a collective (every rank must call it) and every
        rank gets the whole state; prefer :meth:`sharded_state_dict` for large models."""
        sharding = self._hora_sharding
        if sharding is None:
            return super().state_dict()  # type: ignore[misc, no-any-return]
        full = super().state_dict()  # type: ignore[misc]
        everything = sharding.gather_all()
        full["state"] = {i: everything[name] for i, name in enumerate(self._hora_names) if name in everything}
        return full  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict()``; sharded, each rank keeps the entries of the parameters it owns (not
        a collective)."""
        sharding = self._hora_sharding
        if sharding is None:
            super().load_state_dict(state_dict)  # type: ignore[misc]
            return
        owned = set(sharding.owned())
        kept = {**state_dict, "state": {k: v for k, v in state_dict["state"].items() if k in owned}}
        super().load_state_dict(kept)  # type: ignore[misc]
        sharding.loaded()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hora_reducer.in_flight():
            raise ValueError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(): gradients are still being reduced. Call zero_grad() before "
                "backward() or after step()."
            )
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]
        self._hora_reducer.release()


# Built-in optimizers whose update of a parameter reads only that parameter, its gradient and its own state
# (no norm or statistic over all parameters): a step over some parameters, then over the others, is bit for
# bit one step over all. tests/distributed/test_step_overlap.py checks each against a single step.
PER_PARAMETER: frozenset[type] = frozenset(
    cls for cls in (getattr(torch.optim, name, None) for name in (
        "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD",
        "Adafactor"))
    if isinstance(cls, type)
)


def _overlappable(optimizer: Any) -> bool:
    """Step bucket by bucket? A per-parameter built-in optimizer with no step hooks (they would run once per
    bucket), and a reducer with several buckets to overlap (:attr:`GradientReducer.overlaps_step`)."""
    if optimizer._hora_base not in PER_PARAMETER:
        return False
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return False
    if getattr(torch_optimizer, "_global_optimizer_pre_hooks", None) or getattr(
            torch_optimizer, "_global_optimizer_post_hooks", None):  # register_optimizer_step_*_hook
        return False
    return bool(optimizer._hora_reducer.overlaps_step)


def _step_on(optimizer: Any, params: list[torch.Tensor]) -> None:
    """The wrapped optimizer's own step on ``params`` alone: every group keeps only those of its parameters
    for the call (the others are not looked at), then gets its list back."""
    keep = {id(p) for p in params}
    stashed = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [q for q in group["params"] if id(q) in keep]
        super(_DistributedOptimizer, optimizer).step()
    finally:
        for group, kept in zip(optimizer.param_groups, stashed):
            group["params"] = kept


def _load_entries(optimizer: Any, entries: dict[int, Any], hyper: list[dict[str, Any]] | None = None) -> None:
    """Make ``entries`` ({parameter index: state entry}) the optimizer's whole state, through torch's own
    ``load_state_dict`` (its casting and moves to each parameter's device); the groups' hyperparameters are
    ``hyper`` (default: unchanged)."""
    live = optimizer.param_groups
    kept = list(live)
    groups, start = [], 0
    for g, group in enumerate(live):
        values = hyper[g] if hyper is not None else {k: v for k, v in group.items() if k != "params"}
        groups.append({**values, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    super(_DistributedOptimizer, optimizer).load_state_dict({"state": entries, "param_groups": groups})
    # torch's load_state_dict makes new group dicts; keep the old ones (an LR scheduler, or the optimizer
    # this one wraps, holds them), with the loaded values
    for old, loaded in zip(kept, optimizer.param_groups):
        old.update(loaded)
    live[:] = kept
    optimizer.param_groups = live


def _local_step(optimizer: Any, p: torch.Tensor) -> None:
    """The wrapped optimizer's own step on parameter ``p`` alone (Horovod's Adasum reduces its update)."""
    _step_on(optimizer, [p])


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Iterable[Any] | None) -> tuple[list, list[str], dict[torch.Tensor, str]]:
    """The optimizer's parameters (deduplicated, in group order), their names, and Horovod's
    ``_parameter_names`` (every named parameter given, or the optimizer's own under generated names)."""
    params: list[torch.Tensor] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    if named_parameters is None:  # Horovod's names: allreduce.noname.<group index>.<index in the group>
        noname = {id(p): f"allreduce.noname.{i}.{j}" for i, group in enumerate(optimizer.param_groups)
                  for j, p in enumerate(group["params"])}
        names = [noname[id(p)] for p in params]
        return params, names, dict(zip(params, names))
    pairs = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in pairs):
        raise ValueError(
            "named_parameters should be a sequence of (name, parameter) tuples, usually produced by "
            "model.named_parameters()"
        )
    counts: dict[str, int] = {}
    for name, _ in pairs:
        counts[name] = counts.get(name, 0) + 1
    dups = sorted(n for n, c in counts.items() if c > 1)
    if dups:
        raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {', '.join(dups)}")
    name_of = {id(p): name for name, p in pairs}
    unnamed = [i for i, p in enumerate(params) if id(p) not in name_of]
    if unnamed:
        raise ValueError(
            f"named_parameters was given but {len(unnamed)} of the optimizer's parameters are not in it "
            f"(positions {unnamed[:10]} in the optimizer's parameter list): pass model.named_parameters() "
            "of the model whose parameters the optimizer holds"
        )
    return params, [name_of[id(p)] for p in params], {p: name for name, p in pairs}


def _group_of(params: list[torch.Tensor], num_groups: int, groups: Any) -> list[int]:
    if isinstance(groups, int):  # Horovod also accepted an int here
        num_groups, groups = groups, None
    if groups is None:
        if num_groups < 0:
            raise ValueError(f"num_groups must be >= 0, got {num_groups}")
        return split_groups(len(params), num_groups)
    index_of = {id(p): i for i, p in enumerate(params)}
    out = [-1] * len(params)
    for g, members in enumerate(groups):
        for p in members:
            if id(p) not in index_of:
                raise ValueError(f"groups[{g}] holds a tensor that is not one of the optimizer's parameters")
            out[index_of[id(p)]] = g
    return out


def _validate(optimizer: Any, compression: Any, passes: int, op: Any, predivide: float) -> None:
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError(  # noqa: TRY004 - Horovod raised ValueError here too
            "this optimizer is already a hora DistributedOptimizer; wrap the plain optimizer once"
        )
    if passes < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"op must be hvd.Average, hvd.Sum or hvd.Adasum for gradients, got {op!r}")
    if predivide != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
    if predivide <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {predivide}")
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise ValueError(f"compression must have compress() and decompress(), got {compression!r}")


def _validate_sharding(optimizer: Any, sharding: str | None, op: Any) -> None:
    if sharding is None:
        return
    if sharding not in MODES:
        raise ValueError(f"sharding must be None, 'optimizer' or 'gradients', got {sharding!r}")
    if op is Adasum:
        raise ValueError("sharding does not combine with op=hvd.Adasum (Adasum combines every rank's own update of "
                         "every parameter); use op=hvd.Average")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("sharding does not work with LBFGS: its step reads every parameter at once (one flat "
                         "view), so it cannot update a share of them")


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Compressor = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = global_process_set,
    sharding: str | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced across ``process_set``.

    Args:
        optimizer: any ``torch.optim.Optimizer``; the result shares its groups and state and is an
            instance of its class.
        named_parameters: ``model.named_parameters()``; names appear in errors and stall reports.
        compression: ``Compression.none``/``fp16``/``bf16`` or any object with ``compress``/``decompress``.
        backward_passes_per_step: backward passes accumulated locally before one reduction.
        op: ``Average`` (default), ``Sum`` or ``Adasum``.
        gradient_predivide_factor: with Average, divide by this before the sum and by size/this after.
        num_groups: split the parameters into this many groups, each reduced as one bucket.
        groups: explicit list of lists of parameters, each reduced as one bucket.
        sparse_as_dense: reduce sparse gradients as dense tensors instead of by allgather.
        process_set: the ranks to reduce across.
        sharding: ``None`` (every rank keeps the whole optimizer state), ``"optimizer"`` (each rank keeps and
            updates the state of its own share of the parameters; gradients are reduced in full as without
            sharding) or ``"gradients"`` (also each rank keeps only its share's reduced gradients).
            docs/large-models.md says which to choose.

    Returns:
        The distributed optimizer.
    """
    _validate(optimizer, compression, backward_passes_per_step, op, gradient_predivide_factor)
    _validate_sharding(optimizer, sharding, op)
    params, names, parameter_names = _named(optimizer, named_parameters)
    base = type(optimizer)
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base), {"__qualname__": base.__qualname__})
        _classes[base] = cls
    wrapped = cls.__new__(cls)  # type: ignore[call-overload]  # no __init__: the groups and state are shared
    # Share groups, state, defaults and hooks; drop an LR scheduler's instance-level step wrapper so
    # that our step() runs (a scheduler created after wrapping wraps ours).
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    wrapped._hora_should_sync = True
    wrapped._hora_synced_for_scaler = False
    wrapped._hora_updates_by_bucket = 0
    wrapped._hora_base = base  # the wrapped class: decides whether step() may go bucket by bucket
    # Horovod's attribute: {parameter: name}; the names the reducer uses in errors and stall reports
    wrapped._parameter_names = parameter_names
    reducer_args: dict[str, Any] = {
        "compression": compression, "sparse_as_dense": sparse_as_dense, "process_set": process_set,
        "backward_passes_per_step": backward_passes_per_step,
    }
    params_names_groups = (params, names, _group_of(params, num_groups, groups))
    if op is Adasum:  # chosen once: Adasum reduces each parameter's local update (hora.training.adasum_reducer)
        wrapped._hora_reducer = AdasumReducer(*params_names_groups, **reducer_args,
                                              local_step=functools.partial(_local_step, wrapped))
    else:
        kind = ShardedGradientReducer if sharding == "gradients" else GradientReducer
        wrapped._hora_reducer = kind(*params_names_groups, **reducer_args, op=op,
                                     gradient_predivide_factor=gradient_predivide_factor)
    wrapped._hora_params, wrapped._hora_names = params, names
    wrapped.sharding = sharding
    wrapped._hora_sharding = None
    if sharding is not None:
        wrapped._hora_sharding = Sharding(sharding, wrapped, params, names, params_names_groups[2], process_set,
                                          wrapped._hora_reducer.naming, functools.partial(_load_entries, wrapped))
        if isinstance(wrapped._hora_reducer, ShardedGradientReducer):
            wrapped._hora_reducer.sharding = wrapped._hora_sharding
    wrapped._hora_reducer.register_hooks()  # buckets are planned at the first backward
    return wrapped
