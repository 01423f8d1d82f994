"""What each forked process of a ``hora bench control`` job runs: a rank of a fixed job (``init()``, the cold and
warm rounds, ``shutdown()``), a worker of the elastic job (``init()`` into world 1, a reset into world 2), and
the stand-in for ``hora run``'s elastic driver. Each returns its counts (:mod:`hora.bench.control` has the
phases' description).
"""

from __future__ import annotations

import datetime
import gc
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import hora
from hora.bench import census
from hora.bench.store_server import Job, Side, server_cpu
from hora.bench.store_tally import StoreTally
from hora.common import rendezvous
from hora.common.env import job_secret
from hora.launcher.elastic.driver import TICK
from hora.protocol import elastic as ep
from hora.protocol.signedstore import SignedStore
from hora.runtime import lifecycle as runtime

__all__ = ["elastic_rank", "fixed_rank"]


def _timed_init(tally: StoreTally, side: Side, job: Job, rank: int) -> tuple[dict[str, Any], census.Census]:
    """``hora.init()`` between two barriers, counted: its record and the census before it."""
    ports = {job.port}
    before = census.take(ports)
    side.barrier("init")
    server0 = server_cpu(job) if rank == 0 else 0.0
    began, cpu0 = time.time(), census.cpu_seconds()
    hora.init()
    ended, cpu = time.time(), census.cpu_seconds() - cpu0
    store = tally.take()
    after = census.take(ports)
    side.barrier("init-done")
    record = {"began": began, "ended": ended, "cpu_s": cpu, "store": store.as_dict(),
              "peer": after.traffic(since=before).as_dict(), "census": after.diff(before).as_dict()}
    if rank == 0:
        record["server_cpu_s"] = server_cpu(job) - server0
    return record, before


def fixed_rank(rank: int, size: int, job: Job) -> dict[str, Any]:
    """A rank of a fixed job: ``init()``, the cold and the warm rounds, ``shutdown()``, each counted."""
    side = Side(job, size)
    tally = StoreTally(job.job_id)
    rendezvous.wrap_clients(tally.wrap)
    try:
        out: dict[str, Any] = {"rank": rank}
        out["init"], before = _timed_init(tally, side, job, rank)
        out["plane"] = runtime.state().negotiator.control_plane
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


def _rounds(side: Side, tally: StoreTally, job: Job, phase: str, rank: int, size: int) -> dict[str, Any]:
    """``job.ops`` synchronous tiny allreduces named ``scale.<i>`` (new names when cold, the same when warm)."""
    negotiator = runtime.state().negotiator
    ports = {job.port}
    side.barrier(f"{phase}-ready")
    between = tally.take()  # nothing is expected between phases: shown if something was
    before, rounds0 = census.take(ports), negotiator.rounds_run
    side.barrier(f"{phase}-go")
    server0 = server_cpu(job) if rank == 0 else 0.0
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
        record["server_cpu_s"] = server_cpu(job) - server0
    return record


def elastic_rank(rank: int, size: int, job: Job) -> dict[str, Any]:
    """Process 0 plays the driver; the others are workers ``h<rank>:0``, one per host."""
    if rank == 0:
        return _driver(size - 1, job)
    os.environ.update(HORA_ELASTIC="1", HORA_WORKER_ID=f"h{rank}:0", HORA_HOSTNAME=f"h{rank}")
    side = Side(job, size)
    tally = StoreTally(job.job_id)
    rendezvous.wrap_clients(tally.wrap)
    try:
        out: dict[str, Any] = {"rank": rank}
        out["init"], before = _timed_init(tally, side, job, rank - 1)
        out["checked"] = [_check(1)]
        side.barrier("reset")
        after_init = census.take({job.port})
        server0 = server_cpu(job) if rank == 1 else 0.0
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
            out["reset"]["server_cpu_s"] = server_cpu(job) - server0
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


def _driver(workers: int, job: Job) -> dict[str, Any]:
    """The elastic driver's part: publish world 1 once every worker posted ready, then world 2 once every
    worker posted ready after world 1 (the same workers: a reset that changes no membership)."""
    side = Side(job, workers + 1)
    tally = StoreTally(job.job_id)
    raw = tally.wrap(dist.TCPStore("127.0.0.1", job.port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=job.timeout_s)))
    store = SignedStore(raw, job_secret(), job.job_id, f"127.0.0.1:{job.port}")  # as the driver writes
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


def _publish_when_ready(store: SignedStore, job_id: str, members: list[tuple[str, str]],
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
