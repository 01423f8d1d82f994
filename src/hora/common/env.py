"""The only reader of ``os.environ`` in hora: :class:`WorkerEnv`, a frozen record of this process's place in
the job (rank, size, local and cross ranks, where the rendezvous store is), detected from hora's launcher,
horovodrun-style ``HOROVOD_*`` variables, torchrun, Open MPI, MPICH/Intel MPI or Slurm, else a single process;
the job's secret; :func:`environ`, what :mod:`hora.common.knobs` reads the tuning knobs from; and
:func:`torch_groups_of_hora`, the variables hora sets for torch while it makes its process groups.

Example:
    >>> env = WorkerEnv.from_environ({"HORA_RANK": "1", "HORA_SIZE": "2"})  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from hora.common.slurm import expand_nodelist, parse_tasks_per_node
from hora.errors import ConfigError
from hora.protocol import elastic as elastic_protocol
from hora.protocol.jobsecret import ENV_SECRET, ENV_SECRET_FILE, JobSecret, SecretError

DEFAULT_PORT = 29500


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEnv:
    """Where this process sits in the job.

    ``cross_rank``/``cross_size`` are None when the launcher did not say; the runtime then derives them
    from every rank's host at ``init()``.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int | None = None
    cross_size: int | None = None
    store_addr: str = "127.0.0.1"
    store_port: int = 0
    store_is_server: bool = True  # rank 0 hosts the store (torchrun without agent store, MPI, Slurm)
    hostname: str = ""
    host_key: str = ""  # identifies the host for local/cross grouping; never hostname alone
    source: str = "single"  # which launcher's variables we read
    job_id: str = ""  # distinguishes concurrent jobs and elastic generations in the store
    store_addr_origin: str = ""  # where store_addr came from, for error messages ("MASTER_ADDR", ...)
    elastic: bool = False  # an elastic job of hora run: init() joins the driver's newest world (hora.elastic)
    worker_id: str = ""  # "<host>:<slot>" in an elastic job, stable for the process's life
    world_gen: int = 0  # elastic: the launcher's world this record describes (0: not joined yet)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.size} (from {self.source} variables)")
        if not 0 <= self.rank < self.size:
            raise ConfigError(
                f"rank {self.rank} is outside 0..{self.size - 1} (from {self.source} variables); "
                "check the launcher's environment"
            )
        if not 0 <= self.local_rank < self.local_size:
            raise ConfigError(
                f"local rank {self.local_rank} is outside 0..{self.local_size - 1} (from {self.source} variables)"
            )

    @property
    def board_id(self) -> str:
        """The job id of the board this process shares with ``hora run``'s driver ('' outside hora run): in
        an elastic job each world has its own board, since ranks are numbered afresh in each world."""
        if self.source != "hora":
            return ""
        return elastic_protocol.world_job_id(self.job_id, self.world_gen) if self.elastic else self.job_id

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Detect the launcher from ``environ`` (default ``os.environ``) and build the record."""
        env = os.environ if environ is None else environ
        for detect in _DETECTORS:
            found = detect(env)
            if found is not None:
                return found
        return cls(hostname=_hostname(env), host_key=_hostname(env))


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"environment variable {name} is required here but not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _hostname(env: Mapping[str, str]) -> str:
    return env.get("HORA_HOSTNAME") or socket.gethostname()


def _addr_origin(env: Mapping[str, str]) -> str:
    return "HORA_STORE_ADDR" if env.get("HORA_STORE_ADDR") else "MASTER_ADDR" if env.get("MASTER_ADDR") else ""


def _master(env: Mapping[str, str], source: str, size: int) -> tuple[str, int]:
    addr = env.get("HORA_STORE_ADDR") or env.get("MASTER_ADDR")
    port = _int(env, "HORA_STORE_PORT", 0) or _int(env, "MASTER_PORT", 0)
    if size > 1 and not addr:
        raise ConfigError(
            f"started by {source} with {size} processes but no rendezvous address: set MASTER_ADDR "
            "(and MASTER_PORT) to a host every rank can reach, or launch with `hora run`"
        )
    return addr or "127.0.0.1", port or DEFAULT_PORT


def _from_hora(env: Mapping[str, str]) -> WorkerEnv | None:
    if "HORA_RANK" not in env:
        return None
    host = _hostname(env)
    return WorkerEnv(
        rank=_int(env, "HORA_RANK"),
        size=_int(env, "HORA_SIZE"),
        local_rank=_int(env, "HORA_LOCAL_RANK", 0),
        local_size=_int(env, "HORA_LOCAL_SIZE", 1),
        cross_rank=_int(env, "HORA_CROSS_RANK", 0) if "HORA_CROSS_RANK" in env else None,
        cross_size=_int(env, "HORA_CROSS_SIZE", 1) if "HORA_CROSS_SIZE" in env else None,
        store_addr=env.get("HORA_STORE_ADDR", "127.0.0.1"),
        store_port=_int(env, "HORA_STORE_PORT", 0),
        store_is_server=False,  # the launcher's driver hosts the store
        hostname=host,
        host_key=env.get("HORA_HOST_KEY") or host,
        source="hora",
        job_id=env.get("HORA_JOB_ID", ""),
        elastic=env.get(elastic_protocol.ELASTIC_ENV, "") == "1",
        worker_id=env.get(elastic_protocol.WORKER_ID_ENV, ""),
    )


def _from_horovod(env: Mapping[str, str]) -> WorkerEnv | None:
    if "HOROVOD_RANK" not in env:
        return None
    size = _int(env, "HOROVOD_SIZE")
    addr, port = _master(env, "horovodrun-style HOROVOD_* variables", size)
    host = env.get("HOROVOD_HOSTNAME") or _hostname(env)
    return WorkerEnv(
        rank=_int(env, "HOROVOD_RANK"),
        size=size,
        local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
        local_size=_int(env, "HOROVOD_LOCAL_SIZE", 1),
        cross_rank=_int(env, "HOROVOD_CROSS_RANK", 0) if "HOROVOD_CROSS_RANK" in env else None,
        cross_size=_int(env, "HOROVOD_CROSS_SIZE", 1) if "HOROVOD_CROSS_SIZE" in env else None,
        store_addr=addr,
        store_port=port,
        store_addr_origin=_addr_origin(env),
        hostname=host,
        host_key=host,
        source="horovod",
    )


def _from_torchrun(env: Mapping[str, str]) -> WorkerEnv | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    nproc = _int(env, "PET_NPROC_PER_NODE", 1) if env.get("PET_NPROC_PER_NODE", "").isdigit() else 1
    if "LOCAL_RANK" not in env and nproc > 1:
        raise ConfigError(
            f"RANK={env['RANK']} looks like a Kubeflow pod index (PET_NPROC_PER_NODE={nproc}), not a process "
            "rank: start the workers with torchrun or `hora run` inside the pod"
        )
    size = _int(env, "WORLD_SIZE")
    addr, port = _master(env, "torchrun", size)
    host = _hostname(env)
    return WorkerEnv(
        rank=_int(env, "RANK"),
        size=size,
        local_rank=_int(env, "LOCAL_RANK", 0),
        local_size=_int(env, "LOCAL_WORLD_SIZE", 1),
        cross_rank=_int(env, "GROUP_RANK") if "GROUP_RANK" in env and "LOCAL_WORLD_SIZE" in env else None,
        store_addr=addr,
        store_port=port,
        store_addr_origin=_addr_origin(env),
        store_is_server=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true",
        hostname=host,
        host_key=host,
        source="torchrun",
        # torchrun's store outlives a restart (--max-restarts): each attempt needs keys of its own, as torch's
        # own env:// rendezvous keeps them ("/worker/attempt_<n>"); a restarted worker would read the last one's
        job_id=env.get("TORCHELASTIC_RUN_ID", "") + (f"/attempt{env['TORCHELASTIC_RESTART_COUNT']}"
                                                      if env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" else ""),
    )


def _from_mpi(env: Mapping[str, str]) -> WorkerEnv | None:
    if "OMPI_COMM_WORLD_RANK" in env:
        source, rank, size = "Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"
        local_rank, local_size = "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"
    elif "PMI_RANK" in env:
        source, rank, size = "MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE"
        local_rank, local_size = "MPI_LOCALRANKID", "MPI_LOCALNRANKS"
    else:
        return None
    world = _int(env, size)
    addr, port = _master(env, source, world)
    host = _hostname(env)
    return WorkerEnv(
        rank=_int(env, rank),
        size=world,
        local_rank=_int(env, local_rank, 0),
        local_size=_int(env, local_size, 1),
        store_addr=addr,
        store_port=port,
        store_addr_origin=_addr_origin(env),
        hostname=host,
        host_key=host,
        source=source,
    )


def _from_slurm(env: Mapping[str, str]) -> WorkerEnv | None:
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    size = _int(env, "SLURM_NTASKS")
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    job = _int(env, "SLURM_JOB_ID", 0)
    addr = env.get("HORA_STORE_ADDR") or env.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1")
    origin = _addr_origin(env) or ("the first node of SLURM_JOB_NODELIST" if nodes else "")
    port = _int(env, "HORA_STORE_PORT", 0) or _int(env, "MASTER_PORT", 0) or DEFAULT_PORT + job % 1000
    tasks_on_node = parse_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", ""))
    node_id = _int(env, "SLURM_NODEID", 0)
    local_size = tasks_on_node[node_id] if node_id < len(tasks_on_node) else _int(env, "SLURM_NTASKS_PER_NODE", 1)
    host = env.get("SLURMD_NODENAME") or _hostname(env)
    return WorkerEnv(
        rank=_int(env, "SLURM_PROCID"),
        size=size,
        local_rank=_int(env, "SLURM_LOCALID", 0),
        local_size=local_size,
        store_addr=addr,
        store_port=port,
        store_addr_origin=origin,
        hostname=host,
        host_key=host,
        source="Slurm",
        job_id=str(job or ""),
    )


_DETECTORS: tuple[Callable[[Mapping[str, str]], WorkerEnv | None], ...] = (
    _from_hora,
    _from_horovod,
    _from_torchrun,
    _from_mpi,
    _from_slurm,
)


def job_secret(environ: Mapping[str, str] | None = None) -> JobSecret | None:
    """The job's secret: ``HORA_SECRET`` (hex, set by hora's launcher in a rank's own environment) or the file
    that ``HORA_SECRET_FILE`` names (external launchers); None when neither is set.

    Raises:
        ConfigError: the variable or the file holds no usable secret (the message never shows the value).
    """
    env = os.environ if environ is None else environ
    try:
        if env.get(ENV_SECRET):
            return JobSecret.from_text(env[ENV_SECRET], ENV_SECRET)
        if env.get(ENV_SECRET_FILE):
            return JobSecret.from_file(env[ENV_SECRET_FILE])
    except SecretError as e:
        raise ConfigError(str(e)) from None
    return None


def environ() -> Mapping[str, str]:
    """This process's environment, read-only by convention: the knobs (:mod:`hora.common.knobs`) read it here."""
    return os.environ


def launcher_environ() -> dict[str, str]:
    """A copy of this process's environment, for the launcher to forward to workers."""
    return dict(os.environ)



GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"  # torch's choice of network interface for a Gloo group
TORCH_GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"  # read each time torch makes a Gloo group (a torch without it: ignored)
# read each time torch makes an NCCL group (ProcessGroupNCCL's constructor): what its watchdog does when a
# collective fails or passes the group's timeout. torch's default, 3 (SkipCleanUp), takes the process down;
# 2 (CleanUpOnly) aborts the group's communicators and leaves the process alive, the error raised at wait()
TORCH_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_CLEAN_UP_ONLY = "2"


@contextlib.contextmanager
def torch_groups_of_hora(lazy: bool, iface: str = "") -> Iterator[None]:
    """Within the block, the process groups torch makes are made as hora's groups need:

    - a Gloo group connects a pair of ranks at the first collective that pair needs (``lazy``), or every pair
      at once, as torch does by default; with ``iface`` (``HOROVOD_GLOO_IFACE``) and no
      ``GLOO_SOCKET_IFNAME`` of the user's, it uses that network interface;
    - an NCCL group's watchdog, when a collective fails or times out, aborts the group's communicators and
      leaves the process alive (hora raises the error where the collective is waited for, and an elastic
      job recovers in the same process), unless the user chose otherwise with
      ``TORCH_NCCL_ASYNC_ERROR_HANDLING``.

    Outside it, the variables are what they were, so the groups a script makes itself follow its own choice.

    Example:
        >>> with torch_groups_of_hora(True):
        ...     os.environ[TORCH_GLOO_LAZY_INIT]
        '1'
    """
    values = {TORCH_GLOO_LAZY_INIT: "1" if lazy else "0"}
    if iface and not os.environ.get(GLOO_SOCKET_IFNAME):
        values[GLOO_SOCKET_IFNAME] = iface
    if not os.environ.get(TORCH_NCCL_ASYNC_ERROR_HANDLING):
        values[TORCH_NCCL_ASYNC_ERROR_HANDLING] = NCCL_CLEAN_UP_ONLY
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
