"""The worker's watch over its data transfers (hora.diagnostics.inflight): what it posts on the board, when it
withdraws the post, and that a rank that was frozen itself does not blame its peers. The end-to-end case (a
stopped rank, hora run's report and shutdown) is in tests/launcher/test_silent_ranks.py."""

from __future__ import annotations

import ctypes
import json
import logging
import sys
import threading
from collections.abc import Iterator

import pytest
from torch.distributed import HashStore

from hora.diagnostics.board import Board
from hora.diagnostics.inflight import InflightWatch
from hora.diagnostics.stall_report import StallPolicy
from hora.engine.scheduling.table import Request
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
    return HashStore()


@pytest.fixture
def watches() -> Iterator[list[InflightWatch]]:
    """The watches a test makes, stopped after it (their threads end)."""
    made: list[InflightWatch] = []
    yield made
    for watch in made:
        watch.stop()


def _watch(watches: list[InflightWatch], store: HashStore, policy: StallPolicy) -> InflightWatch:
    watch = InflightWatch(Board(store, "job", 0), 0, policy)
    watches.append(watch)
    return watch


def test_a_transfer_past_the_deadlines_is_posted_then_withdrawn_when_it_finishes(
        store: HashStore, watches: list[InflightWatch], caplog: pytest.LogCaptureFixture) -> None:
    inflight = _watch(watches, store, StallPolicy(warning_s=0.2, shutdown_s=0.4))
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
    # the post is written, then the launcher's counter bumped: the test may read between the two
    assert wait_until(lambda: int(store.add(protocol.board_key("job", protocol.WAITS), 0)) >= 1)
    assert wait_until(lambda: (_post(store) or {}).get("expired"))  # past the shutdown time: posted again
    work.done.set()  # it finished after all (nobody synchronized it): the post is withdrawn
    assert wait_until(lambda: (_post(store) or {}).get("ops") == [])


def _watchdog() -> threading.Thread | None:
    """The watch's thread, by the name a user sees in a stack dump (it exists only while ops are in flight)."""
    return next((th for th in threading.enumerate() if th.name == "hora-inflight-watch"), None)


def _asleep_between_checks(thread: threading.Thread) -> bool:
    """True while ``thread`` waits for its next tick (in an Event's wait, under its loop)."""
    frame = sys._current_frames().get(thread.ident or -1)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return "wait" in names and "_watch" in names


def test_a_synchronized_op_is_forgotten_and_nothing_is_posted(store: HashStore, watches: list[InflightWatch],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    inflight = _watch(watches, store, StallPolicy(warning_s=0.2))
    handle = object()
    with caplog.at_level(logging.WARNING, logger="hora.diagnostics.inflight"):
        inflight.launched(handle, (Request("x", "allreduce", "float32", (4,), ps=(0, 1)),), Transfer())
        watchdog = _watchdog()
        assert watchdog is not None  # the op is watched...
        inflight.finished(handle)
        # ...until it is forgotten: with nothing in flight the watch ends (an op it still held would be posted
        # at the warning time and keep it running)
        watchdog.join(10)
        assert not watchdog.is_alive()
    assert _post(store) is None and "hora stall" not in caplog.text


def test_time_this_rank_spent_frozen_does_not_count_against_its_own_transfers(
        store: HashStore, watches: list[InflightWatch]) -> None:
    """A native call holds the GIL for longer than the warning time while this rank's op is on the wire: the
    watch cannot run meanwhile, then wakes to an op launched long ago. That time was the rank's own, not a
    peer's: the op is posted only once it has been in flight for the warning time outside the freeze, with
    that age."""
    frozen_s = 1.5
    inflight = _watch(watches, store, StallPolicy(warning_s=0.2))
    work = Transfer()
    inflight.launched(object(), (Request("big", "allreduce", "float32", (4,), ps=(0, 1)),), work)
    watchdog = _watchdog()
    assert watchdog is not None and wait_until(lambda: _asleep_between_checks(watchdog))
    ctypes.PyDLL(None).usleep(int(frozen_s * 1e6))  # holds the GIL: the watch's tick cannot run
    assert wait_until(lambda: (_post(store) or {}).get("ops"))
    post = _post(store)
    assert post is not None and post["ops"][0]["age"] < frozen_s, post  # type: ignore[index]
    work.done.set()
