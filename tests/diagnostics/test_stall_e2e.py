"""The stall inspector for real: ranks that are late, skip a collective, or call another one.

Each case runs 2-3 fork-started ranks with a 2 s warning time. Every rank captures the records of hora's
loggers and returns them, so the tests can check that exactly ONE report was logged in the whole job, by
which rank, and what it says.
"""

from __future__ import annotations

import logging
import re
import socket
import time

import pytest
import torch

import hora as hvd
from tests.distributed.harness import run_ranks

FAST = {"HORA_STALL_CHECK_TIME_SECONDS": "2", "HORA_STALL_SHUTDOWN_TIME_SECONDS": None,
        "HORA_STALL_CHECK_DISABLE": None}
HOST = socket.gethostname()  # the harness sets no HORA_HOSTNAME: ranks report this machine's name


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _captured(fn):
    """Run ``fn(rank, size)`` with hora's warnings captured; return (fn's result, stall reports)."""
    cap = _Capture()
    logging.getLogger("hora").addHandler(cap)
    try:
        result = fn()
    finally:
        logging.getLogger("hora").removeHandler(cap)
    return result, [m for m in cap.messages if m.startswith("hora stall:")]


def _reports(results) -> list[tuple[int, str]]:
    return [(rank, text) for rank, (_, reports) in enumerate(results) for text in reports]


# --- a rank sleeping in user code ---------------------------------------------------------------------
def slow_data_loading(seconds: float) -> None:
    time.sleep(seconds)


def _late_rank(rank: int, size: int, name: str | None):
    def body():
        if rank == size - 1:
            slow_data_loading(6.0)  # 4 s past the warning time: room for a slow machine
        return hvd.allreduce(torch.ones(3), op=hvd.Sum, name=name).tolist()

    return _captured(body)


@pytest.mark.parametrize(("nprocs", "name", "shown"), [(2, "loss", r"allreduce 'loss' \(#\d+\)"),
                                                       (3, None, r"unnamed allreduce #\d+")])
def test_report_names_the_late_rank_its_host_and_the_function_it_sleeps_in(nprocs, name, shown):
    results = run_ranks(_late_rank, nprocs, name, env=FAST, timeout=60)
    assert [r[0] for r in results] == [[float(nprocs)] * 3] * nprocs  # the job goes on afterwards
    (who, text), = _reports(results)  # one report in the whole job
    assert who == 0  # the lowest rank that arrived speaks
    lines = text.splitlines()
    late = nprocs - 1
    assert re.match(rf"hora stall: {shown} has waited \d+ s: {nprocs - 1} of {nprocs} "
                    r"ranks arrived, 1 missing\.", lines[0])
    assert lines[1] == ("  arrived: rank 0" if nprocs == 2 else "  arrived: ranks 0-1")
    assert re.fullmatch(rf"  missing: rank {late} on {re.escape(HOST)}: running test_stall_e2e\.py:\d+ "
                        r"slow_data_loading <- test_stall_e2e\.py:\d+ body.*", lines[2])


# --- a rank skipping a collective (and so waiting in another one) --------------------------------------
def _skipper(rank: int, size: int):
    def body():
        try:
            if rank != size - 1:
                hvd.allreduce(torch.ones(2), name="grad.a")
            hvd.allreduce(torch.ones(2), name="grad.b")
        except hvd.CollectiveTimeoutError as e:
            return f"timeout: {e}"
        return "finished"

    return _captured(body)


def test_rank_that_skips_a_collective_is_reported_then_the_job_is_stopped():
    env = {**FAST, "HORA_STALL_SHUTDOWN_TIME_SECONDS": "5"}
    results = run_ranks(_skipper, 3, env=env, timeout=60)
    outcomes = [r[0] for r in results]
    # every rank stops with the report as its error instead of hanging forever
    assert all(o.startswith("timeout: hora stall:") for o in outcomes), outcomes
    assert "allreduce 'grad.a'" in outcomes[0] and "allreduce 'grad.b'" in outcomes[2]
    reports = {text.splitlines()[0].split("'")[1]: (who, text) for who, text in _reports(results)}
    assert sorted(reports) == ["grad.a", "grad.b"]  # one report per stalled name, not per rank
    who, text = reports["grad.a"]
    assert who == 0
    assert "  arrived: ranks 0-1" in text
    assert re.search(rf"  missing: rank 2 on {re.escape(HOST)}: waiting in allreduce 'grad\.b' "
                     r"\(called from test_stall_e2e\.py:\d+ body\)", text)
    assert "wait in another collective" in text
    who, text = reports["grad.b"]
    assert who == 2
    assert re.search(rf"  missing: ranks 0-1 on {re.escape(HOST)}: waiting in allreduce 'grad\.a'", text)


# --- a rank calling a different collective -------------------------------------------------------------
def _other_collective(rank: int, size: int):
    def body():
        try:
            if rank == 1:
                hvd.broadcast(torch.ones(2), root_rank=0)  # its peers call allreduce here
            else:
                hvd.allreduce(torch.ones(2))
        except hvd.CollectiveMismatchError as e:
            return f"mismatch: {e}"
        return "finished"

    return _captured(body)


def test_unnamed_different_collective_fails_at_once_on_every_rank():
    # a hang here would hit the harness deadline and fail naming the hung ranks
    results = run_ranks(_other_collective, 3, env=FAST, timeout=60)
    outcomes = [r[0] for r in results]
    assert all(o.startswith("mismatch:") for o in outcomes), outcomes
    assert all("rank 1" in o and "broadcast" in o and "allreduce" in o for o in outcomes)
    assert _reports(results) == []  # decided at once, not a stall


def _named_other_collective(rank: int, size: int):
    def body():
        try:
            if rank == 0:
                hvd.broadcast(torch.ones(2), root_rank=0, name="weights")
            else:
                hvd.allreduce(torch.ones(2), name="loss")
        except hvd.CollectiveTimeoutError as e:
            return f"timeout: {e}"
        return "finished"

    return _captured(body)


def test_named_different_collective_is_reported_with_where_each_side_waits():
    env = {**FAST, "HORA_STALL_SHUTDOWN_TIME_SECONDS": "5"}
    results = run_ranks(_named_other_collective, 2, env=env, timeout=60)
    reports = {text.splitlines()[0].split("'")[1]: text for _, text in _reports(results)}
    assert sorted(reports) == ["loss", "weights"]
    assert re.search(r"missing: rank 1 on .*: waiting in allreduce 'loss'", reports["weights"])
    assert re.search(r"missing: rank 0 on .*: waiting in broadcast 'weights'", reports["loss"])


def _disabled(rank: int, size: int):
    def body():
        if rank == 1:
            slow_data_loading(3.5)
        return hvd.allreduce(torch.ones(1), name="x").item()

    return _captured(body)


def test_no_report_when_the_inspector_is_off():
    env = {**FAST, "HORA_STALL_CHECK_DISABLE": "1"}
    results = run_ranks(_disabled, 2, env=env, timeout=60)
    assert [r[0] for r in results] == [1.0, 1.0]
    assert _reports(results) == []
