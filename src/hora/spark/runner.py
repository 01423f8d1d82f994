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

import datetime
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.common import env as hora_env
from hora.errors import ConfigError, JobFailedError, PlacementTimeoutError
from hora.launcher import envvars
from hora.launcher.frameworks import rank_failed, require
from hora.launcher.procs import describe_exit
from hora.launcher.pyfunc import shipping
from hora.launcher.pyfunc.run import collect_results
from hora.launcher.supervision import root_cause as rule
from hora.launcher.supervision.root_cause import RankState, RootCause
from hora.protocol.jobsecret import JobSecret
from hora.protocol.messages import PYRUN_ERRORS_KEY, PYRUN_FN_KEY, PYRUN_RESULT_KEY
from hora.protocol.signedstore import SignedStore
from hora.spark import task

log = logging.getLogger(__name__)

_POLL_S = 0.2  # how often the driver looks for a rank's end while the stage runs
_DEFAULT_START_TIMEOUT = 600.0  # Horovod's (HOROVOD_SPARK_START_TIMEOUT)


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
        stage = threading.Thread(target=self._stage, name="hora-spark-stage", daemon=True)
        stage.start()
        try:
            failed = self._watch()
        except BaseException:  # Ctrl-C in the driver, or the start timeout: stop every task first
            self._stop()
            stage.join(timeout=60.0)
            raise
        if failed:
            self._stop()
        stage.join()
        self.store.set(task.STOP_KEY, "1")
        self._forward()
        return self._result(failed)

    def _stage(self) -> None:
        try:
            self.sc.setJobGroup(self.group, "hora.spark.run", interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self.num_proc), self.num_proc)
            self.outcome = rdd.barrier().mapPartitions(task.rank_task(self.spec)).collect()
        except Exception as e:  # noqa: BLE001 - reported by the driver's thread
            self.outcome = [e]
        finally:
            self.finished.set()

    def _watch(self) -> bool:
        """Wait for the stage to end or a rank to fail (its process ended badly, or it raised and is still on
        its way out); True if one failed. Failures are weighed together for the window of
        :class:`~hora.launcher.supervision.root_cause.RootCause` before the job is stopped."""
        seen = 0
        window = RootCause()
        deadline: float | None = time.monotonic() + self.start_timeout
        while not self.finished.wait(_POLL_S):
            self._forward()
            if deadline is not None and time.monotonic() > deadline:
                started = self._started()
                if started < self.num_proc:
                    self._stop()
                    raise PlacementTimeoutError(
                        f"Timed out waiting for Spark tasks to start: {started} of {self.num_proc} ranks' tasks "
                        f"started within start_timeout={self.start_timeout:g} s. Every rank is a task of one "
                        f"barrier stage, so the cluster needs {self.num_proc} free task slots at once: ask for "
                        "fewer ranks (num_proc), add executors or cores, or raise start_timeout if executors "
                        "are added on demand")
                deadline = None
            news = self.store.add(task.EXITS_KEY, 0) + self.store.add(PYRUN_ERRORS_KEY, 0)
            if news != seen:
                seen = news
                offered = {c.slot.rank for c in window.candidates}
                for state in self._failures():
                    if state.slot.rank not in offered:
                        window.offer(state)
            if window.due(all_done=False, follows=self._follows(window.candidates)):
                return True
        return window.deadline is not None or bool(self._failures())

    def _failures(self) -> list[RankState]:
        """The ranks that failed so far: their exit records (``code``, ``signal``, ``time``) and what they raised
        (a rank may have raised without an exit record: its task was stopped while it shut down)."""
        return failures({e["rank"]: e for e in self._exits()}, self._error_types())

    @staticmethod
    def _follows(candidates: list[RankState]) -> set[int]:
        return rule.follow_ons({}, {c.slot.rank: c.raised for c in candidates if c.raised})

    def _started(self) -> int:
        """How many ranks' tasks have started."""
        return sum(1 for r in range(self.num_proc) if self.store.check([task.HOST_KEY.format(rank=r)]))

    def _forward(self) -> None:
        """The ranks' new output lines, to the streams given to run()."""
        if self.output is not None:
            self.output.forward(self.store, self.num_proc)

    def _exits(self) -> list[dict[str, Any]]:
        keys = [task.EXIT_KEY.format(rank=r) for r in range(self.num_proc)]
        return [json.loads(self.store.get(k)) for k in keys if self.store.check([k])]

    def _stop(self) -> None:
        self.store.set(task.STOP_KEY, "1")
        self.sc.cancelJobGroup(self.group)

    def _result(self, failed: bool) -> list[Any]:
        hosts = {r: self.store.get(k).decode() for r in range(self.num_proc)
                 if self.store.check([k := task.HOST_KEY.format(rank=r)])}
        exits = {e["rank"]: e for e in self._exits()}
        root = root_cause(exits, self._error_types()) if failed else None
        if root is not None and exits.get(root, {}).get("signal") is not None:  # killed: it raised nothing
            how = describe_exit(None, exits[root]["signal"])
            raise JobFailedError(rank_failed("hora.spark.run", root, f"host {hosts.get(root, '?')}", how), 1)
        values = collect_results(self.store, self.num_proc, lambda r: f"host {hosts.get(r, '?')}", root,
                                 complete=not failed and not self._stage_error())
        if values is not None:
            return values
        if root is not None:
            how = describe_exit(exits[root]["code"], None) if root in exits else "its task ended"
            raise JobFailedError(rank_failed("hora.spark.run", root, f"host {hosts.get(root, '?')}", how), 1)
        error = self._stage_error()
        raise JobFailedError(f"hora.spark.run: the Spark stage failed before every rank returned: "
                             f"{_first_line(error) if error else 'no value from every rank'}", 1) from error

    def _error_types(self) -> dict[int, str]:
        """rank -> the type name of the exception it raised, for the ranks that raised."""
        types = {}
        for rank in range(self.num_proc):
            key = PYRUN_RESULT_KEY.format(rank=rank)
            if self.store.check([key]):
                record = shipping.load(self.store, key)
                if record[0] == "error":
                    types[rank] = str(record[2])
        return types

    def _stage_error(self) -> BaseException | None:
        return self.outcome[0] if len(self.outcome) == 1 and isinstance(self.outcome[0], BaseException) else None


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


def failures(exits: Mapping[int, Mapping[str, Any]], raised: Mapping[int, str]) -> list[RankState]:
    """The failed ranks, from their exit records (rank -> ``code``, ``signal``, ``time``) and the type names of
    what they raised (rank -> name)."""
    failed = sorted({r for r, e in exits.items() if e.get("code") != 0} | set(raised))
    return [RankState.ended(rank, "", code=exits.get(rank, {}).get("code", 1), sig=exits.get(rank, {}).get("signal"),
                            exit_ts=float(exits.get(rank, {}).get("time", float("inf"))), raised=raised.get(rank))
            for rank in failed]


def root_cause(exits: Mapping[int, Mapping[str, Any]], raised: Mapping[int, str]) -> int | None:
    """The rank whose failure ended the job, by the one rule of :mod:`hora.launcher.supervision.root_cause`: a
    rank killed by a signal, then one that raised an error of its own (not a peer's follow-on ``CollectiveError``)
    before one that failed because of it; earliest first.

    ``exits``: rank -> its exit record (``code``, ``signal``, ``time``); ``raised``: rank -> the type name of what
    it raised (a rank may have raised without an exit record: its task was stopped while it shut down).

    >>> root_cause({0: {"code": 1, "signal": None, "time": 1.0}}, {0: "CollectiveError", 1: "ValueError"})
    1
    """
    window = RootCause()
    for state in failures(exits, raised):
        window.offer(state)
    if not window.candidates:
        return None
    return window.choose({}, rule.follow_ons({}, raised)).slot.rank


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
