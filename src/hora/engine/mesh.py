"""The TCP control mesh: one connection between every pair of ranks, carrying negotiation rounds.

Each round every rank sends exactly one length-prefixed frame to every peer and reads exactly one from each,
so a round is an allgather of small payloads that costs one network round trip (tens of microseconds on a
LAN) instead of a Gloo collective plus a store wake-up (hundreds). The mesh is its own bell: an idle
negotiator blocks in ``poll`` on its peers' connections and a local wake-up socket, so a frame from any peer
(someone started a round) or a local submit wakes it, and nothing else does. A peer whose process ends
closes its connections, so a lost rank is noticed by every rank at once and named.

Frames of later rounds may arrive early (a fast peer is already in the next round); they wait in a
per-peer buffer. Sockets are non-blocking and a round sends and receives together, so two ranks exchanging
large first-round payloads never deadlock on full socket buffers.
"""

from __future__ import annotations

import datetime
import math
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from hora.errors import CollectiveError

_HELLO = struct.Struct("<4sI")  # magic, rank: the first bytes a connecting rank sends
_MAGIC = b"hora"
_LEN = struct.Struct("<I")
_RING = b"!"
WAIT_TICK_S = 1.0  # how often a round waiting for peers calls Mesh.on_wait
_READ = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


class PeerLost(CollectiveError):
    """A peer's control connection closed or broke: its process ended or its link went down."""

    def __init__(self, peer: int, why: str) -> None:
        super().__init__(f"rank {peer}'s control connection {why}")
        self.peer = peer


class Mesh:
    """The control plane of one negotiator; see the module docstring. Built by :func:`connect_mesh`."""

    watches_peers = True  # a dead peer's connection closes: no separate death watch needed
    inline_rounds = True  # a thread about to wait for its op may run the round itself (Negotiator.drive)

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket], round_timeout: float = math.inf) -> None:
        self.rank = rank
        self.size = size
        self._peers = peers
        self._by_fd = {s.fileno(): r for r, s in peers.items()}
        self._inbox = {r: bytearray() for r in peers}
        self._round_timeout = round_timeout
        # called every WAIT_TICK_S while a round waits for peers, with (ranks missing, seconds waited); it may
        # raise to end the round (the negotiator's stall checks: a peer that cannot run Python never answers)
        self.on_wait: Callable[[list[int], float], None] | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # Two poll sets: rounds (whichever thread runs one) poll the peers; the idle negotiator thread polls
        # the wake socket and an epoll set of the peers, which a thread running a round on its own switches
        # off (one call), so the frames it is about to read do not also wake the idle thread.
        self._poll = select.poll()
        self._peers_ep = select.epoll()
        for s in peers.values():
            s.setblocking(False)
            self._poll.register(s.fileno(), _READ)
            self._peers_ep.register(s.fileno(), select.EPOLLIN)
        self._idle_ep = select.epoll()
        self._idle_ep.register(self._wake_r.fileno(), select.EPOLLIN)
        self._idle_ep.register(self._peers_ep.fileno(), select.EPOLLIN)
        self._deaf = False
        self._deaf_lock = threading.Lock()

    def quiet(self, on: bool) -> None:
        """While ``on``, peers' frames do not wake the idle negotiator thread (another thread reads them).
        In a synchronous loop it stays on from op to op, so only changes cost a system call."""
        with self._deaf_lock:  # the caller's thread and the listen timer both switch it
            if on != self._deaf:
                self._idle_ep.modify(self._peers_ep.fileno(), 0 if on else select.EPOLLIN)
                self._deaf = on

    # --- the bell -----------------------------------------------------------------------------------
    def ring(self, round_no: int) -> None:
        """Wake this rank's negotiator for ``round_no`` (from any thread). Local: peers see nothing."""
        try:
            self._wake_w.send(_RING)
        except BlockingIOError:  # plenty of rings are pending already
            pass

    def wake(self) -> None:
        self.ring(0)

    def wait(self, round_no: int, timeout: float) -> bool:
        """Block until this rank is rung or a peer's connection has something to read (a peer started a
        round, or closed). Reads nothing from peers: the thread that runs the next round does, under the
        negotiator's round lock (see :meth:`receive_ready`). Any ring wakes it; the negotiator checks under
        that lock whether a round is really due, so a stale ring costs a look, never a wrong round."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            events = self._idle_ep.poll(left)
            for fd, _ in events:
                if fd == self._wake_r.fileno():
                    self._read_wake()
            if events:
                return True

    def receive_ready(self) -> None:
        """Read whatever peers have sent, without blocking (round lock held)."""
        for peer in self._peers:
            self._receive(peer)

    def has_input(self) -> bool:
        """True when some peer has sent (part of) a frame this rank has not consumed in a round."""
        return any(self._inbox.values())

    def clear(self, round_no: int) -> None:
        """Nothing to clean: a mesh keeps no state per round."""

    def _read_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def peek(self) -> dict[int, bytes]:
        """The complete frames peers have sent for the next round, without consuming them."""
        frames = {}
        for peer, buf in self._inbox.items():
            if len(buf) >= _LEN.size:
                (n,) = _LEN.unpack_from(buf)
                if len(buf) >= _LEN.size + n:
                    frames[peer] = bytes(buf[_LEN.size : _LEN.size + n])
        return frames

    # --- the exchange -------------------------------------------------------------------------------
    def allgather(self, payload: bytes) -> list[bytes]:
        """Send ``payload`` to every peer and return every rank's payload of this round, in rank order."""
        frame = memoryview(_LEN.pack(len(payload)) + payload)
        unsent = {r: frame for r in self._peers}
        got: dict[int, bytes] = {self.rank: payload}
        for r in self._peers:
            self._send(r, unsent)
            self._take(r, got)
        start = time.monotonic()
        deadline = start + self._round_timeout
        tick = start + WAIT_TICK_S
        while unsent or len(got) < self.size:
            for r in unsent:
                self._poll.modify(self._peers[r].fileno(), _READ | select.POLLOUT)
            now = time.monotonic()
            if now >= tick:
                tick = now + WAIT_TICK_S
                if self.on_wait is not None:
                    self.on_wait(sorted((set(range(self.size)) - set(got)) | set(unsent)), now - start)
            left = min(deadline, tick) - now
            events = self._poll.poll(max(left, 0.0) * 1000.0) if left > 0 else []
            if not events and time.monotonic() >= deadline:
                missing = sorted(set(range(self.size)) - set(got))
                raise CollectiveError(f"rank {self.rank}: rank(s) {missing} did not answer a negotiation round "
                                      f"within {self._round_timeout:.0f}s (hung process or broken network)")
            for fd, ev in events:
                peer = self._by_fd[fd]
                if ev & select.POLLOUT:
                    self._send(peer, unsent)
                    if peer not in unsent:
                        self._poll.modify(fd, _READ)
                if ev & ~select.POLLOUT:
                    self._receive(peer)
                    self._take(peer, got)
        return [got[r] for r in range(self.size)]

    def _send(self, peer: int, unsent: dict[int, memoryview]) -> None:
        view = unsent.get(peer)
        if view is None:
            return
        try:
            n = self._peers[peer].send(view)
        except BlockingIOError:
            return
        except OSError as e:
            raise PeerLost(peer, f"broke ({e})") from e
        if n == len(view):
            del unsent[peer]
        else:
            unsent[peer] = view[n:]

    def _receive(self, peer: int) -> None:
        buf = self._inbox[peer]
        try:
            while True:
                chunk = self._peers[peer].recv(1 << 16)
                if not chunk:
                    raise PeerLost(peer, "closed (its process exited)")
                buf += chunk
                if len(chunk) < 1 << 16:
                    return
        except BlockingIOError:
            return
        except OSError as e:
            raise PeerLost(peer, f"broke ({e})") from e

    def _take(self, peer: int, got: dict[int, bytes]) -> None:
        """Move one complete frame from ``peer``'s buffer into ``got`` (later frames stay buffered)."""
        if peer in got:
            return
        buf = self._inbox[peer]
        if len(buf) < _LEN.size:
            return
        (n,) = _LEN.unpack_from(buf)
        if len(buf) < _LEN.size + n:
            return
        got[peer] = bytes(buf[_LEN.size : _LEN.size + n])
        del buf[: _LEN.size + n]

    def close(self) -> None:
        self.on_wait = None  # it points back at the negotiator: let both be freed without the cycle collector
        self._idle_ep.close()
        self._peers_ep.close()
        for s in (*self._peers.values(), self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass


def connect_mesh(rank: int, size: int, store: Any, advertise: str, timeout: float,
                 round_timeout: float = math.inf) -> Mesh:
    """Connect every pair of ranks (collective: every rank calls it). Each rank listens, publishes its
    address in the store, connects to every lower rank and accepts every higher one."""
    listener = socket.create_server(("", 0), backlog=max(size, 16))
    try:
        store.set(f"mesh/{rank}", f"{advertise}:{listener.getsockname()[1]}")
        deadline = time.monotonic() + timeout
        peers: dict[int, socket.socket] = {}
        for peer in range(rank):
            store.wait([f"mesh/{peer}"], datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
            host, _, port = store.get(f"mesh/{peer}").decode().rpartition(":")
            try:
                s = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 1.0))
            except OSError as e:
                raise CollectiveError(f"rank {rank} cannot connect to rank {peer} at {host}:{port} ({e}): the "
                                      "ranks' hosts must reach each other on any TCP port") from e
            s.sendall(_HELLO.pack(_MAGIC, rank))
            peers[peer] = s
        while len(peers) < size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(size)) - set(peers) - {rank})
                raise CollectiveError(f"rank {rank}: rank(s) {missing} did not connect to it within {timeout:.0f}s")
            listener.settimeout(left)
            try:
                s, _ = listener.accept()
            except TimeoutError:
                continue
            s.settimeout(min(max(left, 1.0), 5.0))  # a real peer says hello at once
            hello = _recv_exact(s, _HELLO.size)
            magic, peer = _HELLO.unpack(hello) if hello is not None else (b"", -1)
            if magic != _MAGIC or not rank < peer < size or peer in peers:
                s.close()  # a stray connection (a port scanner, a stale job): ignore it
                continue
            peers[peer] = s
    finally:
        listener.close()
    for s in peers.values():
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Mesh(rank, size, peers, round_timeout)


def _recv_exact(s: socket.socket, n: int) -> bytes | None:
    data = b""
    try:
        while len(data) < n:
            chunk = s.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
    except OSError:
        return None
    return data
