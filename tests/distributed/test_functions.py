"""broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hora as hvd
from tests.distributed.harness import run_ranks
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


def _broadcast_parameters_in_chunks(rank: int, size: int) -> dict:
    from hora.api import functions

    functions.BROADCAST_CHUNK_BYTES = 64  # 16 float32s: every form of chunk below
    torch.manual_seed(rank)
    tensors = {"small1": torch.randn(3), "small2": torch.randn(5), "exact": torch.randn(16), "big": torch.randn(40),
               "strided": torch.randn(8, 6).t(), "small3": torch.randn(2, 2)}  # strided: large, not contiguous
    hvd.broadcast_parameters(tensors, root_rank=1)
    return tensors


def test_broadcast_parameters_in_bounded_chunks_reaches_every_tensor() -> None:
    results = run_tensors(_broadcast_parameters_in_chunks, 2)
    torch.manual_seed(1)
    want = {"small1": torch.randn(3), "small2": torch.randn(5), "exact": torch.randn(16), "big": torch.randn(40),
            "strided": torch.randn(8, 6).t(), "small3": torch.randn(2, 2)}
    for r in results:
        for k in want:
            assert torch.equal(r[k], want[k]), k


def test_broadcast_chunks_never_exceed_the_cap_but_for_a_single_large_tensor() -> None:
    from hora.api.functions import _chunks

    sizes = [3, 5, 16, 40, 1, 1, 14, 2]  # float32 elements; cap 64 bytes = 16 elements
    chunks = _chunks([torch.empty(n) for n in sizes], 64)
    assert [[t.numel() for t in c] for c in chunks] == [[3, 5], [16], [40], [1, 1, 14], [2]]


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


class Canary:
    """Unpickling it creates the file ``path``: what a stranger's pickle would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _forged_on_the_wire(rank: int, size: int, canary: str, kind: str) -> str:
    """Rank 0's object bytes are replaced on the way, as a stranger on the data plane's network would: every
    byte after the root's length is a pickle that creates ``canary`` (the length is the root's own)."""
    from hora.api import ops

    forged = pickle.dumps(Canary(canary))
    real_broadcast, real_allgather = ops.broadcast_, ops.allgather

    def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, **kw: Any) -> torch.Tensor:
        out = real_broadcast(tensor, root_rank, name=name, **kw)
        if rank != root_rank and name is not None and name.endswith(".data"):
            fill = forged + bytes(max(0, out.numel() - len(forged)))
            out.copy_(torch.frombuffer(bytearray(fill[:out.numel()]), dtype=torch.uint8))
        return out

    def allgather(tensor: torch.Tensor, name: str | None = None, **kw: Any) -> torch.Tensor:
        out = real_allgather(tensor, name=name, **kw)
        if name is not None and name.endswith(".data") and rank == 1:  # rank 0's slot leads the buffer
            out[:len(forged)] = torch.frombuffer(bytearray(forged), dtype=torch.uint8)
        return out

    ops.broadcast_, ops.allgather = broadcast_, allgather  # type: ignore[assignment]
    state = {"w": torch.ones(3)}
    try:
        if kind == "broadcast":
            got = hvd.broadcast_object(state if rank == 0 else None, root_rank=0, name="forged")
        else:
            got = hvd.allgather_object(state, name="forged")
    except Exception as e:  # noqa: BLE001 - what the rank raised is the result
        return f"{type(e).__name__}: {e}"
    finally:
        ops.broadcast_, ops.allgather = real_broadcast, real_allgather  # type: ignore[assignment]
    return f"loaded {got!r}"


@pytest.mark.parametrize("kind", ["broadcast", "allgather"])
def test_forged_object_bytes_are_refused_before_anything_is_unpickled(tmp_path: Path, kind: str) -> None:
    canary = tmp_path / "canary"
    results = run_ranks(_forged_on_the_wire, 2, str(canary), kind)
    assert not canary.exists(), "the forged pickle ran in a rank"
    assert results[1].startswith(f"ObjectAuthError: {kind}_object 'forged': the bytes of rank 0's object failed "
                                 "authentication and were not unpickled"), results
    assert "docs/security.md" in results[1]


class Custom:
    """A class of the user's own, as Horovod scripts broadcast."""

    def __init__(self, value: int) -> None:
        self.value = value


def _custom_objects(rank: int, size: int) -> dict:
    tensors_on = {"t": torch.arange(3.0)}
    got = hvd.broadcast_object(Custom(7) if rank == 0 else None, root_rank=0)
    everyone = hvd.allgather_object(Custom(rank))
    plain = hvd.broadcast_object(tensors_on if rank == 0 else None, root_rank=0)
    return {"got": got.value, "everyone": [c.value for c in everyone], "device": str(plain["t"].device)}


def test_a_job_with_a_secret_sends_its_own_classes() -> None:
    assert run_ranks(_custom_objects, 2) == [{"got": 7, "everyone": [0, 1], "device": "cpu"}] * 2


def _custom_without_secret(rank: int, size: int) -> dict:
    out = {}
    for kind in ("broadcast", "allgather"):
        try:
            if kind == "broadcast":
                hvd.broadcast_object(Custom(7) if rank == 0 else None, root_rank=0)
            else:
                hvd.allgather_object(Custom(rank) if rank == 1 else rank)
            out[kind] = "sent"
        except hvd.UnsafeObjectError as e:
            out[kind] = str(e)
    out["plain"] = hvd.broadcast_object({"lr": 0.1, "t": torch.ones(2)} if rank == 0 else None)["lr"]
    return out


def test_without_a_secret_only_safe_objects_travel_and_every_member_says_why() -> None:
    results = run_ranks(_custom_without_secret, 2, env={"HORA_SECRET": None})
    here = f"{__name__}.Custom"
    for r in results:
        assert r["broadcast"].startswith("broadcast_object 'hora.broadcast_object': rank 0's object cannot be sent "
                                         f"in a job without a secret: it holds {here}"), r
        assert r["allgather"].startswith("allgather_object 'hora.allgather_object': rank 1's object cannot be sent "
                                         f"in a job without a secret: it holds {here}"), r
        for kind in ("broadcast", "allgather"):
            assert "HORA_SECRET_FILE" in r[kind] and "torch.serialization.add_safe_globals" in r[kind], r
        assert r["plain"] == 0.1  # tensors and plain values travel as before


def _from_the_second_gpu(rank: int, size: int) -> list[str]:
    """Rank 0 sends tensors whose storages say ``cuda:1`` (as a rank on the second GPU does); the others have
    no such device here."""
    registry = torch.serialization._package_registry
    entry = (-1, lambda storage: "cuda:1", lambda storage, location: None)
    if rank == 0:
        registry.insert(0, entry)  # type: ignore[arg-type]
    try:
        state = {"exp_avg": torch.arange(3.0), "step": torch.tensor(4)}
        got = hvd.broadcast_object(state if rank == 0 else None, root_rank=0)
        gathered = hvd.allgather_object(state if rank == 0 else {"exp_avg": torch.zeros(1)})
    finally:
        if rank == 0:
            registry.remove(entry)  # type: ignore[arg-type]
    return [str(t.device) for t in (got["exp_avg"], gathered[0]["exp_avg"], gathered[0]["step"])]


def test_tensors_arrive_on_the_cpu_whatever_device_the_root_had() -> None:
    results = run_ranks(_from_the_second_gpu, 2)
    assert results[1] == ["cpu", "cpu", "cpu"], results  # horovod's docstring, hora's too: tensors arrive on the CPU
