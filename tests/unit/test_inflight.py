"""The worker's watch over its data transfers (hora.diagnostics.inflight): what it posts on the board, when it
withdraws the post, and that a rank that was frozen itself does not blame its peers. The end-to-end case (a
stopped rank, hora run's report and shutdown) is in tests/launcher/test_silent_ranks.py."""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time

import pytest
from torch.distributed import HashStore

from hora.diagnostics import inflight
from hora.diagnostics.board import Board
from hora.diagnostics.stall_report import StallPolicy
from hora.engine.table import Request
from hora.protocol import messages as protocol
from tests.polling import wait_until


class Transfer:
    """Stands in for a c10d Work: completes when told to."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def is_completed(self) -> bool:
        return self.done.is_set()


def _post(store: HashStore, rank: int = 0) -> dict[str, object] | None:
    key = protocol.board_key("job", protocol.INFLIGHT, rank=rank)
    return json.loads(store.get(key)) if store.check([key]) else None




@pytest.fixture
def store() -> HashStore:
    store = HashStore()
    yield store
    inflight.configure(Board(None, "", 0), 0, StallPolicy(enabled=False))  # no watch for later tests


def test_a_transfer_past_the_deadlines_is_posted_then_withdrawn_when_it_finishes(
        store: HashStore, caplog: pytest.LogCaptureFixture) -> None:
    inflight.configure(Board(store, "job", 0), 0, StallPolicy(warning_s=0.2, shutdown_s=0.4))
    req = Request("big", "allreduce", "float32", (1024, 1024), ps=(0, 1, 2))
    work, handle = Transfer(), object()
    with caplog.at_level(logging.WARNING, logger="hora.diagnostics.inflight"):
        inflight.launched(handle, (req,), work)
        assert wait_until(lambda: (_post(store) or {}).get("ops"))
    post = _post(store)
    assert post is not None and post["expired"] is False
    assert post["ops"] == [{"kind": "allreduce", "name": "big", "op": "allreduce 'big'", "ps": [0, 1, 2],
                            "bytes": 4 << 20, "age": post["ops"][0]["age"]}]  # type: ignore[index]
    assert "hora stall: rank 0: allreduce 'big' (4.0 MB on ranks 0-2) has been in the communication backend" \
        in caplog.text
    assert int(store.add(protocol.board_key("job", protocol.WAITS), 0)) >= 1
    assert wait_until(lambda: (_post(store) or {}).get("expired"))  # past the shutdown time: posted again
    work.done.set()  # it finished after all (nobody synchronized it): the post is withdrawn
    assert wait_until(lambda: (_post(store) or {}).get("ops") == [])


def test_a_synchronized_op_is_forgotten_and_nothing_is_posted(store: HashStore) -> None:
    inflight.configure(Board(store, "job", 0), 0, StallPolicy(warning_s=0.2))
    handle = object()
    inflight.launched(handle, (Request("x", "allreduce", "float32", (4,), ps=(0, 1)),), Transfer())
    inflight.finished(handle)
    time.sleep(0.5)
    assert _post(store) is None


def test_time_this_rank_spent_frozen_does_not_count_against_its_own_transfers(store: HashStore) -> None:
    inflight.configure(Board(store, "job", 0), 0, StallPolicy(warning_s=0.4))
    work = Transfer()
    inflight.launched(object(), (Request("big", "allreduce", "float32", (4,), ps=(0, 1)),), work)
    time.sleep(0.05)
    # a native call that holds the GIL for 1 s: the watchdog cannot run, then wakes to an op 1 s old
    ctypes.PyDLL(None).usleep(1_000_000)
    time.sleep(0.25)
    assert _post(store) is None
    work.done.set()
