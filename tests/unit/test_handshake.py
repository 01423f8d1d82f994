"""The control connections' handshake (hora.engine.auth.handshake) against a real listener
(hora.engine.auth.listener) on loopback: who may connect, what a stranger, a replay or another hora gets."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from hora.engine import codec
from hora.engine.auth import handshake
from hora.engine.auth.handshake import HandshakeFailed, Identity, IncompatiblePeer
from hora.engine.auth.listener import PeerListener
from hora.errors import CollectiveError
from hora.protocol.jobsecret import JobSecret

SECRET = JobSecret.generate()


def me(rank: int, secret: JobSecret | None = SECRET, **changes: Any) -> Identity:
    base = Identity(rank=rank, world="hora/job1/g1", purpose="mesh", secret=secret, code="c0de" * 16,
                    hora="0.1.0", host=f"node{rank}")
    return replace(base, **changes)


@pytest.fixture
def listener() -> Iterator[PeerListener]:
    """Rank 0 waiting for ranks 1 and 2."""
    lis = PeerListener(me(0), [1, 2], "127.0.0.1", handshake_s=5.0)
    yield lis
    lis.close()


def connect(lis: PeerListener) -> socket.socket:
    host, _, port = lis.address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def dial(lis: PeerListener, who: Identity, to: int = 0) -> handshake.Peer:
    with connect(lis) as sock:
        peer = handshake.dial(sock, who, to, time.monotonic() + 5)
        sock.detach()  # the listener keeps its end; ours stays open until the test ends
        return peer


def hung_up(sock: socket.socket) -> bool:
    """Whether the other end closes ``sock`` (EOF, or a reset when our bytes were left unread) within 10 s."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


class Recording:
    """A socket that keeps a copy of everything sent through it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent = bytearray()

    def sendall(self, data: bytes) -> None:
        self.sent += data
        self.sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def test_ranks_holding_the_secret_are_connected_and_named(listener: PeerListener) -> None:
    assert dial(listener, me(1)).rank == 0
    assert dial(listener, me(2)).host == "node0"
    peers = listener.wait(time.monotonic() + 5, 5)
    assert sorted(peers) == [1, 2] and peers[2][1].host == "node2"


def test_a_replayed_handshake_fails_and_the_real_rank_still_connects(caplog: pytest.LogCaptureFixture) -> None:
    first = PeerListener(me(0), [1], "127.0.0.1")
    try:
        with connect(first) as raw:
            rec = Recording(raw)
            handshake.dial(rec, me(1), 0, time.monotonic() + 5)  # type: ignore[arg-type]
            recorded = bytes(rec.sent)
    finally:
        first.close()
    again = PeerListener(me(0), [1], "127.0.0.1")  # the same rank and world, waiting for rank 1 again
    try:
        with caplog.at_level(logging.WARNING, logger="hora.engine.auth.listener"), connect(again) as attacker:
            attacker.sendall(recorded)  # the captured HELLO and PROOF, byte for byte
            attacker.settimeout(5)
            answer = b""
            while chunk := attacker.recv(4096):
                answer += chunk
            assert _refusal(answer) == "the proof does not match"
            assert dial(again, me(1)).rank == 0  # the listener kept waiting for the real rank 1
            assert sorted(again.wait(time.monotonic() + 5, 5)) == [1]
        [line] = [r.getMessage() for r in caplog.records if "failed the handshake" in r.getMessage()]
        assert "127.0.0.1:" in line and "claimed rank 1 but could not prove" in line
    finally:
        again.close()


def _refusal(answer: bytes) -> str:
    """The reason in the last REFUSE message of ``answer`` (a listener's messages)."""
    reasons = []
    while answer:
        magic, _version, kind, n = struct.unpack_from("<4sHBI", answer)
        body = answer[11 : 11 + n]
        if kind == handshake.REFUSE:
            reasons.append(codec.decode(body))
        answer = answer[11 + n :]
    return reasons[-1]


def test_a_replayed_listener_answer_does_not_fool_a_dialer() -> None:
    real = PeerListener(me(0), [1], "127.0.0.1")
    try:
        host, _, port = real.address.rpartition(":")
        with socket.create_connection((host, int(port))) as s:  # record what the real listener answers
            s.sendall(_hello_bytes(me(1)))
            s.settimeout(5)
            answer = b""
            while _messages(answer) < 2:  # its HELLO and its PROOF
                answer += s.recv(4096)
    finally:
        real.close()
    fake = socket.create_server(("127.0.0.1", 0))

    def replay() -> None:
        conn, _ = fake.accept()
        conn.recv(4096)
        conn.sendall(answer)  # the recorded HELLO and PROOF, made for another nonce
        time.sleep(1)
        conn.close()

    threading.Thread(target=replay, daemon=True).start()
    with socket.create_connection(fake.getsockname()) as s, \
            pytest.raises(CollectiveError, match="is not rank 0 of this job: it could not prove"):
        handshake.dial(s, me(1), 0, time.monotonic() + 5)
    fake.close()


def _hello_bytes(who: Identity, to: int = 0) -> bytes:
    body = codec.encode(who.hello(to, b"n" * handshake.NONCE_BYTES))
    return struct.pack("<4sHBI", handshake.MAGIC, codec.WIRE_VERSION, handshake.HELLO, len(body)) + body


def _messages(data: bytes) -> int:
    """How many complete handshake messages ``data`` holds."""
    count, at = 0, 0
    while at + 11 <= len(data):
        at += 11 + struct.unpack_from("<4sHBI", data, at)[3]
        count += at <= len(data)
    return count


def test_a_stranger_with_another_secret_is_refused_and_told_nothing_useful(listener: PeerListener) -> None:
    stranger = me(1, secret=JobSecret.generate())
    with connect(listener) as s, pytest.raises(CollectiveError, match="is not rank 0 of this job: it could not prove"):
        handshake.dial(s, stranger, 0, time.monotonic() + 5)
    assert dial(listener, me(1)).rank == 0  # the seat stayed free for the real rank


def test_a_stranger_sending_a_made_up_proof_is_refused(listener: PeerListener,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), connect(listener) as s:
        s.sendall(_hello_bytes(me(2)))
        body = codec.encode(b"\0" * 32)
        s.sendall(struct.pack("<4sHBI", handshake.MAGIC, codec.WIRE_VERSION, handshake.PROOF, len(body)) + body)
        s.settimeout(5)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    assert _refusal(got) == "the proof does not match"
    assert any("claimed rank 2 but could not prove" in r.getMessage() for r in caplog.records)


def test_claiming_a_rank_the_listener_does_not_wait_for_is_refused(listener: PeerListener) -> None:
    with connect(listener) as s, pytest.raises(CollectiveError, match="refused.*claims rank 5"):
        handshake.dial(s, me(5), 0, time.monotonic() + 5)
    dial(listener, me(1))
    with connect(listener) as s, pytest.raises(CollectiveError, match="refused.*claims rank 1, which is connected"):
        handshake.dial(s, me(1), 0, time.monotonic() + 5)


def test_another_world_or_purpose_is_refused(listener: PeerListener) -> None:
    with connect(listener) as s, pytest.raises(CollectiveError, match="another job or world"):
        handshake.dial(s, me(1, world="hora/job1/g2"), 0, time.monotonic() + 5)
    with connect(listener) as s, pytest.raises(CollectiveError, match="'watch' connection"):
        handshake.dial(s, me(1, purpose="watch"), 0, time.monotonic() + 5)


def test_a_rank_without_the_secret_is_told_how_to_fix_it(listener: PeerListener) -> None:
    with connect(listener) as s, pytest.raises(CollectiveError, match="holds no job secret.*HORA_SECRET_FILE"):
        handshake.dial(s, me(1, secret=None), 0, time.monotonic() + 5)


def test_without_a_secret_ranks_connect_and_still_compare_code() -> None:
    lis = PeerListener(me(0, secret=None), [1, 2], "127.0.0.1")
    try:
        assert dial(lis, me(1, secret=None)).rank == 0
        with connect(lis) as s, pytest.raises(IncompatiblePeer, match="runs hora 0.1.0 \\(code c0dec0dec0de\\)"):
            handshake.dial(s, me(2, secret=None, code="f" * 64), 0, time.monotonic() + 5)
        with pytest.raises(IncompatiblePeer, match=r"rank 2 on node2 .* runs hora 0.1.0 \(code ffffffffffff\)"):
            lis.wait(time.monotonic() + 5, 5)
    finally:
        lis.close()


def test_a_rank_of_this_job_running_other_code_fails_both_sides_naming_both_builds(listener: PeerListener) -> None:
    other = me(1, code="e" * 64, hora="0.1.0")
    with connect(listener) as s, pytest.raises(IncompatiblePeer) as dialer:
        handshake.dial(s, other, 0, time.monotonic() + 5)
    assert "rank 0 on node0" in str(dialer.value) and "code c0dec0dec0de" in str(dialer.value)
    assert "code eeeeeeeeeeee" in str(dialer.value)
    with pytest.raises(IncompatiblePeer, match="rank 1 on node1 .*code eeeeeeeeeeee.*rank 0 on node0.*c0dec0dec0de"):
        listener.wait(time.monotonic() + 5, 5)


def test_a_stranger_claiming_other_code_cannot_fail_the_listener(listener: PeerListener) -> None:
    stranger = me(1, secret=JobSecret.generate(), code="e" * 64)
    with connect(listener) as s, pytest.raises(CollectiveError):
        handshake.dial(s, stranger, 0, time.monotonic() + 5)
    dial(listener, me(1))
    dial(listener, me(2))
    assert sorted(listener.wait(time.monotonic() + 5, 5)) == [1, 2]


def test_another_wire_version_after_a_strangers_hello_fails_that_connection_only(
        listener: PeerListener, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 33.2: a stranger claims rank 1, gets the listener's HELLO and PROOF, then sends a message of wire
    version 99 where its PROOF should be. Nothing it proved, so nothing it says may fail the listener."""
    with caplog.at_level(logging.WARNING), connect(listener) as s:
        s.sendall(_hello_bytes(me(1)))
        s.settimeout(5)
        answer = b""
        while _messages(answer) < 2:  # the listener's HELLO and PROOF
            answer += s.recv(4096)
        s.sendall(struct.pack("<4sHBI", handshake.MAGIC, 99, handshake.PROOF, 0))  # read whole: no reset
        got = answer
        while chunk := s.recv(4096):
            got += chunk
    assert dial(listener, me(1)).rank == 0 and dial(listener, me(2)).rank == 0  # the real ranks still connect
    assert sorted(listener.wait(time.monotonic() + 5, 5)) == [1, 2]
    assert _refusal(got[len(answer):]).startswith("it (claiming rank 1) speaks control wire version 99")
    assert any("closed a mesh connection from 127.0.0.1:" in r.getMessage() and "failed the handshake: it "
               "(claiming rank 1) speaks control wire version 99" in r.getMessage() for r in caplog.records)


def test_another_wire_version_is_refused_naming_both_versions(listener: PeerListener) -> None:
    with connect(listener) as s:
        body = codec.encode({"anything": "a later version sends"})
        s.sendall(struct.pack("<4sHBI", handshake.MAGIC, codec.WIRE_VERSION + 1, handshake.HELLO, len(body)) + body)
        s.settimeout(5)
        head = s.recv(11)
    assert struct.unpack("<4sHBI", head)[:3] == (handshake.MAGIC, codec.WIRE_VERSION, handshake.REFUSE)
    fake = socket.create_server(("127.0.0.1", 0))  # and a dialer meeting a listener of a later version

    def later_listener() -> None:
        conn, _ = fake.accept()
        conn.recv(4096)
        body = codec.encode("no")
        conn.sendall(struct.pack("<4sHBI", handshake.MAGIC, codec.WIRE_VERSION + 1, handshake.REFUSE, len(body)) + body)
        time.sleep(0.5)
        conn.close()

    threading.Thread(target=later_listener, daemon=True).start()
    both = f"wire version {codec.WIRE_VERSION + 1}, this rank wire version {codec.WIRE_VERSION}"
    with socket.create_connection(fake.getsockname()) as s, pytest.raises(IncompatiblePeer, match=both):
        handshake.dial(s, me(1), 0, time.monotonic() + 5)
    fake.close()


def test_an_old_hora_peer_is_named_as_such(listener: PeerListener, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), connect(listener) as s:
        s.sendall(struct.pack("<4sI", b"hora", 1) + b"\0" * 8)  # what hora sent before wire version 1
        assert hung_up(s)  # after the REFUSE: the line is logged before the connection is closed
    assert any("older than wire version 1" in r.getMessage() for r in caplog.records)


def test_an_oversized_or_garbage_handshake_message_is_refused_before_reading_it(
        listener: PeerListener, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        with connect(listener) as s:
            s.sendall(struct.pack("<4sHBI", handshake.MAGIC, codec.WIRE_VERSION, handshake.HELLO, 1 << 30))
            assert hung_up(s)
        with connect(listener) as s:
            s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64)  # a TLS ClientHello
            assert hung_up(s)
    lines = [r.getMessage() for r in caplog.records if "failed the handshake" in r.getMessage()]
    assert any("1073741824-byte handshake message" in line for line in lines)
    assert any("is not a hora rank" in line for line in lines)
    assert dial(listener, me(1)).rank == 0


def test_fifty_half_open_connections_do_not_hold_up_the_real_ranks(caplog: pytest.LogCaptureFixture) -> None:
    lis = PeerListener(me(0), [1, 2], "127.0.0.1", handshake_s=30.0)
    strays = [connect(lis) for _ in range(50)]  # connected, silent: each holds a handshake open
    try:
        with caplog.at_level(logging.WARNING):
            dial(lis, me(1))
            dial(lis, me(2))
            assert sorted(lis.wait(time.monotonic() + 30, 30)) == [1, 2]
            lis.close()  # every stray was still waiting for its handshake when the real ranks were in
        assert any("closed 50 mesh connection(s) that had not completed a handshake" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        lis.close()
        for s in strays:
            s.close()


def test_a_handshake_that_never_completes_is_cut_at_its_deadline() -> None:
    lis = PeerListener(me(0), [1], "127.0.0.1", handshake_s=0.3)
    try:
        with connect(lis) as s:
            assert hung_up(s)  # the listener hung up on the silent connection
    finally:
        lis.close()


def test_the_listener_binds_the_advertised_address_not_every_interface() -> None:
    lis = PeerListener(me(0), [1], "127.0.0.1")
    try:
        assert lis._sock.getsockname()[0] == "127.0.0.1"
    finally:
        lis.close()


def test_a_dialer_reaching_a_closed_listener_fails_with_a_reason() -> None:
    server = socket.create_server(("127.0.0.1", 0))

    def hang_up() -> None:
        conn, _ = server.accept()
        conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    with socket.create_connection(server.getsockname()) as s, pytest.raises(HandshakeFailed, match="closed|broke"):
        handshake.dial(s, me(1), 0, time.monotonic() + 5)
    server.close()
