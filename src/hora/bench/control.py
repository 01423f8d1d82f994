"""``hora bench control``: how hora's start-up and negotiation grow with the number of ranks, counted exactly.

For each rank count n, n processes forked from this one (which imported torch once, so that 128 ranks fit in
memory) run hora's real ``init()``, negotiation engine and ``shutdown()`` on this machine, with the launcher's
variables as ``hora run`` sets them (:func:`hora.testing.run_ranks`). Each rank counts, exactly:

* **store operations**: every call on the rendezvous store, torch's own (its rendezvous, Gloo's) included,
  by kind and by the part of the system whose key it names (:mod:`hora.bench.store_tally`, installed with
  :func:`hora.common.rendezvous.wrap_clients`), with the bytes of keys and values;
* **messages and bytes on the connections to its peers**: data segments and payload bytes each way, read
  from the kernel for every TCP connection (:mod:`hora.bench.census`), whatever code sent them;
* **descriptors and threads** that ``init()`` added, by kind and by name.

Phases of a fixed job (one per control plane asked for, ``HORA_CONTROL_PLANE``):

1. ``init()``: its store operations, the traffic of the connections it opened, wall and CPU time;
2. rounds, *cold*: ``--ops`` synchronous allreduces of one float32, each under a new name (its request
   travels in full), then *warm*: the same names again (the response cache sends each as a small integer).
   An allreduce this small travels inside the round (no data-plane transfer), so what these phases count is
   the negotiation alone; every result is checked (the sum of the ranks);
3. ``shutdown()``: its store operations.

An elastic job (``--elastic``, the default) starts n workers and a stand-in for ``hora run``'s elastic driver
(process 0; it reads the workers' ready keys every ``TICK`` as the driver does and publishes each world with
:func:`hora.protocol.elastic.assign_world`; the driver's agents and processes are what it replaces).
The workers start in world 1, then all reset (``hora.runtime.lifecycle.reset``: leave the world, post ready, wait for
the driver's next world, build it: what ``hvd.elastic.run`` does after a host change; the state sync that
follows is one data-plane broadcast, not counted) into world 2 of the same workers. Counted: each worker's
and the driver's store operations during the first ``init()`` and during the reset.

The phases are separated by barriers on a store connection of the harness's own, which is never counted.
The store server runs in a process of its own; its CPU time over each phase, divided by the operations the
phase sent it, is what one store operation costs the server (:mod:`hora.bench.projection` uses it).

Times stand beside the counts, with the load average: on a small machine, times at 128 ranks mostly measure
CPU contention; the counts do not depend on it (except the elastic driver's polling, reported apart).

Example:
    >>> cfg = ControlConfig(ranks=(4,), ops=5, elastic=False)
    >>> record = measure(cfg)  # doctest: +SKIP
    >>> record["rows"][0]["warm"]["msgs_per_rank"]  # doctest: +SKIP
    6.0
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import resource
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

import hora
from hora.bench.control_ranks import elastic_rank, fixed_rank
from hora.bench.control_report import summarize_elastic, summarize_fixed
from hora.bench.store_server import COST_CLIENTS, Job, StoreServer, measure_costs
from hora.engine.transport.plane import CONTROL_PLANES
from hora.errors import ConfigError
from hora.launcher.elastic.driver import TICK
from hora.testing import run_ranks

__all__ = ["ControlConfig", "measure"]

@dataclass(frozen=True, kw_only=True)
class ControlConfig:
    """What ``hora bench control`` measures.

    Args:
        ranks: the rank counts, each one job (and one elastic job).
        planes: control planes (``HORA_CONTROL_PLANE``): ``auto`` (hora's choice for n), ``tcp``, ``gloo``.
        ops: allreduces per rounds phase (cold, then warm).
        elastic: also measure an elastic job's start and reset.
        timeout_s: the longest one job may take.
        cost_ops: operations of each kind each of the store-cost part's clients sends.
    """

    ranks: Sequence[int] = (8, 16, 32, 64, 128)
    planes: Sequence[str] = ("tcp",)
    ops: int = 20
    elastic: bool = True
    timeout_s: float = 1800.0
    cost_ops: int = 2000

    def __post_init__(self) -> None:
        if not self.ranks or min(self.ranks) < 2:
            raise ConfigError("--ranks: give rank counts of 2 or more, e.g. 8,16,32")
        bad = [p for p in self.planes if p not in CONTROL_PLANES]
        if bad or not self.planes:
            raise ConfigError(f"--planes {','.join(self.planes)}: use {', '.join(CONTROL_PLANES)}")
        if self.ops < 1 or self.cost_ops < 1:
            raise ConfigError("--ops must be at least 1")


def measure(cfg: ControlConfig, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run every job of ``cfg`` and return the record: per-rank counts, and one summary row per job.

    A job that fails (a limit of this machine, a bug) is recorded with its error, and the others go on."""
    limit = _raise_fd_limit()
    machine = _machine()
    rows: list[dict[str, Any]] = []
    with StoreServer() as server:
        for n in cfg.ranks:
            for plane in cfg.planes:
                rows.append(_run(n, f"fixed/{plane}", fixed_rank, n, {"HORA_CONTROL_PLANE": plane}, server, cfg,
                                 progress, functools.partial(summarize_fixed, n, plane)))
            if cfg.elastic:
                rows.append(_run(n, "elastic", elastic_rank, n + 1, {}, server, cfg, progress,
                                 functools.partial(summarize_elastic, n)))
        progress(f"store server: {COST_CLIENTS} clients x {cfg.cost_ops} operations of each kind ...")
        costs = measure_costs(Job(_job_id(), server.port, server.pid, cfg.ops, cfg.timeout_s, cfg.cost_ops))
    machine["ended_utc"] = _utc()
    return {"kind": "control", "config": asdict(cfg), "machine": machine, "fd_limit": limit, "tick_s": TICK,
            "store_costs": costs, "rows": rows}


def _run(n: int, what: str, fn: Callable[..., dict[str, Any]], procs: int, env: dict[str, str],
         server: StoreServer, cfg: ControlConfig, progress: Callable[[str], None],
         summarize: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> dict[str, Any]:
    job = Job(_job_id(), server.port, server.pid, cfg.ops, cfg.timeout_s, cfg.cost_ops)
    progress(f"{what}: {n} ranks ...")
    load = os.getloadavg()[0]
    began = time.monotonic()
    env = {"HORA_STORE_ADDR": "127.0.0.1", "HORA_STORE_PORT": str(server.port), "HORA_JOB_ID": job.job_id,
           "HORA_START_TIMEOUT": f"{cfg.timeout_s:g}", "HORA_ELASTIC_TIMEOUT": f"{cfg.timeout_s:g}", **env}
    try:
        records = run_ranks(fn, procs, job, timeout=cfg.timeout_s, env=env, init=False, threads=1)
    except AssertionError as e:  # the harness's report of failed or hung ranks
        progress(f"{what}: {n} ranks failed")
        return {"ranks": n, "job": what, "error": str(e)[-4000:], "load": [load, os.getloadavg()[0]]}
    row = summarize(records)
    row.update(job=what, wall_s=time.monotonic() - began, load=[load, os.getloadavg()[0]], per_rank=records)
    progress(f"{what}: {n} ranks done in {row['wall_s']:.0f} s (load {load:.1f} -> {row['load'][1]:.1f})")
    return row


# --- this machine -----------------------------------------------------------------------------------------
def _job_id() -> str:
    return f"scale-{uuid.uuid4().hex[:10]}"


def _utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _machine() -> dict[str, Any]:
    """What a reader needs to judge the times: the CPUs, the memory, the versions."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": model, "platform": platform.platform(),
            "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__, "hora": hora.__version__,
            "started_utc": _utc()}


def _raise_fd_limit() -> dict[str, int]:
    """Raise this process's open-file limit to its hard limit (the ranks and the store server inherit it): at
    128 ranks a rank holds several hundred sockets, and the store one per connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return {"soft_before": soft, "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "hard": hard}
