"""The TCP control mesh on real loopback sockets, ranks as threads of one process sharing a HashStore."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from hora.common.knobs import Knobs
from hora.engine.auth import handshake
from hora.engine.auth.handshake import Identity
from hora.engine.auth.seal import TAG_BYTES
from hora.engine.codec import MAX_FRAME_BYTES
from hora.engine.transport.faults import BadFrame, PeerLost
from hora.engine.transport.mesh import _HEAD, LOSS, ROUND, Mesh, connect_mesh
from hora.engine.transport.plane import make_control_plane
from hora.errors import CollectiveError, ConfigError
from hora.protocol.jobsecret import JobSecret
from tests.polling import wait_until

SECRET = JobSecret.generate()


def identity(rank: int, secret: JobSecret | None = SECRET, code: str = "c0de", world: str = "job/g1") -> Identity:
    return Identity(rank=rank, world=world, purpose="mesh", secret=secret, code=code, hora="0.1.0", host=f"node{rank}")


def _meshes(size: int, round_timeout: float = 30.0, before: Callable[[dist.Store], None] | None = None,
            secret: JobSecret | None = SECRET, full_upto: int = 1 << 20, store: Any = None) -> list[Mesh]:
    """Connect ``size`` ranks (the full exchange unless ``full_upto`` < ``size``); ``before(store)``, if given,
    runs once rank 0 listens, before the others start."""
    store = dist.HashStore() if store is None else store
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
            out[rank] = connect_mesh(identity(rank, secret), size, store, "127.0.0.1", 20.0, round_timeout,
                                     full_upto=full_upto)
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


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
def test_rounds_gather_every_payload_in_rank_order_including_large_ones(secret: JobSecret | None) -> None:
    meshes = _meshes(4, secret=secret)
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
        assert wait_until(lambda: _read(b), timeout=5)  # the bell may ring before the whole frame is in
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


def test_a_peer_that_leaves_after_the_last_round_is_no_failure_of_that_round() -> None:
    """After the shutdown round, a rank that has every frame exits while a slower rank's frame is still on its
    way to others (that rank sent to it first, then was descheduled): that closed connection must not fail
    their round. At 16 ranks on 2 cores, jobs that succeeded printed 'rank 1 on host ... is gone'."""
    meshes = _meshes(3)
    left = threading.Event()
    try:
        def ranks(rank: int, mesh: Mesh) -> list[bytes] | None:
            if rank == 2:  # rank 2's frame reaches rank 1 now, rank 0 only once rank 1 has gone
                payload = b"bye 2"
                head = _HEAD.pack(0, len(payload), ROUND)
                frame = head + payload + mesh._seal.tag(head, payload)
                mesh._peers[1].sendall(frame)
                left.wait(10)
                select.select([meshes[0]._peers[1]], [], [], 10)  # rank 1's goodbye is at rank 0
                mesh._peers[0].sendall(frame)
                return None
            got = mesh.allgather(f"bye {rank}".encode())
            if rank == 1:  # it has every frame: it leaves, as a process does after the shutdown round
                mesh.close()
                left.set()
            return got

        results = _on_every_rank(meshes, ranks)
        assert results[:2] == [[b"bye 0", b"bye 1", b"bye 2"]] * 2
        with pytest.raises(PeerLost, match="rank 1"):  # a round after it would need rank 1: that one fails
            meshes[0].allgather(b"next")
    finally:
        _close([meshes[0], meshes[2]])


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


def test_a_stranger_claiming_a_rank_first_is_refused_and_the_real_rank_connects() -> None:
    refused: list[BaseException] = []

    def impersonate_rank1(store: dist.Store) -> None:  # before the real rank 1 starts
        host, _, port = store.get("mesh/0").decode().rpartition(":")
        with socket.create_connection((host, int(port))) as s:
            try:
                handshake.dial(s, identity(1, JobSecret.generate()), 0, time.monotonic() + 5)
            except CollectiveError as e:
                refused.append(e)

    meshes = _meshes(3, before=impersonate_rank1)
    try:
        assert "could not prove that it holds the job's secret" in str(refused[0])
        assert _on_every_rank(meshes, lambda r, m: m.allgather(bytes([r])))[0] == [b"\0", b"\1", b"\2"]
    finally:
        _close(meshes)


def _inject(meshes: list[Mesh], data: bytes) -> BadFrame:
    """Send ``data`` on rank 1's connection to rank 0, as if injected into it; the error rank 0's round gets."""
    meshes[1]._peers[0].sendall(data)
    with pytest.raises(BadFrame) as info:
        meshes[0].allgather(b"x")
    assert info.value.peer == 1 and "rank 0: the control connection from rank 1 (127.0.0.1:" in str(info.value)
    return info.value


def test_a_forged_frame_fails_the_round_naming_the_peer() -> None:
    meshes = _meshes(2)
    try:
        head = _HEAD.pack(0, 3, ROUND)
        error = _inject(meshes, head + b"abc" + b"\0" * TAG_BYTES)
        assert "failed authentication" in str(error)
    finally:
        _close(meshes)


def test_a_changed_byte_fails_authentication() -> None:
    meshes = _meshes(2)
    try:
        head = _HEAD.pack(0, 3, ROUND)
        tag = meshes[1]._seal.tag(head, b"abc")
        error = _inject(meshes, head + b"abd" + tag)
        assert "failed authentication" in str(error)
    finally:
        _close(meshes)


def test_a_replayed_frame_is_refused_by_its_number() -> None:
    meshes = _meshes(2)
    try:
        assert _on_every_rank(meshes, lambda r, m: m.allgather(b"round0"))[0] == [b"round0", b"round0"]
        head = _HEAD.pack(0, 6, ROUND)
        recorded = head + b"round0" + meshes[1]._seal.tag(head, b"round0")  # rank 1's genuine frame of round 0
        error = _inject(meshes, recorded)
        assert "frame number 0 where number 1 was due" in str(error)
    finally:
        _close(meshes)


def test_an_oversized_frame_is_refused_from_its_header_alone() -> None:
    meshes = _meshes(2)
    try:
        error = _inject(meshes, _HEAD.pack(0, MAX_FRAME_BYTES + 1, ROUND))  # no payload follows: never waited for
        bound = f"announced a {MAX_FRAME_BYTES + 1}-byte frame, more than the {MAX_FRAME_BYTES} bytes allowed"
        assert bound in str(error)
    finally:
        _close(meshes)


def test_garbage_on_the_connection_fails_the_round() -> None:
    meshes = _meshes(2)
    try:
        _inject(meshes, bytes(range(256)) * 4)
    finally:
        _close(meshes)


def test_without_a_secret_frames_carry_no_tag_and_still_check_their_number() -> None:
    meshes = _meshes(2, secret=None)
    try:
        assert meshes[0]._seal.tag_bytes == 0
        error = _inject(meshes, _HEAD.pack(7, 1, ROUND) + b"x")
        assert "frame number 7 where number 0 was due" in str(error)
    finally:
        _close(meshes)


# --- recursive doubling (above HORA_MESH_FULL_UPTO ranks) ---------------------------------------------------------

@pytest.mark.parametrize("size", [2, 3, 5, 6, 8, 11])
def test_doubling_rounds_gather_every_payload_in_rank_order_over_log_n_connections(size: int) -> None:
    meshes = _meshes(size, full_upto=1)
    try:
        assert all(m.plan.shape == "doubling" for m in meshes)
        p = 1 << (size.bit_length() - 1)
        for rank, m in enumerate(meshes):  # log2(p) partners, and the extra rank folded in (or the one it folds into)
            assert len(m._peers) == (1 if rank >= p else (p.bit_length() - 1) + (rank < size - p))
        sizes = [0, 10, 3000, 200_000, 7]  # mixed sizes; each rank's payload differs

        def rounds(rank: int, mesh: Mesh) -> list[list[bytes]]:
            return [mesh.allgather(bytes([rank]) * (n + rank)) for n in sizes]

        results = _on_every_rank(meshes, rounds)
        for i, n in enumerate(sizes):
            expected = [bytes([r]) * (n + r) for r in range(size)]
            assert all(per_rank[i] == expected for per_rank in results)
    finally:
        _close(meshes)


def test_doubling_ranks_wait_in_the_store_only_for_their_partners_addresses() -> None:
    class CountingStore:
        def __init__(self) -> None:
            self.store = dist.HashStore()
            self.waited: list[str] = []
            self.lock = threading.Lock()

        def wait(self, keys: list[str], *args: Any) -> None:
            with self.lock:
                self.waited += keys
            self.store.wait(keys, *args)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.store, name)

    store = CountingStore()
    meshes = _meshes(16, full_upto=8, store=store)
    try:
        # each rank dials only its lower partners: 0 + 1 + 1 + 2 + ... = the number of edges, 4 * 16 / 2
        assert len(store.waited) == 32
        assert max(len(m._peers) for m in meshes) == 4
    finally:
        _close(meshes)


def _read(mesh: Mesh) -> dict[int, bytes]:
    """Read what the peers sent so far (without blocking) and return what is waiting for the next round."""
    mesh.receive_ready()
    return mesh.peek()


def _until_lost(rank: int, mesh: Mesh) -> PeerLost:
    """What an idle rank learns, reading whatever wakes it (its bell: ``wait``), until a loss reaches it."""
    def lost() -> PeerLost | None:
        mesh.wait(0, 1.0)
        try:
            mesh.receive_ready()
        except PeerLost as e:
            return e
        return None

    loss = wait_until(lost, timeout=20, step=0)
    assert loss is not None, f"rank {rank} never learned of the loss"
    return loss


@pytest.mark.parametrize("size", [8, 5])
def test_doubling_a_lost_rank_is_named_on_every_rank_also_on_those_not_connected_to_it(size: int) -> None:
    meshes = _meshes(size, full_upto=1)
    dead = size - 3  # size 8: rank 5 (partners 4, 7, 1); size 5: rank 2 (partners 3, 0)
    try:
        assert _on_every_rank(meshes, lambda r, m: m.allgather(bytes([r])))[0] == [bytes([r]) for r in range(size)]
        meshes[dead].close()
        alive = [m for r, m in enumerate(meshes) if r != dead]
        strangers = [m.rank for m in alive if dead not in m._peers]
        assert strangers, "some rank has no connection to the lost one"
        errors = _on_every_rank(alive, lambda i, m: _until_lost(m.rank, m))
        assert [e.peer for e in errors] == [dead] * (size - 1)
        for e in errors:
            assert f"rank {dead}" in str(e)
    finally:
        _close(meshes)


def test_doubling_a_rank_lost_during_a_round_fails_that_round_on_every_rank_naming_it() -> None:
    meshes = _meshes(8, full_upto=1)
    try:
        meshes[5].close()
        alive = [m for r, m in enumerate(meshes) if r != 5]

        def one_round(i: int, mesh: Mesh) -> int:
            with pytest.raises(PeerLost) as info:
                mesh.allgather(b"x")
            return info.value.peer

        assert _on_every_rank(alive, one_round) == [5] * 7
    finally:
        _close(meshes)


def test_doubling_a_frame_that_does_not_hold_the_scheduled_payloads_fails_the_round() -> None:
    meshes = _meshes(4, full_upto=1, round_timeout=5.0)  # rank 2's step-1 partner is rank 0: ranks 0 and 1's payloads
    try:
        head = _HEAD.pack(0, 5, ROUND)
        payload = b"\x01\0\0\0a"  # rank 0's payload, then nothing for rank 1
        meshes[0]._peers[2].sendall(head + payload + meshes[0]._seal.tag(head, payload))

        def ranks_2_and_3(i: int, mesh: Mesh) -> BaseException | None:  # rank 3 is rank 2's step-0 partner
            try:
                mesh.allgather(b"x")
            except CollectiveError as e:
                return e
            return None

        error = _on_every_rank([meshes[2], meshes[3]], ranks_2_and_3)[0]
        assert isinstance(error, BadFrame) and error.peer == 0, error
        assert "ends before rank 1's payload" in str(error)
    finally:
        _close(meshes)


def test_a_loss_notice_is_authenticated_like_any_frame() -> None:
    meshes = _meshes(4, full_upto=1)
    try:
        head = _HEAD.pack(0, 4, LOSS)
        body = (3).to_bytes(4, "little")
        meshes[0]._peers[2].sendall(head + body + b"\0" * TAG_BYTES)  # a forged notice that rank 3 is gone
        with pytest.raises(BadFrame, match="failed authentication"):
            meshes[2].receive_ready()
    finally:
        _close(meshes)


@pytest.mark.parametrize("size,starter", [(3, 0), (3, 1), (6, 5), (6, 3)])
def test_doubling_a_round_one_rank_starts_wakes_every_idle_rank(size: int, starter: int) -> None:
    """Idle negotiators wake only on a peer's frame: every rank, extras included, must get one once a round
    starts anywhere (an extra whose partner waited for its payload first never woke)."""
    meshes = _meshes(size, full_upto=1)
    try:
        def rank(r: int, mesh: Mesh) -> list[bytes]:
            if r != starter:
                assert mesh.wait(0, 10.0), f"rank {r} was not woken by the round rank {starter} started"
            return mesh.allgather(bytes([r]))

        assert _on_every_rank(meshes, rank) == [[bytes([r]) for r in range(size)]] * size
    finally:
        _close(meshes)
