"""Reaching the job's rendezvous store: the TCPStore every rank of a job (and ``hora run``'s driver) shares.

One client per store address per process (a TCPStore server must outlive ``shutdown()`` / ``init()``); a
host name that does not resolve fails in seconds, naming it; :func:`connector` makes further connections
(the Gloo plane's bell waits on its own). Whoever hosts the store (``hora run``'s driver, rank 0 under other
launchers) serves it on the job's address only, behind a guard that bounds what clients store (:func:`serve`);
hora's own keys are read and written through
:func:`job_store`, which authenticates every value (:mod:`hora.protocol.signedstore`). :func:`wrap_clients` lets a
measurement see every client this process opens (``hora bench control`` counts store operations with it).
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from hora.common.env import WorkerEnv
from hora.common.knobs import Knobs
from hora.common.store_guard import Limits, StoreGuard
from hora.errors import ConfigError
from hora.protocol import network
from hora.protocol.jobsecret import JobSecret
from hora.protocol.signedstore import SignedStore

LOOPBACK = "127.0.0.1"  # where torch's server of a store hora serves listens: only its guard faces the network
MB = 1 << 20
_RESOLVE_TIMEOUT = 10.0  # seconds; a rendezvous host name that takes longer to resolve is treated as unresolvable
_stores: dict[tuple[str, int], dist.Store] = {}  # a TCPStore server must outlive shutdown()/init()
_wrap: Callable[[dist.Store], dist.Store] | None = None  # see wrap_clients()
_unwrapped: dict[int, tuple[dist.Store, dist.Store]] = {}  # id(a wrapped job client) -> (it, the client it wraps)


def wrap_clients(wrap: Callable[[dist.Store], dist.Store] | None) -> None:
    """Pass every store client this process opens from now on (the job's client, the Gloo plane's extra
    connections) through ``wrap`` and use what it returns; None stops. For measurement only: ``hora bench
    control`` counts each rank's store operations this way (:mod:`hora.bench.store_tally`). A store written in
    Python that ``wrap`` returns must be kept alive by its maker: torch's C++ holds only its C++ half."""
    global _wrap
    _wrap = wrap


def _wrapped(client: dist.Store) -> dist.Store:
    return client if _wrap is None else _wrap(client)


def store(env: WorkerEnv, timeout: datetime.timedelta) -> dist.Store:
    if env.size == 1 and env.source == "single":
        return dist.HashStore()
    key = (env.store_addr, env.store_port)
    if key not in _stores:
        _check_resolvable(env)
        server = env.store_is_server and env.rank == 0
        try:
            client = (serve(env.store_addr, env.store_port, timeout) if server else
                      dist.TCPStore(env.store_addr, env.store_port, world_size=None, is_master=False, timeout=timeout,
                                    wait_for_workers=False))
            _stores[key] = _wrapped(client)
            if _stores[key] is not client:  # connector() clones what it wraps
                _unwrapped[id(_stores[key])] = (_stores[key], client)
        except Exception as e:  # c10d raises several types for the same failure
            raise ConfigError(
                f"rank {env.rank}: cannot reach the rendezvous store at {env.store_addr}:{env.store_port} "
                f"({e}); check that the address is reachable from this host and the port is open"
            ) from e
    return _stores[key]


def job_store(env: WorkerEnv, timeout: datetime.timedelta, secret: JobSecret | None) -> SignedStore:
    """The job's store as hora uses it: every value authenticated with ``secret`` (unprefixed)."""
    return SignedStore(store(env, timeout), secret, env.job_id, f"{env.store_addr}:{env.store_port}")


class GuardedStore(dist.TCPStore):
    """The job's store as the process serving it holds it: torch's TCPStore server on the loopback interface (this
    object is also this process's client of it), reached from the network through a :class:`StoreGuard`
    (:mod:`hora.common.store_guard`), whose port is :attr:`port`: what every other client connects to."""

    def __init__(self, guard_listener: socket.socket, timeout: datetime.timedelta, limits: Limits) -> None:
        backend = network.listen_on(LOOPBACK, 0)
        bound = backend.getsockname()[1]
        fd = backend.detach()  # the store owns it from here and closes it when it is destroyed
        try:
            super().__init__(LOOPBACK, bound, world_size=None, is_master=True, timeout=timeout,
                             wait_for_workers=False, master_listen_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):  # unless the store took it before it failed
                socket.close(fd)
            raise
        self.guard = StoreGuard(guard_listener, (LOOPBACK, bound), limits)

    @property
    def port(self) -> int:  # type: ignore[override]
        """The port clients reach the store at (the guard's; torch's own server listens on the loopback)."""
        return self.guard.port


def serve(addr: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The job's store, served on ``addr`` only (torch's own binds every interface of the host), on ``port``
    (0: any free port, read it from ``.port``); where ``addr`` is not this host's, every interface. What clients
    may store is bounded (:mod:`hora.common.store_guard`, the knobs ``HORA_STORE_MAX_*``)."""
    knobs = Knobs.from_environ()
    limits = Limits(value_bytes=int(knobs.store_max_value_mb * MB), host_bytes=int(knobs.store_max_host_mb * MB),
                    total_bytes=int(knobs.store_max_total_mb * MB))
    listener = network.listen_on(addr, port)
    try:
        return GuardedStore(listener, timeout, limits)
    except BaseException:
        listener.close()
        raise


def _check_resolvable(env: WorkerEnv) -> None:
    """Fail in seconds, naming the host, when the rendezvous address does not resolve.

    Without this check every rank retries the store connection until the start timeout (minutes), e.g. under
    Slurm when the first node's name is unknown to the nodes' resolver.
    """
    result: list[BaseException | None] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(env.store_addr, env.store_port, type=socket.SOCK_STREAM)
            result.append(None)
        except (OSError, UnicodeError) as e:
            result.append(e)

    thread = threading.Thread(target=resolve, name="hora-resolve", daemon=True)
    thread.start()
    thread.join(_RESOLVE_TIMEOUT)
    if result and result[0] is None:
        return
    why = f"{result[0]}" if result else f"no answer from the resolver within {_RESOLVE_TIMEOUT:.0f} s"
    origin = f" (from {env.store_addr_origin})" if env.store_addr_origin else ""
    raise ConfigError(
        f"rank {env.rank} on {env.hostname or socket.gethostname()}: the rendezvous host {env.store_addr!r}{origin} "
        f"does not resolve ({why}); set MASTER_ADDR to an address of that host every rank can reach "
        f"(e.g. its IP address) and MASTER_PORT if needed, then start the job again"
    )


def connector(store: dist.Store, prefix: str,
               timeout: datetime.timedelta) -> Callable[[], dist.Store] | None:
    """A factory of new client connections to the store (None for an in-memory store)."""
    store = _unwrapped.get(id(store), (store, store))[1]  # a client passed through wrap_clients(): clone what it wraps
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if not isinstance(inner, dist.TCPStore):
        return None
    clone = getattr(store, "clone", None)
    if clone is not None:  # torch >= 2.5: a new connection to the same server
        return lambda: dist.PrefixStore(prefix, _wrapped(clone()))
    host, port = inner.host, inner.port
    return lambda: dist.PrefixStore(prefix, _wrapped(dist.TCPStore(host, port, is_master=False, timeout=timeout,
                                                                   wait_for_workers=False)))


def default_store() -> dist.Store:
    """The store of the default group a script made itself (e.g. under torchrun)."""
    return _get_default_store()
