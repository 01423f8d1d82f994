"""``hora bench`` end to end, on small settings: the allreduce sweep under ``hora run`` on two local ranks
(table, progress bar on rank 0 only, JSON, plot), ``plan`` on that sweep's JSON, the model benchmark's
scaling efficiency on fork-started ranks, and one-line usage errors."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


def test_hora_bench_model_says_the_defaults_it_chose_and_prints_no_error(tmp_path: Path) -> None:
    png = tmp_path / "model.png"
    out = subprocess.run([*HORA, "run", "-np", "2", *HORA, "bench", "model", "--model", "mlp", "--steps", "2",
                          "--repeats", "1", "--plot", str(png)],
                         capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| ranks | step time (median) |" in out.stdout
    assert "stall" not in out.stderr and "error" not in out.stderr.lower(), out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if "hora bench model: on cpu:" in line]
    assert said == ["[0]<stderr>:hora bench model: on cpu: mlp, 64 px images, batch 32 per rank (the defaults for "
                    "cpu are sized to finish in about two minutes on a quiet machine, longer on a loaded one; to "
                    "change them: --image-size, --batch-size)"]
    assert png.read_bytes()[:4] == b"\x89PNG"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _one_rank_samples(rank: int, size: int) -> list[str]:
    """Rank 0 alone times 12 steps of 0.25 s or more (3 s a sample) while rank 1 idles, under a 1 s stall
    warning time: what the ranks log at warning level and above."""
    caught = _Warnings()
    logging.getLogger("hora").addHandler(caught)
    real_step = model._Trainer.step

    def slow_step(self: model._Trainer) -> None:  # a slow model: the wait is what this test is about
        time.sleep(0.25)
        real_step(self)

    model._Trainer.step = slow_step  # type: ignore[method-assign]
    model.run(model.ModelConfig(model="mlp", batch_size=8, np_list=(1,), steps=12, repeats=1, warmup=1))
    return caught.messages


def test_ranks_idle_during_one_rank_samples_wait_a_step_at_a_time_and_no_stall_is_reported() -> None:
    """`hora bench model` printed `ERROR hora stall: unnamed barrier #1 has waited 60 s ... missing: rank 0`
    while rank 0 timed its 1-rank samples: a benchmark working normally must print no error."""
    logged = run_ranks(_one_rank_samples, 2, timeout=120, env={"HORA_STALL_CHECK_TIME_SECONDS": "1"})
    assert logged == [[], []]


_warm = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # the first step's lazy imports, before
_warm.step()  # the ranks fork: a rank's first step is not seconds longer than its idle peer's barrier


def test_help_says_the_defaults_and_that_it_runs_under_hora_run(capsys: pytest.CaptureFixture[str]) -> None:
    for what in ("allreduce", "model"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([what, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "Run it under hora run, e.g. hora run -np 4" in text
        if what == "allreduce":
            assert "(default 1KB..256MB: 1KB, 4KB, 16KB, ... 64MB, 256MB)" in text
            assert "--repeats REPEATS alternation cycles (default 5)" in text
        else:
            assert "resnet50 at 224 px, batch 32 per rank on GPUs; resnet18 at 64 px, batch 32 on CPUs" in text
    assert model.defaults_for("cpu") == ("resnet18", 64, 32) and model.defaults_for("cuda") == ("resnet50", 224, 32)


def _row(size: int, raw: list[float], hora: list[float]) -> dict[str, object]:
    raw_s, hora_s = sorted(raw)[len(raw) // 2], sorted(hora)[len(hora) // 2]
    spread = (lambda xs: (max(xs) - min(xs)) / sorted(xs)[len(xs) // 2])  # noqa: E731
    ratios = [a / b for a, b in zip(raw, hora)]
    return {"size": size, "raw": {"time_s": raw_s, "algbw_GBps": 1.0, "busbw_GBps": 1.0, "spread": spread(raw)},
            "hora": {"time_s": hora_s, "algbw_GBps": 1.0, "busbw_GBps": 1.0, "spread": spread(hora)},
            "speed_vs_raw": {"median": sorted(ratios)[1], "spread": spread(ratios)},
            "speed_vs_raw_of_medians": raw_s / hora_s}


def test_the_sweep_table_shows_the_ratio_of_its_medians_and_marks_noisy_rows() -> None:
    quiet = _row(4096, [1e-3, 1.02e-3, 1.01e-3], [1.1e-3, 1.12e-3, 1.11e-3])
    # per-cycle ratios 1.6, 0.5, 1.25: their median (1.25) says hora is faster while its median time is slower
    noisy = _row(8192, [1.6e-3, 1e-3, 1.25e-3], [1e-3, 2e-3, 1.3e-3])
    result = {"ranks": 2, "hosts": 1, "dtype": "float32", "compression": "none", "hierarchical": False,
              "repeats": 3, "rows": [quiet, noisy], "links": {}}
    text = sweep.markdown(result)
    lines = text.splitlines()
    assert "hora speed vs raw (raw time / hora time)" in lines[2]
    assert lines[4].startswith("| 4 KB | 1.010 ms |") and "| 0.91x | 0% |" in lines[4]  # 1.01 / 1.11
    assert lines[5].startswith("| 8 KB * | 1.250 ms |") and "| 1.300 ms |" in lines[5]
    assert "| 0.96x |" in lines[5] and "1.25x" not in text  # 1.25 / 1.3: the medians beside it
    assert lines[-1].startswith("warning: too noisy to quote: 1 of 2 rows (marked *) spread more than 25%")
    assert "warning" not in sweep.markdown({**result, "rows": [quiet]})


def test_the_model_plot_has_whole_rank_ticks(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"ranks": n, "images_per_s": 10.0 * n} for n in (1, 2, 3)]
    fig = plt.figure()
    model.plot({"model": "mlp", "rows": rows})(fig)
    ticks = list(fig.axes[0].get_xticks())
    plt.close(fig)
    assert ticks == [1, 2, 3]
