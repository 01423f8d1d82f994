"""runtime.arrivals: the ranks' wait for each other in ``init()``, four store operations a rank whatever the size,
which names late ranks and hears the launcher's word that a member ended (end to end:
tests/distributed/test_elastic_robust.py, tests/distributed/test_init_errors.py)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from torch.distributed import HashStore

from hora.bench.store_tally import StoreTally
from hora.diagnostics.board import Board
from hora.protocol import elastic as ep
from hora.protocol import messages as protocol
from hora.protocol.jobsecret import JobSecret
from hora.protocol.signedstore import SignedStore
from hora.runtime.arrivals import Arrivals

SECRET = JobSecret.generate()


def _store() -> SignedStore:
    return SignedStore(HashStore(), SECRET, "job", "127.0.0.1:1")


def _arrivals(store: SignedStore, size: int) -> list[Arrivals]:
    return [Arrivals(store.under(ep.world_prefix("job", 2)), r, size) for r in range(size)]


@pytest.mark.parametrize("size", [4, 64])
def test_every_rank_released_with_the_same_few_store_operations_at_any_size(size: int) -> None:
    tally = StoreTally("job")
    store = SignedStore(tally.wrap(HashStore()), SECRET, "job", "127.0.0.1:1")
    ranks = _arrivals(store, size)
    for a in ranks:
        a.arrive()
    assert all(a.wait(30.0) == ([], {}) for a in ranks)
    ops = Counter(op for (op, _), n in tally.take().calls.items() for _ in range(n))
    # per rank: set arrived/<rank>, add, wait, get; the last one to arrive also releases everyone
    assert ops == {"set": size, "add": size, "wait": size, "get": size, "compare_set": 1}


def test_a_rank_waiting_is_released_by_the_last_arrival() -> None:
    first, second = _arrivals(_store(), 2)
    first.arrive()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(first.wait(30.0)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting for rank 1
    second.arrive()
    waiter.join(30.0)
    assert got == [([], {})]


def test_late_ranks_are_named_after_the_timeout() -> None:
    ranks = _arrivals(_store(), 3)
    ranks[1].arrive()
    assert ranks[1].wait(0.1) == ([0, 2], {})


def test_a_member_the_launcher_saw_end_stops_the_wait() -> None:
    store = _store()
    ranks = _arrivals(store, 3)
    ranks[0].arrive()
    ranks[1].arrive()
    board = Board(store, ep.world_job_id("job", 2), 0)

    def launcher() -> None:  # what the elastic driver posts when rank 2 of world 2 dies
        time.sleep(0.2)
        store.set(protocol.board_key(ep.world_job_id("job", 2), protocol.ENDED, rank=2), "signal SIGKILL (9)")
        store.add(protocol.board_key(ep.world_job_id("job", 2), protocol.ENDS), 1)
        store.set(ep.arrivals_key("job", 2), ep.MEMBER_ENDED)

    threading.Thread(target=launcher).start()
    assert ranks[0].wait(30.0, lambda: board.ended(range(3))) == ([2], {2: "signal SIGKILL (9)"})


def test_the_last_arrival_does_not_overwrite_the_launchers_word() -> None:
    store = _store()
    ranks = _arrivals(store, 2)
    ranks[0].arrive()
    store.set(ep.arrivals_key("job", 2), ep.MEMBER_ENDED)  # rank 1 was seen to end, then arrives after all
    ranks[1].arrive()
    assert store.get(ep.arrivals_key("job", 2)) == b"ended"


def test_a_release_a_stranger_posted_is_only_a_wake_up_logged_naming_its_key(
        caplog: pytest.LogCaptureFixture) -> None:
    store = _store()
    ranks = _arrivals(store, 3)
    ranks[0].arrive()
    board = Board(store, ep.world_job_id("job", 2), 0)
    key = ep.arrivals_key("job", 2)
    store.raw.set(key, "1")  # what a process without the secret can write
    assert ranks[0].wait(30.0, lambda: board.ended(range(3))) == ([], {})  # nobody the launcher saw end
    assert f"store key '{key}' on the rendezvous store at 127.0.0.1:1 failed authentication" in caplog.text


def test_an_end_a_stranger_posted_is_ignored() -> None:
    store = _store()
    board = Board(store, "job/g2", 0)
    store.raw.set(protocol.board_key("job/g2", protocol.ENDED, rank=2), "signal SIGKILL (9)")
    store.raw.add(protocol.board_key("job/g2", protocol.ENDS), 1)
    assert board.ended([1, 2]) == {}
