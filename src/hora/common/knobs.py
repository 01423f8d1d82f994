"""The tuning knobs: one table (:data:`KNOBS`: name, Horovod alias, type, default, help) and the frozen
:class:`Knobs` read from it once, at ``hvd.init()``. ``docs/knobs.md`` is generated from the table.

Example:
    >>> Knobs.from_environ({"HOROVOD_FUSION_THRESHOLD": "1024"}).fusion_threshold
    1024
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hora.common import env as hora_env
from hora.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Knob:
    name: str  # HORA_* variable
    horovod: str | None  # Horovod's variable with the same meaning, accepted too
    type: type
    default: Any
    help: str


KNOBS: tuple[Knob, ...] = (
    Knob("HORA_LOG_LEVEL", "HOROVOD_LOG_LEVEL", str, "WARNING", "Log level of hora's loggers in workers."),
    Knob("HORA_START_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS", float, 60.0,
         "Seconds init() waits for every rank to reach the rendezvous store."),
    Knob("HORA_COLLECTIVE_TIMEOUT", None, float, 600.0,
         "Seconds one collective may take on the process groups hora makes (the default group, for DDP and "
         "torch.distributed calls, and hora's own): torch's group timeout, after which NCCL's watchdog aborts "
         "the collective. Not the start timeout: a rank late by minutes (evaluation, a checkpoint) is fine."),
    Knob("HORA_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE", bool, False, "Turn the stall inspector off."),
    Knob("HORA_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS", float, 60.0,
         "Seconds a collective may wait for missing ranks before one stall report names them."),
    Knob("HORA_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", float, 0.0,
         "Seconds after which a stalled job is stopped with the stall report as root cause (0 = never)."),
    Knob("HORA_TIMELINE", "HOROVOD_TIMELINE", str, "",
         "Write a Chrome-trace timeline of every collective to this file (rank files are merged)."),
    Knob("HORA_TIMELINE_MARK_CYCLES", "HOROVOD_TIMELINE_MARK_CYCLES", bool, False,
         "Mark each negotiation round in the timeline."),
    Knob("HORA_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD", int, 64 * 1024 * 1024,
         "Bytes: allreduces ready in the same round are fused into one buffer up to this size (0 = off)."),
    Knob("HORA_CYCLE_TIME", "HOROVOD_CYCLE_TIME", float, 0.0,
         "Accepted for Horovod compatibility; hora's negotiation is event-driven and has no cycle."),
    Knob("HORA_DISABLE_CACHE", "HOROVOD_CACHE_CAPACITY", bool, False,
         "Turn the negotiation response cache off (Horovod's HOROVOD_CACHE_CAPACITY=0; any other capacity "
         "keeps it on: hora's cache holds the first 4096 distinct requests, whatever the capacity given; later "
         "ones travel in full)."),
    Knob("HORA_CONTROL_PLANE", None, str, "auto",
         "How negotiators talk: tcp (direct TCP connections: between every pair of ranks up to "
         "HORA_MESH_FULL_UPTO ranks, to about log2 n partners per rank above), gloo (an allgather on a Gloo group, "
         "woken through the store), or auto (tcp)."),
    Knob("HORA_GLOO_LAZY_CONNECT", None, bool, True,
         "The Gloo process groups hora makes connect a pair of ranks at the first collective that pair needs, "
         "so a rank holds connections to the few peers its collectives use and init() reads no peer's address "
         "(torch's TORCH_GLOO_LAZY_INIT, set for hora's groups only); 0 connects every pair at init() (torch's "
         "default)."),
    Knob("HORA_MESH_FULL_UPTO", None, int, 8,
         "TCP control plane: up to this many ranks a negotiation round is one exchange between every pair of "
         "ranks (one round trip, n-1 connections per rank); above, recursive doubling (log2 n round trips, "
         "about log2 n connections and frames per rank)."),
    Knob("HORA_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE", bool, False,
         "Allreduce on the global set in three steps: reduce within each host, allreduce across hosts, share "
         "the result within the host. Where every host runs p ranks, each local rank carries 1/p of the "
         "tensor across hosts (reduce-scatter and allgather within the host, as Horovod's NCCL hierarchical "
         "allreduce; through shared memory on Gloo); else the host's lowest rank carries it all. Pays off "
         "with several ranks per host on a slow network."),
    Knob("HORA_CALL_SITE_CHECK", None, bool, True,
         "Check that ranks reach each unnamed collective from the same line of code (a rank that skipped or "
         "added a collective is reported, not paired with the wrong op); 0 turns it off for code that calls "
         "one collective from different lines on purpose. Named collectives are never checked."),
    Knob("HORA_AUTOTUNE", "HOROVOD_AUTOTUNE", bool, False,
         "Tune the gradient bucket size, the fusion threshold and hierarchical allreduce by Bayesian optimisation "
         "of the measured throughput of the first training steps, then keep the best (docs/performance.md, "
         "Autotune). A knob set explicitly is held constant."),
    Knob("HORA_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG", str, "",
         "Autotune: rank 0 writes each sample's settings and score to this CSV file, in Horovod's columns; the "
         "last row is the best."),
    Knob("HORA_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", int, 3,
         "Autotune: samples discarded before the search starts."),
    Knob("HORA_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", int, 10,
         "Autotune: training steps in one sample; a sample's score is the median of its steps'."),
    Knob("HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", int, 20,
         "Autotune: samples the Bayesian search of the bucket size and fusion threshold takes."),
    Knob("HORA_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", float, 0.8,
         "Autotune: the noise (alpha, in [0, 1]) the Gaussian process assumes in the normalised scores."),
    Knob("HORA_THREAD_AFFINITY", "HOROVOD_THREAD_AFFINITY", str, "",
         "Comma-separated CPU cores, one per local rank: each rank pins its negotiator thread to its core."),
    Knob("HORA_GLOO_IFACE", "HOROVOD_GLOO_IFACE", str, "",
         "Network interface of hora's Gloo groups (torch's GLOO_SOCKET_IFNAME, which wins when set)."),
    Knob("HORA_LOG_HIDE_TIME", "HOROVOD_LOG_HIDE_TIME", bool, True,
         "hora's warning lines in workers carry no time; 0 (hora run --log-with-timestamp) starts each with "
         "the date and time."),
    Knob("HORA_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT", float, 600.0,
         "Elastic jobs: seconds a worker waits at a reset for the launcher's next world before it fails."),
    Knob("HORA_BUCKET_CAP_MB", None, float, 25.0, "DistributedOptimizer bucket size in MB (DDP's default)."),
    Knob("HORA_FIRST_BUCKET_MB", None, float, 1.0,
         "Size of the first gradient bucket in MB, small so communication starts early in backward."),
    Knob("HORA_SHARDED_REDUCE", None, str, "auto",
         "DistributedOptimizer(sharding='gradients'): the collective of each gradient bucket: allreduce (every "
         "rank receives the whole reduced bucket and keeps its owned part), reducescatter (each rank receives "
         "only its owned part; the bucket is laid out in equal owner segments), or auto (reducescatter for CUDA "
         "buckets, allreduce for CPU ones, where Gloo's reduce-scatter measured slower than its allreduce)."),
    Knob("HORA_STEP_OVERLAP", None, bool, True,
         "DistributedOptimizer.step() with a built-in per-parameter optimizer (SGD, Adam, AdamW, ...): update "
         "each bucket's parameters as soon as its gradients are reduced, while later buckets are still on the "
         "wire (the same result bit for bit); 0 waits for every bucket, then steps once."),
    Knob("HORA_REQUIRE_SECRET", None, bool, False,
         "Refuse to start a job of several processes that has no job secret (HORA_SECRET_FILE under torchrun, "
         "srun, mpirun or Kubernetes; hora run and hora.run always make one) instead of warning once that its "
         "store and control plane are unauthenticated (docs/security.md)."),
    Knob("HORA_STORE_MAX_VALUE_MB", None, float, 64.0,
         "The rendezvous store hora serves (hora run's launcher; rank 0 under other launchers) refuses a value "
         "larger than this (hora.run's function and each rank's result are the largest), closing that client's "
         "connection (docs/security.md)."),
    Knob("HORA_STORE_MAX_HOST_MB", None, float, 64.0,
         "The rendezvous store hora serves holds at most this much written from one host (every key last "
         "written from it, name and value: hora.run's results of the ranks on a host count together); a client "
         "whose write would pass it is disconnected, the job's other clients go on (docs/security.md)."),
    Knob("HORA_STORE_MAX_TOTAL_MB", None, float, 512.0,
         "The rendezvous store hora serves holds at most this much in all (docs/security.md)."),
    Knob("HORA_FULL_TRACEBACKS", None, bool, False,
         "Print hora's own frames in the traceback of an uncaught hora error (hora run --verbose sets it); "
         "by default only your script's frames and the error in its terms are shown."),
)


_DEFAULTS: dict[str, Any] = {k.name[len("HORA_"):].lower(): k.default for k in KNOBS}


@dataclass(frozen=True, kw_only=True, slots=True)
class Knobs:
    """Values of :data:`KNOBS` for this process (attribute = knob name without ``HORA_``, lower case).

    The defaults are the table's (written once, there); the runtime reads the knobs once, at ``init()``,
    and every part of hora takes them from it (``runtime.state().knobs``).
    """

    log_level: str = _DEFAULTS["log_level"]
    start_timeout: float = _DEFAULTS["start_timeout"]
    collective_timeout: float = _DEFAULTS["collective_timeout"]
    stall_check_disable: bool = _DEFAULTS["stall_check_disable"]
    stall_check_time_seconds: float = _DEFAULTS["stall_check_time_seconds"]
    stall_shutdown_time_seconds: float = _DEFAULTS["stall_shutdown_time_seconds"]
    timeline: str = _DEFAULTS["timeline"]
    timeline_mark_cycles: bool = _DEFAULTS["timeline_mark_cycles"]
    fusion_threshold: int = _DEFAULTS["fusion_threshold"]
    cycle_time: float = _DEFAULTS["cycle_time"]
    disable_cache: bool = _DEFAULTS["disable_cache"]
    control_plane: str = _DEFAULTS["control_plane"]
    gloo_lazy_connect: bool = _DEFAULTS["gloo_lazy_connect"]
    mesh_full_upto: int = _DEFAULTS["mesh_full_upto"]
    call_site_check: bool = _DEFAULTS["call_site_check"]
    elastic_timeout: float = _DEFAULTS["elastic_timeout"]
    bucket_cap_mb: float = _DEFAULTS["bucket_cap_mb"]
    first_bucket_mb: float = _DEFAULTS["first_bucket_mb"]
    sharded_reduce: str = _DEFAULTS["sharded_reduce"]
    step_overlap: bool = _DEFAULTS["step_overlap"]
    hierarchical_allreduce: bool = _DEFAULTS["hierarchical_allreduce"]
    full_tracebacks: bool = _DEFAULTS["full_tracebacks"]
    require_secret: bool = _DEFAULTS["require_secret"]
    autotune: bool = _DEFAULTS["autotune"]
    autotune_log: str = _DEFAULTS["autotune_log"]
    autotune_warmup_samples: int = _DEFAULTS["autotune_warmup_samples"]
    autotune_steps_per_sample: int = _DEFAULTS["autotune_steps_per_sample"]
    autotune_bayes_opt_max_samples: int = _DEFAULTS["autotune_bayes_opt_max_samples"]
    autotune_gaussian_process_noise: float = _DEFAULTS["autotune_gaussian_process_noise"]
    thread_affinity: str = _DEFAULTS["thread_affinity"]
    gloo_iface: str = _DEFAULTS["gloo_iface"]
    log_hide_time: bool = _DEFAULTS["log_hide_time"]
    store_max_value_mb: float = _DEFAULTS["store_max_value_mb"]
    store_max_host_mb: float = _DEFAULTS["store_max_host_mb"]
    store_max_total_mb: float = _DEFAULTS["store_max_total_mb"]
    explicit: frozenset[str] = frozenset()  # the knobs set in the environment (autotune holds them constant)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Knobs:
        env = hora_env.environ() if environ is None else environ
        values: dict[str, Any] = {}
        explicit: set[str] = set()
        for knob in KNOBS:
            raw = env.get(knob.name)
            if raw is None and knob.horovod is not None:
                raw = env.get(knob.horovod)
                if knob.horovod == "HOROVOD_CACHE_CAPACITY" and raw is not None:
                    raw = "1" if raw.strip() == "0" else "0"
            if raw is None or raw == "":
                continue
            attr = knob.name[len("HORA_"):].lower()
            values[attr] = _convert(knob, raw)
            explicit.add(attr)
        return cls(**values, explicit=frozenset(explicit))


def _convert(knob: Knob, raw: str) -> Any:
    try:
        if knob.type is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return knob.type(raw)
    except ValueError:
        raise ConfigError(f"{knob.name}={raw!r} is not a valid {knob.type.__name__}: {knob.help}") from None


def knobs_markdown() -> str:
    """The knob table as Markdown (docs/knobs.md is generated from this)."""
    rows = ["| variable | Horovod alias | type | default | meaning |", "|---|---|---|---|---|"]
    for k in KNOBS:
        rows.append(f"| `{k.name}` | {f'`{k.horovod}`' if k.horovod else ''} | {k.type.__name__} | "
                    f"`{k.default!r}` | {k.help} |")
    return "\n".join(rows) + "\n"


# Horovod 0.28.1's variables (horovod/common/common.h, logging.h, the runner) that hora has no mechanism for:
# accepted and listed (docs/knobs.md), and rank 0 says once at init() that a set one has no effect.
HOROVOD_ONLY: tuple[tuple[str, str], ...] = (
    ("HOROVOD_HIERARCHICAL_ALLGATHER", "hora has no hierarchical allgather: an allgather is one collective on "
                                       "the process set's group"),
    ("HOROVOD_TORUS_ALLREDUCE", "NCCL's 2D torus allreduce: hora has none (HOROVOD_HIERARCHICAL_ALLREDUCE is "
                                "the nearest)"),
    ("HOROVOD_NUM_NCCL_STREAMS", "hora issues every GPU collective on one launch stream per rank"),
    ("HOROVOD_MPI_THREADS_DISABLE", "hora has no MPI controller"),
    ("HOROVOD_BATCH_D2D_MEMCOPIES", "fusion copies each tensor into the fused buffer with its own copy"),
    ("HOROVOD_CPU_OPERATIONS", "CPU tensors always go through Gloo"),
    ("HOROVOD_CONTROLLER", "negotiation always runs on hora's own control plane (HORA_CONTROL_PLANE)"),
    ("HOROVOD_CCL_CACHE", "hora has no oneCCL backend"),
    ("HOROVOD_ADASUM_MPI_CHUNK_SIZE", "hora's Adasum is one allgather and a local tree, with no MPI chunks"),
    ("HOROVOD_DISABLE_GROUP_FUSION", "hora fuses the allreduces ready in the same round, grouped or not"),
    ("HOROVOD_DISABLE_NVTX_RANGES", "hora emits no NVTX ranges (its timeline shows each op instead)"),
    ("HOROVOD_ENABLE_ASYNC_COMPLETION", "a GPU op's handle always completes without blocking the launch "
                                        "thread (CUDA events)"),
    ("HOROVOD_DYNAMIC_PROCESS_SETS", "process sets can always be added and removed after init()"),
    ("HOROVOD_ENABLE_XLA_OPS", "TensorFlow's XLA only"),
    ("HOROVOD_ELASTIC", "an elastic worker learns it is one from hora run (HORA_ELASTIC)"),
)


def ignored_horovod_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """The :data:`HOROVOD_ONLY` variables set in ``environ``, each as "NAME=value: why it has no effect"."""
    env = hora_env.environ() if environ is None else environ
    return [f"{name}={env[name]}: {why}" for name, why in HOROVOD_ONLY if env.get(name)]


def horovod_only_markdown() -> str:
    """The :data:`HOROVOD_ONLY` table as Markdown (the second table of docs/knobs.md)."""
    rows = ["| Horovod variable | why it has no effect in hora |", "|---|---|"]
    rows += [f"| `{name}` | {why} |" for name, why in HOROVOD_ONLY]
    return "\n".join(rows) + "\n"


assert {f.name for f in dataclasses.fields(Knobs)} - {"explicit"} == {k.name[5:].lower() for k in KNOBS}
