"""The frozen :class:`RunConfig` of a ``hora run`` job, built from parsed flags and checked once.

Everything the driver needs is decided here, at the edge: hosts and slots, the command, ssh settings,
what the workers' environment gets (``-x``, tuning knobs from horovodrun's flags).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hora.common import env as hora_env
from hora.common.knobs import KNOBS
from hora.errors import ConfigError
from hora.launcher.hosts import HostSpec, check_missing_colons, hosts_from


def _bool01(value: object) -> str:
    return "1" if value else "0"


# horovodrun flags that become worker knobs: (argparse dest, knob variable, value -> text, or None for nothing).
# A flag given explicitly sets its knob even to the default, so --autotune holds it constant (as Horovod does).
FLAG_KNOBS: tuple[tuple[str, str, object], ...] = (
    ("timeline_filename", "HORA_TIMELINE", lambda v: str(Path(v).resolve())),
    ("timeline_mark_cycles", "HORA_TIMELINE_MARK_CYCLES", _bool01),
    ("no_stall_check", "HORA_STALL_CHECK_DISABLE", _bool01),
    ("stall_check_warning_time_seconds", "HORA_STALL_CHECK_TIME_SECONDS", str),
    ("stall_check_shutdown_time_seconds", "HORA_STALL_SHUTDOWN_TIME_SECONDS", str),
    ("fusion_threshold_mb", "HORA_FUSION_THRESHOLD", lambda v: str(int(float(v) * 1024 * 1024))),
    ("cycle_time_ms", "HORA_CYCLE_TIME", str),
    ("cache_capacity", "HORA_DISABLE_CACHE", lambda v: "1" if int(v) == 0 else "0"),
    ("hierarchical_allreduce", "HORA_HIERARCHICAL_ALLREDUCE", _bool01),
    ("autotune", "HORA_AUTOTUNE", _bool01),
    ("autotune_log_file", "HORA_AUTOTUNE_LOG", lambda v: str(Path(v).resolve())),
    ("autotune_warmup_samples", "HORA_AUTOTUNE_WARMUP_SAMPLES", str),
    ("autotune_steps_per_sample", "HORA_AUTOTUNE_STEPS_PER_SAMPLE", str),
    ("autotune_bayes_opt_max_samples", "HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", str),
    ("autotune_gaussian_process_noise", "HORA_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", str),
    ("thread_affinity", "HORA_THREAD_AFFINITY", str),
    ("log_with_timestamp", "HORA_LOG_HIDE_TIME", lambda v: "0" if v else "1"),
    ("log_level", "HORA_LOG_LEVEL", str),
    ("gloo_timeout_seconds", "HORA_START_TIMEOUT", str),
    ("start_timeout", "HORA_START_TIMEOUT", str),  # after --gloo-timeout-seconds: it wins
    ("verbose", "HORA_FULL_TRACEBACKS", lambda v: "1" if v else None),
)
_KNOWN_KNOBS = {k.name for k in KNOBS}
assert all(var in _KNOWN_KNOBS for _, var, _ in FLAG_KNOBS), "a flag maps to a knob knobs.KNOBS lacks"

ELASTIC_FLAGS = ("min_np", "max_np", "slots_per_host", "host_discovery_script", "elastic_timeout",
                 "reset_limit", "blacklist_cooldown_range")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Seconds a stopped worker gets between SIGTERM and SIGKILL. Kubernetes (terminationGracePeriodSeconds) and Slurm
# (KillWait) give the launcher 30 s by default before they SIGKILL it: the ranks get most of that, and the
# launcher keeps a few seconds to kill the late ones and say which they were.
DEFAULT_GRACE = 25.0
GRACE_ENV = "HORA_GRACE_PERIOD"


DEFAULT_ELASTIC_TIMEOUT = 600.0  # horovodrun's default --elastic-timeout


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticConfig:
    """The elastic settings of a ``hora run`` job (see docs/elastic.md).

    ``np`` (the job's ``-np``) is the number of slots to wait for before the first world starts; the job then
    starts with every available slot up to ``max_np``.
    """

    min_np: int
    max_np: int | None = None
    slots_per_host: int | None = None  # slots of a discovered host printed without ":slots"
    discovery_script: str | None = None  # None: the fixed hosts of -H/--hostfile
    elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT
    reset_limit: int | None = None
    cooldown: tuple[float, float] | None = None  # --blacklist-cooldown-range MIN MAX; None: blacklisted for good

    def __post_init__(self) -> None:
        if self.min_np < 1:
            raise ConfigError(f"--min-np {self.min_np}: must be at least 1")
        if self.max_np is not None and self.max_np < self.min_np:
            raise ConfigError(f"--max-np {self.max_np} is less than --min-np {self.min_np}")
        if self.slots_per_host is not None and self.slots_per_host < 1:
            raise ConfigError(f"--slots-per-host {self.slots_per_host}: must be at least 1")
        if self.elastic_timeout <= 0:
            raise ConfigError(f"--elastic-timeout {self.elastic_timeout:g}: must be more than 0 seconds")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ConfigError(f"--reset-limit {self.reset_limit}: must not be negative")
        if self.cooldown is not None:
            low, high = self.cooldown
            if low < 0 or high < low:
                raise ConfigError(f"--blacklist-cooldown-range {low:g} {high:g}: give MIN MAX seconds with "
                                  "0 <= MIN <= MAX")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """A checked ``hora run`` job. Build it with :func:`from_args` or directly (``hora.run`` does)."""

    command: tuple[str, ...]
    np: int
    hosts: tuple[HostSpec, ...]
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_options: tuple[str, ...] = ()
    ssh_config_file: str | None = None
    network_interfaces: tuple[str, ...] = ()
    start_timeout: float = 30.0
    output_filename: str | None = None
    prefix_timestamp: bool = False
    verbose: bool = False
    env: dict[str, str] = field(default_factory=dict)  # -x and knobs: set in every worker
    timeline_filename: str | None = None
    python: str = sys.executable
    cwd: str = field(default_factory=os.getcwd)
    grace: float = DEFAULT_GRACE  # --grace-period: seconds between SIGTERM and SIGKILL when stopping workers
    heartbeat_timeout: float = 30.0  # an agent that hears nothing for this long stops its workers
    elastic: ElasticConfig | None = None  # an elastic job (--min-np, --host-discovery-script ...)

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("no command given; usage: hora run -np 2 python train.py")
        if self.np < 1:
            raise ConfigError(f"-np {self.np}: the number of processes must be at least 1")
        if self.start_timeout <= 0:
            raise ConfigError(f"--start-timeout {self.start_timeout:g}: must be more than 0 seconds")
        if not self.grace >= 0:
            raise ConfigError(f"--grace-period {self.grace:g}: must be 0 or more seconds")
        if self.heartbeat_timeout < 3:
            raise ConfigError(f"--heartbeat-timeout {self.heartbeat_timeout:g}: must be at least 3 seconds "
                              "(the launcher pings every host every 2 seconds)")

    @property
    def all_local(self) -> bool:
        """True when every host is this machine (no ssh needed)."""
        return all(h.is_local for h in self.hosts)


def _refuse_unsupported(ns: argparse.Namespace) -> None:
    if ns.mpi or ns.mpi_args is not None:
        flag = "--mpi" if ns.mpi else "--mpi-args"
        raise ConfigError(f"{flag}: hora has no MPI controller (it runs on torch.distributed with Gloo/NCCL); "
                          "drop the flag, or launch with mpirun directly (hora.init() reads Open MPI/MPICH variables)")
    if ns.jsrun:
        raise ConfigError("--jsrun: hora cannot launch through jsrun; use -H/--hostfile (ssh), or start ranks "
                          "with jsrun yourself and let hora.init() read their environment")


def default_elastic_timeout(environ: dict[str, str]) -> float:
    """``--elastic-timeout`` when not given: ``HOROVOD_ELASTIC_TIMEOUT`` / ``HORA_ELASTIC_TIMEOUT``, else 600 s."""
    text = environ.get("HOROVOD_ELASTIC_TIMEOUT") or environ.get("HORA_ELASTIC_TIMEOUT")
    try:
        return float(text) if text else DEFAULT_ELASTIC_TIMEOUT
    except ValueError:
        raise ConfigError(f"HOROVOD_ELASTIC_TIMEOUT={text!r}: not a number of seconds") from None


def default_grace(environ: dict[str, str]) -> float:
    """``--grace-period`` when not given: ``HORA_GRACE_PERIOD``, else :data:`DEFAULT_GRACE` seconds."""
    text = environ.get(GRACE_ENV)
    try:
        return float(text) if text else DEFAULT_GRACE
    except ValueError:
        raise ConfigError(f"{GRACE_ENV}={text!r}: not a number of seconds") from None


def _elastic(ns: argparse.Namespace, environ: dict[str, str]) -> ElasticConfig | None:
    """The elastic settings, when any elastic flag is given (``--min-np``, ``--host-discovery-script`` ...)."""
    if all(getattr(ns, name) is None for name in ELASTIC_FLAGS):
        return None
    if ns.host_discovery_script is not None and (ns.hosts is not None or ns.hostfile is not None):
        raise ConfigError("--host-discovery-script and -H/--hostfile both given; an elastic job takes its hosts "
                          "from one of them")
    if ns.host_discovery_script is None and ns.min_np is None:
        raise ConfigError("elastic flags without --host-discovery-script or --min-np: give --min-np N (with "
                          "-H/--hostfile) or a --host-discovery-script")
    timeout = ns.elastic_timeout if ns.elastic_timeout is not None else default_elastic_timeout(environ)
    min_np = ns.min_np if ns.min_np is not None else (ns.np if ns.np is not None else 1)
    cooldown = ns.blacklist_cooldown_range
    return ElasticConfig(min_np=min_np, max_np=ns.max_np, slots_per_host=ns.slots_per_host,
                         discovery_script=ns.host_discovery_script, elastic_timeout=float(timeout),
                         reset_limit=ns.reset_limit,
                         cooldown=(float(cooldown[0]), float(cooldown[1])) if cooldown is not None else None)


def _extra_env(pairs: list[str], environ: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not _ENV_NAME.match(name):
            raise ConfigError(f"-x {pair}: {name!r} is not a valid environment variable name; "
                              "write -x NAME or -x NAME=VALUE")
        if not sep:
            if name not in environ:
                raise ConfigError(f"-x {name}: {name} is not set in the launcher's environment; "
                                  f"set it or write -x {name}=VALUE")
            value = environ[name]
        env[name] = value
    return env


def _knob_env(ns: argparse.Namespace) -> dict[str, str]:
    env: dict[str, str] = {}
    for dest, var, convert in FLAG_KNOBS:
        value = getattr(ns, dest, None)
        if value is None:
            continue
        text = convert(value)  # type: ignore[operator]
        if text is not None:
            env[var] = text
    return env


def _check_numbers(ns: argparse.Namespace) -> None:
    for dest in ("stall_check_warning_time_seconds", "stall_check_shutdown_time_seconds",
                 "fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "gloo_timeout_seconds",
                 "autotune_warmup_samples", "autotune_steps_per_sample", "autotune_bayes_opt_max_samples"):
        value = getattr(ns, dest)
        if value is not None and value < 0:
            raise ConfigError(f"--{dest.replace('_', '-')} {value:g}: must not be negative")
    if ns.autotune_steps_per_sample is not None and ns.autotune_steps_per_sample < 1:
        raise ConfigError(f"--autotune-steps-per-sample {ns.autotune_steps_per_sample}: must be at least 1")
    noise = ns.autotune_gaussian_process_noise
    if noise is not None and not 0 <= noise <= 1:
        raise ConfigError(f"--autotune-gaussian-process-noise {noise:g}: must be in [0, 1]")
    if ns.thread_affinity is not None and not re.fullmatch(r"\d+(,\d+)*", ns.thread_affinity.replace(" ", "")):
        raise ConfigError(f"--thread-affinity {ns.thread_affinity}: give a core number, or one per local rank "
                          "separated by commas (e.g. 0,2,4,6)")
    if ns.ssh_port is not None and not 0 < ns.ssh_port < 65536:
        raise ConfigError(f"-p {ns.ssh_port}: an ssh port is between 1 and 65535")


def _unwritable(path: str) -> str | None:
    """Why a directory could not be made or written at ``path`` (None when it can), without creating it."""
    probe = Path(path).resolve()
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        return f"{probe} is a file, so nothing can be created under it"
    if not os.access(probe, os.W_OK | os.X_OK):
        fs = os.statvfs(probe)
        readonly = bool(fs.f_flag & os.ST_RDONLY)
        return f"{probe} is on a read-only filesystem" if readonly else f"{probe} is not writable by this user"
    return None


def _check_files(ns: argparse.Namespace) -> None:
    for flag, path in (("-i", ns.ssh_identity_file), ("--ssh-config-file", ns.ssh_config_file)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: no such file")
    if ns.output_filename is not None:
        if os.path.exists(ns.output_filename) and not os.path.isdir(ns.output_filename):
            raise ConfigError(f"--output-filename {ns.output_filename}: exists and is not a directory; "
                              "give a directory (logs go to DIR/rank.N/stdout|stderr)")
        why = _unwritable(ns.output_filename)
        if why is not None:
            raise ConfigError(f"--output-filename {ns.output_filename}: cannot write the logs there ({why}); "
                              "give a writable directory")
    if ns.timeline_filename is not None:
        target = Path(ns.timeline_filename).resolve()
        try:  # created if missing, as each worker does on its own host
            target.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(f"--timeline-filename {ns.timeline_filename}: {target.parent} is not a directory") \
                from None
        except OSError as exc:
            raise ConfigError(f"--timeline-filename {ns.timeline_filename}: cannot create directory {target.parent} "
                              f"({exc.strerror or exc})") from None
        if target.is_dir():
            raise ConfigError(f"--timeline-filename {ns.timeline_filename}: is a directory; give a file name, "
                              f"e.g. {os.path.join(ns.timeline_filename, 'timeline.json')}")
        why = _unwritable(str(target.parent))
        if why is not None:
            raise ConfigError(f"--timeline-filename {ns.timeline_filename}: cannot write it ({why}); "
                              "give a path in a writable directory")


def _check_command(command: tuple[str, ...], path: str, cwd: str) -> tuple[str, ...]:
    """On local launches, catch a missing program or script before starting anything."""
    program = command[0]
    if program.endswith(".py") and os.path.isfile(os.path.join(cwd, program)) and not os.access(
            os.path.join(cwd, program), os.X_OK):
        return (sys.executable, *command)  # `hora run -np 2 train.py`: run it with this Python
    if shutil.which(program, path=path) is None and not os.path.isfile(os.path.join(cwd, program)):
        raise ConfigError(f"command {program!r} not found (not a file, not on PATH); "
                          "check the spelling or give its full path")
    script = next((a for a in command[1:] if not a.startswith("-")), None)
    if os.path.basename(program).startswith("python") and script and script.endswith(".py") \
            and not os.path.isfile(os.path.join(cwd, script)):
        raise ConfigError(f"script {script!r} not found in {cwd}; check the path")
    return command


def from_args(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> RunConfig:
    """Check parsed ``hora run`` flags and build the :class:`RunConfig`.

    Raises:
        ConfigError: the first problem found, as one line that names the flag and the fix.
    """
    environ = hora_env.launcher_environ() if environ is None else environ
    _refuse_unsupported(ns)
    command = tuple(ns.command[1:] if ns.command[:1] == ["--"] else ns.command)
    if not command:
        raise ConfigError("no command given; usage: hora run -np 2 python train.py")
    if ns.np is not None and ns.np < 1:
        raise ConfigError(f"-np {ns.np}: the number of processes must be at least 1")
    elastic = _elastic(ns, environ)
    if elastic is not None and ns.host_discovery_script is not None:
        hosts: tuple[HostSpec, ...] = (HostSpec("localhost", 1),)  # placeholder: the script names the hosts
    else:
        hosts = hosts_from(ns.hosts, ns.hostfile, ns.np)
        check_missing_colons(hosts, f"-H {ns.hosts!r}" if ns.hosts is not None else f"--hostfile {ns.hostfile}")
    _check_numbers(ns)
    _check_files(ns)
    cwd = os.getcwd()
    if all(h.is_local for h in hosts) and (elastic is None or elastic.discovery_script is None):
        command = _check_command(command, environ.get("PATH", os.defpath), cwd)
    env = _knob_env(ns)
    if ns.tcp:
        env["NCCL_IB_DISABLE"] = "1"  # horovodrun --tcp: NCCL keeps off InfiniBand
    env.update(_extra_env(ns.x or [], environ))
    ifaces = tuple(i for spec in (ns.network_interfaces or []) for i in spec.split(",") if i)
    np = ns.np if ns.np is not None else sum(h.slots for h in hosts)
    if elastic is not None:
        np = ns.np if ns.np is not None else elastic.min_np
        if np < elastic.min_np:
            raise ConfigError(f"-np {np} is less than --min-np {elastic.min_np}; -np is the number of slots to "
                              "wait for before starting")
        if elastic.max_np is not None and np > elastic.max_np:
            raise ConfigError(f"-np {np} is more than --max-np {elastic.max_np}")
    return RunConfig(
        command=command, np=np, hosts=hosts, elastic=elastic,
        ssh_port=ns.ssh_port, ssh_identity_file=ns.ssh_identity_file, ssh_options=tuple(ns.ssh_option or ()),
        ssh_config_file=ns.ssh_config_file, network_interfaces=ifaces,
        start_timeout=float(ns.start_timeout) if ns.start_timeout is not None else 30.0,
        output_filename=ns.output_filename, prefix_timestamp=bool(ns.prefix_output_with_timestamp),
        verbose=bool(ns.verbose), env=env,
        timeline_filename=env.get("HORA_TIMELINE"), cwd=cwd,
        heartbeat_timeout=float(ns.heartbeat_timeout) if ns.heartbeat_timeout is not None else 30.0,
        grace=float(ns.grace_period) if ns.grace_period is not None else default_grace(environ),
    )
