"""``hora.run(fn)``: results in rank order, closures and lambdas, a rank's exception re-raised here."""

from __future__ import annotations

import os

import pytest

from hora.errors import LaunchError
from hora.launch.pyrun import RemoteTraceback, run


def test_results_come_back_in_rank_order_from_a_closure() -> None:
    base = {"offset": 100}

    def rank() -> int:
        return int(os.environ["HORA_RANK"])

    results = run(lambda scale, extra=0: (rank() * scale + base["offset"] + extra, os.environ["HORA_SIZE"]),
                  args=(10,), kwargs={"extra": 1}, np=3)
    assert results == [(101, "3"), (111, "3"), (121, "3")]


def test_an_exception_on_a_rank_re_raises_with_that_ranks_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    def train_step() -> None:
        if os.environ["HORA_RANK"] == "1":
            raise KeyError("missing feature 'age'")
        import time
        time.sleep(60)

    with pytest.raises(KeyError) as info:
        run(train_step, np=2)
    assert info.value.args == ("missing feature 'age'",)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    lines = str(cause).splitlines()
    assert lines[0] == "rank 1 on host localhost raised:"
    assert lines[1] == "Traceback (most recent call last):"
    assert "in train_step" in lines[2] and lines[-1] == "KeyError: \"missing feature 'age'\""
    assert "hora run: rank 1 on host localhost failed first: exit code 1" in capfd.readouterr().err


def test_a_rank_that_dies_without_raising_is_a_launch_error() -> None:
    with pytest.raises(LaunchError, match=r"^hora.run: rank 0 on host localhost failed: exit code 7$") as info:
        run(lambda: os._exit(7), np=1)
    assert info.value.exit_code == 7
