"""The stall watchdog (hora.engine.control.Watchdog): fires the armed round once its deadline passes, follows
re-arming to an earlier or a later deadline, and never fires when disarmed."""

from __future__ import annotations

import threading

import pytest

from hora.engine.control import Watchdog


@pytest.fixture
def dog():
    fired: list[int] = []
    event = threading.Event()

    def fire(round_no: int) -> None:
        fired.append(round_no)
        event.set()

    w = Watchdog(fire)
    w.start()
    yield w, fired, event
    w.stop()


def test_fires_the_armed_round(dog):
    w, fired, event = dog
    w.arm(7, 0.01)
    assert event.wait(10)
    assert fired == [7]


def test_an_earlier_deadline_wakes_it_although_a_later_one_was_armed(dog):
    w, fired, event = dog
    w.arm(1, 60.0)
    w.arm(2, 0.01)  # must not wait for the 60 s deadline
    assert event.wait(10)
    assert fired == [2]


def test_a_later_deadline_armed_without_waking_still_fires(dog):
    w, fired, event = dog
    w.arm(1, 0.2)
    w.arm(2, 0.3)  # later than what the thread sleeps until: no notify, it re-reads the deadline on waking
    assert event.wait(10)
    assert fired == [2]


def test_disarmed_never_fires(dog):
    w, fired, event = dog
    w.arm(1, 0.05)
    w.disarm()
    assert not event.wait(0.5)
    assert fired == []
