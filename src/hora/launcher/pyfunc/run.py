"""``hora.run(fn)``: run a Python function on every rank, from a script or a Jupyter notebook.

With Horovod's elastic arguments (``min_num_proc``, ``max_num_proc``, ...) or a host discovery script the job
is elastic, as under ``hora run --min-np``: workers may fail or hosts come and go while ``fn`` trains with
``hvd.elastic.run``; the values come from the members of the last world (docs/elastic.md).

Example:
    >>> import hora
    >>> def work(scale):
    ...     hora.init()
    ...     return hora.rank() * scale
    >>> hora.run(work, args=(10,), num_proc=2)  # doctest: +SKIP
    [0, 10]
"""

from __future__ import annotations

import pickle
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.common import env as hora_env
from hora.errors import ConfigError, HoraError, JobFailedError
from hora.launcher.config import ElasticConfig, RunConfig, default_elastic_timeout, default_grace
from hora.launcher.elastic.driver import ElasticDriver
from hora.launcher.fixed.driver import Driver
from hora.launcher.hosts import HostSpec, hosts_from
from hora.launcher.procs import describe_exit
from hora.launcher.pyfunc import shipping
from hora.protocol.messages import PYRUN_ELASTIC_ERROR_KEY as ELASTIC_ERROR_KEY
from hora.protocol.messages import PYRUN_ELASTIC_RESULT_KEY as ELASTIC_RESULT_KEY
from hora.protocol.messages import PYRUN_FN_KEY as FN_KEY
from hora.protocol.messages import PYRUN_RESULT_KEY as RESULT_KEY
from hora.protocol.signedstore import SignedStore


class RemoteTraceback(Exception):
    """The traceback of the rank where the exception was raised (the ``__cause__`` of what re-raises)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _refuse_unsupported(**given: Any) -> None:
    """Horovod's run() arguments that hora cannot honour fail with the reason, never silently."""
    if given["use_mpi"] or given["mpi_args"] is not None:
        raise ConfigError("hora.run(use_mpi/mpi_args): hora has no MPI controller (it runs on torch.distributed "
                          "with Gloo/NCCL); drop the argument")
    if given["use_gloo"] is False:
        raise ConfigError("hora.run(use_gloo=False): Gloo is hora's only controller; drop the argument")


def _deprecated_spellings(num_proc: int, min_num_proc: int | None, max_num_proc: int | None,
                          network_interfaces: Sequence[str] | None, **old: Any
                          ) -> tuple[int, int | None, int | None, Sequence[str] | None]:
    """Horovod 0.28.1's ``np``, ``min_np``, ``max_np`` and ``network_interface`` (comma-separated): each one given
    warns as deprecated and replaces its new spelling, as in Horovod."""
    new = {"np": "num_proc", "min_np": "min_num_proc", "max_np": "max_num_proc",
           "network_interface": "network_interfaces"}
    for name, value in old.items():
        if value is not None and value != "":
            warnings.warn(f"hora.run({name}=...) is deprecated (Horovod 0.25 renamed it): use {new[name]}=",
                          DeprecationWarning, stacklevel=3)
    if old["np"] is not None:
        num_proc = old["np"]
    if old["min_np"] is not None:
        min_num_proc = old["min_np"]
    if old["max_np"] is not None:
        max_num_proc = old["max_np"]
    if old["network_interface"]:
        network_interfaces = [n.strip() for n in str(old["network_interface"]).split(",") if n.strip()]
    if isinstance(network_interfaces, str):  # a single name where Horovod wants a list: take it, not its letters
        network_interfaces = [n.strip() for n in network_interfaces.split(",") if n.strip()]
    return num_proc, min_num_proc, max_num_proc, network_interfaces


def _elastic(num_proc: int, min_num_proc: int | None, max_num_proc: int | None, slots: int | None,
             reset_limit: int | None, cooldown_range: Any, discovery: str | None, elastic_timeout: float | None,
             fixed_hosts: bool) -> ElasticConfig | None:
    """The elastic settings of a ``run()`` call (None: a fixed job), as ``hora run``'s flags make them."""
    if min_num_proc is None and max_num_proc is None and discovery is None:
        extra = [n for n, v in (("slots", slots), ("reset_limit", reset_limit), ("cooldown_range", cooldown_range),
                                ("elastic_timeout", elastic_timeout)) if v is not None]
        if extra:
            raise ConfigError(f"hora.run({extra[0]}=...) is an elastic setting: give min_num_proc= (with hosts=) or "
                              "host_discovery_script= too, or drop it")
        return None
    if discovery is not None and fixed_hosts:
        raise ConfigError("hora.run(host_discovery_script=..., hosts=/hostfile=...): an elastic job takes its hosts "
                          "from one of them")
    if cooldown_range is not None:
        try:
            low, high = (float(x) for x in cooldown_range)
        except (TypeError, ValueError):
            raise ConfigError(f"hora.run(cooldown_range={cooldown_range!r}): give (MIN, MAX) seconds") from None
        cooldown: tuple[float, float] | None = (low, high)
    else:
        cooldown = None
    timeout = elastic_timeout if elastic_timeout is not None else default_elastic_timeout(
        hora_env.launcher_environ())
    return ElasticConfig(min_np=min_num_proc if min_num_proc is not None else num_proc, max_np=max_num_proc,
                         slots_per_host=slots, discovery_script=discovery, elastic_timeout=float(timeout),
                         reset_limit=reset_limit, cooldown=cooldown)


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        num_proc: int = 1, min_num_proc: int | None = None, max_num_proc: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: Any = None, hosts: str | None = None,
        hostfile: str | None = None, host_discovery_script: str | None = None, start_timeout: float | None = None,
        ssh_port: int | None = None, ssh_identity_file: str | None = None, disable_cache: bool | None = None,
        output_filename: str | None = None, verbose: int | None = None, use_gloo: bool | None = None,
        use_mpi: bool | None = None, mpi_args: str | None = None, network_interface: str | None = None,
        network_interfaces: Sequence[str] | None = None, executable: str | None = None, np: int | None = None,
        min_np: int | None = None, max_np: int | None = None, *, elastic_timeout: float | None = None,
        ssh_options: Sequence[str] = (), env: Mapping[str, str] | None = None,
        prefix_output_with_timestamp: bool = False) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks and return the per-rank results in rank order.

    Horovod 0.28.1's ``horovod.run`` / ``horovod.runner.run``, with its arguments in its order. Each rank is a
    fresh process started like ``hora run`` starts workers (with the same environment variables), so ``func``
    calls ``hora.init()`` itself. Lambdas and closures work (see :mod:`hora.launcher.pyfunc.shipping`). Output
    lines carry their rank, as with ``hora run``.

    Args:
        func: the function; its arguments and return value must be picklable.
        num_proc: number of ranks. hosts / hostfile: as ``-H`` / ``--hostfile`` (default ``localhost:num_proc``).
        start_timeout: seconds to wait for every rank to start (default 30).
        ssh_port, ssh_identity_file, ssh_options: as the ``hora run`` flags.
        network_interfaces: the interfaces to use, e.g. ``["eth0"]`` (``--network-interfaces``).
        executable: the Python the ranks run (default: this one).
        disable_cache, verbose: accepted for Horovod's sake; hora keeps no host cache and logs through ``logging``.
        use_gloo: accepted (Gloo is hora's only controller); ``use_gloo=False`` fails.
        use_mpi, mpi_args, ``use_gloo=False``: fail with a :class:`~hora.errors.ConfigError` saying why (hora
            has no MPI controller).
        np, min_np, max_np, network_interface: Horovod's deprecated spellings of ``num_proc``, ``min_num_proc``,
            ``max_num_proc`` and ``network_interfaces`` (a comma-separated string); as in Horovod, each warns
            (``DeprecationWarning``) and wins over the new spelling.
        env: extra variables for every worker (like ``-x NAME=VALUE``).

    Elastic (any of ``min_num_proc``, ``max_num_proc``, ``host_discovery_script``; the others need one of them), as
    ``hora run`` with horovodrun's elastic flags: ``min_num_proc``/``max_num_proc`` (``--min-np``/``--max-np``;
    ``min_num_proc`` defaults to ``num_proc``), ``slots`` (``--slots-per-host``, for discovered hosts printed
    without slots), ``reset_limit``, ``cooldown_range=(MIN, MAX)`` (``--blacklist-cooldown-range``),
    ``host_discovery_script`` (``--host-discovery-script``) and the keyword-only ``elastic_timeout``
    (``--elastic-timeout``; hora's addition). ``num_proc`` is the number of slots to wait for before starting (at
    least ``min_num_proc``); hosts come from ``hosts``/``hostfile`` or the discovery script. ``func`` trains with
    ``hvd.elastic.run`` (see docs/elastic.md): a failed worker's host is blacklisted and the others go on.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``; elastic: of the ranks of the last world (workers that
        failed or left before it return nothing).

    Raises:
        The exception a rank raised (the first to fail; elastic: the failure that ended the job), chained to a
        :class:`RemoteTraceback` with its traceback; :class:`~hora.errors.JobFailedError` if a rank died
        without raising (a signal) or an elastic job failed (its one-line reason).
    """
    num_proc, min_num_proc, max_num_proc, network_interfaces = _deprecated_spellings(
        num_proc, min_num_proc, max_num_proc, network_interfaces, np=np, min_np=min_np, max_np=max_np,
        network_interface=network_interface)
    _refuse_unsupported(use_gloo=use_gloo, use_mpi=use_mpi, mpi_args=mpi_args)
    elastic = _elastic(num_proc, min_num_proc, max_num_proc, slots, reset_limit, cooldown_range,
                       host_discovery_script, elastic_timeout, hosts is not None or hostfile is not None)
    if elastic is not None:
        num_proc = max(num_proc, elastic.min_np)
        if elastic.max_np is not None and num_proc > elastic.max_np:
            raise ConfigError(f"hora.run(num_proc={num_proc}) is more than max_num_proc={elastic.max_np}")
    payload = shipping.dumps((func, tuple(args), dict(kwargs or {})))
    job_hosts = ((HostSpec("localhost", 1),) if host_discovery_script is not None  # the script names the hosts
                 else hosts_from(hosts or None, hostfile or None, num_proc, flags=("hosts=", "hostfile=")))
    cfg = RunConfig(
        command=(executable or sys.executable, "-m", "hora.launcher.pyfunc.worker"), np=num_proc, hosts=job_hosts,
        elastic=elastic, ssh_port=ssh_port, ssh_identity_file=ssh_identity_file,
        ssh_options=tuple(ssh_options), network_interfaces=tuple(network_interfaces or ()),
        start_timeout=30.0 if start_timeout is None else float(start_timeout), env=dict(env or {}),
        prefix_timestamp=prefix_output_with_timestamp, output_filename=output_filename,
        grace=default_grace(hora_env.launcher_environ()),
    )
    if elastic is not None:
        edriver = ElasticDriver(cfg, store_ready=lambda store: store.set(FN_KEY, payload))
        code = edriver.run()
        try:
            return _collect_elastic(edriver, code)
        finally:
            edriver.store = None
    driver = Driver(cfg, store_ready=lambda store: store.set(FN_KEY, payload))
    code = driver.run()
    try:
        return _collect(driver, code)
    finally:
        driver.store = None  # closes the store's socket


def _collect(driver: Driver, code: int) -> list[Any]:
    failed = driver.first_failure
    if failed is None and driver.interrupted is not None:
        raise KeyboardInterrupt(f"hora.run: interrupted ({driver.interrupted}); every rank was stopped")
    values = collect_results(driver.store, driver.cfg.np, lambda rank: f"host {driver.ranks[rank].slot.hostname}",
                             failed.slot.rank if failed is not None else None, complete=code == 0)
    if values is not None:
        return values
    if failed is not None:
        raise JobFailedError(f"hora.run: rank {failed.slot.rank} on host {failed.slot.hostname} failed: "
                          f"{describe_exit(failed.code, failed.sig)}", code)
    raise JobFailedError(f"hora.run: the job ended with status {code} before every rank returned", code)


def collect_results(store: SignedStore, np: int, where: Callable[[int], str], failed_rank: int | None,
                    complete: bool) -> list[Any] | None:
    """What the ranks of a function job (``python -m hora.launcher.pyfunc.worker``) left in the store.

    Returns every rank's value in rank order when ``complete`` (the job ended well) and every rank returned one;
    re-raises the exception a rank raised (``failed_rank``'s first, else the lowest rank's), chained to a
    :class:`RemoteTraceback` naming the rank and ``where(rank)`` (e.g. ``"host node2"``); None when no rank
    raised (the caller says how the job ended).
    """
    records: dict[int, tuple[Any, ...]] = {}
    for rank in range(np):
        key = RESULT_KEY.format(rank=rank)
        if store.check([key]):
            records[rank] = shipping.load(store, key)
    if complete and len(records) == np and all(r[0] == "ok" for r in records.values()):
        return [records[rank][1] for rank in range(np)]
    order = ([failed_rank] if failed_rank is not None else []) + sorted(records)
    for rank in order:
        record = records.get(rank)
        if record is not None and record[0] == "error":
            _reraise(f"rank {rank} on {where(rank)}", record)
    return None


def _collect_elastic(driver: ElasticDriver, code: int) -> list[Any]:
    """The values of the last world's ranks, or the failure that ended the elastic job."""
    store, world = driver.store, driver.world
    if code == 0 and world is not None:
        keys = [ELASTIC_RESULT_KEY.format(gen=world.gen, rank=r) for r in range(world.size)]
        records = [shipping.load(store, k) for k in keys if store.check([k])]
        if len(records) == world.size and all(r[0] == "ok" for r in records):
            return [r[1] for r in records]
    if driver.failure is None and driver.interrupted is not None:
        raise KeyboardInterrupt(f"hora.run: interrupted ({driver.interrupted}); every worker was stopped")
    failed = driver.failure.worker if driver.failure is not None else None
    if failed is not None:
        key = ELASTIC_ERROR_KEY.format(worker_id=failed.wid)
        if store.check([key]):
            _reraise(f"worker {failed.wid} on host {failed.host}", shipping.load(store, key))
    why = driver.failure.summary if driver.failure is not None else "not every rank of the last world returned"
    raise JobFailedError(f"hora.run: the elastic job failed: {why}", code or 1)


def _reraise(who: str, record: tuple[Any, ...]) -> None:
    _, blob, type_name, message, text = record
    cause = RemoteTraceback(f"{who} raised:\n{text}")
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - the class may not exist here
            exc = None
    if exc is None:
        exc = HoraError(f"{who} raised {type_name}: {message}")
    raise exc from cause
