"""What a sharded checkpoint holds, keyed by names, and how each part goes back into a job of any size.

One nested dict per rank, flattened by DCP into keys like ``model/<parameter>`` and
``optimizer/state/<parameter>/<state key>``:

- ``model``: the model's ``state_dict()``. Every rank offers it; the ranks hold the same values (data
  parallelism), so DCP writes each tensor once, the tensors spread over the ranks, each rank writing its part
  in parallel.
- ``optimizer``: ``{"state": {parameter name: {key: value}}, "param_groups": [...]}``: a sharded
  ``DistributedOptimizer`` offers only the parameters it owns (``sharded_state_dict()``), so the state is
  written by its owners; any other optimizer offers all of it, keyed by the model's parameter names.
  Restoring at another number of ranks, each rank reads the entries of the parameters it owns there.
- ``rng``: ``rank<r>``: each rank's generators (torch's, CUDA's, Python's, NumPy's), back on the same rank.
- ``scheduler``, ``extra`` (every other keyword: a dict, or an object with ``state_dict()`` /
  ``load_state_dict()``) and ``hora`` (the step, the number of ranks, the format): rank 0's.

Example:
    >>> parts = Parts(model=model, optimizer=opt, scheduler=None, rng=True, extra={})  # doctest: +SKIP
    >>> saved = rank_state(parts, step=10, rank=0, size=2)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import metadata as dcp_md

from hora.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT = 1
Path = tuple[Any, ...]  # a value's place in the nested dict (DCP's planner_data)


@dataclass
class Parts:
    """What a caller passed to save or restore."""

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    rng: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def check_extra(self) -> None:
        """Every extra value must be restorable in place: a dict, or an object with state_dict/load_state_dict."""
        for name, value in self.extra.items():
            if not (isinstance(value, dict) or (callable(getattr(value, "state_dict", None))
                                                and callable(getattr(value, "load_state_dict", None)))):
                raise TypeError(f"{name}={value!r}: a sharded checkpoint keeps extra values that restore in place: "
                                f"a dict (pass {name}={{...}}) or an object with state_dict()/load_state_dict()")


def rank_state(parts: Parts, *, step: int, rank: int, size: int) -> dict[str, Any]:
    """This rank's offer to the checkpoint (the module docstring)."""
    state: dict[str, Any] = {}
    if parts.model is not None:
        state["model"] = parts.model.state_dict()
    if parts.optimizer is not None:
        state["optimizer"] = optimizer_state(parts.optimizer, parts.model)
    if parts.rng:
        state["rng"] = {f"rank{rank}": rng_state()}
    if rank == 0:
        state["hora"] = {"format": FORMAT, "step": step, "ranks": size}
        if parts.scheduler is not None:
            state["scheduler"] = parts.scheduler.state_dict()
        if parts.extra:
            # with a marker, so that an empty dict is found again (DCP keeps no entry for an empty dict)
            state["extra"] = {name: {"saved": True, "value": dict(v) if isinstance(v, dict) else v.state_dict()}
                              for name, v in parts.extra.items()}
    return state


# -- the optimizer, by parameter names ---------------------------------------------------------------------------
def _is_hora(optimizer: Any) -> bool:
    return callable(getattr(optimizer, "sharded_state_dict", None))


def _names_in_order(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> list[str]:
    """The names of a plain optimizer's parameters, in torch's state_dict order (group by group)."""
    if model is None:
        raise ValueError("a sharded checkpoint keys optimizer state by parameter name: pass model=... too (or wrap "
                         "the optimizer in hvd.DistributedOptimizer(named_parameters=...), which knows the names)")
    name_of = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = [i for i, p in enumerate(params) if id(p) not in name_of]
    if unknown:
        raise ValueError(f"{len(unknown)} of the optimizer's parameters are not the model's (positions "
                         f"{unknown[:10]}): pass the model whose parameters the optimizer holds")
    return [name_of[id(p)] for p in params]


def optimizer_state(optimizer: Any, model: torch.nn.Module | None) -> dict[str, Any]:
    """``{"state": {name: {...}}, "param_groups": [... "params": [names]]}``: a sharded DistributedOptimizer's
    owned entries, or a plain optimizer's whole state."""
    if _is_hora(optimizer):
        return optimizer.sharded_state_dict()  # type: ignore[no-any-return]
    names = _names_in_order(optimizer, model)
    full = optimizer.state_dict()
    return {"state": {names[i]: s for i, s in full["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in full["param_groups"]]}


def owned_names(optimizer: Any) -> set[str] | None:
    """The parameters whose state this rank reads back; None: all of them."""
    if _is_hora(optimizer):
        return set(optimizer.owned_parameter_names())
    return None


def load_optimizer_state(optimizer: Any, model: torch.nn.Module | None, saved: dict[str, Any]) -> None:
    if _is_hora(optimizer):
        optimizer.load_sharded_state_dict(saved)
        return
    names = _names_in_order(optimizer, model)
    index = {name: i for i, name in enumerate(names)}
    missing = sorted({n for g in saved["param_groups"] for n in g["params"]} - index.keys())
    if missing:
        raise CheckpointError(
            f"the checkpoint's optimizer has parameters this model does not: {', '.join(missing[:5])}")
    optimizer.load_state_dict({
        "state": {index[n]: s for n, s in saved.get("state", {}).items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]],
    })


# -- random generators ---------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This process's generators as tensors and plain values (``weights_only`` loads them)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(), "python": random.getstate(),
        "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = {str(i): t for i, t in enumerate(torch.cuda.get_rng_state_all())}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        devices = min(len(cuda), torch.cuda.device_count())
        torch.cuda.set_rng_state_all([cuda[str(i)] for i in range(devices)])


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# -- reading back: a template of what this rank loads, from the checkpoint's own metadata -----------------------------
def template(metadata: dcp_md.Metadata, parts: Parts, rank: int) -> dict[str, Any]:
    """The nested dict DCP loads into on this rank: the model's own tensors (loaded in place), fresh tensors for
    the owned optimizer entries, this rank's generators, the scheduler, the extras and hora's record.

    Raises:
        CheckpointError: the checkpoint lacks what the caller asked to restore, or the model's tensors differ
            from it in names or shapes.
    """
    entries = metadata.state_dict_metadata
    paths: dict[str, Path] = metadata.planner_data or {k: (k,) for k in entries}
    by_part: dict[str, list[tuple[Path, Any]]] = {}
    for key, path in paths.items():
        by_part.setdefault(path[0], []).append((path, entries[key]))
    out: dict[str, Any] = {}
    for path, md in by_part.get("hora", []):
        _put(out, path, _placeholder(md))
    if parts.model is not None:
        out["model"] = _model_template(parts.model, by_part.get("model", []))
    if parts.optimizer is not None:
        if "optimizer" not in by_part:
            raise CheckpointError("it holds no optimizer state; restore it without optimizer=...")
        owned = owned_names(parts.optimizer)
        for path, md in by_part["optimizer"]:
            if path[1] == "param_groups" or owned is None or path[2] in owned:
                _put(out, path, _placeholder(md))
        out["optimizer"].setdefault("state", {})
    if parts.scheduler is not None:
        _take(out, by_part.get("scheduler", []), "a learning-rate scheduler", "scheduler")
    saved_extras = {p[1] for p, _ in by_part.get("extra", [])}
    for name in parts.extra:
        if name not in saved_extras:
            raise CheckpointError(f"it holds no {name}=...; restore it without that keyword")
        _take(out, [(p, md) for p, md in by_part["extra"] if p[1] == name], name, name)
    if parts.rng:
        for path, md in by_part.get("rng", []):
            if path[1] == f"rank{rank}":
                _put(out, path, _placeholder(md))
    return out


def _take(out: dict[str, Any], found: list[tuple[Path, Any]], what: str, keyword: str) -> None:
    if not found:
        raise CheckpointError(f"it holds no {what}; restore it without {keyword}=...")
    for path, md in found:
        _put(out, path, _placeholder(md))


def _model_template(model: torch.nn.Module, saved: list[tuple[Path, Any]]) -> dict[str, Any]:
    own = model.state_dict()
    shapes = {p[1]: md.size for p, md in saved if isinstance(md, dcp_md.TensorStorageMetadata) and len(p) == 2}
    missing = sorted(own.keys() - {p[1] for p, _ in saved})
    unexpected = sorted({p[1] for p, _ in saved} - own.keys())
    wrong = [f"{k} {tuple(shapes[k])} in the checkpoint, {tuple(v.shape)} here" for k, v in own.items()
             if isinstance(v, torch.Tensor) and k in shapes and tuple(shapes[k]) != tuple(v.shape)]
    if missing or unexpected or wrong:
        said = [f"missing: {', '.join(missing[:5])}" if missing else "",
                f"not in this model: {', '.join(unexpected[:5])}" if unexpected else "",
                f"other shapes: {'; '.join(wrong[:3])}" if wrong else ""]
        raise CheckpointError("its model is not this one (" + "; ".join(s for s in said if s) + ")")
    return dict(own)


def _placeholder(md: Any) -> Any:
    if isinstance(md, dcp_md.TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None


def _put(root: dict[str, Any], path: Path, value: Any) -> None:
    """Set ``value`` at ``path`` in ``root``, making dicts and lists (integer steps) on the way."""
    node: Any = root
    for here, after in zip(path[:-1], path[1:]):
        empty: Any = [] if isinstance(after, int) else {}
        if isinstance(node, list):
            while len(node) <= here:
                node.append(None)
            if node[here] is None:
                node[here] = empty
            node = node[here]
        else:
            node = node.setdefault(here, empty)
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def apply(loaded: dict[str, Any], parts: Parts, rank: int) -> int:
    """Put what was loaded back (the model's tensors already are, in place); the checkpoint's step."""
    if parts.optimizer is not None:
        load_optimizer_state(parts.optimizer, parts.model, loaded["optimizer"])
    if parts.scheduler is not None:
        parts.scheduler.load_state_dict(loaded["scheduler"])
    for name, value in parts.extra.items():
        saved = loaded["extra"][name].get("value", {})
        if isinstance(value, dict):
            value.clear()
            value.update(saved)
        else:
            value.load_state_dict(saved)
    if parts.rng:
        mine = loaded.get("rng", {}).get(f"rank{rank}")
        if mine is None:
            log.info("rank %d: the checkpoint has no random generators for this rank (it was saved by %s ranks); "
                     "this rank keeps its own", rank, loaded["hora"]["ranks"])
        else:
            set_rng_state(mine)
    return int(loaded["hora"]["step"])
