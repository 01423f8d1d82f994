"""Autotune in a real job: every rank switches bucket plans at the same step, training stays exact (the
parameters equal a one-process replay of the averaged gradients), rank 0 writes the log in Horovod's columns and
the job keeps the best settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hora as hvd
from tests.distributed.harness import run_ranks

STEPS = 40


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(1000 * step + rank))


def _train(rank: int, size: int) -> dict[str, object]:
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    reducer = opt._hora_reducer
    plans = []
    for step in range(STEPS):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
        plans.append(reducer._generation)
    reference = _model()  # one process, the same steps on the averaged gradient of every rank's batch
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    for step in range(STEPS):
        ref_opt.zero_grad()
        sum(reference(_batch(r, step)).pow(2).mean() for r in range(size)).div(size).backward()
        ref_opt.step()
    exact = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(model.parameters(),
                                                                          reference.parameters()))
    from hora.runtime import lifecycle
    from hora.training import autotune

    tuner = autotune.tuner_for(reducer)
    fusion = lifecycle.state().negotiator.snapshot().fusion_threshold
    return {"plans": plans, "exact": exact, "caps": reducer._caps(), "active": tuner.active if tuner else None,
            "fusion": fusion, "best": tuner.search.best if tuner and tuner.search else None}


@pytest.mark.parametrize("explicit", [False, True])
def test_every_rank_switches_at_the_same_step_and_keeps_the_best(tmp_path: Path, explicit: bool) -> None:
    log = tmp_path / "autotune.csv"
    env = {"HORA_AUTOTUNE": "1", "HORA_AUTOTUNE_WARMUP_SAMPLES": "1", "HORA_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "5", "HORA_AUTOTUNE_LOG": str(log)}
    if explicit:
        env["HOROVOD_FUSION_THRESHOLD"] = str(1024 * 1024)  # set explicitly: held constant
    results = run_ranks(_train, 2, env=env, timeout=240)
    assert results[0]["plans"] == results[1]["plans"]  # the same bucket plan at every step on both ranks
    assert len(set(results[0]["plans"])) > 2  # the buckets were replanned as settings were tried
    assert all(r["exact"] for r in results)
    assert [r["active"] for r in results] == [False, False]  # done, on both ranks
    assert results[0]["caps"] == results[1]["caps"] and results[0]["fusion"] == results[1]["fusion"]
    best = results[0]["best"]
    assert results[0]["caps"][1] == int(best.bucket_cap_mb * 1024 * 1024)
    assert results[0]["fusion"] == int(best.fusion_threshold_mb * 1024 * 1024)
    lines = log.read_text().splitlines()
    assert lines[0].startswith("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
                               "cycle_time_ms,tensor_fusion_threshold,score")
    rows = [line.split(",") for line in lines[1:]]
    assert len(rows) == 5 + 1  # the five samples of the search (the warm-up one is not logged), then the best
    assert rows[-1] == max(rows[:-1], key=lambda r: float(r[6]))  # the best row last
    assert float(rows[-1][5]) == best.fusion_threshold_mb and float(rows[-1][7]) == best.bucket_cap_mb
    if explicit:
        assert {r[5] for r in rows} == {"1"}  # 1 MB throughout
        assert results[0]["fusion"] == 1024 * 1024
