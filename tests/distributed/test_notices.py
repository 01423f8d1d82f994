"""Notices (hora.engine.scheduling.notices): a value any rank announces comes out at the same notice point on every
rank, however far apart the ranks' notice points are when it is announced."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import torch

import hora as hvd
from hora.runtime import lifecycle as runtime
from tests.distributed.harness import run_ranks

CHECKPOINTS = 200
SYNC_EVERY = 25  # the only collective: between two of them the ranks drift apart by many notice points
ANNOUNCE = {(0, 10), (1, 10), (2, 40), (0, 41), (1, 120), (2, 199)}  # (rank, before its notice point i + 1)


def _ranks(rank: int, size: int) -> dict[str, Any]:
    negotiator = runtime.state().negotiator
    rng = random.Random(rank)
    got: list[tuple[int, list[Any]]] = []
    passed = 0

    def notice_point() -> None:
        nonlocal passed
        passed += 1
        values = negotiator.notice_point()
        if values:
            got.append((passed, sorted(values)))

    # one more announcement from another thread, at no particular notice point
    side = threading.Thread(target=lambda: (time.sleep(0.05), negotiator.announce((rank, -1))))
    if rank == 1:
        side.start()
    for i in range(CHECKPOINTS):
        if (rank, i) in ANNOUNCE:
            negotiator.announce((rank, i))
        notice_point()
        if i % SYNC_EVERY == 0:
            hvd.allreduce(torch.ones(1), name=f"sync.{i}")
        time.sleep(rng.random() * 0.002 * (rank + 1))  # different paces
    if rank == 1:
        side.join()
    # every announcement went out by this allreduce's round, so each is decided by the time a notice point
    # after it returns, at the latest CHECKPOINTS + one per announcement (targets only grow)
    hvd.allreduce(torch.ones(1), name="end")
    for _ in range(len(ANNOUNCE) + 1):
        notice_point()
    return {"got": got}


def test_every_rank_gets_each_notice_at_the_same_checkpoint() -> None:
    results = run_ranks(_ranks, 3, timeout=120)
    got = results[0]["got"]
    for other in results[1:]:
        assert other["got"] == got, "ranks got notices at different notice points"
    values = [tuple(v) for _, vs in got for v in vs]
    assert sorted(values) == sorted([*ANNOUNCE, (1, -1)]), "a notice was lost or repeated"
    for n, vs in got:  # never before the announcing rank reached the notice point after its announcement
        assert all(n > i for _, i in vs), (n, vs)


def _announce_an_object(rank: int, size: int) -> str:
    negotiator = runtime.state().negotiator
    try:
        negotiator.announce(threading.Lock())  # no frame can carry it: refused on the caller's thread
    except ValueError as e:
        message = str(e)
    negotiator.announce(("plain", rank))  # the engine goes on
    hvd.allreduce(torch.ones(1), name="after")
    return message


def test_announcing_something_no_frame_can_carry_is_refused_at_once() -> None:
    for message in run_ranks(_announce_an_object, 2, timeout=60):
        assert message.startswith("cannot encode a lock: the wire carries only None, bool"), message
