"""DistributedOptimizer beyond the option matrix: sparse gradients, frozen parameters, AMP and clipping,
a model also wrapped in DDP, schedulers and state dicts, Adasum, and misuse that must fail clearly."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hora as hvd
from tests.distributed.test_optimizer import ROWS_PER_RANK, STEPS, Net, batch, run_tensors, shard


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same_everywhere_and_close(results: list[list[torch.Tensor]], expected: list[torch.Tensor],
                               tol: float = 1e-5) -> None:
    for rank, params in enumerate(results):
        assert len(params) == len(expected)
        for i, (got, want) in enumerate(zip(params, expected)):
            assert torch.equal(got, results[0][i]), f"rank {rank} parameter {i} differs from rank 0"
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# --- sparse gradients -----------------------------------------------------------------------------------
class EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx).mean(1))


def _ids(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 20, (rows, 5), generator=g), torch.randn(rows, 3, generator=g)


def _train_embed(model: nn.Module, opt: torch.optim.Optimizer, data) -> list[torch.Tensor]:
    for step in range(STEPS):
        opt.zero_grad()
        idx, y = data(step)
        F.mse_loss(model(idx), y).backward()
        opt.step()
    return _params(model)


def _sparse_ranks(rank: int, size: int, sparse_as_dense: bool) -> list[torch.Tensor]:
    model = EmbedNet()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense)

    def data(step: int):
        idx, y = _ids(step, ROWS_PER_RANK * size)
        rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        return idx[rows], y[rows]

    return _train_embed(model, opt, data)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients(sparse_as_dense: bool) -> None:
    model = EmbedNet()
    expected = _train_embed(model, torch.optim.SGD(model.parameters(), lr=0.5), lambda s: _ids(s, 2 * ROWS_PER_RANK))
    _same_everywhere_and_close(run_tensors(_sparse_ranks, 2, sparse_as_dense), expected)


# --- frozen parameters and requires_grad changing between steps ------------------------------------------
def _freeze_schedule(model: Net, opt: torch.optim.Optimizer, data) -> list[torch.Tensor]:
    model.fc1.requires_grad_(False)  # frozen from the start
    for step in range(STEPS):
        if step == 1:  # unfreeze one layer, freeze another
            model.fc1.requires_grad_(True)
            model.fc3.requires_grad_(False)
        opt.zero_grad()
        x, y = data(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return _params(model)


def _freeze_ranks(rank: int, size: int) -> list[torch.Tensor]:
    model = Net()
    model.fc1.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    return _freeze_schedule(model, opt, lambda s: shard(s, 0, rank, size))


def test_frozen_parameters_and_requires_grad_changing_between_steps() -> None:
    model = Net()
    expected = _freeze_schedule(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                lambda s: batch(s, 0, 2 * ROWS_PER_RANK))
    assert not torch.equal(expected[0], Net().fc1.weight.detach())  # fc1 did train after unfreezing
    _same_everywhere_and_close(run_tensors(_freeze_ranks, 2), expected)


# --- AMP GradScaler, clipping between synchronize() and step() --------------------------------------------
def _amp_clip(model: Net, opt: torch.optim.Optimizer, data, distributed: bool) -> list[torch.Tensor]:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data(step)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if distributed:
            opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        if distributed:
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
    return _params(model)


def _amp_ranks(rank: int, size: int) -> list[torch.Tensor]:
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    return _amp_clip(model, opt, lambda s: shard(s, 0, rank, size), True)


def test_grad_scaler_unscale_and_clipping_between_synchronize_and_step() -> None:
    model = Net()
    expected = _amp_clip(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         lambda s: batch(s, 0, 2 * ROWS_PER_RANK), False)
    _same_everywhere_and_close(run_tensors(_amp_ranks, 2), expected)


# torch's own AMP recipes, without synchronize(): the scaler must unscale the reduced gradients, and every rank
# must agree on skipping a step whose gradients overflowed, even when only one rank's shard overflowed
_OVERFLOW_STEP = 1  # rank 1's rows blow up this step: every rank (and one process on the whole batch) skips it


def _torch_amp(model: Net, opt: torch.optim.Optimizer, data, recipe: str) -> tuple[list[torch.Tensor], list[float]]:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    scales = []
    for step in range(STEPS + 1):
        opt.zero_grad()
        x, y = data(step)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if recipe == "clip":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return _params(model), scales


def _overflowing(data):
    def shard_or_whole(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = data(step)
        if step == _OVERFLOW_STEP:
            y = y.clone()
            y[-1] = torch.finfo(torch.float32).max  # the last row (rank 1's shard, or the end of the whole
            # batch): its scaled gradients overflow
        return x, y
    return shard_or_whole


def _torch_amp_ranks(rank: int, size: int, recipe: str, fused: bool) -> tuple[list[torch.Tensor], list[float], int]:
    import warnings

    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused),
                                   named_parameters=model.named_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params, scales = _torch_amp(model, opt, _overflowing(lambda s: shard(s, 0, rank, size)), recipe)
    horovods = sum("skip_synchronize" in str(w.message) for w in caught)
    return params, scales, horovods


@pytest.mark.parametrize(("recipe", "fused"), [("plain", False), ("clip", False), ("plain", True)])
def test_grad_scaler_in_torchs_own_recipe_unscales_reduced_gradients_and_every_rank_skips_together(
        recipe: str, fused: bool) -> None:
    """``scaler.scale(loss).backward(); [scaler.unscale_(opt); clip;] scaler.step(opt); scaler.update()`` with
    no synchronize(): the same parameters and loss scales as one process on the whole batch, on every rank,
    with the step whose gradients overflowed on rank 1 only skipped everywhere, and no Horovod warning."""
    model = Net()
    expected, expected_scales = _torch_amp(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused),
        _overflowing(lambda s: batch(s, 0, 2 * ROWS_PER_RANK)), recipe)
    assert expected_scales[_OVERFLOW_STEP] == expected_scales[_OVERFLOW_STEP - 1] / 2  # the reference skipped
    results = run_tensors(_torch_amp_ranks, 2, recipe, fused)
    for rank, (_, scales, horovods) in enumerate(results):
        assert scales == expected_scales, f"rank {rank}: loss scales {scales}, one process: {expected_scales}"
        assert horovods == 0, f"rank {rank} warned {horovods} time(s) about skip_synchronize()"
    _same_everywhere_and_close([params for params, _, _ in results], expected)


# --- the seed article's script: DDP and DistributedOptimizer together -----------------------------------
class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _ddp_ranks(rank: int, size: int) -> tuple[list[torch.Tensor], list[str]]:
    collect = _Collect()
    logging.getLogger("hora").addHandler(collect)
    model = torch.nn.parallel.DistributedDataParallel(Net())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = shard(step, 0, rank, size)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return _params(model), [m for m in collect.messages if "DistributedDataParallel" in m]


def test_model_in_ddp_and_distributed_optimizer_reduces_once_and_says_so_once() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):  # op=Sum: the gradient of the summed loss over ranks
        opt.zero_grad()
        x, y = batch(step, 0, 2 * ROWS_PER_RANK)
        (F.mse_loss(model(x), y) * 2).backward()
        opt.step()
    results = run_tensors(_ddp_ranks, 2)
    _same_everywhere_and_close([r[0] for r in results], _params(model))
    for _, warnings in results:
        assert len(warnings) == 1 and "does not reduce them again" in warnings[0]


# --- scheduler, state_dict, isinstance, misuse ------------------------------------------------------------
def _api_ranks(rank: int, size: int) -> dict:
    model = Net()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = shard(0, 0, rank, size)
    F.mse_loss(model(x), y).backward()
    errors = {}
    try:
        opt.zero_grad()  # buckets are in flight: must refuse
    except ValueError as e:
        errors["zero_grad"] = str(e)
    opt.step()
    sched.step()
    opt.zero_grad()
    try:
        for _ in range(2):  # two backward passes with backward_passes_per_step=1
            F.mse_loss(model(x), y).backward()
    except ValueError as e:
        errors["passes"] = str(e)
    opt.step()  # the first pass's gradients are still reduced and applied
    state = opt.state_dict()
    fresh = torch.optim.SGD(Net().parameters(), lr=1.0)
    fresh.load_state_dict(state)
    try:
        hvd.DistributedOptimizer(opt)
    except ValueError as e:
        errors["twice"] = str(e)
    return {"isinstance": isinstance(opt, torch.optim.SGD), "class": type(opt).__name__,
            "lr": opt.param_groups[0]["lr"], "fresh_lr": fresh.param_groups[0]["lr"],
            "momentum_buffers": sum("momentum_buffer" in s for s in fresh.state.values()), "errors": errors}


def test_scheduler_state_dict_isinstance_and_misuse_errors() -> None:
    for r in run_tensors(_api_ranks, 2):
        assert r["isinstance"] and r["class"] == "SGD"
        assert r["lr"] == 0.05 and r["fresh_lr"] == 0.05  # StepLR halved it; state_dict carries it
        assert r["momentum_buffers"] == 6
        assert "before optimizer.step() or optimizer.synchronize()" in r["errors"]["zero_grad"]
        assert "backward_passes_per_step=1" in r["errors"]["passes"]
        assert "already a hora DistributedOptimizer" in r["errors"]["twice"]


# --- Adasum -----------------------------------------------------------------------------------------------
def _adasum_ranks(rank: int, size: int) -> list[float]:
    w = nn.Parameter(torch.zeros(2))
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)], op=hvd.Adasum)
    (w * grads[rank]).sum().backward()
    opt.step()
    return w.detach().tolist()


def test_adasum_matches_the_formula_on_a_hand_computed_case() -> None:
    # a=[1,0], b=[1,1]: a.b=1, |a|^2=1, |b|^2=2 -> (1 - 1/2) a + (1 - 1/4) b = [1.25, 0.75]
    for w in run_tensors(_adasum_ranks, 2):
        assert w == pytest.approx([-1.25, -0.75])


GRADS = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.3, 1.0, 2.0])]


def _adasum_adam_ranks(rank: int, size: int) -> list[float]:
    w = nn.Parameter(torch.ones(3))
    opt = hvd.DistributedOptimizer(torch.optim.Adam([w], lr=0.1), named_parameters=[("w", w)], op=hvd.Adasum)
    for _ in range(2):
        opt.zero_grad()
        (w * GRADS[rank]).sum().backward()
        opt.step()
    return w.detach().tolist()


def test_adasum_combines_each_ranks_optimizer_update_as_horovod_does() -> None:
    # Horovod applies Adasum to the update of each rank's own optimizer step (Adam state stays local)
    from hora.datapath.kinds.adasum import adasum_pair

    w = torch.ones(3)
    locals_ = [nn.Parameter(torch.ones(3)) for _ in GRADS]
    opts = [torch.optim.Adam([p], lr=0.1) for p in locals_]
    for _ in range(2):
        deltas = []
        for p, opt, g in zip(locals_, opts, GRADS):
            with torch.no_grad():
                p.copy_(w)
            p.grad = g.clone()
            opt.step()
            deltas.append(p.detach() - w)
        w = w + adasum_pair(deltas[0], deltas[1])
    for got in run_tensors(_adasum_adam_ranks, 2):
        assert got == pytest.approx(w.tolist(), abs=1e-6)
    assert w.tolist() != pytest.approx((torch.ones(3) - 0.2 * torch.ones(3)).tolist())  # not trivially Adam's


def _adasum_three(rank: int, size: int) -> str:
    w = nn.Parameter(torch.zeros(2))
    try:
        hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), op=hvd.Adasum)
    except ValueError as e:
        return str(e)
    return "no error"


def test_adasum_on_three_ranks_is_refused_with_the_reason() -> None:
    for msg in run_tensors(_adasum_three, 3):
        assert "power-of-two" in msg and "got 3" in msg


def _allreduce_adasum(rank: int, size: int) -> list[float]:
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])]
    return hvd.allreduce(grads[rank], op=hvd.Adasum, name="adasum").tolist()


def test_allreduce_with_op_adasum_uses_the_same_rule() -> None:
    for out in run_tensors(_allreduce_adasum, 2):
        assert out == pytest.approx([1.25, 0.75])


# --- process sets and set_backward_passes_per_step -----------------------------------------------------
def _process_set_ranks(rank: int, size: int) -> list[torch.Tensor]:
    evens = hvd.add_process_set([0, 2])
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=evens)
    opt.set_backward_passes_per_step(2)  # two half-shards per step, accumulated locally
    for step in range(STEPS):
        opt.zero_grad()
        x, y = shard(step, 0, rank, size)
        for half in (slice(0, ROWS_PER_RANK // 2), slice(ROWS_PER_RANK // 2, ROWS_PER_RANK)):
            (F.mse_loss(model(x[half]), y[half]) / 2).backward()
        opt.step()
    return _params(model)


def test_process_set_reduces_only_among_its_members() -> None:
    results = run_tensors(_process_set_ranks, 3)

    def alone(ranks: list[int]) -> list[torch.Tensor]:  # one process on the members' shards
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = zip(*(shard(step, 0, r, 3) for r in ranks))
            F.mse_loss(model(torch.cat(x)), torch.cat(y)).backward()
            opt.step()
        return _params(model)

    _same_everywhere_and_close([results[0], results[2]], alone([0, 2]))
    _same_everywhere_and_close([results[1]], alone([1]))


# --- shutdown()/init() between steps (what an elastic reset does) ---------------------------------------
def _reinit_ranks(rank: int, size: int) -> list[torch.Tensor]:
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(STEPS):
        x, y = shard(step, 0, rank, size)
        if step == 1:  # a step interrupted after backward: its reductions are abandoned
            F.mse_loss(model(x), y).backward()
            hvd.shutdown()
            hvd.init()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return _params(model)


def test_optimizer_keeps_working_after_shutdown_and_init() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, 0, 2 * ROWS_PER_RANK)
        F.mse_loss(model(x), y).backward()
        opt.step()
    _same_everywhere_and_close(run_tensors(_reinit_ranks, 2), _params(model))


# --- gradients set by hand (no backward, so no hook ran) ----------------------------------------------------
def _manual_ranks(rank: int, size: int) -> list[float]:
    w = nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)])
    w.grad = torch.full((3,), float(rank + 1))
    opt.step()
    return w.detach().tolist()


def test_gradients_set_by_hand_are_averaged_too() -> None:
    for w in run_tensors(_manual_ranks, 2):
        assert w == [-1.5, -1.5, -1.5]  # mean of 1 and 2


# --- collective names do not depend on what a process built before ---------------------------------------
class BnNet(nn.Module):
    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 8)
        self.bn = norm(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def _extra_objects_ranks(rank: int, size: int) -> list[torch.Tensor]:
    if rank == 0:  # an evaluation copy and an EMA copy: optimizers and a SyncBatchNorm built, never stepped
        spare = BnNet(hvd.SyncBatchNorm)
        hvd.DistributedOptimizer(torch.optim.SGD(spare.parameters(), lr=0.1), named_parameters=spare.named_parameters())
        ema = BnNet(hvd.SyncBatchNorm)  # the same parameter names as the model below
        hvd.DistributedOptimizer(torch.optim.SGD(ema.parameters(), lr=0.1), named_parameters=ema.named_parameters())
    model = BnNet(hvd.SyncBatchNorm)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(STEPS):
        opt.zero_grad()
        x, y = shard(step, 0, rank, size)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return _params(model)


def test_a_rank_that_built_an_extra_optimizer_and_sync_batch_norm_still_pairs_with_its_peers() -> None:
    model = BnNet(nn.BatchNorm1d)  # SyncBatchNorm over 2 shards = BatchNorm over the whole batch
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, 0, 2 * ROWS_PER_RANK)
        F.mse_loss(model(x), y).backward()
        opt.step()
    _same_everywhere_and_close(run_tensors(_extra_objects_ranks, 2, timeout=60), _params(model), tol=1e-4)
