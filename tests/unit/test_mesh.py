"""The TCP control mesh on real loopback sockets, ranks as threads of one process sharing a HashStore."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from hora.engine.control import make_control_plane
from hora.engine.handshake import Identity
from hora.engine.mesh import Mesh, PeerLost, connect_mesh
from hora.env import Knobs
from hora.errors import CollectiveError, ConfigError
from hora.jobsecret import JobSecret

SECRET = JobSecret.generate()


def identity(rank: int, secret: JobSecret | None = SECRET, code: str = "c0de", world: str = "job/g1") -> Identity:
    return Identity(rank=rank, world=world, purpose="mesh", secret=secret, code=code, hora="0.1.0", host=f"node{rank}")


def _meshes(size: int, round_timeout: float = 30.0, before: Callable[[dist.Store], None] | None = None
            ) -> list[Mesh]:
    """Connect ``size`` ranks; ``before(store)``, if given, runs once rank 0 listens, before the others start."""
    store = dist.HashStore()
    out: list[Any] = [None] * size
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            if rank > 0 and before is not None:
                store.wait(["mesh/0"])
                if rank == 1:
                    before(store)
                    store.set("before-done", "1")
                store.wait(["before-done"])
            out[rank] = connect_mesh(identity(rank), size, store, "127.0.0.1", 20.0, round_timeout)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def _on_every_rank(meshes: list[Mesh], fn: Callable[[int, Mesh], Any]) -> list[Any]:
    results: list[Any] = [None] * len(meshes)
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            results[rank] = fn(rank, meshes[rank])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(meshes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def _close(meshes: list[Mesh]) -> None:
    for m in meshes:
        m.close()


def test_rounds_gather_every_payload_in_rank_order_including_large_ones() -> None:
    meshes = _meshes(4)
    try:
        sizes = [0, 10, 300, 5_000_000, 7]  # 5 MB each way at once: must not deadlock on full socket buffers

        def rounds(rank: int, mesh: Mesh) -> list[list[bytes]]:
            return [mesh.allgather(bytes([rank]) * (n + rank)) for n in sizes]

        results = _on_every_rank(meshes, rounds)
        for per_round in results:
            assert per_round == results[0]
        for i, n in enumerate(sizes):
            assert results[0][i] == [bytes([r]) * (n + r) for r in range(4)]
    finally:
        _close(meshes)


def test_a_fast_rank_runs_ahead_and_its_early_frames_wait_in_order() -> None:
    meshes = _meshes(2)
    try:
        def ranks(rank: int, mesh: Mesh) -> list[list[bytes]]:
            if rank == 1:
                time.sleep(0.2)  # rank 0 sends rounds 0..2 before rank 1 reads any of them
            return [mesh.allgather(f"{rank}:{i}".encode()) for i in range(3)]

        results = _on_every_rank(meshes, ranks)
        assert results[0] == results[1] == [[f"0:{i}".encode(), f"1:{i}".encode()] for i in range(3)]
    finally:
        _close(meshes)


def test_wait_wakes_on_a_ring_or_a_peer_frame_and_only_the_round_consumes_frames() -> None:
    meshes = _meshes(2)
    try:
        a, b = meshes
        assert not a.wait(0, 0.2)  # nothing happened: stays asleep until the timeout
        a.ring(0)
        assert a.wait(0, 1.0)
        assert not a.wait(0, 0.2)  # the ring was consumed
        sender = threading.Thread(target=a.allgather, args=(b"hello",))
        sender.start()
        assert b.wait(0, 5.0)  # a's frame is the bell
        deadline = time.monotonic() + 5
        while not b.peek() and time.monotonic() < deadline:
            b.receive_ready()
        assert b.has_input() and b.peek() == {0: b"hello"}
        assert not b.wait(0, 0.2)  # read already: no busy wake-ups while b defers its answer
        assert b.peek() == {0: b"hello"}  # peeking does not consume
        assert b.allgather(b"there") == [b"hello", b"there"]
        assert not b.has_input()
        sender.join(5)
    finally:
        _close(meshes)


def test_a_peer_that_goes_away_is_named() -> None:
    meshes = _meshes(3)
    try:
        meshes[2].close()
        with pytest.raises(PeerLost, match="rank 2") as info:
            while True:  # rank 1 may answer first; rank 2's closed connection fails the round
                meshes[0].allgather(b"x")
        assert info.value.peer == 2
        assert meshes[1].wait(0, 5.0)  # an idle rank is woken by the loss...
        with pytest.raises(PeerLost, match="rank 2"):
            meshes[1].receive_ready()  # ...and learns who it was
    finally:
        _close(meshes)


def test_a_peer_that_never_answers_fails_the_round_within_the_deadline() -> None:
    meshes = _meshes(2, round_timeout=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(CollectiveError, match=r"rank\(s\) \[1\] did not answer"):
            meshes[0].allgather(b"x")
        assert time.monotonic() - start < 10
    finally:
        _close(meshes)


def test_a_stray_connection_to_the_listener_is_ignored() -> None:
    strays: list[socket.socket] = []

    def poke_rank0(store: dist.Store) -> None:  # rank 0 listens; ranks 1 and 2 connect after this
        host, _, port = store.get("mesh/0").decode().rpartition(":")
        s = socket.create_connection((host, int(port)))
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        strays.append(s)

    meshes = _meshes(3, before=poke_rank0)
    try:
        closed = strays[0].recv(1) == b""
    except ConnectionResetError:  # closed with our request unread: the kernel resets instead
        closed = True
    strays[0].close()
    assert closed, "rank 0 closes a connection that does not say hello"
    try:
        assert _on_every_rank(meshes, lambda r, m: m.allgather(bytes([r])))[0] == [b"\0", b"\1", b"\2"]
    finally:
        _close(meshes)


def test_an_unknown_control_plane_is_a_config_error() -> None:
    class FakeRuntime:
        knobs = Knobs(control_plane="carrier-pigeon")

    with pytest.raises(ConfigError, match="HORA_CONTROL_PLANE='carrier-pigeon'.*tcp"):
        make_control_plane(FakeRuntime())  # type: ignore[arg-type]
