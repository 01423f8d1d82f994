"""The Gloo control plane (``HORA_CONTROL_PLANE=gloo`` only): a round is an allgather on a Gloo group, idle
ranks are woken through a store key (:class:`StoreBell`), peers are watched by
:mod:`hora.engine.transport.death_watch`. What every plane offers, and which one a job gets:
:mod:`hora.engine.transport.plane`.

Both planes follow the same trust rules (docs/security.md, "The control mesh"): their frames are plain values
(:mod:`hora.engine.scheduling.frames`), never pickles, and carry their sender's tag (:mod:`hora.engine.auth.seal`),
checked before a frame is read. The Gloo plane's first allgather is a hello in which every rank checks every
other's wire version, hora code and job secret (through the hello's tag)."""

from __future__ import annotations

import datetime
import logging
import queue
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hora.datapath.c10d import all_gather_into
from hora.engine import codec
from hora.engine.auth.handshake import Identity, IncompatiblePeer, identity
from hora.engine.auth.seal import FrameSeal
from hora.engine.context import EngineContext
from hora.engine.transport.faults import BadFrame
from hora.engine.transport.local_plane import UnreadPlane
from hora.engine.transport.round_schedule import full
from hora.errors import CollectiveError
from hora.protocol.code_fingerprint import short

log = logging.getLogger(__name__)

_SLOT = 256  # bytes per rank in the first control allgather of a round (one new op fits); more takes a second
_SLOT_HEAD = struct.Struct("<IB")  # payload length, tag length (0: the sender has no job secret)
_SEQ = struct.Struct("<Q")


class Exchange:
    """A round's allgather of variable-size payloads over the control group, in preallocated buffers. Each
    rank's slot holds its payload's length, its tag over (exchange number, payload) and, when it fits, the
    payload; a peer's payload is returned only once its tag checks."""

    def __init__(self, rank: int, size: int, group: Any, seal: FrameSeal, hostname: Callable[[int], str]) -> None:
        self.rank = rank
        self.size = size
        self.group = group
        self._seal = seal
        self._hostname = hostname
        self._number = 0  # allgathers so far: the same on every rank
        self._head = _SLOT_HEAD.size + seal.tag_bytes
        self.slot = torch.zeros(_SLOT, dtype=torch.uint8)
        self.gathered = torch.zeros(_SLOT * size, dtype=torch.uint8)
        self._slot_np = self.slot.numpy()
        self._gathered_np = self.gathered.numpy()

    def allgather(self, payload: bytes) -> list[bytes]:
        number = _SEQ.pack(self._number)
        self._number += 1
        n = len(payload)
        tag = self._seal.tag(number, payload)
        _SLOT_HEAD.pack_into(self._slot_np.data, 0, n, len(tag))
        self._slot_np[_SLOT_HEAD.size : self._head] = memoryview(tag)
        fits = n <= _SLOT - self._head
        if fits:
            self._slot_np[self._head : self._head + n] = memoryview(payload)
        all_gather_into(self.gathered, self.slot, group=self.group)
        raw = self._gathered_np
        heads = [_SLOT_HEAD.unpack_from(raw.data, r * _SLOT) for r in range(self.size)]
        for r, (n_r, t_r) in enumerate(heads):
            if t_r != self._seal.tag_bytes:
                raise self._mismatch(r, t_r)
            if n_r > codec.MAX_FRAME_BYTES:
                raise self._bad(r, f"announced a {n_r}-byte frame, more than the {codec.MAX_FRAME_BYTES} bytes allowed "
                                   "(hora.engine.codec.MAX_FRAME_BYTES)")
        big = max(n_r for n_r, _ in heads)
        if big <= _SLOT - self._head:
            out = [raw[r * _SLOT + self._head : r * _SLOT + self._head + n_r].tobytes() if r != self.rank else payload
                   for r, (n_r, _) in enumerate(heads)]
        else:  # rare: a round with many new requests
            mine = torch.zeros(big, dtype=torch.uint8)
            mine[:n] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            full = torch.empty(big * self.size, dtype=torch.uint8)
            all_gather_into(full, mine, group=self.group)
            every = full.numpy()
            out = [every[r * big : r * big + n_r].tobytes() if r != self.rank else payload
                   for r, (n_r, _) in enumerate(heads)]
        if self._seal.tag_bytes:
            for r in range(self.size):
                tag_r = raw[r * _SLOT + _SLOT_HEAD.size : r * _SLOT + self._head].tobytes()
                if r != self.rank and not self._seal.check(r, tag_r, number, out[r]):
                    raise self._bad(r, "sent a frame that failed authentication (its tag does not match: forged, "
                                       "or that rank holds another job secret)")
        return out

    def _bad(self, rank: int, why: str) -> BadFrame:
        return BadFrame(self.rank, rank, f"host {self._hostname(rank)}, Gloo control plane", why)

    def _mismatch(self, rank: int, tag_bytes: int) -> CollectiveError:
        has, lacks = (rank, self.rank) if tag_bytes else (self.rank, rank)
        return CollectiveError(
            f"rank {has} holds a job secret and rank {lacks} does not (Gloo control plane): give every rank the "
            "same secret (hora run does; under other launchers set HORA_SECRET_FILE on every rank, see "
            "docs/security.md)")


_HELLO_MAGIC = b"HoRa"
_HELLO_HEAD = struct.Struct("<4sH")  # in every wire version: magic, wire version; then the version's body


def greet(exchange: Exchange, me: Identity) -> None:
    """The Gloo plane's first allgather: every rank checks that every other speaks its wire version, runs
    its hora code and holds its job secret (the hello's tag), before any round.

    Raises:
        IncompatiblePeer: some rank runs another wire version or other hora code (named, with its host).
        CollectiveError: some rank holds another secret, or none where this rank has one.
    """
    body = codec.encode({"code": me.code, "hora": me.hora, "host": me.host})
    hellos = exchange.allgather(_HELLO_HEAD.pack(_HELLO_MAGIC, codec.WIRE_VERSION) + body)
    for rank, hello in enumerate(hellos):
        magic, version = _HELLO_HEAD.unpack_from(hello) if len(hello) >= _HELLO_HEAD.size else (b"", -1)
        if magic != _HELLO_MAGIC or version != codec.WIRE_VERSION:
            raise IncompatiblePeer(f"rank {rank} speaks control wire version {version}, rank {me.rank} on {me.host} "
                                   f"wire version {codec.WIRE_VERSION} (Gloo control plane): install the same hora on "
                                   "every host")
        try:
            them = codec.decode(hello[_HELLO_HEAD.size :])
            code, hora, host = them["code"], them["hora"], them["host"]
        except (codec.FrameError, TypeError, KeyError):
            raise IncompatiblePeer(f"rank {rank}'s hello on the Gloo control plane is malformed") from None
        if (code, hora) != (me.code, me.hora):
            raise IncompatiblePeer(
                f"rank {rank} on {host} runs hora {hora} (code {short(str(code))}), rank {me.rank} on {me.host} runs "
                f"hora {me.hora} (code {short(me.code)}): every host must run the same hora build (the same wheel, "
                "or one checkout on shared storage); `hora run` checks this before starting")


class LocalBell:
    """The bell of a single-process job."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rung: set[int] = set()

    def ring(self, round_no: int) -> None:
        with self._cond:
            self._rung.add(round_no)
            self._cond.notify_all()

    def wait(self, round_no: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: round_no in self._rung, timeout)

    def clear(self, round_no: int) -> None:
        with self._cond:
            self._rung.discard(round_no)

    def close(self) -> None:
        pass


class StoreBell:
    """The bell of a multi-process job: one store key per idle round. Separate store connections, because a
    client blocked in ``wait`` holds its socket and a ring must not queue behind it. Old keys are deleted
    by a janitor thread (rank 0 only), off the path of the next round."""

    def __init__(self, connect: Callable[[], dist.Store]) -> None:
        self._connect = connect
        self._waiter = connect()
        self._ringer = connect()
        self._janitor: queue.SimpleQueue[int | None] | None = None

    def ring(self, round_no: int) -> None:
        self._ringer.set(f"bell/{round_no}", "1")

    def wait(self, round_no: int, timeout: float) -> bool:
        try:
            self._waiter.wait([f"bell/{round_no}"], datetime.timedelta(seconds=timeout))
            return True
        except RuntimeError as e:  # DistStoreError on timeout; anything else means the store is gone
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                return False
            raise

    def clear(self, round_no: int) -> None:
        """Delete a bell every rank has passed (asynchronously)."""
        if self._janitor is None:
            self._janitor = queue.SimpleQueue()
            threading.Thread(target=self._sweep, args=(self._janitor, self._connect()), name="hora-bell-janitor",
                             daemon=True).start()
        self._janitor.put(round_no)

    def close(self) -> None:
        if self._janitor is not None:
            self._janitor.put(None)

    @staticmethod
    def _sweep(todo: queue.SimpleQueue[int | None], store: dist.Store) -> None:
        while (round_no := todo.get()) is not None:
            try:
                store.delete_key(f"bell/{round_no}")
            except Exception:  # the store is gone (job ending): nothing left to clean
                return


class GlooPlane(UnreadPlane):
    """The allgather on the control Gloo group, and a bell in the store (or in memory for one process)."""

    watches_peers = False  # a dead peer is noticed by hora.engine.transport.death_watch, not by this plane
    inline_rounds = False  # every rank joins every rung round on its negotiator thread

    def __init__(self, ctx: EngineContext) -> None:
        me = identity(ctx, "gloo")
        self.plan = full(ctx.rank, ctx.size)  # a Gloo allgather: every rank hears from every other
        self._exchange = Exchange(ctx.rank, ctx.size, ctx.ctrl_group, FrameSeal(ctx.secret, ctx.world, ctx.rank),
                                  ctx.hostname)
        greet(self._exchange, me)
        connect = ctx.connect_store  # None: an in-memory store, no second connection to wait on
        self._bell: LocalBell | StoreBell = LocalBell() if connect is None else StoreBell(connect)

    def ring(self, round_no: int) -> None:
        self._bell.ring(round_no)

    def wake(self) -> None:
        """Nothing: a wake-up only this rank sees is impossible on a store key every rank waits on, so a
        negotiator thread parked here when stop() gives up on its peers stays parked until the process ends
        (a daemon thread holding one store connection)."""

    def wait(self, round_no: int, timeout: float) -> bool:
        return self._bell.wait(round_no, timeout)

    def clear(self, round_no: int) -> None:
        self._bell.clear(round_no)

    def allgather(self, payload: bytes) -> list[bytes]:
        return self._exchange.allgather(payload)

    def close(self) -> None:
        self._bell.close()
