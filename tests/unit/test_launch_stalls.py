"""The pure parts of issue 17's silent-rank diagnosis: which ranks are silent, which hosts are partitioned,
what /proc's answer means, and one machine listed twice."""

from __future__ import annotations

import os

import pytest

from hora.diagnostics.stall_report import format_silent_report
from hora.errors import LaunchError
from hora.launcher import procs
from hora.launcher.hosts import HostSpec
from hora.launcher.remote import preflight
from hora.launcher.stall_watch import StallWatch

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


def test_proc_states_in_words() -> None:
    assert procs.describe_state({"state": "T"}).startswith("its process is stopped (state T: SIGSTOP")
    assert "busy in native code that holds the Python GIL" in procs.describe_state(
        {"state": "R", "syscall": "running", "threads_running": "1"})
    assert procs.describe_state({"state": "S", "syscall": "clock_nanosleep", "wchan": "hrtimer_nanosleep"}) \
        .startswith("its process is sleeping in the clock_nanosleep system call (kernel: hrtimer_nanosleep)")
    assert procs.describe_state({}) == "its process is gone"


def test_this_process_reads_as_running_or_sleeping() -> None:
    info = procs.process_state(os.getpid())
    assert info["state"] in ("R", "S")


def test_silent_report_names_ranks_hosts_and_the_deadline() -> None:
    text = format_silent_report(0, {1: "n3", 2: "n3"}, 4.2, 10.0, True)
    assert text.startswith("hora stall: ranks 1-2 on n3 have not answered rank 0's negotiation round for 4 s. "
                           "Their processes cannot run Python")
    assert "The job stops when the round has waited 10 s (--stall-check-shutdown-time-seconds)." in text


def test_one_machine_listed_twice_is_refused_and_different_machines_pass() -> None:
    hosts = (HostSpec("localhost", 1), HostSpec("127.0.0.1", 1))
    with pytest.raises(LaunchError, match=r"hosts localhost and 127\.0\.0\.1 are the same machine \(this machine\)"):
        preflight.refuse_same_machine(hosts, {"localhost", "127.0.0.1"}, {})
    remote = (HostSpec("a", 1), HostSpec("10.0.0.1", 2), HostSpec("b", 1))
    answers = {"a": {"machine": "boot1/net:[1]"}, "10.0.0.1": {"machine": "boot1/net:[1]"},
               "b": {"machine": "boot2/net:[1]"}}
    with pytest.raises(LaunchError, match=r"hosts a and 10\.0\.0\.1 are the same machine: .* -H a:3$"):
        preflight.refuse_same_machine(remote, {"a", "10.0.0.1", "b"}, answers)
    preflight.refuse_same_machine(remote, {"a", "b"}, answers)  # -np left 10.0.0.1 without ranks


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
