"""The harness itself: results in rank order, failures reported earliest first, hung ranks named and killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed.harness import rank_store, run_ranks


def _env_and_order(rank: int, size: int, tag: str) -> tuple:
    time.sleep(0.2 * (size - 1 - rank))  # rank 0 finishes last
    keys = ("HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE", "HORA_JOB_ID", "EXTRA", "HOME")
    return rank, tag, {k: os.environ.get(k) for k in keys}


def test_results_come_back_in_rank_order_with_the_launcher_env() -> None:
    first = run_ranks(_env_and_order, 3, "x", init=False, env={"EXTRA": "1", "HOME": None})
    assert [r[0] for r in first] == [0, 1, 2]
    assert [r[1] for r in first] == ["x", "x", "x"]
    for rank, (_, _, env) in enumerate(first):
        assert env["HORA_RANK"] == env["HORA_LOCAL_RANK"] == str(rank)
        assert env["HORA_SIZE"] == env["HORA_LOCAL_SIZE"] == "3"
        assert env["EXTRA"] == "1" and env["HOME"] is None
    assert len({env["HORA_JOB_ID"] for _, _, env in first}) == 1
    second = run_ranks(_env_and_order, 2, "y", init=False)
    assert second[0][2]["HORA_JOB_ID"] != first[0][2]["HORA_JOB_ID"]  # unique per call
    assert "HORA_RANK" not in os.environ  # the parent's environment is untouched


def _raise_on(rank: int, size: int, bad: int, delay: dict) -> None:
    time.sleep(delay.get(rank, 0.0))
    if rank == bad or bad == -1:
        raise ValueError(f"boom from rank {rank}")


def test_a_raising_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_raise_on, 2, 1, {}, init=False)
    msg = str(info.value)
    assert "1 of 2 ranks failed" in msg
    assert "ValueError: boom from rank 1" in msg
    assert "in _raise_on" in msg  # the traceback, not just the message


def test_the_earliest_failure_is_shown_first() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_raise_on, 3, -1, {0: 1.2, 1: 0.6, 2: 0.0}, init=False)
    msg = str(info.value)
    assert "Earliest failure first: rank 2." in msg
    assert msg.index("boom from rank 2") < msg.index("boom from rank 1") < msg.index("boom from rank 0")


def _hang_on(rank: int, size: int, hung: int, pid_dir: str) -> int:
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == hung:
        time.sleep(3600)
    return rank


def _assert_gone(pid_dir: str, rank: int) -> None:
    with open(os.path.join(pid_dir, f"{rank}.pid")) as f:
        pid = int(f.read())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_hung_rank_is_named_and_killed(tmp_path) -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_hang_on, 3, 1, str(tmp_path), timeout=3.0, init=False)
    msg = str(info.value)
    assert "0 of 3 ranks failed, 1 did not finish" in msg
    assert "rank 1 hung: no result before the deadline" in msg
    assert "hung ranks: [1]" in msg
    assert "where rank 1's threads were:" in msg and "in _hang_on" in msg  # its stack, to see where it hung
    _assert_gone(str(tmp_path), 1)


def _fail_and_hang(rank: int, size: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        raise RuntimeError("root cause on rank 0")
    time.sleep(3600)


def test_after_a_failure_the_others_are_killed_and_named(tmp_path) -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_fail_and_hang, 2, str(tmp_path), timeout=300.0, init=False)
    msg = str(info.value)
    assert "RuntimeError: root cause on rank 0" in msg
    assert "rank 1 hung: still running" in msg
    _assert_gone(str(tmp_path), 1)


def _die(rank: int, size: int) -> None:
    if rank == 1:
        os._exit(3)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_rank_dying_without_a_report_is_named() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_die, 3, init=False)
    msg = str(info.value)
    assert "rank 1 died without reporting (exit code 3)" in msg
    assert "rank 2 died without reporting (killed by SIGKILL)" in msg


def _unpicklable(rank: int, size: int):
    return lambda: rank


def test_an_unpicklable_result_is_a_clear_failure() -> None:
    with pytest.raises(AssertionError, match="rank 0's result could not be sent back"):
        run_ranks(_unpicklable, 1, init=False)


def _side_channel(rank: int, size: int) -> str:
    store = rank_store()
    store.set(f"from{rank}", f"hello {rank}")
    return store.get(f"from{(rank + 1) % size}").decode()


def test_rank_store_is_a_side_channel_between_ranks() -> None:
    assert run_ranks(_side_channel, 2, init=False) == ["hello 1", "hello 0"]


def test_a_process_that_used_the_harness_exits_leaving_nothing_running_or_open() -> None:
    """The store process ends with its session and its pipes are closed: no ``ResourceWarning: subprocess ...
    is still running`` nor ``unclosed file`` when the interpreter exits (they used to end every make test)."""
    script = ("import hora as hvd, torch\nfrom hora.testing import run_ranks\n"
              "print(run_ranks(lambda r, n: hvd.allreduce(torch.tensor([r]), op=hvd.Sum).item(), 2))\n")
    out = subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-c", script], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0 and out.stdout == "[1, 1]\n", out.stderr[-2000:]
    assert "ResourceWarning" not in out.stderr, out.stderr[-2000:]
