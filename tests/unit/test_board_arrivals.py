"""Board.wait_arrivals: the elastic members' wait for each other in ``init()``, which hears the launcher's word
that a member ended (the end-to-end case is tests/distributed/test_elastic_robust.py)."""

from __future__ import annotations

import threading
import time

import pytest
from torch.distributed import HashStore

from hora.diagnostics.board import Board
from hora.errors import StoreAuthError
from hora.protocol import messages as protocol
from hora.protocol.jobsecret import JobSecret
from hora.protocol.signedstore import SignedStore

SECRET = JobSecret.generate()


def _store() -> SignedStore:
    return SignedStore(HashStore(), SECRET, "job", "127.0.0.1:1")


def _boards(store: SignedStore, size: int) -> list[Board]:
    return [Board(store, "job/g2", r) for r in range(size)]


def test_every_member_arrived_returns_at_once() -> None:
    boards = _boards(_store(), 3)
    for b in boards:
        b.arrive(2)
    assert boards[0].wait_arrivals(3, 2, timeout_s=30.0) == ([], {})


def test_a_member_the_launcher_saw_end_stops_the_wait() -> None:
    store = _store()
    boards = _boards(store, 3)
    boards[0].arrive(2)
    boards[1].arrive(2)

    def launcher() -> None:  # what the elastic driver posts when rank 2 of world 2 dies
        time.sleep(0.2)
        store.set(protocol.board_key("job/g2", protocol.ENDED, rank=2), "signal SIGKILL (9)")
        store.add(protocol.board_key("job/g2", protocol.ENDS), 1)

    threading.Thread(target=launcher).start()
    assert boards[0].wait_arrivals(3, 2, timeout_s=30.0) == ([2], {2: "signal SIGKILL (9)"})


def test_late_members_are_named_after_the_timeout_and_an_inactive_board_never_waits() -> None:
    boards = _boards(_store(), 3)
    boards[1].arrive(2)
    assert boards[1].wait_arrivals(3, 2, timeout_s=0.1) == ([0, 2], {})
    assert Board(None, "", 0).wait_arrivals(3, 2, timeout_s=30.0) == ([], {})


def test_an_arrival_a_stranger_posted_fails_the_wait_naming_its_key() -> None:
    store = _store()
    boards = _boards(store, 2)
    boards[0].arrive(2)
    key = protocol.board_key("job/g2", protocol.ARRIVED, gen=2, rank=1)
    store.raw.set(key, "1")  # what a process without the secret can write
    with pytest.raises(StoreAuthError, match=f"store key '{key}' on the rendezvous store at 127.0.0.1:1"):
        boards[0].wait_arrivals(2, 2, timeout_s=30.0)


def test_an_end_a_stranger_posted_is_ignored() -> None:
    store = _store()
    boards = _boards(store, 3)
    store.raw.set(protocol.board_key("job/g2", protocol.ENDED, rank=2), "signal SIGKILL (9)")
    store.raw.add(protocol.board_key("job/g2", protocol.ENDS), 1)
    assert boards[0].ended([1, 2]) == {}
