"""Choosing the root cause among failures seen close together."""

from __future__ import annotations

from hora.launcher.failures import RankState, RootCause
from hora.launcher.hosts import SlotInfo


def _state(rank: int, code: int | None = 1, sig: int | None = None, exit_ts: float = 0.0,
           how: str | None = None) -> RankState:
    slot = SlotInfo(rank=rank, size=4, local_rank=0, local_size=1, cross_rank=rank, cross_size=4,
                    hostname=f"h{rank}", host_index=rank)
    return RankState(slot, done=True, code=code, sig=sig, exit_ts=exit_ts, how=how)


def _root(*states: RankState) -> RootCause:
    root = RootCause(settle=0.0)
    for state in states:
        root.offer(state)
    return root


def test_the_rank_whose_traceback_began_first_wins_over_the_first_to_exit() -> None:
    follow_on, raiser = _state(0, exit_ts=10.2), _state(1, exit_ts=10.5)
    root = _root(follow_on, raiser)
    assert root.choose({0: 10.1, 1: 10.0}) is raiser
    assert root.culprit({0: 10.1, 1: 10.0}) is None


def test_a_killed_rank_is_the_cause_even_if_peers_printed_tracebacks() -> None:
    killed, follow_on = _state(2, code=None, sig=9, exit_ts=10.0), _state(3, exit_ts=10.3)
    root = _root(follow_on, killed)
    assert root.choose({3: 9.9}) is killed  # the follow-on's traceback time says nothing about a SIGKILL
    assert root.culprit({3: 9.9}) is None


def test_a_lost_host_is_the_cause() -> None:
    lost, follow_on = _state(1, exit_ts=10.4, how="lost: ..."), _state(3, exit_ts=10.2)
    root = _root(follow_on, lost)
    assert root.choose({3: 10.1}) is lost and root.culprit({3: 10.1}) is None


def test_a_rank_still_in_teardown_after_raising_is_named_as_culprit() -> None:
    follow_on = _state(0, exit_ts=10.2)
    root = _root(follow_on)
    assert root.choose({0: 10.1, 1: 10.0}) is follow_on
    assert root.culprit({0: 10.1, 1: 10.0}) == 1


def test_a_rank_that_raised_peer_lost_is_a_consequence_even_when_its_output_was_timed_first() -> None:
    """On a busy host the agents may read a follow-on's traceback before the cause's: a PeerLostError says
    which it is. Only when every failure is one (a peer finished early) is one of them the cause."""
    follow_on, raiser = _state(0, exit_ts=10.2), _state(1, exit_ts=10.5)
    root = _root(follow_on, raiser)
    assert root.choose({0: 10.0, 1: 10.1}, follow_ons={0}) is raiser
    assert root.culprit({0: 10.0, 1: 10.1}, follow_ons={0}) is None
    only = _root(_state(2, exit_ts=10.0), _state(3, exit_ts=10.1))
    assert only.choose({2: 9.9, 3: 9.8}, follow_ons={2, 3}).slot.rank == 3


def test_follow_on_reads_the_error_line_of_a_ranks_last_traceback() -> None:
    from hora.launcher import output

    gone = ["Traceback (most recent call last):", '  File "t.py", line 4, in <module>', "    hvd.allreduce(t)",
            "hora.PeerLostError: rank 0: rank 1 on host h1 is gone (its process exited or its link broke), ...",
            "(hora's own frames are not shown: HORA_FULL_TRACEBACKS=1, or hora run --verbose, shows them)"]
    assert output.follow_on(["some output", *gone])
    assert not output.follow_on([*gone[:3], "ValueError: bad batch mentions PeerLostError"])
    assert not output.follow_on(["no traceback at all"])
