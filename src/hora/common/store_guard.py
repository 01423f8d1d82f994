"""The rendezvous store's front door: what clients may store is bounded, per host and in all, so a stranger who
reaches the store's port cannot fill the memory of the host that serves it.

torch's TCPStore server keeps every value any client sends, and nothing bounds them (issue 33 measured a
launcher growing from 232 MB to 542 MB under 300 one-MiB values from a stranger). So the job's store is served
behind this guard (:func:`hora.common.rendezvous.serve`): torch's server listens on the loopback interface only,
and the guard, on the job's address, relays each client's connection to it. It reads every request as it
streams through (torch's wire format: a command byte, then 64-bit little-endian lengths before each key and
value; ``torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp``), never holding a whole value, and passes the
server's replies back untouched. A request that would

- write a key outside hora's prefixes (``hora/``, ``hora.run/``, ``hora.spark/``; torch's own keys for hora's
  groups live under ``hora/``),
- store a value longer than :attr:`Limits.value_bytes`,
- make the values last written from one host hold more than :attr:`Limits.host_bytes` (a key costs its name,
  its value and 64 bytes), or the whole store more than :attr:`Limits.total_bytes`,

is refused before torch's server has it whole: that client's connection is closed and one warning names its
address, the key and the bound. The job's other clients go on. Hosts, not connections, are the unit, so a
stranger cannot reset its account by reconnecting; ranks of the job that share a host share its account.

The guard is a Python thread of the serving process, whose own client talks to torch's server directly (its
keys are not counted): a client in that same process must not go through the guard, since some of torch's
client calls hold the GIL while they wait for the answer.

Example:
    >>> guard = StoreGuard(listener, ("127.0.0.1", backend_port), Limits())  # doctest: +SKIP
    >>> guard.close()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass

log = logging.getLogger(__name__)

PREFIXES = ("hora/", "hora.run/", "hora.spark/")
KEY_OVERHEAD = 64  # what a key costs besides its name and value (the server's map entry, roughly)
MAX_KEY_BYTES = 4096  # hora's and torch's keys are short; a longer one is refused
MAX_KEYS_PER_REQUEST = 1 << 16  # keys of one check, wait or multi_get / multi_set
_CHUNK = 1 << 16
_BACKLOG_BYTES = 4 << 20  # relayed bytes one side may have waiting before the guard stops reading the other
_U64 = struct.Struct("<Q")

# torch's QueryType (TCPStoreBackend.hpp), the requests a client sends
(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET,
 CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST_KEYS, BARRIER) = range(19)


@dataclass(frozen=True, slots=True)
class Limits:
    """What the store's clients may hold (knobs ``HORA_STORE_MAX_VALUE_MB``, ``HORA_STORE_MAX_HOST_MB``,
    ``HORA_STORE_MAX_TOTAL_MB``, docs/knobs.md)."""

    value_bytes: int = 64 << 20  # one value (hora.run's function and results are the big ones)
    host_bytes: int = 64 << 20  # every value last written from one host
    total_bytes: int = 512 << 20  # every value


class Refused(Exception):
    """A request over a bound; the message says which (the connection is closed)."""


class Ledger:
    """Who holds what in the store: each key's cost and the host that last wrote it."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._keys: dict[str, tuple[str, int]] = {}  # key -> (host, cost)
        self._hosts: dict[str, int] = {}
        self.total = 0

    def held(self, host: str) -> int:
        return self._hosts.get(host, 0)

    def charge(self, host: str, key: str, size: int, grow: bool = False) -> None:
        """``host`` writes ``size`` bytes to ``key`` (``grow``: appended to what it holds).

        Raises:
            Refused: a key outside hora's prefixes, or a bound would be passed.
        """
        key = key.removeprefix("/")  # torch's clients put "/" before every key
        if not key.startswith(PREFIXES):
            raise Refused(f"it writes {key[:80]!r}, outside hora's keys ({', '.join(PREFIXES)})")
        if size > self.limits.value_bytes:
            raise Refused(f"it writes a {size}-byte value to {key[:80]!r} (at most {self.limits.value_bytes} bytes "
                          "per value: HORA_STORE_MAX_VALUE_MB)")
        owner, old = self._keys.get(key, (host, 0))
        cost = (old + size) if grow else len(key) + KEY_OVERHEAD + size
        if grow and old == 0:
            cost += len(key) + KEY_OVERHEAD
        mine = self.held(host) - (old if owner == host else 0) + cost
        if mine > self.limits.host_bytes:
            raise Refused(f"its host would hold {mine} bytes in the store with {key[:80]!r} (at most "
                          f"{self.limits.host_bytes} per host: HORA_STORE_MAX_HOST_MB)")
        total = self.total - old + cost
        if total > self.limits.total_bytes:
            raise Refused(f"the store would hold {total} bytes with {key[:80]!r} (at most {self.limits.total_bytes}: "
                          "HORA_STORE_MAX_TOTAL_MB)")
        self._move(key, host, cost)

    def release(self, key: str) -> None:
        """``key`` was deleted."""
        key = key.removeprefix("/")
        if key in self._keys:
            self._move(key, None, 0)

    def _move(self, key: str, host: str | None, cost: int) -> None:
        owner, old = self._keys.pop(key, ("", 0))
        if owner:
            self._hosts[owner] -= old
        self.total += cost - old
        if host is not None:
            self._keys[key] = (host, cost)
            self._hosts[host] = self.held(host) + cost


# --- one client's requests, read as they stream through -------------------------------------------------------
Step = tuple[bool, int]  # (True, n): the next field, n bytes, to read whole; (False, n): n bytes to pass through


class RequestReader:
    """The requests of one client's byte stream, checked against ``ledger`` as they arrive.

    :meth:`feed` returns what may go on to torch's server. A field (a command, a length, a key) is passed once
    the request so far is acceptable; a value's bytes stream through without being held, once its length was
    charged. So torch's server never has a refused request whole.
    """

    def __init__(self, ledger: Ledger, host: str) -> None:
        self._ledger = ledger
        self._host = host
        self._steps = self._requests()
        self._step = next(self._steps)
        self._held = bytearray()

    def feed(self, data: bytes) -> bytes:
        """The bytes of ``data`` to relay. Raises :class:`Refused` (nothing more may be relayed)."""
        out = bytearray()
        view = memoryview(data)
        while True:
            whole, n = self._step
            if n == 0:
                self._step = self._steps.send(b"" if whole else None)
                continue
            if not view:
                return bytes(out)
            if not whole:  # a value's bytes: straight through
                take = min(n, len(view))
                out += view[:take]
                view = view[take:]
                self._step = (False, n - take) if take < n else self._steps.send(None)
                continue
            take = min(n - len(self._held), len(view))
            self._held += view[:take]
            view = view[take:]
            if len(self._held) == n:
                field = bytes(self._held)
                self._held.clear()
                self._step = self._steps.send(field)  # raises Refused: this field is not relayed
                out += field

    def _requests(self) -> Generator[Step, bytes | None, None]:
        while True:
            command = (yield (True, 1))
            assert command is not None
            kind = command[0]
            if kind in (VALIDATE, PING):
                yield (True, 4)
            elif kind in (GET, QUEUE_POP, QUEUE_LEN):
                yield from self._key()
            elif kind == DELETE_KEY:
                self._ledger.release((yield from self._key()))
            elif kind in (SET, APPEND, QUEUE_PUSH):
                key = yield from self._key()
                yield from self._value(key, grow=kind != SET)
            elif kind == COMPARE_SET:
                key = yield from self._key()
                expected = yield from self._length()
                if expected > self._ledger.limits.value_bytes:
                    raise Refused(f"it compares {key[:80]!r} with a {expected}-byte value")
                yield (False, expected)
                yield from self._value(key, grow=False)
            elif kind in (ADD, BARRIER):
                self._ledger.charge(self._host, (yield from self._key()), 8)
                yield (True, 8)
            elif kind in (CHECK, WAIT, MULTI_GET):
                for _ in range((yield from self._count())):
                    yield from self._key()
            elif kind == MULTI_SET:
                for _ in range((yield from self._count())):
                    yield from self._value((yield from self._key()), grow=False)
            elif kind not in (GETNUMKEYS, CANCEL_WAIT, LIST_KEYS):
                raise Refused(f"it sent request type {kind}, which is not torch's")

    def _length(self) -> Generator[Step, bytes | None, int]:
        raw = yield (True, 8)
        assert raw is not None
        return int(_U64.unpack(raw)[0])

    def _count(self) -> Generator[Step, bytes | None, int]:
        n = yield from self._length()
        if n > MAX_KEYS_PER_REQUEST:
            raise Refused(f"it names {n} keys in one request (at most {MAX_KEYS_PER_REQUEST})")
        return n

    def _key(self) -> Generator[Step, bytes | None, str]:
        n = yield from self._length()
        if n > MAX_KEY_BYTES:
            raise Refused(f"it sent a {n}-byte key (at most {MAX_KEY_BYTES})")
        raw = yield (True, n)
        assert raw is not None
        return raw.decode("utf-8", "replace")

    def _value(self, key: str, grow: bool) -> Generator[Step, bytes | None, None]:
        n = yield from self._length()
        self._ledger.charge(self._host, key, n, grow=grow)
        yield (False, n)


# --- the relay ------------------------------------------------------------------------------------------------
class _Pair:
    """One client's connection and the guard's connection to torch's server for it."""

    def __init__(self, client: socket.socket, server: socket.socket, reader: RequestReader, address: str) -> None:
        self.client, self.server, self.reader, self.address = client, server, reader, address
        self.to_server = bytearray()
        self.to_client = bytearray()
        self.registered: set[socket.socket] = set()


class StoreGuard:
    """Relays the clients that connect to ``listener`` to torch's server at ``backend``, bounded by ``limits``
    (module docstring). One thread; :meth:`close` stops it and closes every connection."""

    def __init__(self, listener: socket.socket, backend: tuple[str, int], limits: Limits,
                 warn: Callable[[str], None] | None = None) -> None:
        self.ledger = Ledger(limits)
        self._listener = listener
        self._listener.setblocking(False)
        self._backend = backend
        self._warn = warn or log.warning
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pairs: dict[socket.socket, _Pair] = {}
        self.refused = 0  # connections closed for passing a bound
        self._thread = threading.Thread(target=self._run, name="hora-store-guard", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def close(self) -> None:
        try:
            self._wake_w.send(b"!")
        except OSError:
            pass
        self._thread.join(5.0)

    # --- the loop -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                for key, events in self._selector.select():
                    sock = key.fileobj
                    if sock is self._wake_r:
                        return
                    if sock is self._listener:
                        self._accept()
                        continue
                    pair = self._pairs.get(sock)  # type: ignore[call-overload]
                    if pair is not None:
                        self._serve(pair, sock, events)  # type: ignore[arg-type]
        finally:
            for pair in list({id(p): p for p in self._pairs.values()}.values()):
                self._drop(pair)
            self._selector.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: the client waits in the backlog
                log.debug("store guard: accept failed: %s", e)
                return
            try:
                server = socket.create_connection(self._backend, timeout=10)
            except OSError as e:
                log.warning("the rendezvous store's server did not take a connection (%s)", e)
                client.close()
                continue
            address = f"{peer[0]}:{peer[1]}" if len(peer) == 2 else f"[{peer[0]}]:{peer[1]}"
            pair = _Pair(client, server, RequestReader(self.ledger, str(peer[0])), address)
            for sock in (client, server):
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._pairs[sock] = pair
            self._interest(pair)

    def _serve(self, pair: _Pair, sock: socket.socket, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                data = sock.recv(_CHUNK)
                if not data:
                    self._drop(pair)
                    return
                if sock is pair.client:
                    pair.to_server += pair.reader.feed(data)
                else:
                    pair.to_client += data
            self._flush(pair)
        except Refused as e:
            self.refused += 1
            self._warn(f"the rendezvous store closed the connection of {pair.address}: {e}; hora's own clients "
                       "never do this (a stranger on the network? see docs/security.md)")
            self._drop(pair)
        except OSError:
            self._drop(pair)

    def _flush(self, pair: _Pair) -> None:
        for out, sock in ((pair.to_server, pair.server), (pair.to_client, pair.client)):
            if out:
                try:
                    sent = sock.send(out)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                del out[:sent]
        self._interest(pair)

    def _interest(self, pair: _Pair) -> None:
        """Read a side only while what it sends can be passed on; wait to write where bytes wait."""
        for sock, pending, inbound in ((pair.client, pair.to_client, pair.to_server),
                                       (pair.server, pair.to_server, pair.to_client)):
            want = (selectors.EVENT_WRITE if pending else 0) | \
                (selectors.EVENT_READ if len(inbound) < _BACKLOG_BYTES else 0)
            registered = sock in pair.registered
            if want and registered:
                self._selector.modify(sock, want, None)
            elif want:
                self._selector.register(sock, want, None)
                pair.registered.add(sock)
            elif registered:  # paused until the other side drains what it waits to write
                self._selector.unregister(sock)
                pair.registered.discard(sock)

    def _drop(self, pair: _Pair) -> None:
        for sock in (pair.client, pair.server):
            self._pairs.pop(sock, None)
            if sock in pair.registered:
                pair.registered.discard(sock)
                self._selector.unregister(sock)
            sock.close()
