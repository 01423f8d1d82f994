"""The TCP control mesh: authenticated connections between ranks, carrying negotiation rounds.

A round is an allgather of small payloads: every rank ends it holding every rank's payload of that round.
Who sends what to whom is the round's schedule (:mod:`hora.engine.transport.round_schedule`): up to
``HORA_MESH_FULL_UPTO`` ranks, each rank sends its frame to every other and reads one from each (one network
round trip, n-1 connections per rank); above, recursive doubling, in which each rank talks to log2(n) partners
only, each frame carrying the payloads its sender holds so far. Either costs one round trip per step instead
of a Gloo collective plus a store wake-up. The mesh is its own bell: an idle negotiator blocks in ``poll`` on
its peers' connections and a local wake-up socket, so a frame from any peer (someone started a round) or a
local submit wakes it, and nothing else does.

A lost rank is noticed by every rank at once and named. Its process ending closes its connections; a rank
that sees one close (or that hears from ``hora run`` that the rank has exited) tells each of its other peers
in a *loss notice* naming the lost rank, and each rank passes the first notice it gets on to its own peers.
The connections form a connected graph (log2(n) hops across at most), so every rank learns the lost rank's
number, not merely that a partner stopped answering.

Each connection carries the same frames every round, in the same order, so frames of later rounds may
arrive early (a fast peer is already in the next round) and wait in a per-peer buffer. Sockets are
non-blocking and a round sends and receives together, so two ranks exchanging large first-round payloads
never deadlock on full socket buffers.

Trust: a connection is used only after both ends proved who they are (:mod:`hora.engine.auth.handshake`, run by
:func:`connect_mesh` and :class:`~hora.engine.auth.listener.PeerListener`). After that every frame is
``seq:u64 length:u32 kind:u8 payload tag``: the number of the frame on its connection, the payload's length
(at most :data:`~hora.engine.codec.MAX_FRAME_BYTES` per rank it carries, checked before the payload is read),
whether it is a round's frame or a loss notice, and the sender's tag (:mod:`hora.engine.auth.seal`) over all of
it. A frame that fails any check fails the round, naming the peer. A round's frame holds the payloads the
schedule says it must, each length-prefixed when it holds several: a peer relays others' payloads only
inside its own sealed frame. Payloads are round frames in the plain-value wire format
(:mod:`hora.engine.scheduling.frames`), never pickles.
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

from hora.common.knobs import Knobs
from hora.engine.auth import handshake
from hora.engine.auth.handshake import HandshakeFailed, Identity, Peer
from hora.engine.auth.listener import HANDSHAKE_S, PeerListener
from hora.engine.auth.seal import FrameSeal
from hora.engine.codec import MAX_FRAME_BYTES
from hora.engine.transport.faults import BadFrame, PeerLost
from hora.engine.transport.round_schedule import Schedule, Transfer, full, schedule
from hora.errors import CollectiveError

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<QIB")  # the frame's number on its connection, the payload's length, the frame's kind
ROUND, LOSS = 0, 1  # a frame's kinds: a round's payloads; a loss notice (the payload: the lost rank)
_LEN = struct.Struct("<I")  # before each payload of a frame holding several
_RANK = struct.Struct("<I")  # a loss notice's payload
_RING = b"!"
WAIT_TICK_S = 1.0  # how often a round waiting for peers calls Mesh.on_wait
NOTICE_S = 2.0  # how long a loss notice may wait for room in a peer's socket buffer
_READ = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


class Mesh:
    """The control plane of one negotiator; see the module docstring. Built by :func:`connect_mesh`."""

    watches_peers = True  # a dead peer's connection closes and its peers pass the news on: no death watch
    inline_rounds = True  # a thread about to wait for its op may run the round itself (Negotiator.drive)

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket], round_timeout: float = math.inf,
                 seal: FrameSeal | None = None, addresses: dict[int, str] | None = None,
                 plan: Schedule | None = None) -> None:
        self.rank = rank
        self.size = size
        self.plan = plan if plan is not None else full(rank, size)
        if set(self.plan.peers) != set(peers):
            raise ValueError(f"rank {rank}: connected to ranks {sorted(peers)}, but its round exchanges frames with "
                             f"{list(self.plan.peers)}")
        self._peers = peers
        self._by_fd = {s.fileno(): r for r, s in peers.items()}
        self._inbox = {r: bytearray() for r in peers}
        self._frames: dict[int, deque[bytes]] = {r: deque() for r in peers}  # checked payloads, not yet taken
        self._receiving = self.plan.receiving()  # what each peer's frames of a round hold
        sending = self.plan.sending()
        self._frames_in = {r: len(self._receiving.get(r, ())) for r in peers}  # how many each round
        self._frames_out = {r: len(sending.get(r, ())) for r in peers}
        # the longest round frame each peer may announce: MAX_FRAME_BYTES per payload it carries
        self._bound = {r: _bound(max((len(t.origins) for t in self._receiving.get(r, ())), default=1)) for r in peers}
        self._next_in = dict.fromkeys(peers, 0)  # the number of the next frame due from each peer
        self._next_out = dict.fromkeys(peers, 0)  # the number of the next frame to each peer
        self._unsent: dict[int, memoryview] = {}  # what is still to send to each peer
        self._passed_on: int | None = None  # the lost rank this rank told its peers about
        self._seal = seal if seal is not None else FrameSeal(None, "", rank)
        self._addresses = addresses or {}
        self._round_timeout = round_timeout
        # called every WAIT_TICK_S while a round waits for peers, with (peers it waits for, seconds waited); it
        # may raise to end the round (the negotiator's stall checks: a peer that cannot run Python never answers)
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
        round, sent a loss notice, or closed). Reads nothing from peers: the thread that runs the next round
        does, under the negotiator's round lock (see :meth:`receive_ready`). Any ring wakes it; the negotiator
        checks under that lock whether a round is really due, so a stale ring costs a look, never a wrong round."""
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
        """The payloads (by rank) of the complete (checked) frames peers have sent for the next round, without
        consuming them. With recursive doubling these are only some ranks' payloads."""
        found: dict[int, bytes] = {}
        for peer, frames in self._frames.items():
            if frames:
                origins = self._receiving[peer][0].origins
                found.update(zip(origins, self._split(peer, origins, frames[0])))
        return found

    # --- the exchange -------------------------------------------------------------------------------
    def allgather(self, payload: bytes) -> list[bytes]:
        """Return every rank's ``payload`` of this round, in rank order (the schedule's steps, in order)."""
        if len(payload) > MAX_FRAME_BYTES:
            raise CollectiveError(f"rank {self.rank}: a negotiation round of {len(payload)} bytes is larger than the "
                                  f"control plane carries ({MAX_FRAME_BYTES} bytes, "
                                  "hora.engine.codec.MAX_FRAME_BYTES): "
                                  "submit fewer new collectives at once")
        got: dict[int, bytes] = {self.rank: payload}
        to_take = dict(self._frames_in)  # frames of this round each peer has still to send
        to_send = dict(self._frames_out)  # frames of this round still to queue for each peer
        made: dict[tuple[int, tuple[int, ...]], memoryview] = {}  # frames by (number, origins): built once
        done: list[int] = []  # peers this round needs nothing more from, left out of the poll until it ends
        start = time.monotonic()
        try:
            for step in self.plan.steps:
                for t in step.sends:
                    self._queue(t, got, made)
                    to_send[t.peer] -= 1
                need = {t.peer: t for t in step.receives}
                for t in step.receives:
                    if self._take(t, got):
                        to_take[t.peer] -= 1
                        del need[t.peer]
                self._pump(need, got, to_take, to_send, done, start, drain=False)
            self._pump({}, got, to_take, to_send, done, start, drain=True)
        finally:
            for fd in done:
                self._poll.register(fd, _READ)
        return [got[r] for r in range(self.size)]

    def _pump(self, need: dict[int, Transfer], got: dict[int, bytes], to_take: dict[int, int],
              to_send: dict[int, int], done: list[int], start: float, drain: bool) -> None:
        """Send and receive until every frame in ``need`` is in (and, with ``drain``, every frame is out)."""
        deadline = start + self._round_timeout
        tick = time.monotonic() + WAIT_TICK_S
        while need or (drain and self._unsent):
            for r in self._unsent:
                self._poll.modify(self._peers[r].fileno(), _READ | select.POLLOUT)
            now = time.monotonic()
            if now >= tick:
                tick = now + WAIT_TICK_S
                self._report_wait(sorted(set(need) | set(self._unsent)), now - start)
            left = min(deadline, tick) - now
            events = self._poll.poll(max(left, 0.0) * 1000.0) if left > 0 else []
            if not events and time.monotonic() >= deadline:
                raise CollectiveError(f"rank {self.rank}: rank(s) {sorted(need or self._unsent)} did not answer a "
                                      f"negotiation round within {self._round_timeout:.0f}s (hung process or broken "
                                      "network)")
            for fd, ev in events:
                peer = self._by_fd[fd]
                if ev & select.POLLOUT:
                    self._send(peer)
                    if peer not in self._unsent:
                        self._poll.modify(fd, _READ)
                if ev & ~select.POLLOUT:
                    if not to_take[peer] and not to_send[peer] and peer not in self._unsent:
                        # Its frames of this round are in and ours are out: what it does now is the next
                        # round's business. After the last round (the shutdown) a peer that has it all exits
                        # while others still wait for a slower rank: its closing is no failure of this round.
                        self._poll.unregister(fd)
                        done.append(fd)
                        continue
                    self._receive(peer)
                    t = need.get(peer)
                    if t is not None and self._take(t, got):
                        to_take[peer] -= 1
                        del need[peer]

    def _report_wait(self, waiting_for: list[int], waited: float) -> None:
        if self.on_wait is None:
            return
        try:
            self.on_wait(waiting_for, waited)
        except PeerLost as e:  # hora run saw that rank exit (its connection held open by a process it forked)
            self._pass_on(e.peer, None)
            raise

    def _queue(self, t: Transfer, got: dict[int, bytes], made: dict[tuple[int, tuple[int, ...]], memoryview]) -> None:
        """Queue this round's frame to ``t.peer`` and send what the socket takes now. On the full exchange
        every peer gets the same frame: it is built and sealed once."""
        seq = self._next_out[t.peer]
        self._next_out[t.peer] = seq + 1
        frame = made.get((seq, t.origins))
        if frame is None:
            if len(t.origins) == 1:
                body = got[t.origins[0]]
            else:
                body = b"".join(part for o in t.origins for part in (_LEN.pack(len(got[o])), got[o]))
            head = _HEAD.pack(seq, len(body), ROUND)
            frame = made[(seq, t.origins)] = memoryview(b"".join((head, body, self._seal.tag(head, body))))
        before = self._unsent.get(t.peer)  # the peer's previous frame of this round, not all out yet
        self._unsent[t.peer] = frame if before is None else memoryview(b"".join((before, frame)))
        self._send(t.peer)

    def _send(self, peer: int) -> None:
        view = self._unsent.get(peer)
        if view is None:
            return
        try:
            n = self._peers[peer].send(view)
        except BlockingIOError:
            return
        except OSError as e:
            raise self._lost(peer, f"broke ({e})") from e
        if n == len(view):
            del self._unsent[peer]
        else:
            self._unsent[peer] = view[n:]

    def _receive(self, peer: int) -> None:
        buf = self._inbox[peer]
        try:
            while True:
                chunk = self._peers[peer].recv(1 << 16)
                if not chunk:
                    raise self._lost(peer, "closed (its process exited)")
                buf += chunk
                self._check_frames(peer, buf)
                if len(chunk) < 1 << 16:
                    return
        except BlockingIOError:
            return
        except OSError as e:
            raise self._lost(peer, f"broke ({e})") from e

    def _check_frames(self, peer: int, buf: bytearray) -> None:
        """Move every complete frame at the start of ``buf`` to ``peer``'s checked frames. A length beyond
        the bound is refused as soon as the header is in, before the rest is read."""
        tag_bytes = self._seal.tag_bytes
        while len(buf) >= _HEAD.size:
            seq, n, kind = _HEAD.unpack_from(buf)
            if kind not in (ROUND, LOSS):
                raise self._bad(peer, f"sent a frame of unknown kind {kind}")
            bound = self._bound[peer] if kind == ROUND else _RANK.size
            if n > bound:
                raise self._bad(peer, f"announced a {n}-byte frame, more than the {bound} bytes allowed "
                                      "(hora.engine.codec.MAX_FRAME_BYTES per rank's payload it carries)")
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
            self._next_in[peer] = seq + 1
            if kind == LOSS:
                (lost,) = _RANK.unpack_from(frame, _HEAD.size)
                if n != _RANK.size or lost >= self.size or lost in (self.rank, peer):
                    raise self._bad(peer, f"sent a loss notice naming rank {lost}, which cannot be lost to it")
                raise self._lost(lost, f"closed or broke, as rank {peer} reported (its process exited or its link "
                                       "broke)", via=peer)
            self._frames[peer].append(frame[_HEAD.size : body])

    def _bad(self, peer: int, why: str) -> BadFrame:
        return BadFrame(self.rank, peer, self._addresses.get(peer, "?"), why)

    def _take(self, t: Transfer, got: dict[int, bytes]) -> bool:
        """Move ``t.peer``'s next checked frame into ``got`` (later frames stay buffered); False: none yet."""
        frames = self._frames[t.peer]
        if not frames:
            return False
        got.update(zip(t.origins, self._split(t.peer, t.origins, frames.popleft())))
        return True

    def _split(self, peer: int, origins: tuple[int, ...], frame: bytes) -> list[bytes]:
        """The payloads of ``origins`` in ``peer``'s frame: the frame itself for one, else each length-prefixed."""
        if len(origins) == 1:
            return [frame]
        out = []
        at = 0
        for origin in origins:
            if at + _LEN.size > len(frame):
                raise self._bad(peer, f"sent a round frame of {len(frame)} bytes that ends before rank {origin}'s "
                                      f"payload (it must hold those of ranks {list(origins)})")
            (n,) = _LEN.unpack_from(frame, at)
            at += _LEN.size + n
            if at > len(frame):
                raise self._bad(peer, f"sent a round frame in which rank {origin}'s payload of {n} bytes runs past "
                                      f"its end ({len(frame)} bytes)")
            out.append(frame[at - n : at])
        if at != len(frame):
            raise self._bad(peer, f"sent a round frame with {len(frame) - at} bytes after the payloads of ranks "
                                  f"{list(origins)}")
        return out

    # --- a lost rank --------------------------------------------------------------------------------
    def _lost(self, lost: int, why: str, via: int | None = None) -> PeerLost:
        """The error of a round that lost ``lost`` (seen by ``via``'s notice, or on its own connection), once
        this rank's other peers have been told."""
        self._pass_on(lost, via)
        return PeerLost(lost, why)

    def _pass_on(self, lost: int, via: int | None) -> None:
        """Tell every peer but ``via`` and ``lost`` that ``lost`` is gone, once: a peer that is not connected
        to it learns whom the job lost, not merely that this rank stopped answering. Best effort: a peer
        whose connection takes nothing for NOTICE_S is cut off instead (it then sees this rank's connection
        close, and the rendezvous store's record of the loss names the lost rank)."""
        if self._passed_on is not None:
            return
        self._passed_on = lost
        for peer, sock in self._peers.items():
            if peer in (lost, via):
                continue
            seq = self._next_out[peer]
            self._next_out[peer] = seq + 1
            head = _HEAD.pack(seq, _RANK.size, LOSS)
            body = _RANK.pack(lost)
            rest = self._unsent.pop(peer, None)  # the part of a frame already begun goes first
            try:
                sock.settimeout(NOTICE_S)
                sock.sendall(b"".join((bytes(rest or b""), head, body, self._seal.tag(head, body))))
            except OSError:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            finally:
                sock.setblocking(False)
        log.debug("rank %d: told ranks %s that rank %d is gone", self.rank,
                  sorted(set(self._peers) - {lost, via}), lost)

    def close(self) -> None:
        self.on_wait = None  # it points back at the negotiator: let both be freed without the cycle collector
        self._idle_ep.close()
        self._peers_ep.close()
        for s in (*self._peers.values(), self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass


def _bound(payloads: int) -> int:
    """The longest round frame that may hold ``payloads`` payloads."""
    return MAX_FRAME_BYTES if payloads == 1 else payloads * (MAX_FRAME_BYTES + _LEN.size)


def connect_mesh(me: Identity, size: int, store: Any, advertise: str, timeout: float,
                 round_timeout: float = math.inf, full_upto: int | None = None) -> Mesh:
    """Connect each rank to the peers its rounds exchange frames with (collective: every rank calls it):
    every other rank up to ``full_upto`` ranks (default: ``HORA_MESH_FULL_UPTO``'s), its recursive-doubling
    partners above (:func:`hora.engine.transport.round_schedule.schedule`). A rank with higher peers listens and
    publishes its address in the store; it dials its lower peers (waiting in the store for their addresses
    only) and accepts its higher ones, each connection opened by the handshake of
    :mod:`hora.engine.auth.handshake`. Rounds' frames are then sealed with ``me.secret``.

    Raises:
        IncompatiblePeer: a rank runs another wire version or other hora code.
        CollectiveError: a rank did not connect in time, or the hosts cannot reach each other.
    """
    rank = me.rank
    plan = schedule(rank, size, Knobs().mesh_full_upto if full_upto is None else full_upto)
    lower = [p for p in plan.peers if p < rank]
    higher = [p for p in plan.peers if p > rank]
    deadline = time.monotonic() + timeout
    listener = PeerListener(me, higher, advertise) if higher else None
    peers: dict[int, tuple[socket.socket, Peer]] = {}
    try:
        if listener is not None:
            store.set(f"mesh/{rank}", listener.address)
        for peer in lower:
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
                FrameSeal(me.secret, me.world, rank), {r: p.address for r, (_, p) in peers.items()}, plan)


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
