"""The pieces ``init()`` (:mod:`hora.runtime.lifecycle`) builds a world from that need no runtime: the job's secret (and
what a job without one gets: a warning, or a refusal with ``HORA_REQUIRE_SECRET=1``), the CUDA device of
the local rank, the topology (from the launcher's elastic world record, else gathered over the control
group), the Gloo control group's deadline, and the errors of a world that did not stand up (a rank late to
``init()``, a member of an elastic world gone before its groups were built).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from hora.common import env as hora_env
from hora.common.env import Knobs, WorkerEnv
from hora.diagnostics.board import Board
from hora.errors import CollectiveError, ConfigError, WorldMemberLostError
from hora.protocol.jobsecret import ENV_SECRET_FILE, JobSecret
from hora.protocol.topology import Topology, derive_topology
from hora.runtime import elastic_rendezvous as world

log = logging.getLogger(__name__)

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
    board.blame(late[0], f"did not call hvd.init() within --start-timeout {knobs.start_timeout:g} s "
                         "(its peers waited for it)")
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


def control_timeout(knobs: Knobs) -> datetime.timedelta:
    """The Gloo control group's deadline (the rounds of the Gloo control plane, ``HORA_CONTROL_PLANE=gloo`` or
    more than 256 ranks, which cannot report a silent rank early): the stall shutdown time when one is set,
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
