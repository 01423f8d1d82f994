"""The control plane's trust rules on real ranks, on both planes (the TCP mesh and the Gloo allgather): the
job's secret from the environment, a rank with another secret or other hora code refused at init, naming it,
and a job without a secret still running (nothing is ever unpickled either way)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import hora as hvd
from hora.engine.auth import handshake
from hora.protocol.jobsecret import ENV_SECRET, JobSecret
from tests.distributed.harness import run_ranks

PLANES = ["tcp", "gloo"]


def _sum_of_ranks(rank: int, size: int) -> list[float]:
    return [hvd.allreduce(torch.tensor([float(rank + i)]), op=hvd.Sum, name=f"t{i}").item() for i in range(3)]


@pytest.mark.parametrize("plane", PLANES)
def test_a_job_without_a_secret_runs_and_its_results_are_exact(plane: str) -> None:
    results = run_ranks(_sum_of_ranks, 3, env={ENV_SECRET: None, "HORA_CONTROL_PLANE": plane})
    assert results == [[3.0, 6.0, 9.0]] * 3


def _init_with(rank: int, size: int, changes: dict[int, dict[str, Any]]) -> str:
    """hvd.init() after this rank's ``changes`` (``secret``: its own secret; ``code``: its code fingerprint);
    the error text, or "ok"."""
    mine = changes.get(rank, {})
    if "secret" in mine:
        os.environ[ENV_SECRET] = mine["secret"]
    if "code" in mine:
        handshake.code_fingerprint = lambda: mine["code"]  # type: ignore[assignment]  # this forked rank only
    try:
        hvd.init()
    except Exception as e:  # noqa: BLE001 - the test looks at what the user would read
        return f"{type(e).__name__}: {e}"
    hvd.shutdown()
    return "ok"


@pytest.mark.parametrize("plane", PLANES)
def test_a_rank_running_other_hora_code_is_refused_at_init_naming_both_builds(plane: str) -> None:
    other = "e" * 64
    results = run_ranks(_init_with, 2, {1: {"code": other}}, init=False, timeout=90,
                        env={"HORA_CONTROL_PLANE": plane, "HORA_START_TIMEOUT": "30"})
    mine = handshake.code_fingerprint()[:12]
    for message in results:
        assert message.startswith("IncompatiblePeer: rank "), message
        assert f"(code {other[:12]})" in message and f"(code {mine})" in message, message
        assert "every host must run the same hora build" in message, message


def test_a_rank_with_another_secret_is_refused_on_the_gloo_plane() -> None:
    results = run_ranks(_init_with, 2, {1: {"secret": JobSecret.generate().hex()}}, init=False, timeout=90,
                        env={"HORA_CONTROL_PLANE": "gloo"})
    assert "rank 0 (host" in results[1] and "failed authentication" in results[1], results[1]
    assert "rank 1 (host" in results[0] and "holds another job secret" in results[0], results[0]


def test_a_rank_with_another_secret_is_refused_on_the_mesh() -> None:
    """The mesh's peers find each other through the store, whose values are signed: a rank with another secret
    is refused when it reads rank 0's address there (the handshake's own refusal of such a rank, reached by a
    stranger who dials the listener directly, is tests/unit/test_handshake.py's)."""
    results = run_ranks(_init_with, 2, {1: {"secret": JobSecret.generate().hex()}}, init=False, timeout=90,
                        env={"HORA_START_TIMEOUT": "12"})
    assert results[1].startswith("StoreAuthError: the value of store key"), results[1]
    assert "/mesh/0' on the rendezvous store at 127.0.0.1:" in results[1], results[1]
    assert "failed authentication" in results[1], results[1]
    # rank 0 waited for the real rank 1 until its deadline, and says so
    assert "rank(s) [1] did not connect to it within 12s" in results[0], results[0]


def test_a_rank_without_a_secret_among_ranks_with_one_is_told_how_to_fix_it() -> None:
    results = run_ranks(_init_with, 2, {0: {"secret": ""}}, init=False, timeout=90, env={"HORA_START_TIMEOUT": "12"})
    refused = [r for r in results if "failed authentication" in r or "job secret" in r]
    assert refused and all("HORA_SECRET_FILE" in r for r in refused), results
