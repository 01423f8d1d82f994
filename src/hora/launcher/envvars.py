"""What each worker's environment holds.

* The launcher's environment, forwarded to every host minus host-specific variables (``HOSTNAME``,
  ``SSH_*``, ``DISPLAY``...) and minus another launcher's rank variables.
* ``-x NAME[=VALUE]`` and the knobs set by horovodrun's flags (:attr:`RunConfig.env`).
* Per rank: hora's ``HORA_*``, torchrun-style and horovodrun-style variables (the contract in
  ``hora.common.env.WorkerEnv``), and the job's secret (``HORA_SECRET``, set by the agent from the job spec: it is in
  no other process's environment and on no command line).
"""

from __future__ import annotations

from collections.abc import Mapping

from hora.launcher.hosts import SlotInfo
from hora.protocol.jobsecret import ENV_SECRET, ENV_SECRET_FILE

_HOST_SPECIFIC = frozenset({
    "HOSTNAME", "HOST", "PWD", "OLDPWD", "SHLVL", "_", "DISPLAY", "XAUTHORITY", "TMUX", "TMUX_PANE", "STY",
    "WINDOW", "TERM_SESSION_ID", "LS_COLORS", "MAIL", "PS1", "PROMPT_COMMAND", "SESSION_MANAGER",
    "DBUS_SESSION_BUS_ADDRESS", "TMPDIR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
})
_HOST_SPECIFIC_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_", "KRB5", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
# Set afresh per rank; a value inherited from an outer launcher would be wrong. The job's secret too: the agent
# sets HORA_SECRET for each worker from the job spec (docs/security.md).
RANK_VARIABLES = (
    ENV_SECRET, ENV_SECRET_FILE,
    "HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE", "HORA_CROSS_RANK", "HORA_CROSS_SIZE",
    "HORA_HOSTNAME", "HORA_HOST_KEY", "HORA_STORE_ADDR", "HORA_STORE_PORT", "HORA_JOB_ID",
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
)


def is_host_specific(name: str) -> bool:
    """True for variables that describe the launcher's host or session, not the job."""
    return name in _HOST_SPECIFIC or name.startswith(_HOST_SPECIFIC_PREFIXES)


def forwarded(environ: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment as workers get it: host-specific and rank variables dropped, then
    ``extra`` (``-x`` and knobs) applied. ``extra`` may re-add a dropped name on purpose."""
    env = {k: v for k, v in environ.items() if not is_host_specific(k) and k not in RANK_VARIABLES}
    env.setdefault("PYTHONUNBUFFERED", "1")  # output reaches the console as it is printed
    env.update(extra)
    return env


def rank_env(slot: SlotInfo, *, store_addr: str, store_port: int, job_id: str) -> dict[str, str]:
    """The variables that tell one worker who it is and where the rendezvous store lives."""
    values = {
        "RANK": slot.rank, "SIZE": slot.size, "LOCAL_RANK": slot.local_rank, "LOCAL_SIZE": slot.local_size,
        "CROSS_RANK": slot.cross_rank, "CROSS_SIZE": slot.cross_size, "HOSTNAME": slot.hostname,
    }
    env = {f"HORA_{k}": str(v) for k, v in values.items()}
    env.update({f"HOROVOD_{k}": str(v) for k, v in values.items()})
    env.update({
        "HORA_HOST_KEY": slot.hostname,  # the name used to reach the host: unique per host
        "HORA_STORE_ADDR": store_addr, "HORA_STORE_PORT": str(store_port), "HORA_JOB_ID": job_id,
        "RANK": str(slot.rank), "LOCAL_RANK": str(slot.local_rank), "WORLD_SIZE": str(slot.size),
        "LOCAL_WORLD_SIZE": str(slot.local_size), "GROUP_RANK": str(slot.cross_rank),
        "MASTER_ADDR": store_addr, "MASTER_PORT": str(store_port),
        # Plain torch.distributed.init_process_group("env://") then joins the driver's store as a
        # client instead of trying to host it on MASTER_PORT (which the driver holds): torchrun's way.
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
    })
    return env
