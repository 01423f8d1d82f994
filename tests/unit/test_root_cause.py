"""Choosing the root cause among failures seen close together (launcher/supervision/root_cause.py)."""

from __future__ import annotations

from hora.launcher.hosts import SlotInfo
from hora.launcher.supervision.root_cause import RankState, RootCause, follow_ons, silenced


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
    assert root.choose({0: 10.0, 1: 10.1}, follows={0}) is raiser
    assert root.culprit({0: 10.0, 1: 10.1}, follows={0}) is None
    only = _root(_state(2, exit_ts=10.0), _state(3, exit_ts=10.1))
    assert only.choose({2: 9.9, 3: 9.8}, follows={2, 3}).slot.rank == 3


def test_follow_on_reads_the_error_line_of_a_ranks_last_traceback() -> None:
    gone = ["Traceback (most recent call last):", '  File "t.py", line 4, in <module>', "    hvd.allreduce(t)",
            "hora.PeerLostError: rank 0: rank 1 on host h1 is gone (its process exited or its link broke), ...",
            "(hora's own frames are not shown: HORA_FULL_TRACEBACKS=1, or hora run --verbose, shows them)"]
    torch_prefixed = [f"[rank2]: {line}" for line in gone]  # torch prefixes lines once a process group exists
    tails = {0: ["some output", *gone], 1: [*gone[:3], "ValueError: bad batch mentions PeerLostError"],
             2: torch_prefixed, 3: ["no traceback at all"]}
    assert follow_ons(tails) == {0, 2}


def test_what_a_framework_says_a_rank_raised_decides_as_its_traceback_would() -> None:
    """hora.ray and hora.spark know the type a rank raised: the same rule reads it (one rule for every driver)."""
    assert follow_ons({}, {0: "PeerLostError", 1: "CollectiveError", 2: "CollectiveMismatchError", 3: "ValueError"}) \
        == {0, 1}
    raised = _state(1, exit_ts=10.5, how="raised ValueError: bad batch")
    raised.raised = "ValueError"
    assert not silenced(raised)  # it said how it ended, but it raised: it had its chance
    died = _state(2, exit_ts=11.0, how="its Ray actor died (ActorDiedError: killed, out of memory, or its node lost)")
    follower = _state(0, exit_ts=10.0, how="raised PeerLostError: rank 2 is gone")
    follower.raised = "PeerLostError"
    root = _root(follower, raised, died)
    assert root.choose({}, follows={0}) is died  # an actor that died could not raise: it comes first
    assert _root(follower, raised).choose({}, follows={0}) is raised  # its own error before a follow-on


def test_while_only_follow_ons_were_seen_the_window_waits_for_the_cause() -> None:
    """Ray sees a killed actor after its peers raised PeerLostError: the window stays open for the grace."""
    root = RootCause(settle=0.0, grace=60.0)
    root.offer(_state(0, exit_ts=10.0))
    assert not root.due(all_done=False, follows={0})  # only a follow-on so far: wait
    assert root.due(all_done=False, follows=set())  # a failure of its own: decide now
    assert root.due(all_done=True, follows={0})  # nothing else can fail
    impatient = RootCause(settle=0.0, grace=0.0)
    impatient.offer(_state(0, exit_ts=10.0))
    assert impatient.due(all_done=False, follows={0})  # the grace is over


def test_a_frameworks_ranks_are_weighed_by_the_same_rule() -> None:
    """hora.spark and the fixed hora.ray executor know each failed rank's exit (or that it raised while its process
    still ends) and the type it raised, no traceback times: the same rule names the rank."""
    def choose(*states: RankState) -> int:
        return _root(*states).choose({}, follow_ons({}, {s.slot.rank: s.raised for s in states if s.raised})).slot.rank

    follow_on = RankState.ended(0, "h0", code=1, exit_ts=1.0, raised="CollectiveError")
    assert choose(follow_on, RankState.ended(1, "h1", code=None, sig=9, exit_ts=2.0)) == 1  # killed: first
    # rank 1 raised and its task was stopped while its process shut down: no exit time, still its own error
    assert choose(follow_on, RankState.ended(1, "h1", exit_ts=float("inf"), raised="ValueError")) == 1
    peer_lost = RankState.ended(0, "h0", code=1, exit_ts=1.0, raised="PeerLostError")  # hora's "rank 1 is gone"
    assert choose(peer_lost, RankState.ended(1, "h1", exit_ts=float("inf"), raised="ValueError")) == 1
    assert choose(RankState.ended(0, "h0", exit_ts=3.0, raised="KeyError"),
                  RankState.ended(1, "h1", exit_ts=2.0, raised="ValueError")) == 1  # both their own: the earlier
