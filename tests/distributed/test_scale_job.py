"""A job of 16 forked ranks end to end (benchmarks/scale_job.py runs the same at 128): 200 named allreduces
give exact results, the job ends with nothing printed and no process left; a rank SIGKILLed in the middle is
named in the job's report and every other rank gets the error naming it."""

from __future__ import annotations

import re

import pytest

from hora.bench.scale_job import ScaleJob, run_job

RANKS = 16
ERROR_LINE = re.compile(r"error|traceback|exception", re.IGNORECASE)


def test_a_16_rank_job_of_200_named_allreduces_is_exact_and_ends_saying_nothing(
        capfd: pytest.CaptureFixture[str]) -> None:
    result = run_job(ScaleJob(ranks=RANKS, steps=2, per_step=100))
    printed = capfd.readouterr()
    assert result.ok and result.exact, result.report
    assert [line for line in printed.err.splitlines() if ERROR_LINE.search(line)] == [], printed.err
    assert result.left_behind == []


def test_a_rank_killed_mid_job_is_named_and_every_other_rank_is_told(capfd: pytest.CaptureFixture[str]) -> None:
    result = run_job(ScaleJob(ranks=RANKS, steps=2, per_step=100, kill_rank=9))
    assert not result.ok and "rank 9 died without reporting (killed by SIGKILL)" in result.report, result.report
    assert sorted(result.survivors) == [r for r in range(RANKS) if r != 9], result.survivors
    for rank, error in result.survivors.items():  # a call already in flight says which op could not run, first
        assert re.search(rf"(^|: )rank {rank}: rank 9 on host .* is gone \(its process exited", error), error
    assert result.exact  # every step before the kill
    assert result.left_behind == []
    printed = capfd.readouterr()
    assert [line for line in printed.err.splitlines() if ERROR_LINE.search(line)] == [], printed.err
