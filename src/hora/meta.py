"""Models built on the meta device: :func:`materialize` gives one storage on a real device and initial values, the
same on every rank, without a second copy of the weights at any moment.

A model built under ``with torch.device("meta"):`` has shapes and no memory. ``materialize`` allocates its
parameters and buffers once where they will live (``Module.to_empty``), fills them in place (``init``, or each
submodule's own ``reset_parameters()``), and then broadcasts rank 0's values in bounded chunks
(:func:`hora.broadcast_parameters`), so ranks whose random generators differ still start from one model. Nothing is
built twice: no random initialisation on the CPU followed by a copy to the GPU, no state dict beside the model.

To start from trained weights instead, load them into the materialised model in place: ``hora.checkpoint``'s
``restore_sharded`` reads each tensor straight into the model's storage; a Hugging Face model comes from
``from_pretrained`` shard by shard (docs/large-models.md has both recipes and their measured peaks).

Example:
    >>> with torch.device("meta"):                                   # doctest: +SKIP
    ...     model = transformers.AutoModelForCausalLM.from_config(config)
    >>> hora.meta.materialize(model, init=model.init_weights)        # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from hora.api.functions import broadcast_parameters
from hora.runtime import lifecycle as runtime

__all__ = ["materialize", "non_persistent_buffers"]

log = logging.getLogger(__name__)


def non_persistent_buffers(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s buffers that are not in its state dict (computed at construction, such as a
    rotary embedding's frequencies): no checkpoint and no broadcast restores them, only an ``init`` that
    recomputes them."""
    names = []
    for prefix, sub in module.named_modules():
        for name in sub._non_persistent_buffers_set:
            if sub._buffers.get(name) is not None:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def materialize(module: torch.nn.Module, device: torch.device | str | None = None, *,
                init: Callable[[], Any] | None = None, root_rank: int = 0) -> torch.nn.Module:
    """Give ``module``, built on the meta device, storage on ``device`` and initial values, the same on every rank.

    Args:
        module: a model whose every parameter and buffer is on the meta device.
        device: where it will train; default: hora's device for this rank (its GPU), else the CPU.
        init: called with no argument after the storage exists, to fill it in place (a Hugging Face model's
            ``model.init_weights``, a torchtitan-style ``model.init_weights``). Default: every submodule's own
            ``reset_parameters()``, which torch's layers have.
        root_rank: the rank whose values every rank ends with (when hora runs more than one).

    Returns:
        ``module`` itself, materialised.

    Raises:
        ValueError: some parameters or buffers are not on the meta device (``to_empty`` would discard their
            values), or, without ``init``, the model has non-persistent buffers or submodules with tensors of
            their own and no ``reset_parameters()``: their memory would stay uninitialised.
    """
    real = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if not t.is_meta]
    if real:
        raise ValueError(
            f"materialize() takes a model built entirely on the meta device; {len(real)} of its tensors are "
            f"not ({', '.join(real[:5])}{', ...' if len(real) > 5 else ''}): build the whole model under "
            "`with torch.device('meta'):`, or load those values after materialising"
        )
    computed = non_persistent_buffers(module)
    if init is None and computed:
        raise ValueError(
            f"the model has buffers that are computed at construction and saved nowhere ({', '.join(computed[:5])}"
            f"{', ...' if len(computed) > 5 else ''}); on the meta device they were not computed. Pass "
            "init=... that sets them (a Hugging Face model's init_weights does)"
        )
    uncovered = [] if init is not None else _without_reset(module)
    if uncovered:
        raise ValueError(
            f"without init=..., materialize() fills each submodule with its reset_parameters(), but "
            f"{', '.join(uncovered[:5])}{', ...' if len(uncovered) > 5 else ''} hold tensors of their own and have "
            "none: their values would be whatever the memory held. Pass init=... that sets every parameter"
        )
    target = torch.device(device) if device is not None else _default_device()
    module.to_empty(device=target)
    with torch.no_grad():
        if init is not None:
            init()
        else:
            for sub in module.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
    if runtime.is_initialized() and runtime.size() > 1:
        broadcast_parameters(module.state_dict(), root_rank=root_rank)
    log.info("materialised %s on %s", type(module).__name__, target)
    return module


def _without_reset(module: torch.nn.Module) -> list[str]:
    """Submodules holding parameters or saved buffers of their own but no ``reset_parameters()`` to fill them."""
    out = []
    for prefix, sub in module.named_modules():
        own = any(p is not None for p in sub._parameters.values()) or any(
            b is not None and name not in sub._non_persistent_buffers_set for name, b in sub._buffers.items())
        if own and not callable(getattr(sub, "reset_parameters", None)):
            out.append(prefix or type(sub).__name__)
    return out


def _default_device() -> torch.device:
    if runtime.is_initialized():
        device = runtime.state("materialize()").device
        if device is not None:
            return device
    return torch.device("cpu")
