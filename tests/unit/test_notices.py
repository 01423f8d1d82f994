"""Notice channels: a value comes out at its own channel's notice point only (the first at or after the agreed
number), and a channel's listener gets it in the round that carried it."""

from __future__ import annotations

from hora.engine.scheduling.notices import Notices
from hora.engine.scheduling.pending import Pending


def _agree(notices: Notices, pending: Pending, *values: list[object]) -> None:
    notices.on_round([{"notice": list(values)}])  # round A: the announcement; this rank arms
    notices.on_round([pending.flags])  # round A+1: every rank's count (here one rank's)
    pending.flags.clear()


def test_a_value_waits_for_its_own_channels_notice_point() -> None:
    pending = Pending(0)
    notices = Notices(pending, wake=lambda: None)
    heard: list[object] = []
    notices.listen("autotune", heard.append)
    _agree(notices, pending, ["autotune", [4.0, 8.0, False, False]], ["elastic", "hosts"])
    assert heard == [[4.0, 8.0, False, False]]  # in round A, before any notice point
    assert notices.notice_point("elastic") == ["hosts"]  # number 1: the elastic value is due and its own
    assert notices.notice_point("elastic") == []
    assert notices.notice_point("autotune") == [[4.0, 8.0, False, False]]  # due since number 1, kept for it
    assert notices.notice_point("autotune") == []
    notices.listen("autotune", None)
    _agree(notices, pending, ["autotune", "later"])
    assert heard == [[4.0, 8.0, False, False]]
    assert notices.notice_point() == [] and notices.notice_point("autotune") == ["later"]
