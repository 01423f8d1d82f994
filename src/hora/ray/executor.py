"""``RayExecutor``: Horovod 0.28.1's ``horovod.ray.RayExecutor``, on Ray actors and a placement group.

The executor reserves the ranks' resources in one placement group, starts one actor per rank
(:class:`~hora.ray.worker.BaseHorovodWorker`), gives each its place in the job through its environment and runs
functions on all of them. A rank that raises or dies ends the job: every actor is stopped, the placement group
released, and the error names the rank and its node.

Example:
    >>> import ray, hora.ray
    >>> def train():
    ...     import hora as hvd
    ...     hvd.init()
    ...     return hvd.rank()
    >>> ray.init()                                                          # doctest: +SKIP
    >>> executor = hora.ray.RayExecutor(hora.ray.RayExecutor.create_settings(timeout_s=30), num_workers=2)
    >>> executor.start()                                                    # doctest: +SKIP
    >>> executor.run(train)                                                 # doctest: +SKIP
    [0, 1]
    >>> executor.shutdown()                                                 # doctest: +SKIP
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import ray
import ray.exceptions
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hora.errors import ConfigError, JobFailedError
from hora.launcher import output
from hora.launcher.config import RunConfig
from hora.launcher.elastic.hosts import HostDiscovery
from hora.launcher.fixed.driver import Driver
from hora.launcher.frameworks import rank_failed
from hora.launcher.hosts import SlotInfo
from hora.launcher.pyfunc.run import RemoteTraceback
from hora.protocol.jobsecret import ENV_SECRET, JobSecret
from hora.ray import placement
from hora.ray.actors import RayActor, RayActors
from hora.ray.elastic import ElasticParams, ElasticRayJob
from hora.ray.worker import BaseHorovodWorker

log = logging.getLogger(__name__)



@dataclass(kw_only=True)
class MiniSettings:
    """What ``RayExecutor.create_settings`` returns (Horovod's name). ``timeout_s``: seconds ``hvd.init()`` waits
    for every rank and :meth:`RayExecutor.start` for the actors; ``nics``: the network interfaces for Gloo/NCCL."""

    timeout_s: float = 30
    placement_group_timeout_s: float = 100
    nics: set[str] | None = None
    ssh_identity_file: str | None = None
    verbose: int = 1
    elastic: bool = False
    discovery: HostDiscovery | None = None  # an elastic job's hosts when override_discovery=False (Horovod's)


@dataclass(frozen=True, slots=True)
class _Rank:
    actor: Any
    node_id: str
    node_ip: str
    pid: int

    @property
    def where(self) -> str:
        return f"node {self.node_ip} (Ray node {self.node_id[:8]}, pid {self.pid})"


class RayExecutor:
    """Run hora functions on Ray: one actor per rank (Horovod 0.28.1's ``horovod.ray.RayExecutor``).

    Args:
        settings: from :meth:`create_settings`.
        num_workers: ranks, packed onto as few nodes as fit; or ``num_hosts`` nodes with
            ``num_workers_per_host`` ranks each (each host a different Ray node).
        cpus_per_worker, use_gpu, gpus_per_worker: what Ray reserves for each rank.
        use_current_placement_group: inside a placement group (a Ray Tune trial), run the ranks in it.
        min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout: Horovod's elastic form
            (instead of ``num_workers``): the job starts with every slot Ray's nodes have, up to ``max_workers``,
            and goes on while ``min_workers`` remain (:mod:`hora.ray.elastic`, docs/frameworks.md).
        override_discovery: an elastic job's hosts are Ray's live nodes (True, the default), or
            ``settings.discovery`` (a :class:`~hora.launcher.elastic.hosts.HostDiscovery`) when False, each worker
            placed with Ray's resource ``node:<host>`` as Horovod does.
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: str | None = None, ssh_str: str | None = None,
                        placement_group_timeout_s: float = 100, nics: set[str] | None = None) -> MiniSettings:
        """Settings for :class:`RayExecutor`. ``ssh_identity_file`` and ``ssh_str`` are accepted for Horovod's sake
        and unused: Ray reaches the nodes, hora needs no ssh (and writes no key file)."""
        return MiniSettings(timeout_s=timeout_s, placement_group_timeout_s=placement_group_timeout_s,
                            nics=set(nics) if nics else None, ssh_identity_file=ssh_identity_file)

    def __init__(self, settings: MiniSettings, num_workers: int | None = None, num_hosts: int | None = None,
                 num_workers_per_host: int = 1, cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float | None = None, use_current_placement_group: bool = True,
                 min_workers: int | None = None, max_workers: int | None = None, reset_limit: int | None = None,
                 cooldown_range: Sequence[int] | None = None, elastic_timeout: int = 600,
                 override_discovery: bool = True) -> None:
        if max_workers is not None and not min_workers:
            raise ValueError("hora.ray.RayExecutor: max_workers is given without min_workers; an elastic job needs "
                             "a positive min_workers")
        if min_workers is not None and (num_workers is not None or num_hosts is not None):
            raise ValueError("hora.ray.RayExecutor: Both `min_workers` and `num_workers` provided. Give min_workers "
                             "(an elastic job) or num_workers / num_hosts (a fixed job), not both")
        if min_workers is None and (reset_limit is not None or cooldown_range is not None):
            raise ValueError("hora.ray.RayExecutor: reset_limit and cooldown_range are for an elastic job: give "
                             "min_workers too")
        self._elastic: ElasticRayJob | None = None
        if min_workers is not None:
            if gpus_per_worker and not use_gpu:
                raise ValueError("hora.ray.RayExecutor: gpus_per_worker is set but use_gpu is False; set "
                                 "use_gpu=True")
            self._elastic = ElasticRayJob(ElasticParams(
                min_workers=min_workers, max_workers=max_workers, reset_limit=reset_limit,
                cooldown_range=cooldown_range, elastic_timeout=elastic_timeout, cpus_per_worker=cpus_per_worker,
                gpus_per_worker=(gpus_per_worker or 1) if use_gpu else 0, timeout_s=settings.timeout_s,
                nics=settings.nics, discovery=None if override_discovery else settings.discovery))
            settings.elastic = True
            num_workers = min_workers
        if gpus_per_worker and not use_gpu:
            raise ValueError("hora.ray.RayExecutor: gpus_per_worker is set but use_gpu is False; set use_gpu=True")
        if num_workers is not None and num_hosts is not None:
            raise ValueError("hora.ray.RayExecutor: give num_workers or num_hosts (with num_workers_per_host), "
                             "not both")
        if num_workers is None and num_hosts is None:
            raise ValueError("hora.ray.RayExecutor: give num_workers, or num_hosts and num_workers_per_host")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and value < 1:
                raise ValueError(f"hora.ray.RayExecutor: {name}={value} must be at least 1")
        self.settings = settings
        self.num_workers = num_workers if num_workers is not None else int(num_hosts or 0) * num_workers_per_host
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self._ranks: list[_Rank] = []
        self._reservation: placement.Reservation | None = None

    # -- starting -------------------------------------------------------------------------------------------------

    def start(self, executable_cls: type | None = None, executable_args: list[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None,
              extra_env_vars: Mapping[str, Any] | None = None) -> None:
        """Reserve the ranks, start one actor each, tell each its place and build ``executable_cls`` in each.

        Raises:
            PlacementTimeoutError: (a ConfigError and a TimeoutError) the cluster cannot place the ranks within
                ``placement_group_timeout_s``.
            JobFailedError: an actor did not start within ``timeout_s``.
        """
        if self._elastic is not None:
            self._elastic.start(executable_cls, executable_args, executable_kwargs, extra_env_vars)
            return
        if self._ranks:
            raise ConfigError("hora.ray.RayExecutor.start(): already started; call shutdown() first")
        self._reservation = placement.reserve(
            num_workers=None if self.num_hosts is not None else self.num_workers, num_hosts=self.num_hosts,
            num_workers_per_host=self.num_workers_per_host, cpus_per_worker=self.cpus_per_worker,
            gpus_per_worker=self.gpus_per_worker, use_current=self.use_current_placement_group,
            timeout_s=self.settings.placement_group_timeout_s)
        try:
            self._start_actors(executable_cls, executable_args, executable_kwargs, extra_env_vars or {})
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, executable_cls: type | None, executable_args: list[Any] | None,
                      executable_kwargs: dict[str, Any] | None, extra_env: Mapping[str, Any]) -> None:
        assert self._reservation is not None
        actor_cls = ray.remote(BaseHorovodWorker)
        actors: list[Any] = [
            actor_cls.options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._reservation.group, placement_group_bundle_index=bundle,
                    placement_group_capture_child_tasks=False),
            ).remote(world_rank=rank, world_size=self.num_workers)
            for rank, bundle in enumerate(self._reservation.bundles)
        ]
        described = self._get([a.describe.remote() for a in actors], "start the rank actors")
        self._ranks = [_Rank(actor, node, ip, pid) for actor, (node, ip, _host, pid) in zip(actors, described)]
        node_ids = [r.node_id for r in self._ranks]
        port = self._get([actors[0].free_port.remote()], "find a port for the job's store")[0]
        envs = placement.rank_environments(node_ids, [r.node_ip for r in self._ranks], self._ranks[0].node_ip, port)
        if self.use_gpu:
            gpus = self._get([a.get_gpu_ids.remote() for a in actors], "read the ranks' GPUs")
            for env, devices in zip(envs, placement.visible_devices(node_ids, gpus)):
                env["CUDA_VISIBLE_DEVICES"] = devices
        secret = JobSecret.generate()  # one per job; travels in Ray's own calls, never on a command line or in a log
        common: dict[str, Any] = {"HORA_START_TIMEOUT": str(self.settings.timeout_s), ENV_SECRET: secret.hex(),
                                  "PYTHONUNBUFFERED": "1"}
        if self.settings.nics:
            nic = sorted(self.settings.nics)[0]
            common.update(GLOO_SOCKET_IFNAME=nic, NCCL_SOCKET_IFNAME=",".join(sorted(self.settings.nics)))
        common.update(extra_env)
        self._get([a.update_env_vars.remote({**env, **common}) for a, env in zip(actors, envs)], "set up the ranks")
        self._get([a.start_executable.remote(executable_cls, executable_args, executable_kwargs) for a in actors],
                  "build the executable on every rank")

    def _get(self, refs: list[Any], doing: str) -> list[Any]:
        """``ray.get`` of a start-up step on every rank, within ``timeout_s``."""
        try:
            return list(ray.get(refs, timeout=self.settings.timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise JobFailedError(
                f"hora.ray: could not {doing} within {self.settings.timeout_s:.0f} s (timeout_s in "
                "create_settings()); check that the cluster has room for every rank", 1) from None

    # -- running --------------------------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
            callbacks: list[Callable[..., Any]] | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the values in rank order.

        ``callbacks``: in an elastic job (``min_workers``), each is called on the driver with every dict a worker
        sends with ``ray_logger.log`` (:mod:`hora.ray.ray_logger`); in a fixed job, as in Horovod's, nothing
        calls them.

        Raises:
            The exception a rank raised (the first), with its traceback as the cause, after every rank was
            stopped; :class:`~hora.errors.JobFailedError` if a rank's process died. Either way the executor is shut
            down: call :meth:`start` again for another job.
        """
        call_args, call_kwargs = tuple(args or ()), dict(kwargs or {})
        if self._elastic is not None:
            return self._elastic.run(lambda _executable: fn(*call_args, **call_kwargs), callbacks)
        return self._supervise(lambda _executable: fn(*call_args, **call_kwargs))

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable[..., Any]] | None = None) -> list[Any]:
        """Run ``fn(executable)`` on every rank (the object ``start(executable_cls)`` built); values in rank order."""
        if self._elastic is not None:
            return self._elastic.run(fn, callbacks)
        return self._supervise(fn)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(executable)`` on rank 0 only and return its value (not in an elastic job, as in Horovod)."""
        self._fixed_only("execute_single")
        return self._supervise(fn, ranks=self._started()[:1])[0]

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every rank and return their ObjectRefs at once (``ray.get`` them). The
        executor does not watch these: a rank that fails shows in its ref, and the others may wait for it."""
        self._fixed_only("run_remote")
        call_args, call_kwargs = tuple(args or ()), dict(kwargs or {})
        return self._submit(lambda _executable: fn(*call_args, **call_kwargs))

    def _fixed_only(self, method: str) -> None:
        if self._elastic is not None:
            raise ConfigError(f"hora.ray.RayExecutor.{method}(): not in an elastic job (min_workers), whose "
                              "workers come and go; use run() or execute()")

    def _started(self) -> list[_Rank]:
        if not self._ranks:
            raise ConfigError("hora.ray.RayExecutor: not started (call start() first, or again after a failure)")
        return self._ranks

    def _submit(self, fn: Callable[[Any], Any]) -> list[Any]:
        return [r.actor.execute.remote(fn) for r in self._started()]

    def _supervise(self, call: Callable[[Any], Any], ranks: list[_Rank] | None = None) -> list[Any]:
        """Run ``call(executable)`` on every rank (or ``ranks``) under the fixed driver's loop (:class:`RayRun`);
        their values in rank order. When ranks fail, every rank is stopped and the root cause's error is raised
        (the one rule of :mod:`hora.launcher.supervision.root_cause`), naming the rank."""
        job = RayRun(ranks if ranks is not None else self._started(), call, self.settings.timeout_s)
        with output.speaking_as("hora.ray", str):
            status = job.run()
        if status == 0:
            return job.values()
        failed = job.first_failure
        error = job.handle.actors[failed.slot.rank].error if failed is not None else None
        if error is None:
            self.shutdown()
            if job.interrupted == signal.SIGINT:
                raise KeyboardInterrupt  # Ctrl-C in the Ray driver: every rank was stopped, as under hora run
            raise JobFailedError(f"hora.ray: the job ended with exit status {status}: {job.summary or 'stopped'}",
                                 status)
        assert failed is not None and isinstance(error, Exception)
        self._fail(failed.slot.rank, error)

    def _fail(self, rank: int, error: Exception) -> NoReturn:
        """Stop every rank and raise ``rank``'s failure: what it raised (its traceback as the cause), or a
        JobFailedError when its process died."""
        where = self._ranks[rank].where
        self.shutdown()
        if isinstance(error, ray.exceptions.RayTaskError):
            cause = error.cause if isinstance(error.cause, BaseException) else error
            headline = rank_failed("hora.ray", rank, where, f"raised {type(cause).__name__}: {cause}")
            log.error("%s", headline.splitlines()[0])
            if hasattr(cause, "add_note"):
                cause.add_note(headline.splitlines()[0])
            raise cause from RemoteTraceback(f"rank {rank} on {where} raised:\n{error}")
        headline = rank_failed("hora.ray", rank, where, "its process died (killed, out of memory, or its node was "
                               "lost)")
        log.error("%s", headline)
        raise JobFailedError(headline, 1) from error

    # -- stopping -------------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every rank's actor (their processes end) and release the placement group the executor made."""
        if self._elastic is not None:
            self._elastic.shutdown()  # an elastic run stops its actors when it ends
        ranks, self._ranks = self._ranks, []
        for r in ranks:
            try:
                ray.kill(r.actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone
                log.debug("hora.ray: rank actor already gone: %s", e)
        reservation, self._reservation = self._reservation, None
        if reservation is not None and reservation.owned:
            ray.util.remove_placement_group(reservation.group)


class RayRun(Driver):
    """One call on the ranks of a fixed ``RayExecutor`` job (``run``, ``execute``, ``execute_single``), supervised by
    the fixed driver of ``hora run`` (:class:`~hora.launcher.fixed.driver.Driver`): the ranks' actors are its one
    handle (:class:`~hora.ray.actors.RayActors`, kept for the executor's next call); a rank that raises or dies is
    offered to the root cause, every rank is stopped, the report names the rank and :attr:`first_failure` is the
    failure the executor raises. Ctrl-C stops every rank, as under ``hora run``.

    Args:
        ranks: the ranks' actors, in rank order.
        call: what each runs: ``call(executable)``.
        timeout_s: the executor's ``timeout_s`` (the job's start timeout).
    """

    def __init__(self, ranks: Sequence[_Rank], call: Callable[[Any], Any], timeout_s: float) -> None:
        size = len(ranks)
        # the command is never run: the ranks are Ray actors that run call (RunConfig wants one for `hora run`)
        cfg = RunConfig(command=("hora.ray",), np=size, hosts=(), start_timeout=timeout_s, grace=0.0)
        # Ray placed the ranks; a slot here only names a rank and its node (placement.py set their variables)
        slots = [SlotInfo(rank=i, size=size, local_rank=0, local_size=1, cross_rank=i, cross_size=size,
                          hostname=r.node_ip, host_index=i) for i, r in enumerate(ranks)]
        super().__init__(cfg, slots=slots)
        self.ray_ranks = list(ranks)
        self.call = call
        self.handle = RayActors(index=0, host="the Ray cluster", ranks=list(range(size)), keep=True)

    def set_up(self) -> None:
        return None  # no store to serve (rank 0's actor hosts the ranks' own), no host to check: Ray placed them

    def start(self) -> None:
        for number, r in enumerate(self.ray_ranks):
            run = r.actor.execute.remote(self.call)
            self.handle.actors[number] = RayActor(number, r.actor, r.node_id, r.node_ip, run)
        self.watch(self.handle)

    def where(self, rank: int) -> str:
        return self.ray_ranks[rank].where

    def values(self) -> list[Any]:
        """What each rank's call returned, in rank order."""
        return [self.handle.actors[number].value for number in range(len(self.ray_ranks))]


@dataclass(kw_only=True)
class ElasticSettings(MiniSettings):
    """What ``ElasticRayExecutor.create_settings`` returns."""

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600
    elastic: bool = True


def _nic_set(nics: str | Iterable[str] | None) -> set[str] | None:
    """``nics`` as a set: Horovod takes ``"eth0,eth1"`` or ``{"eth0"}``."""
    names = nics.split(",") if isinstance(nics, str) else list(nics or ())
    return {n for n in names if n} or None


class ElasticRayExecutor:
    """Horovod 0.28.1's older elastic Ray API (``horovod.ray.ElasticRayExecutor``), on the same elastic driver as
    ``RayExecutor(min_workers=...)`` (:mod:`hora.ray.elastic`): ``worker_fn()`` runs in one actor per slot of
    Ray's nodes (``cpus_per_slot`` CPUs each), up to ``max_num_proc``, and goes on while ``min_num_proc``
    remain."""

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: int | None = None, reset_limit: int | None = None,
                        elastic_timeout: int = 600, timeout_s: int = 30, ssh_identity_file: str | None = None,
                        nics: str | Iterable[str] | None = None, min_np: int | None = None,
                        max_np: int | None = None,
                        **kwargs: Any) -> ElasticSettings:
        """Settings for :class:`ElasticRayExecutor`; ``min_np``/``max_np`` are the deprecated names of
        ``min_num_proc``/``max_num_proc``. ``ssh_identity_file`` and other keywords are accepted and unused."""
        return ElasticSettings(min_num_proc=min_np if min_np is not None else min_num_proc,
                               max_num_proc=max_np if max_np is not None else max_num_proc,
                               reset_limit=reset_limit, elastic_timeout=elastic_timeout, timeout_s=timeout_s,
                               nics=_nic_set(nics),
                               ssh_identity_file=ssh_identity_file)

    def __init__(self, settings: ElasticSettings, use_gpu: bool = False, cpus_per_slot: int = 1,
                 gpus_per_slot: int | None = None, env_vars: dict[str, Any] | None = None,
                 override_discovery: bool = True) -> None:
        if gpus_per_slot and not use_gpu:
            raise ValueError("hora.ray.ElasticRayExecutor: gpus_per_slot is set but use_gpu is False; set "
                             "use_gpu=True")
        self.settings = settings
        self.env_vars = dict(env_vars or {})
        self._job = ElasticRayJob(ElasticParams(
            min_workers=settings.min_num_proc, max_workers=settings.max_num_proc, reset_limit=settings.reset_limit,
            elastic_timeout=settings.elastic_timeout, cpus_per_worker=cpus_per_slot,
            gpus_per_worker=(gpus_per_slot or 1) if use_gpu else 0, timeout_s=settings.timeout_s,
            nics=settings.nics, discovery=None if override_discovery else settings.discovery))

    def start(self) -> None:
        """Get ready to run (the actors start with each :meth:`run`)."""
        self._job.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn: Callable[[], Any], callbacks: list[Callable[..., Any]] | None = None) -> list[Any]:
        """Run ``worker_fn()`` elastically; the final world's values in rank order. Each of ``callbacks`` gets every
        dict a worker sends with ``ray_logger.log``."""
        return self._job.run(lambda _executable: worker_fn(), callbacks)

    def shutdown(self) -> None:
        self._job.shutdown()
