"""The job secret under an external launcher (torchrun-style variables, rank 0 hosting the store): a secret file
authenticates every value hora puts in the store; without one the job runs and rank 0 warns once, or refuses
with HORA_REQUIRE_SECRET=1; ranks with different secrets fail naming the key they could not trust."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hora as hvd
from hora.protocol.jobsecret import JobSecret
from tests.distributed.harness import run_ranks

LAUNCHER_VARS = ("HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE", "HORA_CROSS_RANK", "HORA_CROSS_SIZE",
                 "HORA_STORE_ADDR", "HORA_STORE_PORT", "HORA_JOB_ID", "HORA_SECRET")


def _torchrun_env(**extra: str) -> dict[str, str | None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return {k: None for k in LAUNCHER_VARS} | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} | extra


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _two_inits(rank: int, size: int) -> dict[str, Any]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))
    warnings = _Warnings()
    logging.getLogger("hora").addHandler(warnings)
    sums = []
    for _ in range(2):  # a second init() in the same process says nothing new
        hvd.init()
        sums.append(hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum).item())
        raw = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False)
        generation = hvd.runtime.lifecycle.world_generation()
        mesh = raw.get(f"hora//g{generation}/mesh/0")  # as a stranger reads it (no job id)
        hvd.shutdown()
    return {"sums": sums, "warnings": warnings.lines, "mesh_value_kind": mesh[:1].decode()}


def test_a_secret_file_authenticates_every_value_and_nothing_is_said(tmp_path: Path) -> None:
    path = tmp_path / "job.secret"
    JobSecret.generate().write_file(str(path))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    results = run_ranks(_two_inits, 2, init=False, env=_torchrun_env(HORA_SECRET_FILE=str(path)))
    assert [r["sums"] for r in results] == [[3.0, 3.0], [3.0, 3.0]]
    assert [r["warnings"] for r in results] == [[], []]
    assert {r["mesh_value_kind"] for r in results} == {"M"}  # a MAC'd value


def test_without_a_secret_the_job_runs_and_rank_0_warns_once() -> None:
    results = run_ranks(_two_inits, 2, init=False, env=_torchrun_env())
    assert [r["sums"] for r in results] == [[3.0, 3.0], [3.0, 3.0]]
    assert results[1]["warnings"] == []
    (warning,) = results[0]["warnings"]
    assert warning.startswith("this job has no job secret, so its rendezvous store and control plane are "
                              "unauthenticated"), warning
    assert "HORA_SECRET_FILE=" in warning and "hora secret" in warning and "HORA_REQUIRE_SECRET=1" in warning
    assert {r["mesh_value_kind"] for r in results} == {"P"}


def _init_error(rank: int, size: int) -> str:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))
    try:
        hvd.init()
    except hvd.HoraError as e:
        return f"{type(e).__name__}: {e}"
    hvd.shutdown()
    return "started"


def test_hora_require_secret_refuses_a_job_without_one() -> None:
    results = run_ranks(_init_error, 2, init=False, env=_torchrun_env(HORA_REQUIRE_SECRET="1"))
    for rank, text in enumerate(results):
        assert text.startswith(f"ConfigError: rank {rank}: HORA_REQUIRE_SECRET=1 and this job has no job secret "
                               "(HORA_SECRET_FILE is not set); give every process of the job the same secret "
                               "file"), text


def _other_secret(rank: int, size: int, path: str) -> str:
    if rank == 1:
        JobSecret.generate().write_file(path)  # rank 1 was given another job's file
        os.environ["HORA_SECRET_FILE"] = path
    return _init_error(rank, size)


def test_ranks_with_different_secrets_fail_naming_the_key_and_the_store(tmp_path: Path) -> None:
    ours = tmp_path / "ours.secret"
    JobSecret.generate().write_file(str(ours))
    env = _torchrun_env(HORA_SECRET_FILE=str(ours), HORA_START_TIMEOUT="10")
    results = run_ranks(_other_secret, 2, str(tmp_path / "theirs.secret"), init=False, env=env, timeout=90)
    port = env["MASTER_PORT"]
    assert results[1] == (f"StoreAuthError: the value of store key 'hora//g1/mesh/0' on the rendezvous store at "
                          f"127.0.0.1:{port} failed authentication and was not used: its MAC does not match this "
                          "job's secret: a process without the secret wrote it (a stranger on the network, or a "
                          "process of another job; see docs/security.md)"), results[1]
    assert results[0] != "started"  # rank 0 never hears from rank 1: its init fails at the start timeout
