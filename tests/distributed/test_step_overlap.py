"""``DistributedOptimizer.step()`` bucket by bucket (the update overlapped with the wire) is one step, bit for bit.

Each rank trains two copies of a model on its own data: one steps the usual way (``step()``: bucket by bucket
as the reductions land), the other reduces everything first and steps once (``synchronize()`` then
``step()`` under ``skip_synchronize()``). Parameters and optimizer state must be identical, for every
optimizer hora steps bucket by bucket, and the bucket-by-bucket path must really have been taken (counted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import hora as hvd
import hora.training.optimizer as hopt
from tests.distributed.harness import run_ranks

ONE_BUCKET_PER_PARAM = {"HORA_BUCKET_CAP_MB": "0", "HORA_FIRST_BUCKET_MB": "0"}
STEPS = 3

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_nesterov_wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=1e-3),
    "adam_for_loop": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2, decoupled_weight_decay=True, weight_decay=1e-2),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "adadelta": lambda p: torch.optim.Adadelta(p),
    "rmsprop_centered": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "asgd": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=1),
    **({"adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2)} if hasattr(torch.optim, "Adafactor") else {}),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two parameter groups with different learning-rate scales, so a step over a subset must keep each
    parameter in its own group."""
    params = list(model.parameters())
    return [{"params": params[:3]}, {"params": params[3:], "lr_scale": 0.5}]


def _make(name: str, model: nn.Module) -> torch.optim.Optimizer:
    opt = OPTIMIZERS[name](_groups(model))
    for group in opt.param_groups:
        group["lr"] = group["lr"] * group.get("lr_scale", 1.0)
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, how: str) -> None:
    """``how``: "overlap" (``step()``), "once" (reduce everything, then one step) or "subsets" (reduce
    everything, then one step per parameter, last parameter first: the finest split ``step()`` can make)."""
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if how == "overlap":
            opt.step()
            continue
        opt.synchronize()  # type: ignore[attr-defined]
        if how == "once":
            with opt.skip_synchronize():  # type: ignore[attr-defined]
                opt.step()
        else:
            for p in reversed(list(model.parameters())):
                _step_on(opt, p)


def _step_on(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
    """The wrapped torch optimizer's own step on parameter ``p`` alone: every group keeps only ``p`` (if it
    holds it) for the call, then gets its list back."""
    base = next(cls for cls in type(opt).__mro__ if cls in hopt.PER_PARAMETER)
    stashed = [group["params"] for group in opt.param_groups]
    try:
        for group in opt.param_groups:
            group["params"] = [q for q in group["params"] if q is p]
        base.step(opt)
    finally:
        for group, kept in zip(opt.param_groups, stashed):
            group["params"] = kept


def _state_tensors(opt: torch.optim.Optimizer, model: nn.Module) -> list[torch.Tensor]:
    """The state in parameter order (the dict's own order is the order parameters were first stepped)."""
    return [v for p in model.parameters() for _, v in sorted(opt.state[p].items()) if torch.is_tensor(v)]


def _by_bucket(opt: torch.optim.Optimizer) -> int:
    """The updates ``step()`` applied to part of the parameters (the bucket-by-bucket path)."""
    return hopt.snapshot(opt).updates_by_bucket


def _compare_all(rank: int, size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in OPTIMIZERS:
        nets = {k: _net() for k in ("overlap", "once", "subsets")}
        opts = {k: _make(name, net) for k, net in nets.items()}
        _train(nets["overlap"], opts["overlap"], rank, "overlap")
        partial = _by_bucket(opts["overlap"])
        for how in ("once", "subsets"):
            _train(nets[how], opts[how], rank, how)
        params = {k: list(net.parameters()) for k, net in nets.items()}
        state = {k: _state_tensors(opts[k], nets[k]) for k in nets}
        same = {k: len(state[k]) == len(state["once"])
                and all(torch.equal(a, b) for a, b in zip(params[k] + state[k], params["once"] + state["once"]))
                for k in ("overlap", "subsets")}
        moved = not torch.equal(params["overlap"][0], next(_net().parameters()))
        out[name] = (same["overlap"], same["subsets"], moved, partial)
    return out


def test_bucket_by_bucket_step_equals_one_step_for_every_per_parameter_optimizer() -> None:
    results = run_ranks(_compare_all, 2, env=ONE_BUCKET_PER_PARAM, timeout=120)
    for rank, res in enumerate(results):
        for name, (same_overlap, same_subsets, moved, partial) in res.items():
            assert same_overlap, f"rank {rank}, {name}: step() bucket by bucket differs from one step"
            assert same_subsets, f"rank {rank}, {name}: a step per parameter differs from one step"
            assert moved, f"rank {rank}, {name}: the parameters did not change"
            # 6 parameters, one bucket each: between 1 call per step (every bucket had landed before step())
            # and 6 (each bucket landed after the previous one's update)
            assert STEPS <= partial <= 6 * STEPS, f"rank {rank}, {name}: {partial} partial steps"


class _OwnSGD(torch.optim.SGD):
    """A user's subclass: hora cannot know its step is per parameter."""


def _not_overlapped(rank: int, size: int) -> dict[str, int]:
    hooked_net, own_net = _net(), _net()
    hooked = _make("sgd", hooked_net)
    ran = [0]
    hooked.register_step_pre_hook(lambda *_: ran.__setitem__(0, ran[0] + 1))
    own = hvd.DistributedOptimizer(_OwnSGD(own_net.parameters(), lr=0.1), named_parameters=own_net.named_parameters())
    seen: dict[str, int] = {}
    for key, opt, model in (("hook", hooked, hooked_net), ("subclass", own, own_net)):
        _train(model, opt, rank, "overlap")
        seen[key] = _by_bucket(opt)
    seen["hook_runs"] = ran[0]
    return seen


def test_step_hooks_and_unknown_optimizer_classes_step_once() -> None:
    for res in run_ranks(_not_overlapped, 2, env=ONE_BUCKET_PER_PARAM, timeout=60):
        assert res == {"hook": 0, "subclass": 0, "hook_runs": STEPS}


def _knob_off(rank: int, size: int) -> int:
    model = _net()
    opt = _make("adam_amsgrad", model)
    _train(model, opt, rank, "overlap")
    return _by_bucket(opt)


def test_knob_off_steps_once() -> None:
    assert run_ranks(_knob_off, 2, env={**ONE_BUCKET_PER_PARAM, "HORA_STEP_OVERLAP": "0"}) == [0, 0]


class _RefusedRate(float):
    """A learning rate SGD cannot apply: its update of a parameter raises (SGD steps by ``-lr``)."""

    def __neg__(self) -> float:
        raise RuntimeError("update failed")


def _failing_step(rank: int, size: int) -> tuple[str, bool, bool]:
    """An update that raises on the first group's bucket(s): the error reaches the caller after every bucket is
    back (nothing left in flight: zero_grad() and the next step work)."""
    model = _net()
    opt = _make("sgd", model)
    good = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = _RefusedRate(good)
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    nn.functional.mse_loss(model(x), y).backward()
    try:
        opt.step()
        message = ""
    except RuntimeError as exc:
        message = str(exc)
    in_flight = hopt.snapshot(opt).in_flight
    opt.param_groups[0]["lr"] = good
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return message, in_flight, all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_an_update_that_raises_leaves_nothing_in_flight() -> None:
    for res in run_ranks(_failing_step, 2, env=ONE_BUCKET_PER_PARAM, timeout=60):
        assert res == ("update failed", False, True)
