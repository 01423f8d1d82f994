"""``hora.run(fn)``: results in rank order, closures and lambdas, a rank's exception re-raised here; elastic
runs (Horovod's ``min_num_proc=``...) going on without a worker that died."""

from __future__ import annotations

import os

import pytest

from hora.errors import ConfigError, LaunchError
from hora.launcher.pyfunc.run import RemoteTraceback, run


def test_results_come_back_in_rank_order_from_a_closure() -> None:
    base = {"offset": 100}

    def rank() -> int:
        return int(os.environ["HORA_RANK"])

    results = run(lambda scale, extra=0: (rank() * scale + base["offset"] + extra, os.environ["HORA_SIZE"]),
                  args=(10,), kwargs={"extra": 1}, num_proc=3)  # Horovod 0.28.1's name
    assert results == [(101, "3"), (111, "3"), (121, "3")]


def test_an_exception_on_a_rank_re_raises_with_that_ranks_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    def train_step() -> None:
        if os.environ["HORA_RANK"] == "1":
            raise KeyError("missing feature 'age'")
        import time
        time.sleep(60)

    with pytest.raises(KeyError) as info:
        run(train_step, num_proc=2)
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
        run(lambda: os._exit(7), num_proc=1)
    assert info.value.exit_code == 7


def test_an_elastic_run_goes_on_without_a_worker_that_died() -> None:
    def train(steps: int) -> tuple[int, int, int, float]:
        import signal

        import torch

        import hora as hvd

        hvd.init()

        @hvd.elastic.run
        def loop(state: hvd.elastic.ObjectState) -> None:
            while state.step < steps:
                if state.step == 5 and os.environ["HORA_WORKER_ID"] == "localhost:2":
                    os.kill(os.getpid(), signal.SIGKILL)  # its peers' next allreduce fails: they restore, reset
                state.total += hvd.allreduce(torch.ones(1), op=hvd.Sum, name="one").item()
                state.step += 1
                state.commit()

        state = hvd.elastic.ObjectState(step=0, total=0.0)
        loop(state)
        return hvd.rank(), hvd.size(), state.step, state.total

    results = run(train, args=(20,), num_proc=3, min_num_proc=2, hosts="localhost:3")  # one machine
    # 5 committed steps of 3 ranks, then 15 of 2: no committed step lost or repeated
    assert results == [(0, 2, 20, 45.0), (1, 2, 20, 45.0)]


def test_elastic_settings_without_an_elastic_job_and_both_host_sources_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"hora.run\(reset_limit=...\) is an elastic setting: give min_num_proc="):
        run(print, num_proc=1, reset_limit=3)
    with pytest.raises(ConfigError, match="an elastic job takes its hosts from one of them"):
        run(print, min_num_proc=1, hosts="a:1", host_discovery_script="cat hosts")
    with pytest.raises(ConfigError, match=r"num_proc=5\) is more than max_num_proc=4"):
        run(print, num_proc=5, min_num_proc=2, max_num_proc=4)
