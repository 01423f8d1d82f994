"""DistributedOptimizer(sharding=...): every rank ends where one process training on the whole batch ends.

Each case trains a small model for 3 steps with a sharded optimizer on N ranks; the parent replays the steps
with the plain optimizer in one process on the concatenated batches. Parameters must match the reference
(1e-5 on an fp32 wire, 2e-3 fp16, 2e-2 bf16), be bit-identical on every rank, and each rank must hold
optimizer state only for the parameters it owns, every parameter owned by exactly one rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hora as hvd
from tests.distributed.test_optimizer import ROWS_PER_RANK as ROWS
from tests.distributed.test_optimizer import STEPS, TOL, HalfScale, Net, batch, run_tensors

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    # factored second moments of the 2-D weights: exact only because whole parameters are sharded
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
}


def _cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    for mode in ("optimizer", "gradients"):
        for opt in OPTIMIZERS:
            cases[f"{mode}-{opt}"] = {"mode": mode, "opt": opt}
        cases[f"{mode}-accumulate"] = {"mode": mode, "opt": "adamw", "bpps": 2}
        cases[f"{mode}-fp16"] = {"mode": mode, "opt": "adamw", "dist": {"compression": hvd.Compression.fp16}}
        cases[f"{mode}-bf16"] = {"mode": mode, "opt": "sgd", "dist": {"compression": hvd.Compression.bf16}}
        cases[f"{mode}-custom_compressor"] = {"mode": mode, "opt": "sgd", "dist": {"compression": HalfScale()}}
        cases[f"{mode}-sum"] = {"mode": mode, "opt": "sgd", "dist": {"op": hvd.Sum}, "loss_scale": "size"}
        cases[f"{mode}-clip"] = {"mode": mode, "opt": "adamw", "clip": 0.05}
        # no weight decay: the unused parameter gets a zero gradient (Horovod's rule) and must not move
        cases[f"{mode}-unused"] = {"mode": mode, "opt": "sgd", "unused": True}
        # fc1 frozen at first, then trained while fc3 is frozen: the layouts change between steps
        cases[f"{mode}-freeze"] = {"mode": mode, "opt": "sgd", "freeze": True}
    return cases


CASES = _cases()
THREE_RANK_CASES = ["optimizer-adamw", "gradients-adamw", "gradients-accumulate", "gradients-clip",
                    "optimizer-adafactor"]


def _train(model: nn.Module, opt: Any, case: dict[str, Any], data: Callable[[int, int], Any], loss_scale: float,
           distributed: bool) -> dict[str, Any]:
    norms = []
    for step in range(STEPS):
        if case.get("freeze") and step == 1:
            model.fc1.requires_grad_(True)
            model.fc3.requires_grad_(False)
        opt.zero_grad()
        for micro in range(case.get("bpps", 1)):
            x, y = data(step, micro)
            (F.mse_loss(model(x), y) * loss_scale).backward()
        if "clip" in case:
            if distributed:
                norms.append(opt.clip_grad_norm_(case["clip"]))
                with opt.skip_synchronize():
                    opt.step()
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"]))
                opt.step()
        else:
            opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms}


def _ranks(rank: int, size: int, names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        case = CASES[name]
        model = Net(unused=case.get("unused", False))
        model.fc1.requires_grad_(not case.get("freeze"))
        opt = hvd.DistributedOptimizer(OPTIMIZERS[case["opt"]](model.parameters()),
                                       named_parameters=model.named_parameters(), sharding=case["mode"],
                                       backward_passes_per_step=case.get("bpps", 1), **case.get("dist", {}))

        def data(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = batch(step, micro, ROWS * size)
            return x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]

        result = _train(model, opt, case, data, 1.0, distributed=True)
        # what a user sees of the sharding after a step
        opt.zero_grad()
        F.mse_loss(model(data(0, 0)[0]), data(0, 0)[1]).backward()
        opt.synchronize()
        names_of = dict(zip(opt._parameter_names.values(), opt._parameter_names.keys()))
        result["owned"] = opt.owned_parameter_names()
        result["with_state"] = sorted(n for n, p in names_of.items() if opt.state.get(p))
        result["with_grad"] = sorted(n for n, p in names_of.items() if p.grad is not None)
        result["sharded_keys"] = sorted(opt.sharded_state_dict()["state"])
        with opt.skip_synchronize():
            opt.step()
        out[name] = result
    return out


def reference(name: str, size: int) -> dict[str, Any]:
    case = CASES[name]
    model = Net(unused=case.get("unused", False))
    model.fc1.requires_grad_(not case.get("freeze"))
    scale = float(size) if case.get("loss_scale") == "size" else 1.0
    opt = OPTIMIZERS[case["opt"]](model.parameters())
    return _train(model, opt, case, lambda s, m: batch(s, m, ROWS * size), scale, distributed=False)


def check(results: list[dict[str, Any]], names: list[str], size: int) -> None:
    for name in names:
        case = CASES[name]
        want = reference(name, size)
        tol = next((t for key, t in TOL.items() if key in name), 1e-5)
        every = [n for n, _ in Net(unused=case.get("unused", False)).named_parameters()]
        owned = [r[name]["owned"] for r in results]
        assert sorted(n for o in owned for n in o) == sorted(every), f"{name}: not a partition: {owned}"
        assert all(owned), f"{name}: some rank owns nothing: {owned}"
        for rank, per_rank in enumerate(results):
            got = per_rank[name]
            for i, (p, q) in enumerate(zip(got["params"], want["params"])):
                assert torch.equal(p, results[0][name]["params"][i]), f"{name}: rank {rank} param {i} != rank 0's"
                torch.testing.assert_close(p, q, atol=tol, rtol=tol, msg=lambda m, j=i, n=name: f"{n}, param {j}: {m}")
            for a, b in zip(got["norms"], want["norms"]):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: clip norm: {m}")
            mine = sorted(got["owned"])
            assert got["with_state"] == mine, f"{name}: rank {rank} holds state of {got['with_state']}, owns {mine}"
            assert got["sharded_keys"] == mine, name
            grads = got["with_grad"]
            trained = [n for n in sorted(every) if not (case.get("freeze") and n.startswith("fc3"))]
            if case["mode"] == "gradients":
                mine_trained = [n for n in mine if n in trained]
                assert grads == mine_trained, f"{name}: rank {rank} keeps gradients of {grads}, owns {mine}"
            else:
                assert grads == trained, f"{name}: rank {rank} keeps gradients of {grads}"


def test_every_case_matches_one_process_on_the_whole_batch_2_ranks() -> None:
    names = list(CASES)
    check(run_tensors(_ranks, 2, names, timeout=180), names, 2)


def test_cases_match_on_3_ranks() -> None:
    check(run_tensors(_ranks, 3, THREE_RANK_CASES, timeout=180), THREE_RANK_CASES, 3)


@pytest.mark.parametrize("env", [
    {"HORA_BUCKET_CAP_MB": "0", "HORA_FIRST_BUCKET_MB": "0"},  # one bucket per parameter: steps as buckets land
    {"HORA_SHARDED_REDUCE": "reducescatter"},  # equal owner segments, reduce-scattered
    {"HORA_SHARDED_REDUCE": "reducescatter", "HORA_BUCKET_CAP_MB": "0", "HORA_FIRST_BUCKET_MB": "0"},
], ids=["bucket_per_parameter", "reducescatter", "reducescatter_per_parameter"])
def test_bucket_layouts_match(env: dict[str, str]) -> None:
    names = ["optimizer-adamw", "gradients-adamw", "gradients-accumulate", "gradients-fp16", "gradients-clip"]
    check(run_tensors(_ranks, 2, names, timeout=180, env=env), names, 2)


def test_reference_is_sensitive_to_the_options() -> None:
    # guards the tests above: if the options did not change the outcome, matching the reference would prove little
    base = reference("optimizer-adamw", 2)["params"]
    for name in ("optimizer-sgd", "optimizer-adafactor", "optimizer-accumulate", "optimizer-clip"):
        assert not all(torch.allclose(a, b) for a, b in zip(reference(name, 2)["params"], base)), name


@pytest.mark.parametrize("kwargs, match", [
    ({"sharding": "parameters"}, "sharding must be None, 'optimizer' or 'gradients'"),
    ({"sharding": "gradients", "op": hvd.Adasum}, "Adasum"),
])
def test_bad_sharding_arguments_say_what_is_wrong(kwargs: dict[str, Any], match: str) -> None:
    model = Net()
    with pytest.raises(ValueError, match=match):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_lbfgs_is_refused() -> None:
    model = Net()
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), sharding="optimizer")


# --- the state: full and sharded forms ---------------------------------------------------------------------
def _adamw_steps(model: nn.Module, opt: Any, steps: range, rank: int, size: int) -> None:
    for step in steps:
        opt.zero_grad()
        x, y = batch(step, 0, ROWS * size)
        F.mse_loss(model(x[rank * ROWS:(rank + 1) * ROWS]), y[rank * ROWS:(rank + 1) * ROWS]).backward()
        opt.step()


def _reference_adamw(sizes: list[int]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One process: step ``i`` on the global batch of ``sizes[i]`` ranks."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step, size in enumerate(sizes):
        opt.zero_grad()
        x, y = batch(step, 0, ROWS * size)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def _full_state(rank: int, size: int, mode: str) -> dict[str, Any]:
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
                                   named_parameters=model.named_parameters(), sharding=mode)
    _adamw_steps(model, opt, range(STEPS), rank, size)
    full = copy.deepcopy(opt.state_dict())  # a collective: every rank gets every entry (as torch, live tensors)
    # a fresh sharded optimizer (of a copy of the model) loads the full state: each rank keeps its own
    # entries, and training goes on exactly
    again = Net()
    again.load_state_dict(model.state_dict())
    fresh = hvd.DistributedOptimizer(torch.optim.AdamW(again.parameters(), lr=0.5),
                                     named_parameters=again.named_parameters(), sharding=mode)
    fresh.load_state_dict(copy.deepcopy(full))  # torch keeps the loaded tensors as its state
    kept = sorted(fresh.sharded_state_dict()["state"])
    _adamw_steps(again, fresh, range(STEPS, STEPS + 2), rank, size)
    return {"full": full, "kept": kept, "owned": sorted(fresh.owned_parameter_names()),
            "params": [p.detach().clone() for p in again.parameters()]}


@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
def test_full_state_dict_is_torchs_and_loads_back(mode: str) -> None:
    results = run_tensors(_full_state, 2, mode, timeout=120)
    model, opt = _reference_adamw([2] * STEPS)
    want = opt.state_dict()
    for rank, got in enumerate(results):
        assert got["full"]["param_groups"] == want["param_groups"]
        assert sorted(got["full"]["state"]) == sorted(want["state"])
        for index, entry in want["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(got["full"]["state"][index][key], value, atol=1e-5, rtol=1e-5,
                                           msg=lambda m, i=index, k=key, r=rank: f"rank {r} entry {i}.{k}: {m}")
        assert got["kept"] == got["owned"], f"rank {rank} kept {got['kept']}, owns {got['owned']}"
    model, _ = _reference_adamw([2] * (STEPS + 2))  # the reference goes on two more steps
    for got in results:
        for p, q in zip(got["params"], model.parameters()):
            torch.testing.assert_close(p, q.detach(), atol=1e-5, rtol=1e-5)


def _save_shards(rank: int, size: int, mode: str) -> dict[str, Any]:
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
                                   named_parameters=model.named_parameters(), sharding=mode)
    _adamw_steps(model, opt, range(2), rank, size)
    return {"shard": opt.sharded_state_dict(), "model": model.state_dict()}


def _load_shards(rank: int, size: int, mode: str, shards: list[dict[str, Any]],
                 model_state: dict[str, torch.Tensor]) -> dict[str, Any]:
    model = Net()
    model.load_state_dict(model_state)
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.3),
                                   named_parameters=model.named_parameters(), sharding=mode)
    merged = {"state": {k: v for s in shards for k, v in s["state"].items()}, "param_groups": shards[0]["param_groups"]}
    opt.load_sharded_state_dict(merged)  # every rank's shards: each keeps its own
    lr = opt.param_groups[0]["lr"]
    _adamw_steps(model, opt, range(2, 4), rank, size)
    return {"lr": lr, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
def test_shards_saved_at_2_ranks_restore_at_3(mode: str) -> None:
    saved = run_tensors(_save_shards, 2, mode, timeout=120)
    assert sorted(k for s in saved for k in s["shard"]["state"]) == sorted(n for n, _ in Net().named_parameters())
    assert saved[0]["shard"]["param_groups"][0]["params"] == [n for n, _ in Net().named_parameters()]
    results = run_tensors(_load_shards, 3, mode, [s["shard"] for s in saved], saved[0]["model"], timeout=120)
    model, _ = _reference_adamw([2, 2, 3, 3])
    for rank, got in enumerate(results):
        assert got["lr"] == 0.01, "the saved hyperparameters were not loaded"
        for p, q in zip(got["params"], model.parameters()):
            torch.testing.assert_close(p, q.detach(), atol=1e-5, rtol=1e-5, msg=lambda m, r=rank: f"rank {r}: {m}")


def _broadcast_state(rank: int, size: int) -> dict[str, Any]:
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01 * (rank + 1)),
                                   named_parameters=model.named_parameters(), sharding="gradients")
    _adamw_steps(model, opt, range(1), rank, size)
    before = sorted(opt.sharded_state_dict()["state"])
    hvd.broadcast_optimizer_state(opt, root_rank=1)
    return {"lr": opt.param_groups[0]["lr"], "before": before, "after": sorted(opt.sharded_state_dict()["state"])}


def test_broadcast_optimizer_state_gives_a_sharded_optimizer_the_roots_options_and_keeps_each_shard() -> None:
    results = run_tensors(_broadcast_state, 2, timeout=120)
    assert [r["lr"] for r in results] == [0.02, 0.02]
    for r in results:
        assert r["before"] == r["after"] and r["after"]


# --- AMP: torch's GradScaler recipe on a sharded optimizer --------------------------------------------------
_OVERFLOW_STEP = 1  # this step fc3.bias's gradient overflows: only its owner sees it, every rank must skip


def _amp(model: Net, opt: Any, data: Callable[[int], Any], clip: Callable[[], Any] | None) -> dict[str, Any]:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    scales = []
    for step in range(STEPS + 1):
        opt.zero_grad()
        x, y = data(step)
        loss = F.mse_loss(model(x), y)
        if step == _OVERFLOW_STEP:
            loss = loss + model.fc3.bias.sum() * torch.finfo(torch.float32).max
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            clip()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"params": [p.detach().clone() for p in model.parameters()], "scales": scales}


def _amp_ranks(rank: int, size: int, mode: str, clip: bool, fused: bool) -> dict[str, Any]:
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused),
                                   named_parameters=model.named_parameters(), sharding=mode)

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(step, 0, ROWS * size)
        return x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]

    out = _amp(model, opt, data, (lambda: opt.clip_grad_norm_(0.05)) if clip else None)
    out["owns_bias"] = "fc3.bias" in opt.owned_parameter_names()
    return out


@pytest.mark.parametrize(("mode", "clip", "fused"), [
    ("optimizer", False, False), ("gradients", False, False), ("gradients", True, False), ("gradients", False, True),
])
def test_grad_scaler_recipe_skips_an_overflowing_step_on_every_rank(mode: str, clip: bool, fused: bool) -> None:
    """``scaler.scale(loss).backward(); [scaler.unscale_(opt); opt.clip_grad_norm_(); ] scaler.step(opt);
    scaler.update()``: with sharding="gradients" only the owner of fc3.bias holds its overflowing gradient,
    and every rank must skip that step and back the scale off, as one process on the whole batch does."""
    model = Net()
    ref_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    want = _amp(model, ref_opt, lambda s: batch(s, 0, ROWS * 2),
                (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)) if clip else None)
    assert want["scales"][_OVERFLOW_STEP] == want["scales"][_OVERFLOW_STEP - 1] / 2  # the reference skipped
    results = run_tensors(_amp_ranks, 2, mode, clip, fused, timeout=120)
    assert sorted(r["owns_bias"] for r in results) == [False, True]
    for rank, got in enumerate(results):
        assert got["scales"] == want["scales"], f"rank {rank}: scales {got['scales']}, one process {want['scales']}"
        for i, (p, q) in enumerate(zip(got["params"], want["params"])):
            assert torch.equal(p, results[0]["params"][i]), f"rank {rank} param {i} != rank 0's"
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=lambda m, j=i: f"param {j}: {m}")


# --- autotune replans the gradient buckets; the ownership (and the state) stays ------------------------------
AUTOTUNE_STEPS = 24


def _autotune_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)])  # 3 MB: 1 to 3 buckets as caps change


def _autotune_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 256, generator=torch.Generator().manual_seed(100 * step + rank))


def _autotuned(rank: int, size: int, mode: str) -> dict[str, Any]:
    model = _autotune_model()
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), sharding=mode)
    owned, plans = [], []
    for step in range(AUTOTUNE_STEPS):
        opt.zero_grad()
        model(_autotune_batch(step, rank)).pow(2).mean().backward()
        opt.step()
        owned.append(tuple(opt.owned_parameter_names()))
        plans.append(opt._hora_reducer._generation)  # bumped at every replan
    return {"params": [p.detach().clone() for p in model.parameters()], "owned": sorted(set(owned)),
            "plans": plans}


def test_autotune_replans_sharded_gradient_buckets_and_training_stays_exact() -> None:
    """sharding="gradients" plans its own buckets: autotune's sizes reach them (sharding="optimizer" reduces
    with the unsharded reducer, tests/distributed/test_autotune.py)."""
    mode = "gradients"
    env = {"HORA_AUTOTUNE": "1", "HORA_AUTOTUNE_WARMUP_SAMPLES": "1", "HORA_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "5"}
    results = run_tensors(_autotuned, 2, mode, env=env, timeout=240)
    assert results[0]["plans"] == results[1]["plans"] and len(set(results[0]["plans"])) > 1, results[0]["plans"]
    assert all(len(r["owned"]) == 1 for r in results)  # the same owners all along
    model = _autotune_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(AUTOTUNE_STEPS):
        opt.zero_grad()
        sum(model(_autotune_batch(step, r)).pow(2).mean() for r in range(2)).div(2).backward()
        opt.step()
    for r in results:
        for i, (p, q) in enumerate(zip(r["params"], model.parameters())):
            assert torch.equal(p, results[0]["params"][i])
            torch.testing.assert_close(p, q.detach(), atol=1e-5, rtol=1e-5)


# --- a process set that is not every rank -----------------------------------------------------------------
def _in_a_process_set(rank: int, size: int, mode: str) -> dict[str, Any] | None:
    ps = hvd.add_process_set([0, 2])
    if rank == 1:
        return None  # not a member: builds no optimizer
    model = Net()
    opt = hvd.DistributedOptimizer(OPTIMIZERS["adamw"](model.parameters()),
                                   named_parameters=model.named_parameters(), sharding=mode, process_set=ps)
    member = ps.rank()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, 0, ROWS * 2)
        F.mse_loss(model(x[member * ROWS:(member + 1) * ROWS]), y[member * ROWS:(member + 1) * ROWS]).backward()
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "owned": opt.owned_parameter_names(),
            "full": len(opt.state_dict()["state"])}


@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
def test_ranks_2_of_3_share_the_state_of_a_process_set(mode: str) -> None:
    results = run_tensors(_in_a_process_set, 3, mode, timeout=120)
    assert results[1] is None
    want = reference(f"{mode}-adamw", 2)["params"]
    names = [n for n, _ in Net().named_parameters()]
    assert sorted(results[0]["owned"] + results[2]["owned"]) == sorted(names)
    for r in (results[0], results[2]):
        assert r["full"] == len(names)
        for p, q in zip(r["params"], want):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
