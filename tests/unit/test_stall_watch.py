"""The launcher's watch over silent ranks (hora.launcher.stall_watch, issue 17): which ranks are silent, which
hosts are partitioned, which member froze in a transfer; and the silent-rank report it prints."""

from __future__ import annotations

from hora.diagnostics.stall_report import format_silent_report
from hora.launcher.supervision.stall_watch import StallWatch

HOSTS = {0: "n2", 1: "n3", 2: "n3", 3: "n4"}


def test_ranks_nobody_hears_from_are_silent_and_probed_once() -> None:
    watch = StallWatch(None, "", HOSTS)
    waiting = {r: {"missing": [2], "round": 9, "waited": 2.0} for r in (0, 1, 3)}
    assert watch.analyse(waiting) == ([2], [])
    assert watch.analyse(waiting) == ([], [])  # already asked
    assert watch.on_probe(2, "its process is stopped").startswith(
        "stall: rank 2 on host n3 has not answered its peers for 2 s: its process is stopped")


def test_two_groups_waiting_for_each_other_in_one_round_are_a_partition() -> None:
    watch = StallWatch(None, "", HOSTS)
    waiting = {
        0: {"missing": [1, 2, 3], "round": 10, "waited": 2.0},  # a round later: it waits behind the others
        1: {"missing": [3], "round": 9, "waited": 2.0},
        2: {"missing": [3], "round": 9, "waited": 2.0},
        3: {"missing": [1, 2], "round": 9, "waited": 2.0},
    }
    probe, notes = watch.analyse(waiting)
    assert probe == []
    assert notes == ["stall: hosts n3 and n4 cannot reach each other: ranks 1, 2 on n3 and rank 3 on n4 wait for "
                     "each other and all are running (a network partition; hora run still reaches both hosts)"]
    culprit = watch.culprit()
    assert culprit is not None and culprit.rank == 3 and culprit.how.startswith("unreachable from host n3")


def test_silent_report_names_ranks_hosts_and_the_deadline() -> None:
    text = format_silent_report(0, {1: "n3", 2: "n3"}, 4.2, 10.0, True)
    assert text.startswith("hora stall: ranks 1-2 on n3 have not answered rank 0's negotiation round for 4 s. "
                           "Their processes cannot run Python")
    assert "The job stops when the round has waited 10 s (--stall-check-shutdown-time-seconds)." in text


def _transfer(age: float, expired: bool = False, ps: tuple[int, ...] = (0, 1, 2, 3)) -> dict[str, object]:
    return {"ops": [{"kind": "allreduce", "name": "big", "op": "allreduce 'big'", "ps": list(ps), "bytes": 64 << 20,
                     "age": age}], "waited": age, "expired": expired, "shutdown": 4.0}


def test_a_member_that_posted_no_unfinished_transfer_is_frozen_in_it_and_named_at_the_shutdown_time() -> None:
    watch = StallWatch(None, "", HOSTS)
    assert watch.analyse({}, {r: _transfer(2.0) for r in (0, 1, 3)}) == ([2], [])
    assert watch.shutdown_due() is None  # not past the shutdown time yet
    assert watch.on_probe(2, "its process is stopped") == (
        "stall: rank 2 on host n3 has not finished allreduce 'big' (64.0 MB), which ranks 0, 1, 3 have waited 2 s "
        "for in the communication backend: its process is stopped")
    assert watch.analyse({}, {r: _transfer(4.0, expired=True) for r in (0, 1, 3)}) == ([], [])  # probed once
    found = watch.shutdown_due()
    assert found is not None and found.rank == 2
    assert found.how == ("did not finish allreduce 'big' (64.0 MB) within --stall-check-shutdown-time-seconds 4 s "
                         "while ranks 0, 1, 3 waited for it in the communication backend: its process is stopped; "
                         "hora run stopped the job")
    assert watch.shutdown_due() is None  # once


def test_members_of_other_process_sets_and_ranks_waiting_elsewhere_are_not_frozen() -> None:
    watch = StallWatch(None, "", HOSTS)
    waiting = {3: {"missing": [2], "round": 5, "waited": 2.0}}  # rank 3 waits in a negotiation round: alive
    assert watch.analyse(waiting, {0: _transfer(2.0, ps=(0, 2, 3))}) == ([2], [])
    assert 1 not in watch.held and 3 not in watch.held


def test_a_withdrawn_transfer_ends_the_episode_and_a_later_freeze_is_reported_again() -> None:
    watch = StallWatch(None, "", HOSTS)
    assert watch.analyse({}, {0: _transfer(2.0, ps=(0, 1))}) == ([1], [])
    assert watch.analyse({}, {0: {"ops": [], "waited": 0.0, "expired": False, "shutdown": 4.0}}) == ([], [])
    assert watch.held == {} and watch.shutdown_due() is None
    assert watch.analyse({}, {0: _transfer(2.0, ps=(0, 1))}) == ([1], [])


def test_a_transfer_every_member_waits_for_ends_naming_the_network_not_a_rank() -> None:
    watch = StallWatch(None, "", HOSTS)
    assert watch.analyse({}, {r: _transfer(4.0, expired=True) for r in range(4)}) == ([], [])
    found = watch.shutdown_due()
    assert found is not None and found.rank == 0
    assert found.how.startswith("allreduce 'big' (64.0 MB) did not finish within --stall-check-shutdown-time-seconds "
                                "4 s, and every member (ranks 0, 1, 2, 3) waits for it in the communication backend "
                                "and is running: the network between hosts n2, n3, n4 is slow or cut")


def test_two_ranks_waiting_for_each_other_one_round_apart_are_a_partition() -> None:
    # rank 3 got rank 1's frame of round 9 and waits in round 10; rank 1 never got rank 3's frame of round 9,
    # sent before rank 3 finished that round: the link between their hosts lost it
    watch = StallWatch(None, "", {0: "n2", 1: "n3", 3: "n4"})
    waiting = {
        0: {"missing": [3], "round": 10, "waited": 2.0},
        1: {"missing": [3], "round": 9, "waited": 2.0},
        3: {"missing": [1], "round": 10, "waited": 2.0},
    }
    probe, notes = watch.analyse(waiting)
    assert probe == []
    assert notes == ["stall: hosts n3 and n4 cannot reach each other: rank 1 on n3 and rank 3 on n4 wait for "
                     "each other and all are running (a network partition; hora run still reaches both hosts)"]
    culprit = watch.culprit()
    assert culprit is not None and culprit.rank == 3 and culprit.how.startswith("unreachable from host n3")


def test_ranks_two_rounds_apart_are_not_a_partition() -> None:
    watch = StallWatch(None, "", {0: "n2", 1: "n3", 3: "n4"})
    waiting = {1: {"missing": [3], "round": 9, "waited": 2.0}, 3: {"missing": [1], "round": 11, "waited": 2.0}}
    assert watch.analyse(waiting) == ([], [])
    assert watch.culprit() is None
