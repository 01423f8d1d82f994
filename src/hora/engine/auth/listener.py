"""The listening side of the control connections: serves every connecting process at once.

A listener waits for a known set of ranks (the higher ranks of the mesh, a death watch's predecessor). Each
accepted connection runs its handshake (:mod:`hora.engine.auth.handshake`) on a thread of its own with a short
deadline, so a connection that never speaks (a port scanner, a half-open attack) costs a thread for a few
seconds and delays nobody. A connection that fails the handshake is closed and logged on one line naming its
address; the listener keeps waiting for the real rank. A rank of this job running other hora code
(it proved who it is) ends the wait with :class:`~hora.engine.auth.handshake.IncompatiblePeer`.

The listener binds to the address this rank advertises (its address on the route to the rendezvous host),
not every interface, where the platform allows it.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Iterable

from hora.engine.auth import handshake
from hora.engine.auth.handshake import HandshakeFailed, Identity, IncompatiblePeer, Peer
from hora.errors import CollectiveError
from hora.protocol.network import listen_on

log = logging.getLogger(__name__)

HANDSHAKE_S = 10.0  # how long one connection may take over its handshake (a real rank needs milliseconds)
MAX_PENDING = 512  # handshakes in progress at once; beyond this, new connections are closed at once
_BACKLOG = 128


def bind_listener(address: str) -> socket.socket:
    """A listening TCP socket on ``address`` (any free port); on every interface if ``address`` is not this
    host's (a NAT'ed container advertising its host's address)."""
    return listen_on(address, 0, backlog=_BACKLOG)


class PeerListener:
    """Accepts the control connections of ``expect`` for ``me``, concurrently (module docstring).

    Example:
        >>> listener = PeerListener(me, range(me.rank + 1, size), "10.0.0.5")  # doctest: +SKIP
        >>> store.set(f"mesh/{me.rank}", listener.address)                     # doctest: +SKIP
        >>> peers = listener.wait(deadline, timeout_s)                          # doctest: +SKIP
        >>> listener.close()                                                    # doctest: +SKIP
    """

    def __init__(self, me: Identity, expect: Iterable[int], advertise: str, handshake_s: float = HANDSHAKE_S) -> None:
        self.me = me
        self._expect = set(expect)
        self._handshake_s = handshake_s
        self._sock = bind_listener(advertise)
        self._sock.setblocking(False)
        self.address = f"{advertise}:{self._sock.getsockname()[1]}"
        self._cond = threading.Condition()
        self._connected: dict[int, tuple[socket.socket, Peer]] = {}
        self._claimed: set[int] = set()
        self._pending: set[socket.socket] = set()
        self._refusals: list[str] = []
        self._fatal: IncompatiblePeer | None = None
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._accept_loop, name=f"hora-{me.purpose}-listener", daemon=True)
        self._thread.start()

    # --- what the handshake asks ------------------------------------------------------------------------
    def wants(self, rank: int) -> bool:
        with self._cond:
            return rank in self._expect and rank not in self._claimed and not self._closed

    def claim(self, rank: int) -> bool:
        """Take ``rank``'s seat for the connection about to be accepted (False: taken meanwhile)."""
        with self._cond:
            if rank not in self._expect or rank in self._claimed or self._closed:
                return False
            self._claimed.add(rank)
            return True

    def release(self, rank: int) -> None:
        with self._cond:
            self._claimed.discard(rank)

    # --- the owner's side -------------------------------------------------------------------------------
    def wait(self, deadline: float, timeout_s: float) -> dict[int, tuple[socket.socket, Peer]]:
        """Every expected rank's connection, once all have completed their handshake.

        Raises:
            IncompatiblePeer: a rank of this job runs other hora code.
            CollectiveError: some rank did not connect by ``deadline`` (the message names them, and the
                connections refused meanwhile).
        """
        with self._cond:
            while True:
                if self._fatal is not None:
                    raise self._fatal
                if self._expect <= self._connected.keys():
                    return dict(self._connected)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(self._expect - self._connected.keys())
                    refused = ""
                    if self._refusals:
                        refused = (f"; meanwhile it refused {len(self._refusals)} connection(s) that failed the "
                                   f"handshake, the last: {self._refusals[-1]}")
                    raise CollectiveError(f"rank {self.me.rank}: rank(s) {missing} did not connect to it within "
                                          f"{timeout_s:.0f}s{refused}")
                self._cond.wait(left)

    def close(self) -> None:
        """Stop listening; cut the handshakes still in progress (strangers: the expected ranks are in)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        sources = _sources(pending)
        try:
            self._wake_w.send(b"!")
        except OSError:
            pass
        self._thread.join(5.0)
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()
        for sock in pending:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes its handshake thread, which closes it
            except OSError:
                pass
        if pending:
            log.warning("rank %d: closed %d %s connection(s) that had not completed a handshake when every rank was "
                        "connected (from %s)", self.me.rank, len(pending), self.me.purpose, sources)

    # --- threads ----------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        poller.register(self._wake_r.fileno(), select.POLLIN)
        crowded = False
        while True:
            events = dict(poller.poll())
            if self._wake_r.fileno() in events:
                return
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the connection went away before we took it, or the listener is closing
                continue
            conn.setblocking(True)
            with self._cond:
                busy = len(self._pending) >= MAX_PENDING
                if not busy:
                    self._pending.add(conn)
            if busy:
                if not crowded:
                    log.warning("rank %d: %d %s handshakes are in progress; closing new connections until some end "
                                "(a flood of connections from %s?)", self.me.rank, MAX_PENDING, self.me.purpose,
                                _sources([conn]))
                crowded = True
                conn.close()
                continue
            crowded = False
            threading.Thread(target=self._serve, args=(conn,), name=f"hora-{self.me.purpose}-handshake",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        peer: Peer | None = None
        source = _sources([conn])
        try:
            peer = handshake.answer(conn, self.me, self, time.monotonic() + self._handshake_s)
        except HandshakeFailed as e:
            self._refused(source, str(e))
        except IncompatiblePeer as e:
            log.error("%s", e)
            with self._cond:
                self._fatal = self._fatal or e
                self._cond.notify_all()
        except Exception as e:  # a bug must not take the listener down: refuse this one connection
            log.exception("rank %d: a control handshake failed unexpectedly", self.me.rank)
            self._refused(source, f"unexpected error {type(e).__name__}: {e}")
        with self._cond:
            self._pending.discard(conn)
            if peer is not None and not self._closed:
                self._connected[peer.rank] = (conn, peer)
                self._cond.notify_all()
                return
        conn.close()

    def _refused(self, source: str, reason: str) -> None:
        with self._cond:
            closing = self._closed
            if not closing:
                self._refusals.append(f"from {source}: {reason}")
        if not closing:  # connections cut by close() are counted there, in one line
            log.warning("rank %d: closed a %s connection from %s that failed the handshake: %s", self.me.rank,
                        self.me.purpose, source, reason)


def _sources(socks: Iterable[socket.socket]) -> str:
    """The peer addresses of ``socks``: host:port for one socket, the distinct hosts for several."""
    found = []
    for sock in socks:
        try:
            found.append(sock.getpeername()[:2])
        except OSError:
            pass
    if len(found) == 1:
        return f"{found[0][0]}:{found[0][1]}"
    return ", ".join(sorted({str(host) for host, _ in found})) or "unknown addresses"
