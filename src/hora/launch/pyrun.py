"""``hora.run(fn)``: run a Python function on every rank, from a script or a Jupyter notebook.

Example:
    >>> import hora
    >>> def work(scale):
    ...     hora.init()
    ...     return hora.rank() * scale
    >>> hora.run(work, args=(10,), np=2)  # doctest: +SKIP
    [0, 10]
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.errors import ConfigError, HoraError, JobFailedError
from hora.launch import shipping
from hora.launch.config import RunConfig
from hora.launch.driver import Driver
from hora.launch.hosts import hosts_from
from hora.launch.procs import describe_exit
from hora.launch.protocol import PYRUN_FN_KEY as FN_KEY
from hora.launch.protocol import PYRUN_RESULT_KEY as RESULT_KEY


class RemoteTraceback(Exception):
    """The traceback of the rank where the exception was raised (the ``__cause__`` of what re-raises)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _refuse_unsupported(**given: Any) -> None:
    """Horovod's run() arguments that hora cannot honour fail with the reason, never silently."""
    elastic = [name for name in ("min_np", "max_np", "slots", "reset_limit", "cooldown_range")
               if given[name] is not None]
    if elastic:
        raise ConfigError(f"hora.run({elastic[0]}=...): elastic jobs are not supported by hora yet; run with a "
                          "fixed np=")
    if given["use_mpi"] or given["mpi_args"] is not None:
        raise ConfigError("hora.run(use_mpi/mpi_args): hora has no MPI controller (it runs on torch.distributed "
                          "with Gloo/NCCL); drop the argument")
    if given["use_gloo"] is False:
        raise ConfigError("hora.run(use_gloo=False): Gloo is hora's only controller; drop the argument")


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, np: int = 1,
        min_np: int | None = None, max_np: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: Any = None, hosts: str | None = None,
        hostfile: str | None = None, start_timeout: float | None = None, ssh_port: int | None = None,
        ssh_identity_file: str | None = None, disable_cache: bool | None = None, output_filename: str | None = None,
        verbose: int | None = None, use_gloo: bool | None = None, use_mpi: bool | None = None,
        mpi_args: str | None = None, network_interface: str | None = None, executable: str | None = None, *,
        ssh_options: Sequence[str] = (), env: Mapping[str, str] | None = None,
        prefix_output_with_timestamp: bool = False) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``np`` ranks and return the per-rank results in rank order.

    Horovod's ``horovod.run`` / ``horovod.runner.run``, with its arguments in its order. Each rank is a fresh
    process started like ``hora run`` starts workers (with the same environment variables), so ``func`` calls
    ``hora.init()`` itself. Lambdas and closures work (see :mod:`hora.launch.shipping`). Output lines carry
    their rank, as with ``hora run``.

    Args:
        func: the function; its arguments and return value must be picklable.
        np: number of ranks. hosts / hostfile: as ``-H`` / ``--hostfile`` (default ``localhost:np``).
        start_timeout: seconds to wait for every rank to start (default 30).
        ssh_port, ssh_identity_file, ssh_options, network_interface: as the ``hora run`` flags.
        executable: the Python the ranks run (default: this one).
        disable_cache, verbose: accepted for Horovod's sake; hora keeps no host cache and logs through ``logging``.
        use_gloo: accepted (Gloo is hora's only controller); ``use_gloo=False`` fails.
        min_np, max_np, slots, reset_limit, cooldown_range (elastic), use_mpi, mpi_args: fail with a
            :class:`~hora.errors.ConfigError` saying why (hora has no elastic mode and no MPI controller).
        env: extra variables for every worker (like ``-x NAME=VALUE``).

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        The exception a rank raised (the first to fail), chained to a :class:`RemoteTraceback` with that
        rank's traceback; :class:`~hora.errors.JobFailedError` if a rank died without raising (a signal).
    """
    _refuse_unsupported(min_np=min_np, max_np=max_np, slots=slots, reset_limit=reset_limit,
                        cooldown_range=cooldown_range, use_gloo=use_gloo, use_mpi=use_mpi, mpi_args=mpi_args)
    payload = shipping.dumps((func, tuple(args), dict(kwargs or {})))
    cfg = RunConfig(
        command=(executable or sys.executable, "-m", "hora.launch.pyworker"), np=np,
        hosts=hosts_from(hosts or None, hostfile or None, np, flags=("hosts=", "hostfile=")),
        ssh_port=ssh_port, ssh_identity_file=ssh_identity_file,
        ssh_options=tuple(ssh_options), network_interfaces=(network_interface,) if network_interface else (),
        start_timeout=30.0 if start_timeout is None else float(start_timeout), env=dict(env or {}),
        prefix_timestamp=prefix_output_with_timestamp, output_filename=output_filename,
    )
    driver = Driver(cfg, store_ready=lambda store: store.set(FN_KEY, payload))
    code = driver.run()
    try:
        return _collect(driver, code)
    finally:
        driver.store = None  # closes the store's socket


def _collect(driver: Driver, code: int) -> list[Any]:
    store = driver.store
    records: dict[int, tuple[Any, ...]] = {}
    for rank in range(driver.cfg.np):
        key = RESULT_KEY.format(rank=rank)
        if store.check([key]):
            records[rank] = shipping.loads(store.get(key))
    failed = driver.first_failure
    if failed is None and driver.interrupted is not None:
        raise KeyboardInterrupt(f"hora.run: interrupted ({driver.interrupted}); every rank was stopped")
    if code == 0 and len(records) == driver.cfg.np and all(r[0] == "ok" for r in records.values()):
        return [records[rank][1] for rank in range(driver.cfg.np)]
    order = ([failed.slot.rank] if failed is not None else []) + sorted(records)
    for rank in order:
        record = records.get(rank)
        if record is not None and record[0] == "error":
            _reraise(rank, driver.ranks[rank].slot.hostname, record)
    if failed is not None:
        raise JobFailedError(f"hora.run: rank {failed.slot.rank} on host {failed.slot.hostname} failed: "
                          f"{describe_exit(failed.code, failed.sig)}", code)
    raise JobFailedError(f"hora.run: the job ended with status {code} before every rank returned", code)


def _reraise(rank: int, host: str, record: tuple[Any, ...]) -> None:
    _, blob, type_name, message, text = record
    cause = RemoteTraceback(f"rank {rank} on host {host} raised:\n{text}")
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - the class may not exist here
            exc = None
    if exc is None:
        exc = HoraError(f"rank {rank} on host {host} raised {type_name}: {message}")
    raise exc from cause
