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

Trust: a connection is used only after both ends proved who they are (:mod:`hora.engine.handshake`, run by
:func:`connect_mesh` and :class:`~hora.engine.listener.PeerListener`). After that every frame is
``seq:u64 length:u32 payload tag``: the number of the frame on its connection, the payload's length (at most
:data:`~hora.engine.codec.MAX_FRAME_BYTES`, checked before the payload is read), and the sender's tag
(:mod:`hora.engine.seal`) over both. A frame that fails any check fails the round, naming the peer. Payloads
are round frames in the plain-value wire format (:mod:`hora.engine.frames`), never pickles.
"""

from __future__ import annotations

import datetime
import logging
import math
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from hora.engine import handshake
from hora.engine.codec import MAX_FRAME_BYTES
from hora.engine.handshake import HandshakeFailed, Identity, Peer
from hora.engine.listener import HANDSHAKE_S, PeerListener
from hora.engine.seal import FrameSeal
from hora.errors import CollectiveError

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<QI")  # the frame's number on its connection, the payload's length
_RING = b"!"
WAIT_TICK_S = 1.0  # how often a round waiting for peers calls Mesh.on_wait
_READ = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


class PeerLost(CollectiveError):
    """A peer's control connection closed or broke: its process ended or its link went down."""

    def __init__(self, peer: int, why: str) -> None:
        super().__init__(f"rank {peer}'s control connection {why}")
        self.peer = peer


class BadFrame(CollectiveError):
    """A peer's control frame failed a check (its tag, its number, its size): the connection was tampered
    with, or the peer is broken. The round fails on this rank, naming the peer."""

    def __init__(self, rank: int, peer: int, where: str, why: str) -> None:
        super().__init__(f"rank {rank}: the control connection from rank {peer} ({where}) {why}; the job cannot "
                         "trust its negotiation any more")
        self.peer = peer


class Mesh:
    """The control plane of one negotiator; see the module docstring. Built by :func:`connect_mesh`."""

    watches_peers = True  # a dead peer's connection closes: no separate death watch needed
    inline_rounds = True  # a thread about to wait for its op may run the round itself (Negotiator.drive)

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket], round_timeout: float = math.inf,
                 seal: FrameSeal | None = None, addresses: dict[int, str] | None = None) -> None:
        self.rank = rank
        self.size = size
        self._peers = peers
        self._by_fd = {s.fileno(): r for r, s in peers.items()}
        self._inbox = {r: bytearray() for r in peers}
        self._frames: dict[int, deque[bytes]] = {r: deque() for r in peers}  # checked payloads, not yet taken
        self._next_in = dict.fromkeys(peers, 0)  # the number of the next frame due from each peer
        self._next_out = 0  # every round sends one frame on every connection: one number for all
        self._seal = seal if seal is not None else FrameSeal(None, "", rank)
        self._addresses = addresses or {}
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
        return any(self._frames.values()) or any(self._inbox.values())

    def clear(self, round_no: int) -> None:
        """Nothing to clean: a mesh keeps no state per round."""

    def _read_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def peek(self) -> dict[int, bytes]:
        """The complete (checked) frames peers have sent for the next round, without consuming them."""
        return {peer: frames[0] for peer, frames in self._frames.items() if frames}

    # --- the exchange -------------------------------------------------------------------------------
    def allgather(self, payload: bytes) -> list[bytes]:
        """Send ``payload`` to every peer and return every rank's payload of this round, in rank order."""
        if len(payload) > MAX_FRAME_BYTES:
            raise CollectiveError(f"rank {self.rank}: a negotiation round of {len(payload)} bytes is larger than the "
                                  f"control plane carries ({MAX_FRAME_BYTES} bytes, "
                                  "hora.engine.codec.MAX_FRAME_BYTES): "
                                  "submit fewer new collectives at once")
        head = _HEAD.pack(self._next_out, len(payload))
        self._next_out += 1
        frame = memoryview(b"".join((head, payload, self._seal.tag(head, payload))))
        unsent = {r: frame for r in self._peers}
        got: dict[int, bytes] = {self.rank: payload}
        for r in self._peers:
            self._send(r, unsent)
            self._take(r, got)
        start = time.monotonic()
        deadline = start + self._round_timeout
        tick = start + WAIT_TICK_S
        done: list[int] = []  # peers this round needs nothing more from, left out of the poll until it ends
        try:
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
                        if peer in got and peer not in unsent:
                            # Its frame of this round is in and ours is out: what it does now is the next
                            # round's business. After the last round (the shutdown) a peer that has it all exits
                            # while others still wait for a slower rank: its closing is no failure of this round.
                            self._poll.unregister(fd)
                            done.append(fd)
                            continue
                        self._receive(peer)
                        self._take(peer, got)
        finally:
            for fd in done:
                self._poll.register(fd, _READ)
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
                self._check_frames(peer, buf)
                if len(chunk) < 1 << 16:
                    return
        except BlockingIOError:
            return
        except OSError as e:
            raise PeerLost(peer, f"broke ({e})") from e

    def _check_frames(self, peer: int, buf: bytearray) -> None:
        """Move every complete frame at the start of ``buf`` to ``peer``'s checked frames. A length beyond
        the bound is refused as soon as the header is in, before the rest is read."""
        tag_bytes = self._seal.tag_bytes
        while len(buf) >= _HEAD.size:
            seq, n = _HEAD.unpack_from(buf)
            if n > MAX_FRAME_BYTES:
                raise self._bad(peer, f"announced a {n}-byte frame, more than the {MAX_FRAME_BYTES} bytes allowed "
                                      "(hora.engine.codec.MAX_FRAME_BYTES)")
            if seq != self._next_in[peer]:
                raise self._bad(peer, f"sent frame number {seq} where number {self._next_in[peer]} was due "
                                      "(a replayed or injected frame)")
            end = _HEAD.size + n + tag_bytes
            if len(buf) < end:
                return
            frame = bytes(buf[:end])
            del buf[:end]
            body = _HEAD.size + n
            view = memoryview(frame)  # of immutable bytes: slices copy nothing
            if not self._seal.check(peer, view[body:], view[:body]):
                raise self._bad(peer, "sent a frame that failed authentication (its tag does not match: forged or "
                                      "changed on the way)")
            self._frames[peer].append(frame[_HEAD.size : body])
            self._next_in[peer] = seq + 1

    def _bad(self, peer: int, why: str) -> BadFrame:
        return BadFrame(self.rank, peer, self._addresses.get(peer, "?"), why)

    def _take(self, peer: int, got: dict[int, bytes]) -> None:
        """Move one checked frame of ``peer`` into ``got`` (later frames stay buffered)."""
        if peer not in got and self._frames[peer]:
            got[peer] = self._frames[peer].popleft()

    def close(self) -> None:
        self.on_wait = None  # it points back at the negotiator: let both be freed without the cycle collector
        self._idle_ep.close()
        self._peers_ep.close()
        for s in (*self._peers.values(), self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass


def connect_mesh(me: Identity, size: int, store: Any, advertise: str, timeout: float,
                 round_timeout: float = math.inf) -> Mesh:
    """Connect every pair of ranks (collective: every rank calls it). Each rank but the last listens, publishes
    its address in the store, dials every lower rank and accepts every higher one, each connection opened by
    the handshake of :mod:`hora.engine.handshake`. Rounds' frames are then sealed with ``me.secret``.

    Raises:
        IncompatiblePeer: a rank runs another wire version or other hora code.
        CollectiveError: a rank did not connect in time, or the hosts cannot reach each other.
    """
    rank = me.rank
    deadline = time.monotonic() + timeout
    listener = PeerListener(me, range(rank + 1, size), advertise) if rank < size - 1 else None
    peers: dict[int, tuple[socket.socket, Peer]] = {}
    try:
        if listener is not None:
            store.set(f"mesh/{rank}", listener.address)
        for peer in range(rank):
            peers[peer] = _dial(me, store, peer, deadline, timeout)
        if listener is not None:
            peers.update(listener.wait(deadline, timeout))
    except BaseException:
        for sock, _ in peers.values():
            sock.close()
        raise
    finally:
        if listener is not None:
            listener.close()
    for sock, _ in peers.values():
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Mesh(rank, size, {r: s for r, (s, _) in peers.items()}, round_timeout,
                FrameSeal(me.secret, me.world, rank), {r: p.address for r, (_, p) in peers.items()})


def _dial(me: Identity, store: Any, peer: int, deadline: float, timeout: float) -> tuple[socket.socket, Peer]:
    """Connect to ``peer``'s listener and open the connection. A listener that closes on us without an answer
    (it was flooded, or restarting) is tried again until ``deadline``."""
    key = f"mesh/{peer}"
    store.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
    host, _, port = store.get(key).decode().rpartition(":")
    pause = 0.05
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 1.0))
        except OSError as e:
            raise CollectiveError(f"rank {me.rank} cannot connect to rank {peer} at {host}:{port} ({e}): the "
                                  "ranks' hosts must reach each other on any TCP port") from e
        try:
            return sock, handshake.dial(sock, me, peer, min(deadline, time.monotonic() + HANDSHAKE_S))
        except HandshakeFailed as e:
            sock.close()
            if time.monotonic() + pause >= deadline:
                raise CollectiveError(f"rank {me.rank}: rank {peer} at {host}:{port} did not complete a control "
                                      f"connection within {timeout:.0f}s ({e})") from None
            log.debug("rank %d: handshake with rank %d failed (%s); trying again", me.rank, peer, e)
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
        except BaseException:
            sock.close()
            raise
