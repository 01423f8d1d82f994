"""transformers' Trainer on hora (hora.integrations.hf): a tiny config-built GPT-2 fine-tuned under ``hora run -np 2``
learns, ends identical on both ranks, and matches the plain Trainer run in one process on both ranks' batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="hora[hf] (transformers) is not installed; requirements-dev.txt pins it")

JOB = Path(__file__).with_name("hf_job.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], out: Path) -> list[dict]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _params(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"params-rank{rank}.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, torch.Tensor]]:
    """The plain Trainer in one process, on both ranks' batches at once (8 a step instead of 4 on each rank)."""
    ref = tmp_path_factory.mktemp("reference")
    (report,) = _run([sys.executable, str(JOB), str(ref), "--reference", "--max-grad-norm", "0.5"], ref)
    return report, _params(ref, 0)


@pytest.mark.parametrize("sharding", [None, "gradients"])
def test_trainer_under_hora_run_learns_and_matches_one_process(
        tmp_path: Path, sharding: str | None, reference: tuple[dict, dict[str, torch.Tensor]]) -> None:
    out = tmp_path / "hora"
    job = [sys.executable, str(JOB)]
    shard = ["--sharding", sharding] if sharding else []
    ranks = _run([sys.executable, "-m", "hora", "run", "-np", "2", *job, str(out), "--max-grad-norm", "0.5", *shard],
                 out)
    reference_report, pr = reference

    assert [r["world_size"] for r in ranks] == [2, 2] and [r["process_index"] for r in ranks] == [0, 1]
    assert [r["wrapped"] for r in ranks] == ["GPT2LMHeadModel"] * 2  # accelerate wrapped no DDP around it
    assert [r["sharding"] for r in ranks] == [sharding] * 2
    assert ranks[0]["steps"] == reference_report["steps"] == 12  # 64 samples / (2 ranks x 4 x 2 accumulated) x 3 epochs
    first_epoch = [set(r["read"][:32]) for r in ranks]  # each rank reads its own half of the data set
    assert not first_epoch[0] & first_epoch[1] and len(first_epoch[0] | first_epoch[1]) == 64

    losses = ranks[0]["losses"]
    assert losses == ranks[1]["losses"]  # the Trainer logs the mean over ranks
    assert losses[-1] < losses[0] - 0.5, losses  # learns (starts near ln 64 = 4.16)
    assert losses == pytest.approx(reference_report["losses"], abs=1e-4)

    p0, p1 = _params(out, 0), _params(out, 1)
    for name in p0:
        assert torch.equal(p0[name], p1[name]), name  # ranks bit-identical
        torch.testing.assert_close(p0[name], pr[name], atol=1e-4, rtol=1e-4, msg=name)


def test_a_trainer_that_sees_another_world_is_refused_with_the_fix(tmp_path: Path) -> None:
    """Without use_cpu=True on a machine without GPUs accelerate sees one process, not hora's two."""
    proc = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(JOB), str(tmp_path),
                           "--no-use-cpu"], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # the script's uncaught error
    text = proc.stdout + proc.stderr
    assert "hora.ConfigError: rank 0:" in text and "hora.ConfigError: rank 1:" in text
    assert "the Trainer sees a world of 1 process(es)" in text and "hora runs 2 ranks" in text
    assert "TrainingArguments(use_cpu=True)" in text


def test_a_sharded_trainer_resumes_from_its_checkpoint_bit_for_bit(tmp_path: Path) -> None:
    """The Trainer's checkpoint holds the sharded optimizer as a sharded checkpoint, each rank's shard written by
    that rank; resume_from_checkpoint ends exactly where the uninterrupted run ends."""
    hora_run = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(JOB)]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _run([*hora_run, str(whole), "--sharding", "optimizer", "--save-steps", "6"], whole)
    saved = whole / "trainer" / "checkpoint-6"
    shards = saved / "ckpt-000000006.dcp"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (saved / "optimizer.pt").exists()  # no rank gathered the whole state
    _run([*hora_run, str(resumed), "--sharding", "optimizer", "--resume", str(saved)], resumed)
    end, again = _params(whole, 0), _params(resumed, 0)
    for name, value in end.items():
        assert torch.equal(again[name], value), name
