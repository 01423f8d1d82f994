"""The handshake that opens every control connection between two ranks (the mesh, the death watch).

Both ends prove that they hold the job's secret and which rank they are, and check that they speak the same
wire version and run the same hora code, before anything else is read from the connection:

    dialer (rank c)                                   listener (rank l)
    HELLO {rank c, to l, world, purpose, nonce_c, code, hora, host}  ->
                                         <-  HELLO {rank l, to c, world, purpose, nonce_l, code, hora, host}
                                         <-  PROOF mac(secret, "listener", world, hello_c, hello_l)
    PROOF mac(secret, "dialer", world, hello_c, hello_l)  ->
                                         <-  ACCEPT  (or REFUSE {reason} at any step)

Each proof covers both hellos, so it binds both ranks, the job and world generation, the purpose, both
nonces and the direction. The nonces are fresh on both sides, so a recorded handshake replayed later fails
(the other side's nonce differs), and a proof made by one end never passes for the other's (the direction).
Every message starts with the same prefix in every wire version (magic, wire version, type, body length), so
peers of different versions name each other's version before either parses a body; bodies are plain values
(:mod:`hora.engine.codec`) of at most :data:`MAX_MESSAGE_BYTES`. Without a job secret the proofs are empty
and nothing is authenticated, but versions and code are still compared.

A failed handshake raises :class:`HandshakeFailed` (a stranger, a replay, a stale process: the listener logs
it and keeps waiting for the real rank) or :class:`IncompatiblePeer` (a rank of this job running another
hora: the job cannot run, on either side). On the listener's side only a peer that proved it holds the
secret can raise :class:`IncompatiblePeer`: whatever comes before its proof fails that connection alone.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from hora.engine import codec
from hora.engine.context import EngineContext
from hora.errors import CollectiveError
from hora.protocol.code_fingerprint import code_fingerprint, installed_version, short
from hora.protocol.jobsecret import JobSecret

MAGIC = b"HoRa"
OLD_MAGIC = b"hora"  # what hora sent before wire version 1: a bare rank number, then pickled frames
MAX_MESSAGE_BYTES = 4096
NONCE_BYTES = 32
HELLO, PROOF, ACCEPT, REFUSE = 1, 2, 3, 4
_PREFIX = struct.Struct("<4sHBI")  # magic, wire version, message type, body length
_NAMES = {HELLO: "HELLO", PROOF: "PROOF", ACCEPT: "ACCEPT", REFUSE: "REFUSE"}


class HandshakeFailed(Exception):
    """This connection did not complete the handshake; the message is one line saying why."""


class IncompatiblePeer(CollectiveError):
    """A rank of this job runs another wire version or other hora code: no control connection can work."""


@dataclass(frozen=True)
class Identity:
    """Who this rank is when it opens or accepts a control connection."""

    rank: int
    world: str  # the job id and world generation (the store prefix): a handshake of another job fails
    purpose: str  # what the connection is for ("mesh", "watch"): a handshake for one never passes for another
    secret: JobSecret | None  # the job's secret; None: nothing is authenticated (see docs/security.md)
    code: str  # hora.protocol.code_fingerprint.code_fingerprint()
    hora: str  # hora's version string
    host: str  # this rank's host name, for messages

    def hello(self, to: int, nonce: bytes) -> dict[str, Any]:
        return {"rank": self.rank, "to": to, "world": self.world, "purpose": self.purpose, "nonce": nonce,
                "secret": self.secret is not None, "code": self.code, "hora": self.hora, "host": self.host}

    def proof(self, side: bytes, hello_c: bytes, hello_l: bytes) -> bytes:
        if self.secret is None:
            return b""
        key = self.secret.derive("control-handshake")  # a key of its own: its MACs never pass for the store's
        return key.mac(side, self.world.encode(), self.purpose.encode(), hello_c, hello_l)


def identity(ctx: EngineContext, purpose: str) -> Identity:
    """How this rank presents itself on its control connections for ``purpose``."""
    return Identity(rank=ctx.rank, world=ctx.world, purpose=purpose, secret=ctx.secret, code=code_fingerprint(),
                    hora=installed_version(), host=ctx.hostname(ctx.rank))


@dataclass(frozen=True)
class Peer:
    """The other end of a completed handshake."""

    rank: int
    host: str
    address: str  # host:port as this rank sees it


def dial(sock: socket.socket, me: Identity, peer: int, deadline: float) -> Peer:
    """Run the dialer's side on a connected ``sock`` to rank ``peer``'s listener.

    Raises:
        HandshakeFailed: the listener closed the connection or did not answer in time (worth another try).
        CollectiveError: the listener refused this rank, or is not rank ``peer`` of this job.
        IncompatiblePeer: rank ``peer`` runs another wire version or other hora code.
    """
    where = _address(sock)
    who = f"rank {peer} at {where}"
    hello_c = codec.encode(me.hello(peer, os.urandom(NONCE_BYTES)))
    _send(sock, HELLO, hello_c)
    kind, hello_l = _receive(sock, deadline, who)
    if kind != HELLO:
        _refused(kind, hello_l, who, me)
    try:
        them = codec.decode(hello_l)
        problem = _check_hello(them, me, claimed=peer)
    except codec.FrameError as e:
        problem = f"its HELLO is malformed ({e})"
    if problem is not None:
        raise CollectiveError(f"rank {me.rank}: the process at {where} is not rank {peer} of this job: {problem}")
    _secret_agrees(me, them, who, dialer=True)
    kind, proof = _receive(sock, deadline, who)
    if kind != PROOF:
        _refused(kind, proof, who, me)
    if not _proven(proof, me.proof(b"listener", hello_c, hello_l)):
        raise CollectiveError(f"rank {me.rank}: the process at {where} is not rank {peer} of this job: it could "
                              "not prove that it holds the job's secret (a stranger at that address, or a process "
                              "of another job)")
    _send(sock, PROOF, codec.encode(me.proof(b"dialer", hello_c, hello_l)))
    _same_code(me, them, peer, where)
    kind, body = _receive(sock, deadline, who)
    if kind != ACCEPT:
        _refused(kind, body, who, me)
    return Peer(peer, them["host"], where)


class Seats(Protocol):
    """The ranks a listener waits for."""

    def wants(self, rank: int) -> bool:
        """Whether ``rank`` may still connect (asked when its HELLO arrives)."""

    def claim(self, rank: int) -> bool:
        """Take ``rank``'s seat for this connection, once it proved who it is (False: taken meanwhile)."""

    def release(self, rank: int) -> None:
        """Give a claimed seat back (the connection broke before it was accepted)."""


def answer(sock: socket.socket, me: Identity, seats: Seats, deadline: float) -> Peer:
    """Run the listener's side on an accepted ``sock``, for the ranks ``seats`` has free.

    Raises:
        HandshakeFailed: a stranger, a replay, a stale or confused process (log it; keep waiting).
        IncompatiblePeer: a rank of this job (it proved it) runs other hora code.
    """
    where = _address(sock)
    kind, hello_c = _receive_unproven(sock, deadline, "it")
    if kind != HELLO:
        raise HandshakeFailed(f"it sent a {_NAMES.get(kind, kind)} message first, not a HELLO")
    try:
        fields = codec.decode(hello_c)
        problem = _check_hello(fields, me, claimed=None)
    except codec.FrameError as e:
        problem = f"its HELLO is malformed ({e})"
    if problem is None and not seats.wants(fields["rank"]):
        problem = f"it claims rank {fields['rank']}, which is connected already or not one this rank waits for"
    if problem is not None:
        _refuse(sock, problem)
        raise HandshakeFailed(problem)
    claimed = fields["rank"]
    try:
        _secret_agrees(me, fields, f"the process claiming rank {claimed}", dialer=False)
    except HandshakeFailed as e:
        _refuse(sock, str(e))
        raise
    hello_l = codec.encode(me.hello(claimed, os.urandom(NONCE_BYTES)))
    _send(sock, HELLO, hello_l)
    _send(sock, PROOF, codec.encode(me.proof(b"listener", hello_c, hello_l)))
    kind, proof = _receive_unproven(sock, deadline, f"it (claiming rank {claimed})")
    if kind != PROOF:
        raise HandshakeFailed(f"it (claiming rank {claimed}) answered with a {_NAMES.get(kind, kind)}, not its "
                              "PROOF")
    if not _proven(proof, me.proof(b"dialer", hello_c, hello_l)):
        _refuse(sock, "the proof does not match")
        raise HandshakeFailed(f"it claimed rank {claimed} but could not prove that it holds the job's secret (a "
                              "stranger, a replayed handshake, or a process of another job)")
    try:
        _same_code(me, fields, claimed, where)
    except IncompatiblePeer as e:
        _refuse(sock, str(e))
        raise
    if not seats.claim(claimed):
        _refuse(sock, f"rank {claimed} is connected already")
        raise HandshakeFailed(f"it claimed rank {claimed}, which is connected already")
    try:
        _send(sock, ACCEPT, codec.encode(None))
    except HandshakeFailed:
        seats.release(claimed)
        raise
    return Peer(claimed, fields["host"], where)


# --- the checks -------------------------------------------------------------------------------------------
_HELLO_TYPES = {"rank": int, "to": int, "world": str, "purpose": str, "nonce": bytes, "secret": bool, "code": str,
                "hora": str, "host": str}


def _proven(body: bytes, expected: bytes) -> bool:
    """Whether a PROOF message's body is ``expected`` (constant time)."""
    try:
        proof = codec.decode(body)
    except codec.FrameError:
        return False
    return isinstance(proof, bytes) and hmac.compare_digest(proof, expected)


def _check_hello(fields: Any, me: Identity, claimed: int | None) -> str | None:
    """What is wrong with a peer's HELLO for this rank, or None. ``claimed``: the rank it must be."""
    if type(fields) is not dict or set(fields) != set(_HELLO_TYPES):
        return "its HELLO does not have the fields of this wire version"
    for key, kind in _HELLO_TYPES.items():
        if type(fields[key]) is not kind:
            return f"its HELLO's {key!r} is a {type(fields[key]).__name__}"
    if len(fields["nonce"]) != NONCE_BYTES:
        return f"its nonce has {len(fields['nonce'])} bytes, not {NONCE_BYTES}"
    if fields["purpose"] != me.purpose:
        return f"it opens a {fields['purpose']!r} connection, not a {me.purpose!r} one"
    if fields["world"] != me.world:
        return f"it belongs to another job or world ({fields['world']!r}; this rank is in {me.world!r})"
    if fields["to"] != me.rank:
        return f"it wants rank {fields['to']}, this is rank {me.rank}"
    if claimed is not None and fields["rank"] != claimed:
        return f"it says it is rank {fields['rank']}"
    return None


def _secret_agrees(me: Identity, them: dict[str, Any], who: str, dialer: bool) -> None:
    if them["secret"] == (me.secret is not None):
        return
    fix = ("give every rank the same secret (hora run does; under other launchers set HORA_SECRET_FILE on every "
           "rank, see docs/security.md)")
    if me.secret is not None:
        text = f"{who} holds no job secret, rank {me.rank} does: {fix}"
    else:
        text = f"{who} holds a job secret, rank {me.rank} does not: {fix}"
    if dialer:
        raise CollectiveError(f"rank {me.rank}: {text}")
    raise HandshakeFailed(text)


def _same_code(me: Identity, them: dict[str, Any], peer: int, where: str) -> None:
    if them["code"] == me.code and them["hora"] == me.hora:
        return
    raise IncompatiblePeer(
        f"rank {peer} on {them['host']} ({where}) runs hora {them['hora']} (code {short(them['code'])}), rank "
        f"{me.rank} on {me.host} runs hora {me.hora} (code {short(me.code)}): every host must run the same hora "
        "build (the same wheel, or one checkout on shared storage); `hora run` checks this before starting")


def _refused(kind: int, body: bytes, who: str, me: Identity) -> NoReturn:
    if kind == REFUSE:
        try:
            reason = codec.decode(body)
        except codec.FrameError:
            reason = "(no readable reason)"
        raise CollectiveError(f"rank {me.rank}: {who} refused this rank's control connection: {reason}")
    raise CollectiveError(f"rank {me.rank}: {who} sent a {_NAMES.get(kind, kind)} message out of turn in the "
                          "handshake")


# --- messages ----------------------------------------------------------------------------------------------
def _send(sock: socket.socket, kind: int, body: bytes) -> None:
    try:
        sock.sendall(_PREFIX.pack(MAGIC, codec.WIRE_VERSION, kind, len(body)) + body)
    except OSError as e:
        raise HandshakeFailed(f"the connection broke during the handshake ({e})") from None


def _refuse(sock: socket.socket, reason: str) -> None:
    """Tell the other end why (best effort: a stranger may be gone already)."""
    try:
        _send(sock, REFUSE, codec.encode(reason[:MAX_MESSAGE_BYTES - 16]))
    except HandshakeFailed:
        pass


def _receive_unproven(sock: socket.socket, deadline: float, who: str) -> tuple[int, bytes]:
    """The next message from a peer that has proven nothing yet. Anyone can send a wire version number, so
    what such a message says decides this connection only: another version (or an old hora) refuses it, as a
    :class:`HandshakeFailed`, never the listener's fatal :class:`IncompatiblePeer`. The REFUSE tells a real rank
    of another version this rank's version."""
    try:
        return _receive(sock, deadline, who)
    except IncompatiblePeer as e:
        _refuse(sock, str(e))
        raise HandshakeFailed(str(e)) from None


def _receive(sock: socket.socket, deadline: float, who: str) -> tuple[int, bytes]:
    """The next message; ``who`` names the other end in errors ("rank 0 at 10.0.0.5:4000", or "it" on the
    listener's side, whose log line names the address)."""
    head = _exactly(sock, _PREFIX.size, deadline, who)
    magic, version, kind, n = _PREFIX.unpack(head)
    if magic == OLD_MAGIC:
        raise IncompatiblePeer(f"{who} speaks the control protocol of a hora older than wire version 1 "
                               f"(this rank: wire version {codec.WIRE_VERSION}); install the same hora on every host")
    if magic != MAGIC:
        raise HandshakeFailed(f"{who} is not a hora rank (its first bytes are {head[:8]!r})")
    if version != codec.WIRE_VERSION:
        raise IncompatiblePeer(f"{who} speaks control wire version {version}, this rank wire version "
                               f"{codec.WIRE_VERSION}: install the same hora on every host")
    if n > MAX_MESSAGE_BYTES:
        raise HandshakeFailed(f"{who} announced a {n}-byte handshake message (at most {MAX_MESSAGE_BYTES} are "
                              "allowed)")
    return kind, _exactly(sock, n, deadline, who)


def _exactly(sock: socket.socket, n: int, deadline: float, who: str) -> bytes:
    data = bytearray()
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeFailed(f"{who} did not complete the handshake in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            continue
        except OSError as e:
            raise HandshakeFailed(f"{who} broke the connection during the handshake ({e})") from None
        if not chunk:
            raise HandshakeFailed(f"{who} closed the connection during the handshake")
        data += chunk
    return bytes(data)


def _address(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "(a closed connection)"
    return f"{host}:{port}"
