"""The negotiator's timer thread (hora.engine.scheduling.timers): a timer fires its armed deadline once it passes,
follows re-arming to an earlier or a later deadline, never fires when disarmed, and several timers share one thread."""

from __future__ import annotations

import threading

import pytest

from hora.engine.scheduling.timers import Timer, TimerThread


@pytest.fixture
def dog():
    fired: list[int] = []
    event = threading.Event()

    def fire(round_no: int) -> None:
        fired.append(round_no)
        event.set()

    timers = TimerThread()
    timers.start()
    yield timers.timer(fire), fired, event
    timers.stop()


def test_fires_the_armed_round(dog: tuple[Timer, list[int], threading.Event]) -> None:
    w, fired, event = dog
    w.arm(0.01, 7)
    assert event.wait(10)
    assert fired == [7]


def test_an_earlier_deadline_wakes_it_although_a_later_one_was_armed(dog) -> None:
    w, fired, event = dog
    w.arm(60.0, 1)
    w.arm(0.01, 2)  # must not wait for the 60 s deadline
    assert event.wait(10)
    assert fired == [2]


def test_a_later_deadline_armed_without_waking_still_fires(dog) -> None:
    w, fired, event = dog
    w.arm(0.2, 1)
    w.arm(0.3, 2)  # later than what the thread sleeps until: no notify, it re-reads the deadline on waking
    assert event.wait(10)
    assert fired == [2]


def test_disarmed_never_fires(dog) -> None:
    w, fired, event = dog
    w.arm(0.05, 1)
    w.disarm()
    assert not event.wait(0.5)
    assert fired == []


def test_timers_share_one_thread_and_fire_in_deadline_order() -> None:
    fired: list[tuple[str, int]] = []
    done = threading.Event()
    timers = TimerThread(name="hora-test-timers")
    a = timers.timer(lambda n: fired.append(("a", n)))
    b = timers.timer(lambda n: (fired.append(("b", n)), done.set()))
    timers.start()
    try:
        b.arm(0.2, 2)
        a.arm(0.01, 1)
        assert done.wait(10)
        assert fired == [("a", 1), ("b", 2)]
        assert [t.name for t in threading.enumerate()].count("hora-test-timers") == 1
    finally:
        timers.stop()
    assert "hora-test-timers" not in [t.name for t in threading.enumerate()]
