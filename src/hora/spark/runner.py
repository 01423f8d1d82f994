"""``hora.spark.run``: Horovod 0.28.1's ``horovod.spark.run`` on hora, one Spark barrier task per rank.

The driver (this process, which holds the SparkContext) serves the job's store, puts the function in it and
starts a barrier stage of ``num_proc`` tasks, so every rank starts together or none does. Task ``i`` is rank
``i``: it starts the rank's process (:mod:`hora.spark.task`), which runs the function like ``hora.run``'s workers
and leaves its value in the store. The driver returns the values in rank order. The first rank that fails ends
the job at once: the driver cancels the stage (Spark stops every task, and each task its rank process) and
raises the error, naming the rank and its host.

Example:
    >>> from pyspark.sql import SparkSession
    >>> import hora.spark
    >>> spark = SparkSession.builder.getOrCreate()                      # doctest: +SKIP
    >>> def train(scale):
    ...     import hora as hvd
    ...     hvd.init()
    ...     return hvd.rank() * scale
    >>> hora.spark.run(train, args=(10,), num_proc=2)                   # doctest: +SKIP
    [0, 10]
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.common import env as hora_env
from hora.errors import ConfigError, JobFailedError, PlacementTimeoutError
from hora.launcher import envvars, output
from hora.launcher.config import RunConfig
from hora.launcher.fixed.driver import Driver
from hora.launcher.frameworks import rank_failed, require
from hora.launcher.hosts import SlotInfo
from hora.launcher.procs import describe_exit
from hora.launcher.pyfunc import shipping
from hora.launcher.pyfunc.run import collect_results
from hora.launcher.supervision.loop import Handle
from hora.protocol import messages as protocol
from hora.protocol.jobsecret import JobSecret
from hora.protocol.messages import PYRUN_ERRORS_KEY, PYRUN_FN_KEY, PYRUN_RESULT_KEY
from hora.protocol.signedstore import SignedStore
from hora.spark import task

log = logging.getLogger(__name__)

_POLL_S = 0.2  # how often the driver looks for a rank's end while the stage runs
_DEFAULT_START_TIMEOUT = 600.0  # Horovod's (HOROVOD_SPARK_START_TIMEOUT)
STAGE_END_S = 60.0  # after a cancel, how long Spark gets to end the stage's tasks before the driver goes on


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: float | None = None, use_mpi: bool | None = None,
        use_gloo: bool | None = None, extra_mpi_args: str | None = None, env: Mapping[str, str] | None = None,
        stdout: Any = None, stderr: Any = None, verbose: int = 1, nics: Sequence[str] | None = None,
        prefix_output_with_timestamp: bool = False, executable: str | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` ranks, one Spark barrier task each; return the values in rank
    order (Horovod 0.28.1's ``horovod.spark.run``, in its argument order).

    Args:
        fn: the function; it calls ``hvd.init()`` itself. It, its arguments and its value must be picklable
            (lambdas and closures are fine).
        num_proc: ranks (default ``spark.default.parallelism``); the cluster needs that many free task slots.
        start_timeout: seconds for every rank to start (default ``HOROVOD_SPARK_START_TIMEOUT``, else 600).
        env: extra variables for every rank (on top of the driver's environment).
        nics: network interfaces for Gloo/NCCL (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``).
        executable: the Python the ranks run (default: this one; it must exist on every executor).
        use_mpi, extra_mpi_args, ``use_gloo=False``: refused (hora has no MPI controller).
        stdout, stderr: streams the ranks' output lines are written to, each as ``[rank]<stdout>:line``
            (``[rank]<stderr>:line``), as Horovod does; without them the ranks' output goes to the executors'
            logs, as any Spark task's does (a failed rank's traceback comes back in the error either way).
        prefix_output_with_timestamp: each forwarded line starts with the time it reached the driver.
        verbose: accepted; hora logs through :mod:`logging`.

    Raises:
        The exception a rank raised (the first to fail), chained to its traceback; JobFailedError if a rank's
        process died without raising (a signal), or its task ended some other way; PlacementTimeoutError
        (a TimeoutError) if not every rank's task started within ``start_timeout`` (the cluster has fewer free
        task slots than ``num_proc``). Every task and rank process is stopped first.
    """
    pyspark = require("pyspark", "spark", "hora.spark")
    if use_mpi or extra_mpi_args is not None:
        raise ConfigError("hora.spark.run(use_mpi/extra_mpi_args): hora has no MPI controller (it runs on "
                          "torch.distributed with Gloo/NCCL); drop the argument")
    if use_gloo is False:
        raise ConfigError("hora.spark.run(use_gloo=False): Gloo is hora's only controller; drop the argument")
    sc = pyspark.SparkContext._active_spark_context
    if sc is None:
        raise ConfigError("hora.spark.run: no active SparkContext; create one first "
                          "(SparkSession.builder.getOrCreate()) and call hora.spark.run from that driver")
    num_proc = int(num_proc) if num_proc is not None else int(sc.defaultParallelism)
    if num_proc < 1:
        raise ConfigError(f"hora.spark.run(num_proc={num_proc}): give at least 1")
    timeout = float(start_timeout) if start_timeout is not None else _start_timeout()
    output = _Output(stdout, stderr, prefix_output_with_timestamp) if stdout is not None or stderr is not None \
        else None
    return _Job(sc, fn, tuple(args), dict(kwargs or {}), num_proc, timeout, env or {}, nics or (),
                executable or sys.executable, output).run()


def run_elastic(*args: Any, **kwargs: Any) -> list[Any]:
    """Horovod's elastic Spark run: not supported (see docs/frameworks.md); raises ConfigError."""
    raise ConfigError(
        "hora.spark.run_elastic is not supported: hora runs ranks in a Spark barrier stage, which starts its tasks "
        "together and fails them together, so a lost rank cannot be replaced while the others train; use "
        "hora.spark.run (a failed job can be run again from a checkpoint), or `hora run --min-np` for an elastic job")


def _start_timeout() -> float:
    raw = hora_env.launcher_environ().get("HOROVOD_SPARK_START_TIMEOUT", "")
    try:
        return float(raw) if raw else _DEFAULT_START_TIMEOUT
    except ValueError:
        raise ConfigError(f"HOROVOD_SPARK_START_TIMEOUT={raw!r} is not a number of seconds") from None


class _Job:
    """One ``hora.spark.run`` call: the store, the barrier stage in a thread, the watch for a rank's end."""

    def __init__(self, sc: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], num_proc: int,
                 start_timeout: float, env: Mapping[str, str], nics: Sequence[str], executable: str,
                 output: _Output | None = None) -> None:
        from hora.common import rendezvous

        self.sc, self.num_proc = sc, num_proc
        self.start_timeout, self.output = start_timeout, output
        self.job_id = f"spark-{uuid.uuid4().hex[:12]}"
        self.group = f"hora.spark.run.{self.job_id}"
        host = sc.getConf().get("spark.driver.host") or "127.0.0.1"
        secret = JobSecret.generate()
        raw = rendezvous.serve(host, 0, datetime.timedelta(seconds=start_timeout))  # on the driver's address only
        self.store = SignedStore(raw, secret, self.job_id, f"{host}:{raw.port}")  # every value authenticated
        self.store.set(PYRUN_FN_KEY, shipping.dumps((fn, args, kwargs)))
        extra = dict(env)
        if nics:
            extra.setdefault("GLOO_SOCKET_IFNAME", sorted(nics)[0])
            extra.setdefault("NCCL_SOCKET_IFNAME", ",".join(sorted(nics)))
        self.spec = task.TaskSpec(store_addr=host, store_port=int(raw.port), job_id=self.job_id,
                                  executable=executable, env=envvars.forwarded(hora_env.launcher_environ(), extra),
                                  secret_hex=secret.hex(), start_timeout=start_timeout,
                                  forward_output=output is not None)
        self.outcome: list[Any] = []  # the stage's records, or [exception] if the stage failed
        self.finished = threading.Event()

    def run(self) -> list[Any]:
        job = SparkRun(self)
        with output.speaking_as("hora.spark.run", str):
            status = job.run()
        self.store.set(task.STOP_KEY, "1")
        self.forward()
        if status != 0 and job.first_failure is None and job.interrupted == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C in the Spark driver: every task was stopped first
        return self._result(job.first_failure.slot.rank if job.first_failure is not None else None, status != 0)

    def run_stage(self) -> None:
        """The barrier stage, one task per rank (on a thread of the driver's: ``collect`` waits for every task)."""
        try:
            self.sc.setJobGroup(self.group, "hora.spark.run", interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self.num_proc), self.num_proc)
            self.outcome = rdd.barrier().mapPartitions(task.rank_task(self.spec)).collect()
        except Exception as e:  # noqa: BLE001 - reported by the driver's thread
            self.outcome = [e]
        finally:
            self.finished.set()

    def ends(self, told: set[int]) -> list[dict[str, Any]]:
        """The driver's messages about what the ranks' tasks wrote since: each rank's output to the console when it
        raised (its traceback), then its ``exit`` (from its exit record; a rank that raised counts as ended while
        its task still stops its process). ``told``: the ranks already reported, added to."""
        exits = {e["rank"]: e for e in self._exits()}
        errors = self._errors()
        messages: list[dict[str, Any]] = []
        for rank in sorted((set(exits) | set(errors)) - told):
            told.add(rank)
            record, error = exits.get(rank, {}), errors.get(rank)
            end: dict[str, Any] = {"t": protocol.EXIT, "r": rank, "code": record.get("code", 1),
                                   "sig": record.get("signal"), "ts": float(record.get("time") or time.time())}
            if error is not None:
                type_name, message, text = error
                end.update(raised=type_name, how=f"raised {type_name}: {message}")
                messages += [{"t": protocol.OUT, "r": rank, "s": "stderr", "l": line, "ts": end["ts"]}
                             for line in text.rstrip("\n").splitlines()]
            messages.append(end)
        return messages

    def started(self) -> int:
        """How many ranks' tasks have started."""
        return sum(1 for r in range(self.num_proc) if self.store.check([task.HOST_KEY.format(rank=r)]))

    def forward(self) -> None:
        """The ranks' new output lines, to the streams given to run()."""
        if self.output is not None:
            self.output.forward(self.store, self.num_proc)

    def _exits(self) -> list[dict[str, Any]]:
        keys = [task.EXIT_KEY.format(rank=r) for r in range(self.num_proc)]
        return [json.loads(self.store.get(k)) for k in keys if self.store.check([k])]

    def stop(self) -> None:
        self.store.set(task.STOP_KEY, "1")
        self.sc.cancelJobGroup(self.group)

    def _result(self, root: int | None, failed: bool) -> list[Any]:
        """The ranks' values, or the root cause's failure raised (``root``: the rank the driver named)."""
        hosts = self.hosts()
        exits = {e["rank"]: e for e in self._exits()}
        if root is not None and exits.get(root, {}).get("signal") is not None:  # killed: it raised nothing
            how = describe_exit(None, exits[root]["signal"])
            raise JobFailedError(rank_failed("hora.spark.run", root, f"host {hosts.get(root, '?')}", how), 1)
        values = collect_results(self.store, self.num_proc, lambda r: f"host {hosts.get(r, '?')}", root,
                                 complete=not failed and not self.stage_error())
        if values is not None:
            return values
        if root is not None:
            how = describe_exit(exits[root]["code"], None) if root in exits else "its task ended"
            raise JobFailedError(rank_failed("hora.spark.run", root, f"host {hosts.get(root, '?')}", how), 1)
        error = self.stage_error()
        raise JobFailedError(f"hora.spark.run: the Spark stage failed before every rank returned: "
                             f"{_first_line(error) if error else 'no value from every rank'}", 1) from error

    def hosts(self) -> dict[int, str]:
        """rank -> the host its task runs on, for the ranks whose task started."""
        return {r: self.store.get(k).decode() for r in range(self.num_proc)
                if self.store.check([k := task.HOST_KEY.format(rank=r)])}

    def _errors(self) -> dict[int, tuple[str, str, str]]:
        """rank -> (type name, message, traceback) of the exception it raised, for the ranks that raised."""
        errors = {}
        for rank in range(self.num_proc):
            key = PYRUN_RESULT_KEY.format(rank=rank)
            if self.store.check([key]):
                record = shipping.load(self.store, key)
                if record[0] == "error":
                    errors[rank] = (str(record[2]), str(record[3]), str(record[4]))
        return errors

    def stage_error(self) -> BaseException | None:
        """What the stage raised, when it failed as a whole (Spark's error, e.g. a cancelled job group)."""
        return self.outcome[0] if len(self.outcome) == 1 and isinstance(self.outcome[0], BaseException) else None


class SparkStage:
    """The run loop's handle on the barrier stage (a :class:`~hora.launcher.supervision.loop.Handle`, as an agent is
    under ``hora run``): one thread runs the stage, another reads what its tasks write in the store every fraction
    of a second and turns it into the loop's events: ``started`` once every rank's task has, each rank's end
    (:meth:`_Job.ends`), and ``eof`` once the stage has ended; the ranks' output goes to the streams given to
    ``run()``. Stopping any rank stops them all: Spark cancels a barrier stage's tasks together."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.index, self.host, self.remote = 0, "the Spark cluster", False
        self.ranks = list(range(job.num_proc))
        self.started = self.finished = False
        self._stage = threading.Thread(target=job.run_stage, name="hora-spark-stage", daemon=True)
        self.where: dict[int, str] = {}  # rank -> its task's host, once it started

    def watch(self, events: queue.SimpleQueue[tuple[str, int, Any]]) -> None:
        self._stage.start()
        threading.Thread(target=self._read, args=(events,), name="hora-spark-watch", daemon=True).start()

    def _read(self, events: queue.SimpleQueue[tuple[str, int, Any]]) -> None:
        told: set[int] = set()
        seen, started = -1, False
        while True:
            ended = self.job.finished.wait(_POLL_S)
            self.job.forward()
            if not started:
                self.where = self.job.hosts()
                if len(self.where) == self.job.num_proc:
                    started = True
                    events.put(("msg", self.index, {"t": protocol.STARTED, "hostname": self.host}))
            news = self.job.store.add(task.EXITS_KEY, 0) + self.job.store.add(PYRUN_ERRORS_KEY, 0)
            if news != seen or ended:
                seen = news
                for message in self.job.ends(told):
                    events.put(("msg", self.index, message))
            if ended:
                break
        events.put(("eof", self.index, 0))

    def send(self, message: dict[str, Any]) -> None:
        if message.get("t") == protocol.STOP:
            self.job.stop()

    def close(self) -> None:
        if not self.job.finished.is_set():
            self.job.stop()

    def running(self) -> bool:
        return self._stage.is_alive() or not self.job.finished.is_set()

    def wait(self, timeout: float) -> bool:
        return self.job.finished.wait(max(0.0, timeout))

    def kill(self) -> None:
        """Cancel the stage and give Spark a bounded time to end its tasks."""
        self.job.stop()
        self._stage.join(timeout=STAGE_END_S)

    def lost(self, code: int, who: str) -> str:
        error = self.job.stage_error()
        return f"lost: the Spark stage ended before {who} exited ({_first_line(error) if error else 'no error'})"


class SparkRun(Driver):
    """``hora.spark.run``'s job under the fixed driver of ``hora run`` (:class:`~hora.launcher.fixed.driver.Driver`):
    the stage is its one handle (:class:`SparkStage`); a rank that raises or dies is offered to the root cause,
    the stage is cancelled, the report names the rank and :attr:`first_failure` is the failure ``run`` raises.
    Every task must start within ``start_timeout`` (the cluster needs ``num_proc`` free task slots at once)."""

    def __init__(self, job: _Job) -> None:
        # the command is never run: the tasks start the ranks (RunConfig wants one for `hora run`)
        cfg = RunConfig(command=("hora.spark",), np=job.num_proc, hosts=(), start_timeout=job.start_timeout,
                        grace=0.0)
        # Spark places the tasks; a slot here only names a rank (where it runs is known once its task started)
        slots = [SlotInfo(rank=r, size=job.num_proc, local_rank=0, local_size=1, cross_rank=r, cross_size=job.num_proc,
                          hostname="?", host_index=r) for r in range(job.num_proc)]
        super().__init__(cfg, slots=slots)
        self.job = job
        self.stage = SparkStage(job)

    def set_up(self) -> None:
        return None  # the job's store already serves (it holds the function), no host to check: Spark placed them

    def start(self) -> None:
        self.watch(self.stage)
        self.start_deadline = time.monotonic() + self.cfg.start_timeout

    def over(self) -> bool:
        return super().over() and self.stage.finished  # the stage's own end too: its values are collected

    def where(self, rank: int) -> str:
        return f"host {self.stage.where.get(rank, '?')}"

    def on_message(self, handle: Handle, message: dict[str, Any]) -> None:
        if message["t"] == protocol.EXIT:  # where its task ran is known by now: the report names the host
            state = self.ranks[int(message["r"])]
            state.slot = dataclasses.replace(state.slot, hostname=self.stage.where.get(state.slot.rank, "?"))
        super().on_message(handle, message)

    def on_handle_gone(self, handle: Handle, code: int) -> None:
        """The stage ended before some ranks' ends were read: Spark failed it as a whole (a task that could not
        start its rank, a lost executor), not one rank; they count as stopped and ``run`` raises the stage's
        error."""
        for rank in handle.ranks:
            state = self.ranks[rank]
            if not state.done:
                state.done, state.code, state.stopped, state.exit_ts = True, 1, True, time.time()

    def start_timed_out(self) -> None:
        started = len(self.stage.where)
        self.job.stop()
        raise PlacementTimeoutError(
            f"Timed out waiting for Spark tasks to start: {started} of {self.job.num_proc} ranks' tasks "
            f"started within start_timeout={self.job.start_timeout:g} s. Every rank is a task of one "
            f"barrier stage, so the cluster needs {self.job.num_proc} free task slots at once: ask for "
            "fewer ranks (num_proc), add executors or cores, or raise start_timeout if executors "
            "are added on demand")


class _Output:
    """Where ``run(stdout=, stderr=)`` wants the ranks' output: each line as ``[rank]<stdout>:line``, in the
    order each rank's task sent them (chunks of a few lines, every fraction of a second)."""

    def __init__(self, stdout: Any, stderr: Any, with_time: bool) -> None:
        self.streams = {"stdout": stdout, "stderr": stderr}
        self.with_time = with_time
        self.read: dict[int, int] = {}  # rank -> chunks written out so far

    def forward(self, store: SignedStore, num_proc: int) -> None:
        for rank in range(num_proc):
            sent = store.add(task.OUTS_KEY.format(rank=rank), 0)
            while self.read.get(rank, 0) < sent:
                n = self.read.get(rank, 0) + 1
                chunk = json.loads(store.get(task.OUT_KEY.format(rank=rank, n=n)))
                for name, lines in chunk.items():
                    stream = self.streams.get(name)
                    if stream is None:
                        continue
                    stamp = time.asctime() if self.with_time else ""
                    stream.write("".join(f"{stamp}[{rank}]<{name}>:{line}\n" for line in lines))
                    stream.flush()
                self.read[rank] = n


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
