"""where.py: what a rank's main thread is doing, as the stall report shows it."""

from __future__ import annotations

import re
import threading

from hora.diagnostics.where import describe_location, set_waiting, waiting_in
from tests.polling import wait_until


def _in_thread(target) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()
    t = threading.Thread(target=target, args=(done,), daemon=True)
    t.start()
    return t, done


def load_batch_slowly(done: threading.Event) -> None:
    done.wait(10)


def wait_in_collective(done: threading.Event) -> None:
    set_waiting("allreduce 'grad.bucket.3'")
    try:
        done.wait(10)
    finally:
        set_waiting(None)




def test_names_the_function_a_busy_thread_is_in():
    t, done = _in_thread(load_batch_slowly)
    try:
        where = wait_until(lambda: "load_batch_slowly" in describe_location(t.ident) and describe_location(t.ident))
    finally:
        done.set()
        t.join()
    # innermost user frame first, then the library call it is in; threading's own frames left out
    assert re.fullmatch(r"running test_where\.py:\d+ load_batch_slowly \(in threading\.py:\d+ wait\)", where)


def test_says_which_collective_a_thread_waits_in():
    t, done = _in_thread(wait_in_collective)
    try:
        where = wait_until(lambda: waiting_in(t.ident) and describe_location(t.ident))
    finally:
        done.set()
        t.join()
    assert where.startswith("waiting in allreduce 'grad.bucket.3' (called from test_where.py:")
    assert "wait_in_collective" in where
    assert waiting_in(t.ident) is None  # cleared after the wait


def sleeping_main_step(entered: threading.Event, asked: threading.Event) -> None:
    entered.set()
    asked.wait(10)


def test_default_describes_the_main_thread_from_another_thread():
    seen: list[str] = []
    entered, asked = threading.Event(), threading.Event()

    def ask(done: threading.Event) -> None:
        entered.wait(10)  # the main thread is in its step
        seen.append(describe_location())
        asked.set()

    t, _ = _in_thread(ask)
    sleeping_main_step(entered, asked)
    t.join()
    assert seen[0].startswith("running test_where.py:")
    assert "sleeping_main_step" in seen[0].split(" <- ")[0]


def test_hora_frames_are_left_out():
    # Asked from the main thread itself: describe_location's own frames are hora's and must not show.
    where = describe_location()
    assert " where.py:" not in where and "<- where.py" not in where
    assert where.startswith("running test_where.py:")
    assert "test_hora_frames_are_left_out" in where.split(" <- ")[0]
