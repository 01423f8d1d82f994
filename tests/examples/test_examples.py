"""Each example trains briefly on 2 ranks and reports what its user would read."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_ranks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run_example(rank: int, size: int, script: str, argv: list[str]) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location(Path(script).stem, EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.main(argv)


def test_train_digits_learns_and_averages_accuracy_over_ranks() -> None:
    results = run_ranks(_run_example, 2, "train_digits.py", ["--epochs", "4"], init=False, timeout=120)
    assert results[0]["size"] == 2
    assert results[0]["accuracy"] == results[1]["accuracy"]  # averaged across ranks: one number
    assert results[0]["accuracy"] > 0.85  # 10 classes: chance is 0.1


def test_train_digits_seed_article_variant_with_ddp_and_fp16() -> None:
    results = run_ranks(_run_example, 2, "train_digits.py", ["--epochs", "4", "--ddp", "--fp16-allreduce"],
                        init=False, timeout=120)
    assert results[0]["accuracy"] > 0.85


def test_resnet50_synthetic_reports_images_per_second() -> None:
    argv = ["--batch-size", "2", "--image-size", "32", "--num-iters", "2", "--num-batches-per-iter", "1",
            "--num-warmup-batches", "1", "--fp16-allreduce"]
    results = run_ranks(_run_example, 2, "resnet50_synthetic.py", argv, init=False, timeout=120)
    for r in results:
        assert r["img_per_sec_per_rank"] > 0
        assert r["img_per_sec_total"] > r["img_per_sec_per_rank"]  # the sum over 2 ranks
        assert r["header"].endswith("compression fp16"), r["header"]  # the compressor's name, not its repr


def test_elastic_train_runs_as_a_fixed_job_too() -> None:
    """Without elastic flags the elastic example trains once through hvd.elastic.run (its elastic runs are in
    tests/launcher/test_elastic_training.py's style: see docs/elastic.md)."""
    argv = ["--epochs", "2", "--samples", "256", "--batch-size", "16"]
    results = run_ranks(_run_example, 2, "elastic_train.py", argv, init=False, timeout=120)
    assert results[0]["params"] == results[1]["params"]  # synced at the start, averaged every step
    assert results[0]["size"] == 2 and results[0]["accuracy"] > 0.5  # 4 classes: chance is 0.25


def test_unet3d_checkpoints_and_resumes(tmp_path: Path) -> None:
    common = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "3", "--volume-size", "8",
              "--num-samples", "8", "--batch-size", "2"]
    first = run_ranks(_run_example, 2, "unet3d.py", ["--steps", "4", *common], init=False, timeout=120)
    assert [r["start"] for r in first] == [0, 0] and [r["step"] for r in first] == [4, 4]
    assert (tmp_path / "ckpt-000000003.pt").exists()  # hora.checkpoint names
    second = run_ranks(_run_example, 2, "unet3d.py", ["--steps", "6", *common], init=False, timeout=120)
    assert [r["start"] for r in second] == [3, 3]  # the last checkpoint was at step 3
    assert [r["step"] for r in second] == [6, 6]
    assert 0.0 < second[0]["dice"] <= 1.0


def test_readme_main_job_under_hora_run() -> None:
    """`hora run -np 2 python examples/train_digits.py`, as the README runs it (fewer epochs)."""
    proc = subprocess.run(
        [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(EXAMPLES / "train_digits.py"),
         "--epochs", "2"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if "test accuracy (averaged over ranks)" in ln]
    assert len(lines) == 1 and lines[0].startswith("[0]")  # printed once, by rank 0
    assert float(lines[0].rsplit(" ", 1)[1]) > 0.6  # 2 epochs; chance is 0.1
    assert "Warning" not in proc.stderr  # what the user sees is the bar and the result, no library warnings


def test_finetune_lm_learns_checkpoints_sharded_and_resumes_at_another_size(tmp_path: Path) -> None:
    """A Llama-style model built on the meta device, ZeRO-2, bf16 autocast, accumulation and clipping on 2 ranks,
    sharded checkpoints every 4 steps; then resumed at 1 rank and at 3 ranks, the optimizer re-partitioned."""
    pytest.importorskip("transformers", reason="examples/finetune_lm.py needs hora[hf]")
    common = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4", "--bf16", "--sharding", "gradients",
              "--meta", "--accumulate", "2"]
    first = run_ranks(_run_example, 2, "finetune_lm.py", ["--steps", "12", *common], init=False, timeout=240)
    assert [r["start"] for r in first] == [0, 0] and [r["step"] for r in first] == [12, 12]
    assert first[0]["checksum"] == first[1]["checksum"]  # one model on both ranks
    assert first[0]["owned"] + first[1]["owned"] == first[0]["params"]  # each parameter's state on one rank
    losses = first[0]["losses"]
    assert losses[-1] < losses[0] - 0.3, losses  # from ln(128) = 4.85
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000004.dcp", "ckpt-000000008.dcp",
                                                          "ckpt-000000012.dcp"]
    for ranks, start, end in ((1, 12, 16), (3, 16, 20)):
        more = run_ranks(_run_example, ranks, "finetune_lm.py", ["--steps", str(end), *common], init=False,
                         timeout=240)
        assert {r["start"] for r in more} == {start} and {r["step"] for r in more} == {end}
        assert len({r["checksum"] for r in more}) == 1
        assert more[0]["losses"][0] < losses[0] - 0.3  # it went on from the trained model
