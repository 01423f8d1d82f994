"""``hora bench`` end to end, on small settings: the allreduce sweep under ``hora run`` on two local ranks
(table, progress bar on rank 0 only, JSON, plot), ``plan`` on that sweep's JSON, the model benchmark's
scaling efficiency on fork-started ranks, and one-line usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hora as hvd
from hora.bench import cli, model, planner, sweep
from tests.distributed.harness import run_ranks

HORA = [sys.executable, "-m", "hora"]


def test_allreduce_sweep_under_hora_run_then_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    out = subprocess.run([*HORA, "run", "-np", "2", *HORA, "bench", "allreduce", "--sizes", "4KB..256KB",
                          "--repeats", "2", "--sample-seconds", "0.02", "--json", str(sweep), "--plot", str(png)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "| size | raw time | raw algbw GB/s | raw busbw GB/s | hora time" in out.stdout
    assert "[0]<stderr>:allreduce [" in out.stderr  # rank 0's progress bar, and only rank 0's
    assert "[1]<stderr>:allreduce [" not in out.stderr
    data = json.loads(sweep.read_text())
    assert [r["size"] for r in data["rows"]] == [4096, 16384, 65536, 262144]
    for row in data["rows"]:  # busbw = algbw * 2(n-1)/n = algbw for n = 2
        assert row["raw"]["busbw_GBps"] == row["raw"]["algbw_GBps"] > 0
        assert len(row["samples"]["raw"]) == len(row["samples"]["hora"]) == 2
    assert png.read_bytes()[:4] == b"\x89PNG"

    plan_json = tmp_path / "plan.json"
    assert cli.main(["plan", "--sweep", str(sweep), "--model-bytes", "1MB", "--hosts", "1", "--ranks-per-host",
                     "4", "--compute-ms", "50", "--json", str(plan_json)]) == 0
    shown = capsys.readouterr().out
    assert "intra-host" in shown and "scaling efficiency" in shown
    assert "CPU passes hora adds" in shown  # the sweep timed them on every rank
    row = json.loads(plan_json.read_text())["rows"][0]
    assert row["allreduce_s"] > 0 and 0 < row["efficiency"] <= 1


def _model_bench(rank: int, size: int) -> dict[str, object]:
    cfg = model.ModelConfig(model="mlp", batch_size=16, np_list=(1, 2), steps=2, repeats=2, warmup=1)
    result = model.run(cfg)
    return {"ranks": [r["ranks"] for r in result["rows"]], "eff": [r["efficiency"]["median"] for r in result["rows"]],
            "grad": result["gradient_bytes"], "table": model.markdown(result)}


def test_model_scaling_efficiency() -> None:
    out = run_ranks(_model_bench, 2, timeout=90)
    assert out[0] == out[1]  # every rank returns rank 0's record
    assert out[0]["ranks"] == [1, 2]
    assert out[0]["eff"][0] == 1.0 and out[0]["eff"][1] > 0  # type: ignore[index]
    assert out[0]["grad"] == 399370 * 4
    assert "scaling efficiency vs 1 rank" in str(out[0]["table"])


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["allreduce", "--sizes", "3XB"]) == 2
    assert "3XB" in capsys.readouterr().err
    assert cli.main(["plan", "--sweep", "/nonexistent.json"]) == 2
    assert "cannot read it as JSON" in capsys.readouterr().err
    assert cli.main(["model", "--np-list", "1,x"]) == 2
    assert "whole numbers" in capsys.readouterr().err


def _links_sweep(rank: int, size: int) -> dict[str, object]:
    host = rank // 2  # 2 hosts x 2 ranks, as hora run would set them
    os.environ.update({"HORA_HOST_KEY": f"h{host}", "HORA_LOCAL_RANK": str(rank % 2), "HORA_LOCAL_SIZE": "2",
                       "HORA_CROSS_RANK": str(host), "HORA_CROSS_SIZE": "2"})
    hvd.init()
    try:
        result = sweep.run(sweep.SweepConfig(sizes=[4096, 65536], repeats=1, sample_s=0.01))
        return json.loads(json.dumps(result))  # type: ignore[no-any-return]
    finally:
        hvd.shutdown()


def test_sweep_times_each_link_type_and_the_planner_fits_both() -> None:
    out = run_ranks(_links_sweep, 4, init=False, timeout=90)
    result = out[0]
    assert (result["hosts"], result["ranks_per_host"]) == (2, [2, 2])
    links = result["links"]
    assert {k: [r["ranks"] for r in v] for k, v in links.items()} == {"intra": [2, 2], "inter": [2, 2]}
    plan = planner.fit_sweep(result)
    assert plan.intra is not None and plan.inter is not None
    assert plan.allreduce(1e6, 4, 2, hierarchical=True) > 0
