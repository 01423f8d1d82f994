"""broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object."""

from __future__ import annotations

import torch
from torch import nn

import hora as hvd
from tests.distributed.test_optimizer import run_tensors


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 2).double())


def _broadcast_parameters(rank: int, size: int) -> dict:
    a, b, c = _model(rank), _model(10 + rank), _model(20 + rank)
    a[1].num_batches_tracked.fill_(7 + rank)  # int64 buffer, in the state dict
    hvd.broadcast_parameters(a.state_dict(), root_rank=1)
    hvd.broadcast_parameters(b.parameters(), root_rank=0)
    hvd.broadcast_parameters(c.named_parameters(), root_rank=0)
    return {"a": {k: v.clone() for k, v in a.state_dict().items()},
            "b": [p.detach().clone() for p in b.parameters()],
            "c": [p.detach().clone() for p in c.parameters()],
            "requires_grad": all(p.requires_grad for p in a.parameters())}


def test_broadcast_parameters_every_form_every_dtype() -> None:
    results = run_tensors(_broadcast_parameters, 3)
    want_a = _model(1).state_dict()
    want_a["1.num_batches_tracked"] = torch.tensor(8)
    for r in results:
        assert r["a"].keys() == want_a.keys()
        for k in want_a:
            assert torch.equal(r["a"][k], want_a[k]), k
        for got, want in zip(r["b"], _model(10).parameters()):
            assert torch.equal(got, want.detach())
        for got, want in zip(r["c"], _model(20).parameters()):
            assert torch.equal(got, want.detach())
        assert r["requires_grad"]


def _broadcast_optimizer_state(rank: int, size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    fresh = torch.optim.Adam(model.parameters(), lr=0.1 * (rank + 1))
    hvd.broadcast_optimizer_state(fresh, root_rank=0)  # before any step: options travel, state stays empty
    trained = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.99))
    if rank == 0:
        model(torch.randn(3, 4)).sum().backward()
        trained.step()
    else:
        trained.param_groups[0]["lr"] = 5.0
    hvd.broadcast_optimizer_state(trained, root_rank=0)
    return {"fresh_lr": fresh.param_groups[0]["lr"], "fresh_state": len(fresh.state),
            "lr": trained.param_groups[0]["lr"], "betas": trained.param_groups[0]["betas"],
            "state": {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(trained.state.values())}}


def test_broadcast_optimizer_state_before_and_after_the_first_step() -> None:
    results = run_tensors(_broadcast_optimizer_state, 2)
    for r in results:
        assert r["fresh_lr"] == 0.1 and r["fresh_state"] == 0
        assert r["lr"] == 0.01 and tuple(r["betas"]) == (0.8, 0.99)
        assert len(r["state"]) == 4
        for i, s in r["state"].items():
            assert s.keys() == {"step", "exp_avg", "exp_avg_sq"}
            for k in s:
                assert torch.equal(s[k], results[0]["state"][i][k])
    assert float(results[1]["state"][0]["exp_avg"].abs().sum()) > 0  # rank 1 got rank 0's real state


def _objects(rank: int, size: int) -> dict:
    obj = {"rank": rank, "payload": list(range(rank * 50)), "t": torch.full((2,), float(rank))}
    got = hvd.broadcast_object(obj, root_rank=size - 1)
    default_root = hvd.broadcast_object("from zero" if rank == 0 else None)
    gathered = hvd.allgather_object(obj)
    return {"got": got, "default_root": default_root, "gathered": gathered}


def test_broadcast_object_and_allgather_object() -> None:
    results = run_tensors(_objects, 3)
    for r in results:
        assert r["got"]["rank"] == 2 and r["got"]["payload"] == list(range(100))
        assert torch.equal(r["got"]["t"], torch.full((2,), 2.0))
        assert r["default_root"] == "from zero"
        assert [g["rank"] for g in r["gathered"]] == [0, 1, 2]
        assert [len(g["payload"]) for g in r["gathered"]] == [0, 50, 100]  # sizes differ per rank


def _built_from_data(rank: int, size: int) -> dict:
    """A model whose layer sizes come from something that differs by rank (here the rank itself, as a size read
    from a rank's data shard would): broadcast_parameters must name the layers, on every rank."""
    torch.manual_seed(0)
    width = 9 if rank == 1 else 8
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 10))
    try:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    except hvd.ModelMismatchError as exc:
        failed = str(exc)
    else:
        failed = ""
    same = nn.Linear(3, 3)  # the job goes on: a later broadcast of an identical model works
    hvd.broadcast_parameters(same.state_dict(), root_rank=0)
    return {"error": failed, "after": same.weight.detach().clone()}


def test_a_model_built_differently_on_one_rank_is_named_by_its_parameters() -> None:
    results = run_tensors(_built_from_data, 3)
    for r in results:
        message = r["error"]
        assert message.startswith("broadcast_parameters: the model differs across ranks"), message
        assert "\n  rank 1: " in message
        assert "'0.weight' has shape [9, 4] here, [8, 4] on rank 0" in message
        assert "'0.bias' has shape [9] here, [8] on rank 0" in message
        assert "'2.weight' has shape [10, 9] here, [10, 8] on rank 0" in message
        assert "rank 2" not in message  # built like the root's
        assert "The model is built differently on the ranks" in message
        assert "shape=[" not in message and "different names" not in message  # not the packed buffers' terms
        assert torch.equal(r["after"], results[0]["after"])
