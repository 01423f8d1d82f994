"""The death watch of the Gloo control plane: a rank learns at once that its successor's process ended.

The TCP mesh notices a dead peer by itself (its connection closes); the Gloo plane does not, so each rank
watches its successor over a TCP connection of its own. The connection opens with the mesh's handshake
(:mod:`hora.engine.auth.handshake`, purpose ``"watch"``), so only the real successor can answer it and only the
real predecessor can hold it; nothing is ever sent on it.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable

from hora.engine.auth import handshake
from hora.engine.auth.handshake import Identity, identity
from hora.engine.auth.listener import HANDSHAKE_S, PeerListener
from hora.engine.context import EngineContext
from hora.engine.transport.plane import ControlPlane
from hora.protocol.network import advertised_address
from hora.protocol.signedstore import SignedStore

log = logging.getLogger(__name__)


def _ignore_loss(peer: int, error: str) -> None:
    """A closed death watch's callback."""


class DeathWatch:
    """Notices at once when the next rank's process dies or its link breaks, even while every negotiator is
    idle. Each rank connects to its successor's watch listener (the mesh's handshake opens the connection, so
    only that successor can answer it) and holds the connection its predecessor opened to it; nothing is ever
    sent on them. When the successor's process ends, its kernel closes that connection and the blocked
    ``recv`` returns. Plain sockets, so nothing is left pending in c10d when a process exits. Each rank watches
    its successor, so every death is seen by someone, who rings a round that then fails on every rank."""

    def __init__(self, me: Identity, size: int, store: SignedStore, advertise: str, timeout: float,
                 lost: Callable[[int, str], None]) -> None:
        self.me = me
        self.peer = (me.rank + 1) % size
        self._store = store
        self._timeout = timeout
        self._lost = lost
        self._listener: PeerListener | None = PeerListener(me, [(me.rank - 1) % size], advertise)
        store.set(f"watch/{me.rank}", self._listener.address)
        self._conn: socket.socket | None = None
        self._held: socket.socket | None = None  # the predecessor's connection: closes when this process ends
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hora-death-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop watching (shutdown): closing our sockets is what our predecessor will see."""
        self._closed = True
        self._lost = _ignore_loss  # it points back at the negotiator: no cycle left for the collector
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for sock in (self._conn, self._held):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass

    def _run(self) -> None:
        deadline = time.monotonic() + self._timeout
        try:
            key = f"watch/{self.peer}"
            self._store.wait([key], datetime.timedelta(seconds=self._timeout))
            host, _, port = self._store.get(key).decode().rpartition(":")
            conn = socket.create_connection((host, int(port)), timeout=self._timeout)
            self._conn = conn
            handshake.dial(conn, self.me, self.peer, min(deadline, time.monotonic() + HANDSHAKE_S))
            conn.settimeout(None)
            listener = self._listener
            if listener is not None:
                held = listener.wait(deadline, self._timeout)
                self._held = next(iter(held.values()))[0]
                listener.close()
        except Exception as e:  # without a watch the job still runs; the stall inspector remains
            if not self._closed:
                log.warning("death watch of rank %d not set up (%s); a lost rank is noticed by the stall "
                            "inspector instead", self.peer, e)
            return
        try:
            conn.recv(1)  # never sent to: returns (or raises) only when the connection ends
            reason = "its connection closed"
        except OSError as e:
            reason = str(e)
        if not self._closed:
            self._lost(self.peer, reason)


def death_watch(ctx: EngineContext, plane: ControlPlane, lost: Callable[[int, str], None]) -> DeathWatch | None:
    """A watch of this rank's successor, where the plane does not notice a dead peer by itself."""
    if ctx.size == 1 or plane.watches_peers:
        return None
    return DeathWatch(identity(ctx, "watch"), ctx.size, ctx.store, advertised_address(ctx.store_addr),
                      ctx.knobs.start_timeout, lost)
