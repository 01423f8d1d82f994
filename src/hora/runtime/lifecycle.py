"""Lifecycle and topology: ``init()``, ``shutdown()``, ``rank()``, ``size()`` and friends.

``init()`` reads :class:`hora.common.env.WorkerEnv`, joins the rendezvous store, makes torch.distributed's default
process group (Gloo for CPU tensors, NCCL for CUDA tensors where present), binds the CUDA device to the
local rank, builds hora's own groups (a Gloo control group for negotiation and one data group per process
set) and starts the negotiator thread. Because hora's group is the default group, DDP and plain
``torch.distributed`` calls work in the same script; because hora's collectives run on their own groups, they
never interleave with the user's.

Example:
    >>> import hora as hvd
    >>> hvd.init()
    >>> hvd.rank(), hvd.size()
    (0, 1)
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hora.common import env as hora_env
from hora.common import rendezvous
from hora.common.env import WorkerEnv
from hora.common.knobs import Knobs, ignored_horovod_variables
from hora.common.process_sets import ProcessSet, ProcessSetTable, global_process_set
from hora.datapath import hierarchical
from hora.datapath.kinds import adasum
from hora.datapath.wire import WireBuffers
from hora.diagnostics import timeline, user_errors
from hora.diagnostics.board import Board
from hora.engine.context import EngineContext
from hora.engine.scheduling.negotiator import Negotiator
from hora.errors import CollectiveError, ConfigError, NotInitializedError, WorldMemberLostError
from hora.protocol.jobsecret import ENV_SECRET_FILE, JobSecret
from hora.protocol.signedstore import SignedStore
from hora.protocol.topology import Topology, derive_topology
from hora.runtime import elastic_rendezvous as world
from hora.runtime.arrivals import Arrivals

log = logging.getLogger(__name__)

_lock = threading.RLock()
_state: Runtime | None = None
_generation = 0


@dataclass(eq=False)
class Runtime:
    """Everything ``init()`` builds; one per initialised process."""

    env: WorkerEnv
    knobs: Knobs
    store: SignedStore  # hora's keys of this init generation (every value authenticated)
    job_store: SignedStore  # the job's keys (the board, the elastic worlds), unprefixed
    topo: Topology
    backend: str
    owns_default_group: bool
    ctrl_group: Any
    device: torch.device | None
    process_sets: ProcessSetTable
    negotiator: Negotiator = field(init=False, repr=False)  # set by init() once the process sets exist
    connect_store: Callable[[], dist.Store] | None = None  # a fresh client connection (the negotiator's bell)
    world: str = ""  # the store prefix of this world (job id and generation): names it in control handshakes
    alone: bool = False  # a new elastic worker before it joins the job's world (hora.runtime.elastic_rendezvous.alone)
    hierarchy: hierarchical.Hierarchy | None = None  # hierarchical allreduce's groups, when built (the engine's)
    wire_buffers: WireBuffers = field(default_factory=WireBuffers)  # reused 16-bit wires of this world's ops
    joining: Topology | None = None  # alone: its place in the world it joins, what rank(), size()... show


def state(what: str = "this call") -> Runtime:
    """The live runtime, or a clear error naming ``what`` needed it."""
    s = _state
    if s is None:
        raise NotInitializedError(what)
    return s


def hierarchy() -> hierarchical.Hierarchy | None:
    """The hierarchical allreduce this process's runtime built (None: not initialised, knob off, or a layout
    that gains nothing); benchmarks and tests switch it (``hierarchical.flat(hierarchy())``)."""
    s = _state
    return s.hierarchy if s is not None else None


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Start hora in this process. Calling it again while initialised does nothing.

    Args:
        comm: Horovod's MPI communicator argument; only None (all ranks) is supported.
        process_sets: ProcessSet objects to register now (every rank must pass the same list), or
            ``"dynamic"`` (accepted for Horovod compatibility: hora always allows ``add_process_set()``).

    Raises:
        ValueError: a process set names ranks the job does not have. A failed ``init()`` leaves nothing
            behind: ``is_initialized()`` stays False and ``init()`` may be called again.
    """
    if comm is not None:
        raise ConfigError("hvd.init(comm=...) selects an MPI communicator; hora has no MPI: use process sets")
    _init(process_sets, join=False)


def _init(process_sets: Sequence[ProcessSet] | str | None, join: bool) -> None:
    """``init()``; ``join``: an elastic worker joins the launcher's next world even if it never was in one
    (``hvd.elastic.run`` leaving the world a new worker built in alone)."""
    global _state, _generation
    with _lock:
        if _state is not None:
            return
        env = WorkerEnv.from_environ()
        knobs = Knobs.from_environ()
        logging.getLogger("hora").setLevel(knobs.log_level.upper())
        # an error init() raises shows the user's frames, not hora's, like any later hora error
        user_errors.install(knobs.full_tracebacks, under_launcher=bool(env.job_id), with_time=not knobs.log_hide_time)
        secret = job_secret(env, knobs)  # a malformed one (or none, HORA_REQUIRE_SECRET=1) fails here
        alone, planned = False, None
        if env.elastic:  # the launcher's newest world decides rank and size; its number names the store prefix
            store = rendezvous.job_store(env, datetime.timedelta(seconds=knobs.start_timeout), secret)
            running = world.newest(store, env.job_id) if _generation == 0 and not join else 0
            if running:  # a new worker of a running job: build alone, join at its first collective or run
                log.info("hora elastic: worker %s starts while the job runs world %d: rank %d of %d in the world it "
                         "joins at its first collective or hvd.elastic.run call", env.worker_id, running, env.rank,
                         env.size)
                planned, env, alone, generation = world.planned(env), world.alone(env), True, 0
            else:
                env, elastic_world = world.join(store, env, _generation, knobs.elastic_timeout)
                generation = elastic_world.gen
        else:
            generation = _generation + 1
        # Horovod's process_sets="dynamic" enables add/remove_process_set(); hora always allows them
        sets: list[Any] = [] if process_sets == "dynamic" else list(process_sets or ())
        if alone and sets:  # their ranks are not there yet; like every set, they are gone after the join
            log.warning("hora elastic: worker %s starts alone: the %d process set(s) given to hvd.init() are not "
                        "registered (register them in a reset callback)", env.worker_id, len(sets))
            sets = []
        ProcessSetTable.check(sets, env.size)
        _generation = generation
        rt = (_build_elastic(env, knobs, sets, secret) if env.elastic
              else _build(env, knobs, _generation, secret, alone=alone))
        rt.joining = planned if alone else None
        env = rt.env
        try:  # a failed init leaves nothing behind: is_initialized() stays False and init() can be retried
            for ps in sets:
                rt.process_sets.register(ps)
            rt.negotiator = Negotiator(_engine_context(rt, secret))
            rt.negotiator.start()
            timeline.set_world((rt.topo.rank, rt.topo.size), env.job_id)
            if knobs.timeline and not alone:  # alone, it would write the job's file as "rank 0 of 1"
                timeline.start_timeline(knobs.timeline, mark_cycles=knobs.timeline_mark_cycles)
        except BaseException:
            _discard(rt)
            raise
        _state = rt
        warn_unauthenticated(env, secret)
        _note_ignored_horovod_variables(rt.topo.rank)
        log.info("hora initialised: rank %d of %d on %s (%s)", env.rank, env.size, env.hostname, rt.backend)


_noted_ignored = False


def _note_ignored_horovod_variables(rank: int) -> None:
    """Rank 0 says once per process which Horovod variables it was given that hora has no mechanism for."""
    global _noted_ignored
    if rank == 0 and not _noted_ignored:
        _noted_ignored = True
        for line in ignored_horovod_variables():
            log.warning("%s; it has no effect", line)


def _build_elastic(env: WorkerEnv, knobs: Knobs, sets: list[Any], secret: JobSecret | None) -> Runtime:
    """Build the launcher's world that ``env`` joined. A member of it that ends before the world's process
    groups stand (the launcher posts it on the world's board) makes the others post ready again and join the
    world after it, here, at once (not after --start-timeout)."""
    global _generation
    while True:
        try:
            return _build(env, knobs, _generation, secret)
        except WorldMemberLostError as e:
            log.warning("hora elastic: %s; joining the next world", e)
        store = rendezvous.job_store(env, datetime.timedelta(seconds=knobs.start_timeout), secret)
        env, elastic_world = world.join(store, env, _generation, knobs.elastic_timeout)
        ProcessSetTable.check(sets, env.size)
        _generation = elastic_world.gen


def _engine_context(rt: Runtime, secret: JobSecret | None) -> EngineContext:
    """What the negotiation engine gets from this runtime (it never sees the Runtime itself)."""
    board = Board(rt.job_store, rt.env.board_id, rt.topo.rank)
    return EngineContext(rank=rt.topo.rank, size=rt.topo.size, hostnames=rt.topo.hostnames, knobs=rt.knobs,
                         store=rt.store, store_addr=rt.env.store_addr, board=board, process_sets=rt.process_sets,
                         device=rt.device, ctrl_group=rt.ctrl_group, connect_store=rt.connect_store,
                         secret=secret, world=rt.world,
                         abort_data_plane=(lambda: abort_nccl(_data_groups(rt))) if rt.device is not None else None,
                         hierarchy=rt.hierarchy)


def _data_groups(rt: Runtime) -> list[Any]:
    """The groups hora's collectives run on: every process set's and the hierarchy's."""
    hierarchy = rt.hierarchy
    extra = [hierarchy.local_group, hierarchy.cross_group] if hierarchy is not None else []
    return [g for g in [*(ps.group for ps in rt.process_sets.values()), *extra] if g is not None]


def _discard(rt: Runtime) -> None:
    """Undo a partly built runtime (``init()`` failed after ``_build``)."""
    try:
        negotiator = getattr(rt, "negotiator", None)
        if negotiator is not None:
            negotiator.stop(timeout=0.0)
    finally:
        _teardown_groups(rt)


def _build(env: WorkerEnv, knobs: Knobs, generation: int, secret: JobSecret | None, alone: bool = False) -> Runtime:
    timeout = datetime.timedelta(seconds=knobs.start_timeout)  # reaching the store and the peers at init()
    device = bind_device(env)
    owns = not dist.is_initialized()
    backend = groups_backend(None if owns else dist.get_backend_config(), device is not None)
    board: Board | None = None
    if owns:
        job_store = rendezvous.job_store(env, timeout, secret)
        raw = job_store.raw
        prefix = f"hora/{env.job_id}/g{generation}"
        base = dist.PrefixStore(prefix, raw)  # torch's keys (its rendezvous, Gloo's and NCCL's): torch's own
        connect = rendezvous.connector(raw, prefix, timeout)
        hook = sys.excepthook
        board = Board(job_store, env.board_id, env.rank)
        if env.size > 1:  # every rank waits for the others here, where a late one is named (Gloo connects lazily)
            arrivals = Arrivals(job_store.under(prefix), env.rank, env.size)
            arrivals.arrive()
            late, ended = arrivals.wait(knobs.start_timeout,
                                        (lambda: board.ended(range(env.size))) if env.elastic else None)
            if ended:
                raise member_lost(env, generation, ended)
            if late:
                raise late_error(board, env, knobs, late)
        try:
            with hora_env.torch_groups_of_hora(knobs.gloo_lazy_connect, knobs.gloo_iface):
                # device_id: the NCCL communicator is made here, at once, and every group hora makes next is
                # split from it (torch/distributed/distributed_c10d.py:2040-2057, 2333-2335) rather than made
                # lazily by its first collective, in the middle of a negotiation round
                dist.init_process_group(backend, store=dist.PrefixStore("default", base), rank=env.rank,
                                        world_size=env.size, timeout=collective_timeout(knobs),
                                        device_id=device if "nccl" in backend else None)
        except Exception as e:
            ended = board.ended(range(env.size)) if env.elastic else {}
            if ended:
                raise member_lost(env, generation, ended) from e
            raise
        if env.source == "hora" or alone:  # hora run tags each line "[1]<stderr>:"; torch would add "[rank1]: "
            sys.excepthook = hook
    else:  # the script made the default group itself (e.g. under torchrun): join it
        if dist.get_world_size() != env.size and env.source != "single":
            log.warning("default group has %d ranks but %s says %d", dist.get_world_size(), env.source, env.size)
        env = WorkerEnv(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=env.local_rank,
                        local_size=env.local_size, hostname=env.hostname, host_key=env.host_key,
                        source=env.source, job_id=env.job_id)
        prefix = f"hora/g{generation}"
        job_store = SignedStore(rendezvous.default_store(), secret, env.job_id, f"{env.store_addr}:{env.store_port}")
        connect = rendezvous.connector(job_store.raw, prefix, timeout)
    sets = ProcessSetTable(env.size, env.rank, backend, lazy_connect=knobs.gloo_lazy_connect,
                           gloo_iface=knobs.gloo_iface, timeout=collective_timeout(knobs))
    try:
        with hora_env.torch_groups_of_hora(knobs.gloo_lazy_connect, knobs.gloo_iface):
            ctrl = dist.new_group(backend="gloo", timeout=control_timeout(knobs))
        topo = topology(env, ctrl)
        adasum.set_hosts(topo.hosts)
        sets.add_global(sets.new_group())
        tunes_it = knobs.autotune and "hierarchical_allreduce" not in knobs.explicit
        built = None
        if (knobs.hierarchical_allreduce or tunes_it) and env.size > 1:
            built = hierarchical.build(topo.hosts, env.rank, global_process_set.group, backend, sets.new_group)
            if built is not None:  # autotune starts it off, as Horovod's parameter manager does
                built.enabled = knobs.hierarchical_allreduce
    except BaseException as e:  # leave nothing half-built behind (init() may be retried)
        sets.unbind_all()
        if owns and dist.is_initialized():
            abort_groups()  # a peer may be gone: a flushing destroy_process_group() would wait for it
        ended = board.ended(range(env.size)) if board is not None and env.elastic and isinstance(e, Exception) \
            else {}
        if ended:  # a member died while the groups were built: its peers' connections to it failed
            raise member_lost(env, generation, ended) from e
        raise
    return Runtime(env=env, knobs=knobs, store=job_store.under(prefix), job_store=job_store, topo=topo,
                   backend=backend, owns_default_group=owns, ctrl_group=ctrl, device=device, process_sets=sets,
                   connect_store=connect, alone=alone, world=prefix, hierarchy=built)


def shutdown() -> None:
    """Stop hora in this process: drain the negotiator and destroy hora's process groups.

    Every rank should call it (it is a collective with a deadline: a rank waits up to 30 s for the others,
    then leaves anyway). ``init()`` may be called again afterwards.
    """
    _shutdown(peer_wait_s=30.0)


def reset(peer_wait_s: float = 10.0, failed: bool = True) -> None:
    """Elastic reset: leave this world (a collective shutdown, waiting at most ``peer_wait_s`` for the peers;
    none when a peer failed) and ``init()`` in the launcher's next one: a new store prefix, new process groups
    (the default group too), a new control mesh and negotiator. A new worker that built alone
    (:func:`is_alone`) joins the job's world here.

    Args:
        peer_wait_s: the longest wait for the peers' shutdown.
        failed: a collective failed in the old world: free its errors' reference cycles now, collecting the
            young generations only (a full pass is the slowest part of a recovery; the engine closes its
            sockets itself). False for a planned reset (a host change, a new worker's join): no failed op.
    """
    began = time.monotonic()
    _shutdown(peer_wait_s=peer_wait_s, collect=1 if failed else None, failed=failed)
    left = time.monotonic()
    _init(None, join=True)
    log.info("hora elastic: in world %d after %.3f s (leaving the last world %.3f s, joining %.3f s)",
             _generation, time.monotonic() - began, left - began, time.monotonic() - left)


def is_alone() -> bool:
    """True while this process is a new worker of a running elastic job that has not joined the job's world
    yet: ``hvd.init()`` gave it a world of its own to build in (see :mod:`hora.runtime.newcomer`)."""
    s = _state
    return s is not None and s.alone


def world_generation() -> int:
    """The number of the last world this process was initialised in (elastic jobs: the launcher's world)."""
    return _generation


def _shutdown_at_exit() -> None:
    # After an uncaught exception, leave at once: the peers learn of it when this process's connections
    # close, and the launcher reports this rank's traceback as the root cause.
    crashed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    _shutdown(peer_wait_s=0.0 if crashed is not None else 10.0, failed=crashed is not None)


def _shutdown(peer_wait_s: float, collect: int | None = 2, failed: bool = False) -> None:
    """Leave the world; then ``gc.collect(collect)`` (the oldest generation to collect; None: none).
    ``failed`` (or negotiation broke): collectives may be in flight with a peer that is gone, so the process
    groups are aborted, not destroyed (:func:`abort_groups`)."""
    global _state
    with _lock:
        s = _state
        if s is None:
            return
        _state = None
        failed = failed or s.negotiator.error is not None  # read before stop(), which forgets it
        try:
            s.negotiator.stop(timeout=peer_wait_s)
        finally:
            _teardown_groups(s, abort=failed)
    # A failed op's error keeps, in its traceback, frames that refer to the engine, and the handle that holds
    # the error is in those frames: a cycle only the collector frees. Collect now, so a runtime gone closes
    # its sockets and process groups at once, not whenever the collector next runs (shutdown/init loops).
    # A full collection of a process with torch loaded is slow (docs/performance.md, "The measurements behind
    # design choices"): an elastic reset collects only the young generations (see reset()).
    if collect is not None:
        gc.collect(collect)


def _teardown_groups(s: Runtime, abort: bool = True) -> None:
    """Destroy the groups ``init()`` made (the default group with them when hora made it); ``abort``: abort
    them instead, not waiting for collectives in flight."""
    timeline.stop_timeline()
    timeline.set_world(None)
    hierarchy, s.hierarchy = s.hierarchy, None
    adasum.set_hosts(())
    try:
        if s.owns_default_group and dist.is_initialized():
            abort_groups() if abort else dist.destroy_process_group()
        elif dist.is_initialized():
            extra = [hierarchy.local_group, hierarchy.cross_group] if hierarchy is not None else []
            for g in [s.ctrl_group, global_process_set.group, *extra]:
                if g is not None:
                    abort_groups(g) if abort else dist.destroy_process_group(g)
    finally:
        s.process_sets.unbind_all()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set. Every rank must call this, in the same order (a collective).

    Args:
        process_set: a ProcessSet or a list of global ranks.

    Returns:
        The registered ProcessSet.
    """
    return state("add_process_set()").process_sets.register(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set. Every rank must call this, in the same order.

    Returns:
        True when the set was registered and is now removed.
    """
    return state("remove_process_set()").process_sets.unregister(process_set)


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _state is not None


def _shown(what: str) -> Topology:
    """This process's place as the topology queries report it: a new elastic worker still alone reports the
    place the launcher planned for it in the world it joins (Horovod starts it with that rank and size)."""
    s = state(what)
    return s.joining or s.topo


def size() -> int:
    """Number of ranks in the job."""
    return _shown("hvd.size()").size


def rank() -> int:
    """This process's global rank."""
    return _shown("hvd.rank()").rank


def local_size() -> int:
    """Number of ranks on this host."""
    return _shown("hvd.local_size()").local_size


def local_rank() -> int:
    """This process's index among the ranks on its host (use it to pick the GPU)."""
    return _shown("hvd.local_rank()").local_rank


def cross_size() -> int:
    """Number of hosts that have a rank with this process's local rank."""
    return _shown("hvd.cross_size()").cross_size


def cross_rank() -> int:
    """This host's index among the hosts that have a rank with this process's local rank."""
    return _shown("hvd.cross_rank()").cross_rank


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    return _shown("hvd.is_homogeneous()").homogeneous


atexit.register(_shutdown_at_exit)


# --- bootstrap: what init() builds before a runtime exists ---------------------------------------------------------
_GLOO_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's own default for a Gloo group
_HOW_TO_SECRET = (f"give every process of the job the same secret file: `hora secret /shared/dir/job.secret` once, "
                  f"then {ENV_SECRET_FILE}=/shared/dir/job.secret for torchrun, srun or mpirun (Kubernetes: mount a "
                  "Secret, see deploy/k8s); see docs/security.md")
_warned_unauthenticated = False


def job_secret(env: WorkerEnv, knobs: Knobs) -> JobSecret | None:
    """The job's secret (``HORA_SECRET`` from hora's launcher, or ``HORA_SECRET_FILE``). A job of several
    processes without one runs unauthenticated (:func:`warn_unauthenticated`), or is refused here with
    ``HORA_REQUIRE_SECRET=1``.

    Raises:
        ConfigError: no secret and ``HORA_REQUIRE_SECRET=1``; or the secret given is unusable.
    """
    secret = hora_env.job_secret()
    if secret is None and env.size > 1 and knobs.require_secret:
        raise ConfigError(f"rank {env.rank}: HORA_REQUIRE_SECRET=1 and this job has no job secret "
                          f"({ENV_SECRET_FILE} is not set); {_HOW_TO_SECRET}")
    return secret


def warn_unauthenticated(env: WorkerEnv, secret: JobSecret | None) -> None:
    """Rank 0 of a job of several processes without a secret says so, once per process: its store and control
    plane are open to any process on the network."""
    global _warned_unauthenticated
    if secret is not None or env.size == 1 or env.rank != 0 or _warned_unauthenticated:
        return
    _warned_unauthenticated = True
    log.warning("this job has no job secret, so its rendezvous store and control plane are unauthenticated: any "
                "process that reaches them on the network can change what the ranks read; %s "
                "(HORA_REQUIRE_SECRET=1 refuses to start without one)", _HOW_TO_SECRET)


def late_error(board: Board, env: WorkerEnv, knobs: Knobs, late: list[int]) -> CollectiveError:
    """The error of a rank whose peers ``late`` did not reach ``init()`` in time (they are blamed on the board)."""
    who = f"rank {late[0]}" if len(late) == 1 else f"ranks {', '.join(map(str, late))}"
    board.blame(late[0], f"did not call hvd.init() within the start timeout of {knobs.start_timeout:g} s "
                         "(--start-timeout, HORA_START_TIMEOUT; its peers waited for it)")
    return CollectiveError(
        f"rank {env.rank}: {who} did not call hvd.init() within the start timeout of {knobs.start_timeout:g} s "
        "(--start-timeout, HORA_START_TIMEOUT); every rank must call it. Look at the late rank's output: "
        "slow work before init() (imports, data loading) needs a longer --start-timeout; a rank that "
        "never gets there is stuck or takes another branch")


def member_lost(env: WorkerEnv, generation: int, ended: dict[int, str]) -> WorldMemberLostError:
    """The error of a member of elastic world ``generation`` whose peers ``ended`` (rank -> how) are gone."""
    rank, how = min(ended.items())
    return WorldMemberLostError(f"rank {env.rank}: rank {rank} of the launcher's world {generation} ended ({how}) "
                                "before the world's process groups were built")


def groups_backend(default_config: str | None, cuda: bool) -> str:
    """The backend of the groups hora makes: Gloo for CPU tensors, always (its own CPU collectives:
    ``broadcast_parameters``' layout check, ``broadcast_object``, metrics); for CUDA tensors (``cuda``: hora
    bound this rank to a GPU) NCCL, or what the script's default group uses for them when the script made
    it before ``hvd.init()`` (``default_config``: ``dist.get_backend_config()``; Gloo, when two ranks share a
    GPU). A script's NCCL-only default group (``init_process_group("nccl")``, as under torchrun) has no CPU
    backend: copying it would fail every CPU collective with "No backend type associated with device type
    cpu".

    >>> groups_backend(None, cuda=True), groups_backend("cuda:nccl", cuda=True)
    ('cpu:gloo,cuda:nccl', 'cpu:gloo,cuda:nccl')
    >>> groups_backend("cpu:gloo,cuda:gloo", cuda=True), groups_backend("cuda:gloo", cuda=False)
    ('cpu:gloo,cuda:gloo', 'gloo')
    """
    if not cuda:
        return "gloo"
    chosen = dict(part.split(":", 1) for part in default_config.split(",") if ":" in part) if default_config else {}
    return f"cpu:gloo,cuda:{chosen.get('cuda', 'nccl')}"


def collective_timeout(knobs: Knobs) -> datetime.timedelta:
    """The deadline of one collective on the groups hora makes, the default group included
    (``HORA_COLLECTIVE_TIMEOUT``). Deliberately not torch's default: that depends on the backend string, and
    hora's ``"cpu:gloo,cuda:nccl"`` is not ``Backend.NCCL``, so it would get Gloo's 30 minutes
    (torch/distributed/distributed_c10d.py:836-849); nor the start timeout, which a rank busy with evaluation
    or a checkpoint outlasts."""
    return datetime.timedelta(seconds=knobs.collective_timeout)


def abort_groups(group: Any = None) -> None:
    """Abort ``group`` (None: every group, the default one included) instead of destroying it.
    ``dist.destroy_process_group()`` flushes: NCCL's ``shutdown()`` waits for the collectives in flight to
    finish (ncclCommFinalize, since torch's PR #141510), which never happens when a peer is gone; the abort
    (ncclCommAbort) ends them (torch/distributed/distributed_c10d.py:2460-2540; on Gloo it forgets the groups
    as destroy does)."""
    from torch.distributed import distributed_c10d

    try:
        distributed_c10d._abort_process_group(group)
    except ValueError:  # already gone (a group aborted with the default group, or twice)
        pass


def abort_nccl(groups: Sequence[Any]) -> None:
    """Abort the NCCL communicators of ``groups`` now, from any thread: the collectives they run end at once,
    so nothing on the GPU (nor a host thread waiting for it, such as ``.item()``) waits for a peer that is
    gone. The groups stay registered until :func:`abort_groups` at the reset. In one ncclGroupStart/End, as
    torch aborts several groups, so the communicators' aborts cannot deadlock each other
    (torch/distributed/distributed_c10d.py:2490-2502)."""
    backends = []
    for group in groups:
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:  # no CUDA backend in this group
            continue
        if type(backend).__name__ == "ProcessGroupNCCL":
            backends.append(backend)
    if not backends:
        return
    backends[0]._group_start()
    try:
        for backend in backends:
            backend.abort()
    finally:
        backends[0]._group_end()


def control_timeout(knobs: Knobs) -> datetime.timedelta:
    """The Gloo control group's deadline (the rounds of the Gloo control plane, ``HORA_CONTROL_PLANE=gloo``,
    which cannot report a silent rank early): the stall shutdown time when one is set,
    else torch's default. The default mesh plane needs none: its rounds follow the stall inspector's flags."""
    if not knobs.stall_check_disable and knobs.stall_shutdown_time_seconds > 0:
        return datetime.timedelta(seconds=knobs.stall_shutdown_time_seconds)
    return _GLOO_DEFAULT_TIMEOUT


def bind_device(env: WorkerEnv) -> torch.device | None:
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    index = env.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def topology(env: WorkerEnv, ctrl: Any) -> Topology:
    if env.size == 1:
        return derive_topology([env.host_key], [env.hostname], 0)
    hosts = world.hosts_by_rank(env)  # an elastic world: the launcher's record names every rank's host
    if hosts is None:
        gathered: list[Any] = [None] * env.size
        dist.all_gather_object(gathered, (env.host_key, env.hostname), group=ctrl)
        topo = derive_topology([g[0] for g in gathered], [g[1] for g in gathered], env.rank)
    else:
        topo = derive_topology(hosts, hosts, env.rank)
    if env.source == "hora" and env.cross_rank is not None:
        # hora's launcher assigns slots explicitly; trust it (it knows hosts that share a hostname apart).
        topo = Topology(rank=env.rank, size=env.size, local_rank=env.local_rank, local_size=env.local_size,
                        cross_rank=env.cross_rank, cross_size=env.cross_size or 1,
                        hostnames=topo.hostnames, homogeneous=topo.homogeneous, hosts=topo.hosts)
    return topo
