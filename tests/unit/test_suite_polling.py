"""tests/polling.py, the suite's one way to wait: what a wait returns, and when it gives up."""

from __future__ import annotations

from tests.polling import wait_until


def test_a_wait_returns_what_it_found() -> None:
    answers = iter([None, "", "found"])
    assert wait_until(lambda: next(answers), timeout=60, step=0) == "found"


def test_a_wait_that_runs_out_of_time_returns_the_last_answer() -> None:
    assert wait_until(lambda: [], timeout=0.05) == []


def test_a_wait_gives_up_once_unless_holds_and_still_counts_what_was_left_behind() -> None:
    """The process waited for ended between two questions: its last line is still found; what it never wrote
    is not waited for until the timeout."""
    answers = iter([None, "its last line"])
    assert wait_until(lambda: next(answers), timeout=600, unless=lambda: True) == "its last line"
    asked = []
    assert wait_until(lambda: asked.append(1), timeout=600, unless=lambda: True) is None
    assert len(asked) == 2
