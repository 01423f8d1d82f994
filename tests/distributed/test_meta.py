"""hora.meta.materialize: a model built on the meta device gets one storage and the same values on every rank."""

from __future__ import annotations

import torch
from torch import nn

import hora as hvd
from hora.bench.peak_memory import PeakMemory
from hora.meta import materialize
from tests.distributed.test_optimizer import run_tensors


def _net(width: int) -> nn.Module:
    return nn.Sequential(nn.Embedding(10, width), nn.LayerNorm(width), nn.Linear(width, width), nn.Linear(width, 3))


def _materialize_torch_model(rank: int, size: int) -> dict:
    from hora.api import functions

    functions.BROADCAST_CHUNK_BYTES = 1 << 20  # the broadcast's extra memory: 1 MiB, against 17 MB of weights
    hvd.allreduce(torch.zeros(1), name="warm-up")  # the first collective's own buffers are not the model's
    torch.manual_seed(100 + rank)  # the ranks' own draws differ: the broadcast must make them one model
    with torch.device("meta"):
        model = _net(2048)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with PeakMemory() as peak:
        materialize(model)
    return {"params": dict(model.state_dict()), "growth": torch.tensor(peak.growth / nbytes),
            "meta": torch.tensor(any(t.is_meta for t in model.state_dict().values()))}


def test_materialize_gives_one_model_on_every_rank_in_one_copy() -> None:
    results = run_tensors(_materialize_torch_model, 2)
    assert not results[0]["meta"] and not results[1]["meta"]
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name
    params = results[0]["params"]
    assert torch.equal(params["1.weight"], torch.ones(2048)) and torch.equal(params["1.bias"], torch.zeros(2048))
    bound = 1 / 2048 ** 0.5  # nn.Linear's reset_parameters: uniform in +-1/sqrt(fan_in)
    assert params["2.weight"].abs().max() <= bound and params["2.weight"].std() > bound / 3
    for r in results:  # allocated once; a flat copy for the broadcast would be 2x
        assert float(r["growth"]) < 1.5, float(r["growth"])
