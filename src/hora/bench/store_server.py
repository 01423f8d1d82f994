"""The rendezvous store of ``hora bench control``'s jobs: a TCPStore server in a process of its own (as ``hora
run``'s driver hosts it), whose CPU time any process of a job can read; the barriers the harness puts between
phases on a connection of its own (never counted); and what one store operation costs the server.

Example:
    >>> with StoreServer() as server:  # doctest: +SKIP
    ...     costs = measure_costs(Job("j1", server.port, server.pid, ops=1, timeout_s=60, cost_ops=100))
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hora.testing import run_ranks

__all__ = ["COST_CLIENTS", "COST_KEYS", "Job", "Side", "StoreServer", "measure_costs", "server_cpu"]

_SERVER = (
    "import sys, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "sys.stdin.read()  # serve until the harness (our stdin's writer) ends\n"
)


@dataclass(frozen=True)
class Job:
    """What every process of one job is handed (no process reads its environment for these): the job's id and
    store, the store server's process, allreduces per rounds phase, the longest wait, store-cost operations."""

    job_id: str
    port: int
    server_pid: int
    ops: int
    timeout_s: float
    cost_ops: int = 0


class StoreServer:
    """The rendezvous store in a process of its own (as ``hora run``'s driver hosts it), whose CPU time the
    ranks read."""

    def __enter__(self) -> StoreServer:
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


class Side:
    """The harness's own store connection: barriers between phases (never counted)."""

    def __init__(self, job: Job, procs: int) -> None:
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


def server_cpu(job: Job) -> float:
    """CPU seconds the store server has used (read from /proc by any process of the job)."""
    with open(f"/proc/{job.server_pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# what one store operation costs the server: COST_CLIENTS processes send cost_ops operations of each kind at once
COST_CLIENTS = 8
COST_KEYS = 128  # the keys of the long check (as the board's arrival check names every rank's key)


def measure_costs(job: Job) -> dict[str, Any]:
    """Server CPU seconds per operation of each kind (and the rate the clients saw): COST_CLIENTS processes send
    ``job.cost_ops`` operations of a kind at once, the server's CPU time read around each kind."""
    load = os.getloadavg()[0]
    records = run_ranks(_cost_client, COST_CLIENTS, job, timeout=job.timeout_s, init=False, threads=1)
    ops = COST_CLIENTS * job.cost_ops
    kinds = {kind: {"server_cpu_per_op_s": cpu / ops,
                    "client_ops_per_s": ops / max(r[kind] for r in records)}
             for kind, cpu in records[0]["server_cpu"].items()}
    return {"clients": COST_CLIENTS, "ops_per_client": job.cost_ops, "check_keys": COST_KEYS, "kinds": kinds,
            "load": [load, os.getloadavg()[0]]}


def _cost_client(rank: int, size: int, job: Job) -> dict[str, Any]:
    side = Side(job, size)
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
        cpu0 = server_cpu(job) if rank == 0 else 0.0
        began = time.perf_counter()
        for i in range(job.cost_ops):
            op(i)
        out[kind] = time.perf_counter() - began
        side.barrier(f"cost-{kind}-done")
        if rank == 0:
            out["server_cpu"][kind] = server_cpu(job) - cpu0
    return out
