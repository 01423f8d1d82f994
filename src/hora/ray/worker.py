"""The Ray actor that hosts one rank of a :class:`hora.ray.RayExecutor` job (Horovod's ``BaseHorovodWorker``).

Each rank is one actor, so one process, for the executor's life: ``hvd.init()`` in a function run there joins
the world the executor described in the actor's environment (``HOROVOD_RANK``... set through
:meth:`update_env_vars` before anything runs), and later calls find hora still initialised.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any

import ray

from hora.launcher.remote.agent import SHIM_DIR


class BaseHorovodWorker:
    """One rank's process. ``executable`` is the object :meth:`start_executable` built (None without a class)."""

    executable: Any = None

    def __init__(self, world_rank: int = 0, world_size: int = 1) -> None:
        self.world_rank = world_rank
        self.world_size = world_size
        if importlib.util.find_spec("horovod") is None:  # `import horovod.torch as hvd` gives hora, as under hora run
            sys.path.append(SHIM_DIR)

    def node_id(self) -> str:
        """The Ray node this actor runs on (its host, for local ranks)."""
        return str(ray.get_runtime_context().get_node_id())

    def hostname(self) -> str:
        return socket.gethostname()

    def describe(self) -> tuple[str, str, str, int]:
        """``(node id, node IP address, hostname, pid)``: where this rank runs, for its place and for reports."""
        return self.node_id(), ray.util.get_node_ip_address(), socket.gethostname(), os.getpid()

    def free_port(self) -> int:
        """A TCP port free on this node now (rank 0's ``hvd.init()`` serves the job's store on it)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def get_gpu_ids(self) -> list[int]:
        """The CUDA devices Ray gave this actor."""
        return [int(i) for i in ray.get_gpu_ids()]

    def update_env_vars(self, env_vars: Mapping[str, Any]) -> None:
        """Set variables in this process's environment (the rank's place, the job's secret: never a command line)."""
        os.environ.update({k: str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        """This process's environment (Horovod's API; it holds the job's secret: do not print it)."""
        return dict(os.environ)

    def start_executable(self, executable_cls: type | None = None, executable_args: list[Any] | None = None,
                         executable_kwargs: dict[str, Any] | None = None) -> None:
        """Build ``executable_cls(*args, **kwargs)`` here; :meth:`execute` hands it to each function."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, func: Callable[[Any], Any]) -> Any:
        """Run ``func(executable)`` in this rank's process and return its value."""
        return func(self.executable)
