"""``hora bench control``: how hora's start-up and negotiation grow with the number of ranks, counted exactly.

For each rank count n, n processes forked from this one (which imported torch once, so that 128 ranks fit in
memory) run hora's real ``init()``, negotiation engine and ``shutdown()`` on this machine, with the launcher's
variables as ``hora run`` sets them (:func:`hora.testing.run_ranks`). Each rank counts, exactly:

* **store operations**: every call on the rendezvous store, torch's own (its rendezvous, Gloo's) included,
  by kind and by the part of the system whose key it names (:mod:`hora.bench.store_tally`, installed with
  :func:`hora.rendezvous.wrap_clients`), with the bytes of keys and values;
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
:func:`hora.launch.elastic_protocol.assign_world`; the driver's agents and processes are what it replaces).
The workers start in world 1, then all reset (``hora.runtime.reset``: leave the world, post ready, wait for
the driver's next world, build it: what ``hvd.elastic.run`` does after a host change; the state sync that
follows is one data-plane broadcast, not counted) into world 2 of the same workers. Counted: each worker's
and the driver's store operations during the first ``init()`` and during the reset.

The phases are separated by barriers on a store connection of the harness's own, which is never counted.
The store server runs in a process of its own; its CPU time over each phase, divided by the operations the
phase sent it, is what one store operation costs the server (:mod:`hora.bench.projection` uses it).

Times stand beside the counts, with the load average: on a small machine, times at 128 ranks mostly measure
CPU contention; the counts do not depend on it (except the polling of elastic waits, reported apart).

Example:
    >>> cfg = ControlConfig(ranks=(4,), ops=5, elastic=False)
    >>> record = measure(cfg)  # doctest: +SKIP
    >>> record["rows"][0]["warm"]["msgs_per_rank"]  # doctest: +SKIP
    6.0
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
import platform
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

import hora
from hora import rendezvous, runtime
from hora.bench import census
from hora.bench.control_report import summarize_elastic, summarize_fixed
from hora.bench.store_tally import StoreTally
from hora.engine.control import CONTROL_PLANES
from hora.errors import ConfigError
from hora.launch import elastic_protocol as ep
from hora.launch.elastic_driver import TICK
from hora.testing import run_ranks

__all__ = ["ControlConfig", "measure"]

_SERVER = (
    "import sys, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "sys.stdin.read()  # serve until the harness (our stdin's writer) ends\n"
)


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


@dataclass(frozen=True)
class _Job:
    """What every process of one job is handed (no process reads its environment for these)."""

    job_id: str
    port: int
    server_pid: int
    ops: int
    timeout_s: float
    cost_ops: int = 0


def measure(cfg: ControlConfig, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run every job of ``cfg`` and return the record: per-rank counts, and one summary row per job.

    A job that fails (a limit of this machine, a bug) is recorded with its error, and the others go on."""
    limit = _raise_fd_limit()
    machine = _machine()
    rows: list[dict[str, Any]] = []
    with _StoreServer() as server:
        for n in cfg.ranks:
            for plane in cfg.planes:
                rows.append(_run(n, f"fixed/{plane}", _fixed_rank, n, {"HORA_CONTROL_PLANE": plane}, server, cfg,
                                 progress, functools.partial(summarize_fixed, n, plane)))
            if cfg.elastic:
                rows.append(_run(n, "elastic", _elastic_rank, n + 1, {}, server, cfg, progress,
                                 functools.partial(summarize_elastic, n)))
        costs = _run_costs(server, cfg, progress)
    machine["ended_utc"] = _utc()
    return {"kind": "control", "config": asdict(cfg), "machine": machine, "fd_limit": limit, "tick_s": TICK,
            "store_costs": costs, "rows": rows}


def _run(n: int, what: str, fn: Callable[..., dict[str, Any]], procs: int, env: dict[str, str],
         server: _StoreServer, cfg: ControlConfig, progress: Callable[[str], None],
         summarize: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> dict[str, Any]:
    job = _Job(f"scale-{uuid.uuid4().hex[:10]}", server.port, server.pid, cfg.ops, cfg.timeout_s)
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


# what one store operation costs the server: COST_CLIENTS processes send cost_ops operations of each kind at once
COST_CLIENTS = 8
COST_KEYS = 128  # the keys of the long check (as the board's arrival check names every rank's key)


def _run_costs(server: _StoreServer, cfg: ControlConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    job = _Job(f"scale-{uuid.uuid4().hex[:10]}", server.port, server.pid, cfg.ops, cfg.timeout_s, cfg.cost_ops)
    progress(f"store server: {COST_CLIENTS} clients x {cfg.cost_ops} operations of each kind ...")
    load = os.getloadavg()[0]
    records = run_ranks(_cost_client, COST_CLIENTS, job, timeout=cfg.timeout_s, init=False, threads=1)
    ops = COST_CLIENTS * cfg.cost_ops
    kinds = {kind: {"server_cpu_per_op_s": cpu / ops,
                    "client_ops_per_s": ops / max(r[kind] for r in records)}
             for kind, cpu in records[0]["server_cpu"].items()}
    return {"clients": COST_CLIENTS, "ops_per_client": cfg.cost_ops, "check_keys": COST_KEYS, "kinds": kinds,
            "load": [load, os.getloadavg()[0]]}


def _cost_client(rank: int, size: int, job: _Job) -> dict[str, Any]:
    side = _Side(job, size)
    store = dist.PrefixStore(f"bench-control/{job.job_id}/costs", dist.TCPStore(
        "127.0.0.1", job.port, is_master=False, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=job.timeout_s)))
    mine = [f"{rank}/{i}" for i in range(COST_KEYS)]
    for key in mine:
        store.set(key, "x" * 16)
    kinds: dict[str, Callable[[int], Any]] = {
        "set": lambda i: store.set(mine[i % COST_KEYS], "y" * 16),
        "get": lambda i: store.get(mine[i % COST_KEYS]),
        "add": lambda i: store.add(f"{rank}/n", 1),
        "check": lambda i: store.check([mine[i % COST_KEYS]]),
        f"check_{COST_KEYS}": lambda i: store.check(mine),
        "wait_present": lambda i: store.wait([mine[i % COST_KEYS]]),
    }
    out: dict[str, Any] = {"server_cpu": {}}
    for kind, op in kinds.items():
        side.barrier(f"cost-{kind}")
        cpu0 = _server_cpu(job) if rank == 0 else 0.0
        began = time.perf_counter()
        for i in range(job.cost_ops):
            op(i)
        out[kind] = time.perf_counter() - began
        side.barrier(f"cost-{kind}-done")
        if rank == 0:
            out["server_cpu"][kind] = _server_cpu(job) - cpu0
    return out


# --- the processes of one job --------------------------------------------------------------------------------
class _Side:
    """The harness's own store connection: barriers between phases (never counted)."""

    def __init__(self, job: _Job, procs: int) -> None:
        base = dist.TCPStore("127.0.0.1", job.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=job.timeout_s))
        self.store = dist.PrefixStore(f"bench-control/{job.job_id}", base)
        self.procs = procs
        self.ops = 0  # operations this connection sent the server (they share its CPU time)

    def barrier(self, name: str) -> None:
        self.ops += 2
        if self.store.add(f"{name}/n", 1) == self.procs:
            self.store.set(f"{name}/done", "1")
        else:
            self.store.wait([f"{name}/done"])


def _server_cpu(job: _Job) -> float:
    """CPU seconds the store server has used (read from /proc by any process of the job)."""
    with open(f"/proc/{job.server_pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed_init(tally: StoreTally, side: _Side, job: _Job, rank: int) -> tuple[dict[str, Any], census.Census]:
    """``hora.init()`` between two barriers, counted: its record and the census before it."""
    ports = {job.port}
    before = census.take(ports)
    side.barrier("init")
    server0 = _server_cpu(job) if rank == 0 else 0.0
    began, cpu0 = time.time(), census.cpu_seconds()
    hora.init()
    ended, cpu = time.time(), census.cpu_seconds() - cpu0
    store = tally.take()
    after = census.take(ports)
    side.barrier("init-done")
    record = {"began": began, "ended": ended, "cpu_s": cpu, "store": store.as_dict(),
              "peer": after.traffic(since=before).as_dict(), "census": after.diff(before).as_dict()}
    if rank == 0:
        record["server_cpu_s"] = _server_cpu(job) - server0
    return record, before


def _fixed_rank(rank: int, size: int, job: _Job) -> dict[str, Any]:
    side = _Side(job, size)
    tally = StoreTally(job.job_id)
    rendezvous.wrap_clients(tally.wrap)
    try:
        out: dict[str, Any] = {"rank": rank}
        out["init"], before = _timed_init(tally, side, job, rank)
        out["cold"] = _rounds(side, tally, job, "cold", rank, size)
        out["warm"] = _rounds(side, tally, job, "warm", rank, size)
        side.barrier("shutdown")
        began = time.perf_counter()
        hora.shutdown()
        wall = time.perf_counter() - began
        left = census.take({job.port}).diff(before)
        gc.collect()  # what only the collector frees, apart
        out["shutdown"] = {"wall_s": wall, "store": tally.take().as_dict(), "left": _left(left),
                           "left_collected": _left(census.take({job.port}).diff(before))}
        out["side_ops"] = side.ops
        return out
    finally:
        rendezvous.wrap_clients(None)


def _left(diff: census.Census) -> dict[str, Any]:
    """What ``shutdown()`` left: the store connections are not counted (the tally keeps the counted ones)."""
    diff.fds["tcp-store"] = 0
    return diff.as_dict()


def _rounds(side: _Side, tally: StoreTally, job: _Job, phase: str, rank: int, size: int) -> dict[str, Any]:
    """``job.ops`` synchronous tiny allreduces named ``scale.<i>`` (new names when cold, the same when warm)."""
    negotiator = runtime.state().negotiator
    ports = {job.port}
    side.barrier(f"{phase}-ready")
    between = tally.take()  # nothing is expected between phases: shown if something was
    before, rounds0 = census.take(ports), negotiator.rounds_run
    side.barrier(f"{phase}-go")
    server0 = _server_cpu(job) if rank == 0 else 0.0
    cpu0, began = census.cpu_seconds(), time.perf_counter()
    expected = float(size * (size - 1) // 2)
    wrong = 0
    for i in range(job.ops):
        total = hora.allreduce(torch.tensor([float(rank)]), name=f"scale.{i}", op=hora.Sum)
        wrong += int(total.item() != expected)
    wall, cpu = time.perf_counter() - began, census.cpu_seconds() - cpu0
    side.barrier(f"{phase}-done")
    after = census.take(ports)
    record = {"ops": job.ops, "rounds": negotiator.rounds_run - rounds0, "wrong": wrong, "wall_s": wall,
              "cpu_s": cpu, "peer": after.traffic(since=before).as_dict(), "talked": after.talked(since=before),
              "store": tally.take().as_dict(), "store_between": between.ops}
    if rank == 0:
        record["server_cpu_s"] = _server_cpu(job) - server0
    return record


def _elastic_rank(rank: int, size: int, job: _Job) -> dict[str, Any]:
    """Process 0 plays the driver; the others are workers ``h<rank>:0``, one per host."""
    if rank == 0:
        return _driver(size - 1, job)
    os.environ.update(HORA_ELASTIC="1", HORA_WORKER_ID=f"h{rank}:0", HORA_HOSTNAME=f"h{rank}")
    side = _Side(job, size)
    tally = StoreTally(job.job_id)
    rendezvous.wrap_clients(tally.wrap)
    try:
        out: dict[str, Any] = {"rank": rank}
        out["init"], before = _timed_init(tally, side, job, rank - 1)
        out["checked"] = [_check(1)]
        side.barrier("reset")
        after_init = census.take({job.port})
        server0 = _server_cpu(job) if rank == 1 else 0.0
        began, cpu0 = time.time(), census.cpu_seconds()
        runtime.reset(failed=False)
        ended, cpu = time.time(), census.cpu_seconds() - cpu0
        store = tally.take()
        after = census.take({job.port})
        gc.collect()  # a planned reset collects no garbage: what is left until the collector runs, apart
        collected = census.take({job.port})
        side.barrier("reset-done")
        out["reset"] = {"began": began, "ended": ended, "cpu_s": cpu, "store": store.as_dict(),
                        "census": after.diff(after_init).as_dict(),
                        "census_collected": collected.diff(after_init).as_dict(), "world": runtime.world_generation()}
        if rank == 1:
            out["reset"]["server_cpu_s"] = _server_cpu(job) - server0
        out["checked"].append(_check(2))
        hora.shutdown()
        out["side_ops"] = side.ops
        return out
    finally:
        rendezvous.wrap_clients(None)


def _check(gen: int) -> bool:
    """One allreduce in the world just built: the right sum on every rank."""
    size = hora.size()
    total = hora.allreduce(torch.tensor([float(hora.rank())]), name=f"scale.check.{gen}", op=hora.Sum)
    return bool(total.item() == size * (size - 1) // 2)


def _driver(workers: int, job: _Job) -> dict[str, Any]:
    """The elastic driver's part: publish world 1 once every worker posted ready, then world 2 once every
    worker posted ready after world 1 (the same workers: a reset that changes no membership)."""
    side = _Side(job, workers + 1)
    tally = StoreTally(job.job_id)
    store = tally.wrap(dist.TCPStore("127.0.0.1", job.port, is_master=False, wait_for_workers=False,
                                     timeout=datetime.timedelta(seconds=job.timeout_s)))
    members = [(f"h{r}:0", f"h{r}") for r in range(1, workers + 1)]
    side.barrier("init")
    first, passes = _publish_when_ready(store, job.job_id, members, None)
    init = {"store": tally.take().as_dict(), "passes": passes}
    side.barrier("init-done")
    side.barrier("reset")
    _, passes = _publish_when_ready(store, job.job_id, members, first)
    reset = {"store": tally.take().as_dict(), "passes": passes}
    side.barrier("reset-done")
    return {"rank": 0, "driver": True, "init": init, "reset": reset, "side_ops": side.ops}


def _publish_when_ready(store: dist.Store, job_id: str, members: list[tuple[str, str]],
                        previous: ep.World | None) -> tuple[ep.World, int]:
    """Read the ready keys every ``TICK`` as the driver does (a key known to hold the awaited value is not read
    again), then publish the next world; returns it and the number of passes over the keys."""
    last = previous.gen if previous is not None else 0
    waiting = {wid for wid, _ in members}
    passes = 0
    while waiting:
        passes += 1
        for wid in sorted(waiting):
            key = ep.elastic_key(job_id, ep.READY, worker_id=wid)
            if store.check([key]) and int(store.get(key).decode()) == last:
                waiting.discard(wid)
        if waiting:
            time.sleep(TICK)
    world = ep.assign_world(previous, last + 1, members)
    store.set(ep.elastic_key(job_id, ep.WORLD, gen=world.gen), world.to_json())
    store.set(ep.elastic_key(job_id, ep.GEN), str(world.gen))
    return world, passes


# --- this machine -----------------------------------------------------------------------------------------
class _StoreServer:
    """The rendezvous store in a process of its own (as ``hora run``'s driver hosts it), whose CPU time the
    ranks read."""

    def __enter__(self) -> _StoreServer:
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.strip().isdigit():
            self._proc.kill()
            raise RuntimeError(f"the benchmark's store process did not start (it said {line!r})")
        self.port, self.pid = int(line), self._proc.pid
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


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
