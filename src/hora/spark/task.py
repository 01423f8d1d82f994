"""The Spark side of :func:`hora.spark.run`: one barrier task per rank starts the rank's process and reports how
it ended.

Each task of the barrier stage is rank ``partitionId()``. It learns every task's host from the barrier context
(local and cross ranks: ranks on one host are local), starts ``python -m hora.launcher.pyfunc.worker`` with the rank's
variables (the function and its result travel through the driver's store, as with ``hora.run``), waits for it and
writes how it ended to the store. A rank process dies with its task (a cancelled job leaves nothing running).

A task of a retried stage attempt (a second task for a rank) starts nothing: a job whose rank failed is over,
never run twice.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hora.launcher import envvars, procs
from hora.launcher.hosts import SlotInfo
from hora.protocol.jobsecret import ENV_SECRET, JobSecret
from hora.protocol.signedstore import SignedStore
from hora.protocol.topology import derive_topology

EXIT_KEY = "hora.spark/exit/{rank}"  # how rank's process ended: {"code", "signal", "host", "time"}
EXITS_KEY = "hora.spark/exits"  # a counter of the exit records written
STOP_KEY = "hora.spark/stop"  # set by the driver when the job is over: late or retried tasks start nothing
STARTS_KEY = "hora.spark/starts/{rank}"  # how many tasks took rank's place: a second one is a retry
HOST_KEY = "hora.spark/host/{rank}"  # the host rank's task runs on (for reports)
OUT_KEY = "hora.spark/out/{rank}/{n}"  # a chunk of rank's output lines: {"stdout": [...], "stderr": [...]}
OUTS_KEY = "hora.spark/outs/{rank}"  # a counter of rank's output chunks (chunk n is OUT_KEY with n = 1, 2, ...)
_FORWARD_S = 0.2  # how often a task sends its rank's new output lines to the driver


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """What every task needs; travels to the executors inside the task's closure (Spark's RPC; turn on
    ``spark.authenticate`` and ``spark.network.crypto.enabled`` where the network is not trusted)."""

    store_addr: str
    store_port: int
    job_id: str
    executable: str
    env: Mapping[str, str]  # the driver's forwarded environment and the user's env=
    secret_hex: str = field(repr=False)
    start_timeout: float
    forward_output: bool = False  # run(stdout=/stderr=): the rank's lines go to the driver, not the executor's log


def host_hash(salt: str | None = None) -> str:
    """A key for this host, the same in every process on it (Horovod's ``horovod.spark.common.util.host_hash``):
    the host name, told apart per container (``CONTAINER_ID``) and by ``salt`` when given."""
    parts = [socket.gethostname(), os.environ.get("CONTAINER_ID", ""), salt or ""]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"{parts[0]}-{digest}"


def rank_task(spec: TaskSpec) -> Any:
    """The function for ``rdd.barrier().mapPartitions``: run this task's rank; yield its exit record."""

    def run(_partition: Iterator[Any]) -> Iterator[dict[str, Any]]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
        store = _store(spec)
        if store.add(STARTS_KEY.format(rank=rank), 1) > 1 or store.check([STOP_KEY]):
            yield {"rank": rank, "host": hosts[rank], "skipped": True}
            return
        store.set(HOST_KEY.format(rank=rank), hosts[rank])
        yield _run_rank(spec, store, rank, hosts, _gpus(ctx))

    return run


def _store(spec: TaskSpec) -> SignedStore:
    """The driver's store, every value authenticated with the job's secret (as the rank process's)."""
    from torch.distributed import TCPStore

    raw = TCPStore(spec.store_addr, spec.store_port, is_master=False,
                   timeout=datetime.timedelta(seconds=spec.start_timeout))
    return SignedStore(raw, JobSecret.from_text(spec.secret_hex, "the task's spec"), spec.job_id,
                       f"{spec.store_addr}:{spec.store_port}")


def _gpus(ctx: Any) -> list[str]:
    resources = ctx.resources()
    return list(resources["gpu"].addresses) if "gpu" in resources else []


def rank_environment(spec: TaskSpec, rank: int, hosts: list[str], gpus: list[str]) -> dict[str, str]:
    """The rank process's environment: the driver's (forwarded), the rank's place among ``hosts`` (every task's
    host in rank order), the store, and the job's secret (in the environment only: never on a command line)."""
    topo = derive_topology(hosts, hosts, rank)
    slot = SlotInfo(rank=rank, size=topo.size, local_rank=topo.local_rank, local_size=topo.local_size,
                    cross_rank=topo.cross_rank, cross_size=topo.cross_size, hostname=hosts[rank],
                    host_index=topo.cross_rank)
    env = dict(spec.env)
    env.update(envvars.rank_env(slot, store_addr=spec.store_addr, store_port=spec.store_port, job_id=spec.job_id))
    env[ENV_SECRET] = spec.secret_hex
    if gpus:  # the GPUs Spark gave this task (spark.task.resource.gpu.amount)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def _run_rank(spec: TaskSpec, store: SignedStore, rank: int, hosts: list[str], gpus: list[str]) -> dict[str, Any]:
    env = rank_environment(spec, rank, hosts, gpus)
    pipe = subprocess.PIPE if spec.forward_output else None
    proc = subprocess.Popen([spec.executable, "-m", "hora.launcher.pyfunc.worker"], env=env, stdout=pipe,
                            stderr=pipe, preexec_fn=procs.child_setup(os.getpid()))
    forwarder = _Forwarder(store, rank, proc) if spec.forward_output else None
    try:
        status = proc.wait()
    finally:
        if proc.poll() is None:  # this task was interrupted (the job was cancelled): the rank goes with it
            proc.kill()
            proc.wait()
        if forwarder is not None:
            forwarder.close()  # every line is in the store before the exit record
    record = {"rank": rank, "host": hosts[rank], "code": status if status >= 0 else None,
              "signal": -status if status < 0 else None, "time": time.time()}
    store.set(EXIT_KEY.format(rank=rank), json.dumps(record))
    store.add(EXITS_KEY, 1)
    return record


class _Forwarder:
    """Sends a rank process's stdout and stderr lines to the driver's store in chunks (``run(stdout=,
    stderr=)``): a reader thread per stream, and a sender that writes what arrived every ``_FORWARD_S``."""

    def __init__(self, store: SignedStore, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self._store, self._rank = store, rank
        self._lock = threading.Lock()
        self._lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers = [threading.Thread(target=self._read, args=(name, stream), daemon=True)
                         for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr))]
        self._done = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="hora-spark-output", daemon=True)
        for thread in (*self._readers, self._sender):
            thread.start()

    def _read(self, name: str, stream: Any) -> None:
        for raw in iter(stream.readline, b""):
            with self._lock:
                self._lines[name].append(raw.decode(errors="replace").rstrip("\n"))
        stream.close()

    def _send_loop(self) -> None:
        while not self._done.wait(_FORWARD_S):
            self._send()

    def _send(self) -> None:
        with self._lock:
            chunk, self._lines = self._lines, {"stdout": [], "stderr": []}
        if chunk["stdout"] or chunk["stderr"]:
            n = self._store.add(OUTS_KEY.format(rank=self._rank), 0) + 1
            self._store.set(OUT_KEY.format(rank=self._rank, n=n), json.dumps(chunk))
            self._store.add(OUTS_KEY.format(rank=self._rank), 1)

    def close(self) -> None:
        """After the process ended: read to the end of both streams, send the rest."""
        for reader in self._readers:
            reader.join(timeout=10.0)
        self._done.set()
        self._sender.join()
        self._send()
