"""A job of many ranks on one machine, end to end: ``hora.init()``, named allreduces checked exactly,
``hora.shutdown()``; or the same job with one rank killed (SIGKILL) in the middle.

The ranks are processes forked from one parent that imported torch once (:func:`hora.testing.run_ranks`, with
the launcher's variables as ``hora run`` sets them), so that 128 of them fit in memory: a rank that starts its
own interpreter (``hora run``, ``hora.run``) holds about 150 MB of its own (docs/performance.md, "Scale").

Each rank runs ``steps`` steps of ``per_step`` named allreduces submitted together (as an optimizer's
buckets are) and then synchronized; the names repeat every step, as gradient names do. Most are 4 floats
(they travel inside the negotiation round); every tenth is 1,024 floats (the data plane, Gloo). Rank ``r``
gives ``(r + 1) * (i + 1)`` for the ``i``-th name, so each result is ``(i + 1) * n (n + 1) / 2`` exactly.

With ``kill_rank``, that rank SIGKILLs itself at the start of step ``steps // 2``; the others must each get
the error naming it (``hvd.HorovodInternalError``), and the job's report (the harness's) names it as the
rank that died. :func:`run_job` also checks that no rank's process outlives the job.

Used by benchmarks/scale_job.py (``--np 128 --runs 10``) and tests/distributed/test_scale_job.py (16 ranks).

Example:
    >>> result = run_job(ScaleJob(ranks=4, steps=2, per_step=10))  # doctest: +SKIP
    >>> result.ok, result.exact  # doctest: +SKIP
    (True, True)
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import hora
from hora.testing import run_ranks

__all__ = ["JobResult", "ScaleJob", "private_mb", "run_job"]

_SMALL, _LARGE, _LARGE_EVERY = 4, 1024, 10


@dataclass(frozen=True, kw_only=True)
class ScaleJob:
    """One job.

    Args:
        ranks: how many ranks.
        steps: steps of ``per_step`` allreduces each.
        per_step: allreduces submitted together in a step.
        kill_rank: the rank that SIGKILLs itself at step ``steps // 2`` (None: a clean job).
        timeout_s: the longest the job may take.
        env: extra variables for the ranks (e.g. ``HORA_CONTROL_PLANE``).
    """

    ranks: int
    steps: int = 10
    per_step: int = 100
    kill_rank: int | None = None
    timeout_s: float = 1200.0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ops(self) -> int:
        return self.steps * self.per_step


@dataclass
class JobResult:
    """What a job showed: ``ok`` (every rank returned), ``exact`` (every result was), ``report`` (the
    harness's failure report, empty when ok), the survivors' errors and how long after the kill each came,
    processes left behind, and times."""

    ok: bool
    exact: bool
    report: str
    wall_s: float
    init_s: float  # the slowest rank's init()
    private_mb: float  # the largest private memory of a rank at its end
    survivors: dict[int, str]  # rank -> the error it got (a kill run)
    told_after_s: list[float]  # each survivor's error, seconds after the kill
    left_behind: list[int]  # pids of the job's ranks still alive after it ended

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _value(rank: int, i: int) -> float:
    return float((rank + 1) * (i + 1))


def _expected(size: int, i: int) -> float:
    return float((i + 1) * size * (size + 1) // 2)


def _rank(rank: int, size: int, job: ScaleJob, where: str) -> dict[str, Any]:
    Path(where, f"pid.{rank}").write_text(str(os.getpid()))
    began = time.time()
    hora.init()
    init_s = time.time() - began
    tensors = [torch.full((_LARGE if i % _LARGE_EVERY == _LARGE_EVERY - 1 else _SMALL,), _value(rank, i))
               for i in range(job.per_step)]
    exact = True
    try:
        for step in range(job.steps):
            if job.kill_rank == rank and step == job.steps // 2:
                Path(where, "killed").write_text(json.dumps({"rank": rank, "at": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
            handles = [hora.allreduce_async(t, name=f"grad.{i}", op=hora.Sum) for i, t in enumerate(tensors)]
            for i, h in enumerate(handles):
                out = hora.synchronize(h)
                exact = exact and bool((out == _expected(size, i)).all())
        error = ""
    except hora.HorovodInternalError as e:
        if job.kill_rank is None:
            raise
        error = str(e)
    result = {"rank": rank, "init_s": init_s, "exact": exact, "error": error, "at": time.time(),
              "private_mb": private_mb()}
    # a file, not only the return value: when a rank was killed the harness reports the failure, not the values
    Path(where, f"result.{rank}").write_text(json.dumps(result))
    hora.shutdown()
    return result


def private_mb() -> float:
    """This process's private memory (pages no other process shares), in MB."""
    kb = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                kb += int(line.split()[1])
    return kb / 1024


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for this purpose
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def run_job(job: ScaleJob) -> JobResult:
    """Run ``job`` and say what it showed (see :class:`JobResult`)."""
    with tempfile.TemporaryDirectory(prefix="hora-scale-") as where:
        began = time.monotonic()
        report = ""
        try:
            run_ranks(_rank, job.ranks, job, where, timeout=job.timeout_s, env=job.env, init=False)
        except AssertionError as e:  # the harness's report: which rank failed or died, and how
            report = str(e)
        values = [json.loads(p.read_text()) for p in sorted(Path(where).glob("result.*"))]
        wall = time.monotonic() - began
        pids = [int(p.read_text()) for p in Path(where).glob("pid.*")]
        deadline = time.monotonic() + 10.0  # the harness reaps its children as it returns; give stragglers a moment
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        killed = Path(where, "killed")
        killed_at = json.loads(killed.read_text())["at"] if killed.exists() else None
        survivors = {v["rank"]: v["error"] for v in values if v["error"]}
        told = [v["at"] - killed_at for v in values if v["error"] and killed_at is not None]
        exact = len(values) == job.ranks - (job.kill_rank is not None) and all(v["exact"] for v in values)
        return JobResult(ok=not report, exact=exact, report=report,
                         wall_s=wall, init_s=max((v["init_s"] for v in values), default=0.0),
                         private_mb=max((v["private_mb"] for v in values), default=0.0), survivors=survivors,
                         told_after_s=told, left_behind=[p for p in pids if _alive(p)])
