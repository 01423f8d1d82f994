"""Elastic hora jobs on Ray: ``RayExecutor(min_workers=...)`` and ``ElasticRayExecutor`` (Horovod 0.28.1's
``horovod.ray`` elastic forms).

The job runs under the elastic driver of ``hora run --min-np`` (:class:`~hora.launcher.elastic.driver.ElasticDriver`):
the same signed store, worlds, reset protocol, blacklist and limits. Two of its parts are Ray's here:

* the hosts (:class:`RayHosts`): Ray's live nodes, one host per node address, with as many slots as the nodes
  have CPUs (and GPUs) for ``cpus_per_worker`` (``gpus_per_worker``); read about once a second, so nodes that
  join or leave the cluster join or leave the job;
* the workers (:class:`~hora.ray.actors.RayActors`): one actor per worker process, pinned to a node of its
  host, its place in the job and the job's secret set in its environment through a Ray call (never a command
  line or a log), the user's function run in it. The end of that run call is the worker's end: its value, the
  exception it raised, or Ray's word that the actor died (``ray.kill``, its process killed, its node lost).
  Stopping a worker kills its actor.

A worker that dies is a failed worker as under ``hora run``: its peers' collectives fail, they go back to their
last commit (``hvd.elastic.run``) and the next world goes on without it. The job ends when the final world's
workers have returned; their values come back in rank order.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hora.errors import ConfigError, JobFailedError
from hora.launcher import output
from hora.launcher.config import ElasticConfig, RunConfig
from hora.launcher.elastic.driver import ElasticDriver, LostMember
from hora.launcher.elastic.hosts import DiscoveredHosts, HostDiscovery
from hora.launcher.elastic.workers import Worker
from hora.launcher.hosts import HostSpec
from hora.launcher.supervision.loop import Handle
from hora.protocol.jobsecret import ENV_SECRET
from hora.ray.actors import RayActor, RayActors
from hora.ray.worker import BaseHorovodWorker

log = logging.getLogger(__name__)

# A worker waits this much longer than the driver for its next world: the driver, which sees every worker, gives
# the verdict (a job below min_workers fails naming the worker that was lost, not a survivor that gave up). A
# driver that is gone takes its actors with it (Ray ends an owner's actors), so the workers' own deadline is
# only a backstop.
WORKER_TIMEOUT_MARGIN_S = 30.0


@dataclass(frozen=True, slots=True)
class _Node:
    node_id: str
    slots: int


class RayHosts:
    """The hosts of an elastic Ray job: Ray's live nodes by address (several Ray nodes on one machine are one
    host, as hora counts local ranks by machine), each with ``CPU // cpus_per_worker`` slots (and no more than
    ``GPU // gpus_per_worker`` with GPUs); a host's slots are its nodes' in node-id order."""

    def __init__(self, cpus_per_worker: float, gpus_per_worker: float) -> None:
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self._nodes: dict[str, list[_Node]] = {}
        self._lock = threading.Lock()

    def run(self) -> tuple[HostSpec, ...]:
        by_host: dict[str, list[_Node]] = {}
        for node in sorted(ray.nodes(), key=lambda n: str(n.get("NodeID", ""))):
            if not node.get("Alive", node.get("alive", False)):
                continue
            resources = node.get("Resources", {})
            slots = int(resources.get("CPU", 0) // self.cpus_per_worker) if self.cpus_per_worker else 0
            if self.gpus_per_worker:
                slots = min(slots, int(resources.get("GPU", 0) // self.gpus_per_worker))
            if slots > 0:
                address = str(node["NodeManagerAddress"])
                by_host.setdefault(address, []).append(_Node(str(node.get("NodeID", "")), slots))
        with self._lock:
            self._nodes = by_host
        return tuple(HostSpec(host, sum(n.slots for n in nodes)) for host, nodes in by_host.items())

    def node_of(self, host: str, slot: int) -> str | None:
        """The Ray node that holds ``slot`` of ``host`` now (None: the host has no such slot any more)."""
        with self._lock:
            nodes = list(self._nodes.get(host, []))
        for node in nodes:
            if slot < node.slots:
                return node.node_id
            slot -= node.slots
        return None

    def stop(self) -> None:
        return None  # each run is one call to Ray's GCS: nothing to stop

    def resource_of(self, host: str) -> str | None:
        """A Ray resource that places an actor on ``host`` (None: placed by node, :meth:`node_of`)."""
        return None


class RayHostDiscovery(HostDiscovery):
    """Ray's live nodes as hosts (Horovod's ``horovod.ray.elastic_v2.RayHostDiscovery``, and
    ``horovod.ray.elastic.RayHostDiscovery`` with the ``*_per_slot`` names): each node address with as many slots
    as its CPUs (and GPUs, with ``use_gpu``) hold workers."""

    def __init__(self, use_gpu: bool = False, cpus_per_worker: float = 1, gpus_per_worker: float = 1, *,
                 cpus_per_slot: float | None = None, gpus_per_slot: float | None = None) -> None:
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_slot if cpus_per_slot is not None else cpus_per_worker
        self.gpus_per_worker = gpus_per_slot if gpus_per_slot is not None else gpus_per_worker

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        hosts = RayHosts(self.cpus_per_worker, self.gpus_per_worker if self.use_gpu else 0)
        return {h.name: h.slots for h in hosts.run()}


class DiscoveryHosts(DiscoveredHosts):
    """The hosts of a :class:`HostDiscovery` given to the executor (``settings.discovery`` with
    ``override_discovery=False``): a worker on host ``h`` is placed with Ray's resource ``node:h`` (Ray gives
    every node ``node:<its address>``; a test cluster may declare others), as Horovod places them."""

    def node_of(self, host: str, slot: int) -> str | None:
        return None

    def resource_of(self, host: str) -> str | None:
        return f"node:{host}"


@dataclass(kw_only=True)
class ElasticParams:
    """An elastic Ray job's settings (Horovod's names)."""

    min_workers: int
    max_workers: int | None = None
    reset_limit: int | None = None
    cooldown_range: Sequence[float] | None = None
    elastic_timeout: float = 600
    cpus_per_worker: float = 1
    gpus_per_worker: float = 0
    timeout_s: float = 30
    nics: set[str] | None = None
    discovery: HostDiscovery | None = None  # settings.discovery with override_discovery=False: the hosts

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"hora.ray: min_workers={self.min_workers} must be at least 1")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"hora.ray: max_workers={self.max_workers} is less than min_workers={self.min_workers}")
        if self.cooldown_range is not None and len(self.cooldown_range) != 2:
            raise ValueError(f"hora.ray: cooldown_range={self.cooldown_range!r} must be (min seconds, max seconds)")


# The driver speaks `hora run`'s flags; a Ray job's user set the executor's parameters.
_PARAMETER_NAMES = (("--min-np", "min_workers"), ("--max-np", "max_workers"), ("--elastic-timeout", "elastic_timeout"),
                    ("--reset-limit", "reset_limit"), ("--start-timeout", "timeout_s"),
                    ("--blacklist-cooldown-range", "cooldown_range"), ("(-np)", "(min_workers)"))


def in_ray_terms(line: str) -> str:
    """A driver line with ``hora run``'s flags named as the executor's parameters.

    >>> in_ray_terms("fewer than 3 slots (--min-np) for --elastic-timeout 5s")
    'fewer than 3 slots (min_workers) for elastic_timeout 5s'
    """
    for flag, name in _PARAMETER_NAMES:
        line = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", name, line)
    return line


class RayElasticDriver(ElasticDriver):
    """The elastic driver with Ray's hosts and workers (see the module docstring).

    Args:
        cfg: the job (``cfg.elastic`` set; its command is unused: workers run ``fn`` in their actors).
        hosts: where the job's hosts come from.
        fn: what each worker runs: ``fn(executable)``.
        env: every worker's variables besides its place (the secret, ``extra_env_vars``...).
        executable: ``(cls, args, kwargs)`` each actor builds before it runs ``fn``.
    """

    def __init__(self, cfg: RunConfig, hosts: RayHosts | DiscoveryHosts, fn: Callable[[Any], Any],
                 env: Mapping[str, str], executable: tuple[type | None, list[Any] | None, dict[str, Any] | None],
                 cpus_per_worker: float, gpus_per_worker: float) -> None:
        super().__init__(cfg)
        self.discovery = hosts
        self.ray_hosts = hosts
        self.fn = fn
        self.env = dict(env)
        self.executable = executable
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker

    def store_address(self, hosts: list[HostSpec]) -> str:
        """The Ray driver's node address (every Ray node reaches it, as Ray requires), or the ``nics``' address:
        not chosen from the first hosts, which may be none yet (a head without CPUs, workers still joining)."""
        if self.cfg.network_interfaces:
            return super().store_address(hosts)
        return str(ray.util.get_node_ip_address())

    def launch(self, host: str, workers: list[tuple[int, int, dict[str, str]]]) -> Handle:
        actor_cls = ray.remote(BaseHorovodWorker)
        handle = RayActors(index=len(self.handles), host=host, ranks=[n for n, _, _ in workers])
        for number, slot, env in workers:
            node = self.ray_hosts.node_of(host, slot) or ""
            options: dict[str, Any] = {"num_cpus": self.cpus_per_worker, "num_gpus": self.gpus_per_worker,
                                       "max_restarts": 0}
            resource = self.ray_hosts.resource_of(host)
            if node:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
            elif resource is not None:
                options["resources"] = {resource: 0.01}
            actor: Any = actor_cls.options(**options).remote(world_rank=int(env["HORA_RANK"]),
                                                        world_size=int(env["HORA_SIZE"]))
            # one caller's calls to an actor run in order: its place, then the executable, then the function
            described = actor.describe.remote()
            actor.update_env_vars.remote({**env, **self.env})
            actor.start_executable.remote(*self.executable)
            handle.actors[number] = RayActor(number, actor, node, host, actor.execute.remote(self.fn), described)
        self.watch(handle)
        return handle

    def results(self) -> list[Any]:
        """The values of the final world's workers, in rank order."""
        if self.world is None:
            return []
        by_wid = {w.wid: w for w in self.workers.values() if self.member(w)}
        return [self._actor(by_wid[wid]).value for wid in self.world.worker_ids() if wid in by_wid]

    def _actor(self, w: Worker) -> RayActor:
        assert isinstance(w.agent, RayActors)
        return w.agent.actors[w.number]

    def failure_line(self) -> str:
        """The one line of a failed job: why it ended and, when members failed, the first that failed in the
        newest world that lost one (what a shortfall or a reset limit goes back to): its rank and its node."""
        summary = in_ray_terms(self.failure.summary) if self.failure is not None else "the job failed"
        culprit = self._culprit()
        if culprit is None:
            return f"hora.ray: {summary}"
        rank, w = culprit.rank, culprit.worker
        return (f"hora.ray: {summary}; lost: rank {rank} (worker {w.wid}) on {self._actor(w).where()}: "
                f"{w.state.how or 'failed'}")

    def _culprit(self) -> LostMember | None:
        """The first member lost in the newest world that lost one."""
        if not self.lost:
            return None
        newest = max(lost.gen for lost in self.lost)
        return next(lost for lost in self.lost if lost.gen == newest)

    def last_error(self) -> BaseException | None:
        """What the last failed worker's run call raised (the user's traceback, or Ray's word on the actor)."""
        culprit = self._culprit()
        w = culprit.worker if culprit is not None else self.failure.worker if self.failure is not None else None
        return self._actor(w).error if w is not None else None


class ElasticRayJob:
    """What an elastic executor holds between :meth:`start` and :meth:`shutdown`; each :meth:`run` is one job
    with its own secret, store and actors (Horovod's elastic workers, too, live for one run)."""

    def __init__(self, params: ElasticParams) -> None:
        self.params = params
        self._started = False
        self._executable: tuple[type | None, list[Any] | None, dict[str, Any] | None] = (None, None, None)
        self._extra_env: dict[str, str] = {}

    def start(self, executable_cls: type | None = None, executable_args: list[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None,
              extra_env_vars: Mapping[str, Any] | None = None) -> None:
        """Remember what each worker's actor builds and its extra variables; the actors start with each run."""
        if not ray.is_initialized():
            raise ConfigError("hora.ray: Ray is not initialised; call ray.init() (or ray.init(address=...)) "
                              "before start()")
        self._executable = (executable_cls, executable_args, executable_kwargs)
        self._extra_env = {k: str(v) for k, v in (extra_env_vars or {}).items()}
        self._started = True

    def run(self, fn: Callable[[Any], Any], callbacks: Sequence[Callable[[Any], None]] | None = None) -> list[Any]:
        """Run ``fn(executable)`` elastically until the final world's workers return; their values in rank order.
        Each of ``callbacks`` is called, on a thread of the driver, with every dict a worker sends with
        :func:`hora.ray.ray_logger.log` (Horovod's callbacks).

        Raises:
            KeyboardInterrupt: Ctrl-C (every actor stopped first).
            JobFailedError: the job could not go on (fewer than ``min_workers`` for ``elastic_timeout``, the
                reset limit, no worker left holding the state); its message names the last failed worker's
                rank and node, its cause is what that worker raised or Ray's error for its actor.
        """
        if not self._started:
            raise ConfigError("hora.ray: the elastic executor is not started (call start() first)")
        p = self.params
        ecfg = ElasticConfig(min_np=p.min_workers, max_np=p.max_workers, elastic_timeout=p.elastic_timeout,
                             reset_limit=p.reset_limit,
                             cooldown=(float(p.cooldown_range[0]), float(p.cooldown_range[1]))
                             if p.cooldown_range else None)
        nics = tuple(sorted(p.nics)) if p.nics else ()
        # the command is never run: the workers are Ray actors that run fn (RunConfig wants one for `hora run`)
        cfg = RunConfig(command=("hora.ray",), np=p.min_workers, hosts=(), start_timeout=p.timeout_s,
                        network_interfaces=nics, grace=0.0, elastic=ecfg)
        hosts: RayHosts | DiscoveryHosts = DiscoveryHosts(p.discovery) if p.discovery is not None \
            else RayHosts(p.cpus_per_worker, p.gpus_per_worker)
        relay = _CallbackRelay(callbacks) if callbacks else None
        if relay is not None:
            fn = relay.wrap(fn)
        env: dict[str, str] = {"PYTHONUNBUFFERED": "1", "HORA_START_TIMEOUT": f"{p.timeout_s:g}",
                               "HORA_ELASTIC_TIMEOUT": f"{p.elastic_timeout + WORKER_TIMEOUT_MARGIN_S:g}"}
        if nics:
            env.update(GLOO_SOCKET_IFNAME=nics[0], NCCL_SOCKET_IFNAME=",".join(nics))
        env.update(self._extra_env)
        driver = RayElasticDriver(cfg, hosts, fn, env, self._executable, p.cpus_per_worker, p.gpus_per_worker)
        # the job's secret: made by the driver for this job, to the actors in a Ray call only
        driver.env[ENV_SECRET] = driver.secret.hex()
        try:
            with output.speaking_as("hora.ray", in_ray_terms):
                status = driver.run()
        finally:
            if relay is not None:
                relay.close()
        if status == 0:
            return driver.results()
        if driver.interrupted == signal.SIGINT and driver.failure is None:
            raise KeyboardInterrupt  # Ctrl-C in the Ray driver: every actor was stopped, as under hora run
        line = driver.failure_line() if driver.failure is not None else f"hora.ray: the elastic job ended with " \
            f"exit status {status}"
        raise JobFailedError(line, status) from driver.last_error()  # the driver's lines said it on stderr

    def shutdown(self) -> None:
        self._started = False


class _CallbackRelay:
    """Horovod's callbacks: a Ray queue every worker's :mod:`hora.ray.ray_logger` puts dicts in, read by a thread
    of the driver that calls each callback with each dict, until the job ends (then the rest is read)."""

    def __init__(self, callbacks: Sequence[Callable[[Any], None]]) -> None:
        from ray.util.queue import Queue

        self.callbacks = list(callbacks)
        self.queue = Queue()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._relay, name="hora-ray-callbacks", daemon=True)
        self._thread.start()

    def wrap(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        queue = self.queue

        def with_logger(executable: Any) -> Any:
            from hora.ray import ray_logger

            ray_logger.configure(queue)
            return fn(executable)

        return with_logger

    def _relay(self) -> None:
        from ray.util.queue import Empty

        while True:
            try:
                items = self.queue.get_nowait_batch(self.queue.qsize())
            except Empty:
                items = []
            except Exception as e:  # noqa: BLE001 - the queue's actor is gone: the job is over
                log.debug("hora.ray: callbacks' queue gone: %s", e)
                return
            for item in items:
                for callback in self.callbacks:
                    try:
                        callback(item)
                    except Exception:  # noqa: BLE001 - a user's callback must not end the job
                        log.exception("hora.ray: a callback raised on %r", item)
            if not items:
                if self._done.is_set():
                    return
                self._done.wait(0.1)

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=10.0)
        try:
            ray.kill(self.queue.actor)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - already gone
            log.debug("hora.ray: callbacks' queue already gone: %s", e)
