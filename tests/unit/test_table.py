"""The negotiation table (hora.engine.scheduling.table): when a name is ready, mismatches, joined ranks, rejected calls;
pure logic every rank runs on the same inputs."""

from __future__ import annotations

from hora.engine.scheduling.table import Decision, Request, Table, last_joined
from hora.errors import CollectiveError, CollectiveMismatchError, PeerRejectedCallError

ALL = (0, 1, 2)


def req(name: str, kind: str = "allreduce", shape: tuple[int, ...] = (4,), dtype: str = "float32",
        ps: tuple[int, ...] = ALL, **kw: object) -> Request:
    return Request(name, kind, dtype, shape, ps=ps, **kw)  # type: ignore[arg-type]


def step(table: Table, round_no: int, *submissions: tuple[int, Request]) -> Decision:
    decision = Decision()
    for rank, r in submissions:
        table.add(rank, r, round_no, 0.0, decision)
    return table.decide(decision)


def test_a_name_is_ready_once_every_member_submitted_in_any_round() -> None:
    table = Table(3)
    assert step(table, 0, (0, req("a")), (2, req("a"))).ready == []
    d = step(table, 1, (1, req("a")))
    assert [e.name for e in d.ready] == ["a"]
    assert sorted(d.ready[0].requests) == [0, 1, 2]
    assert table.entries == {}


def test_ready_order_is_first_submission_order_whatever_each_rank_did() -> None:
    table = Table(2)
    d = step(table, 0, (0, req("x", ps=(0, 1))), (0, req("y", ps=(0, 1))),
             (1, req("y", ps=(0, 1))), (1, req("x", ps=(0, 1))))
    assert [e.name for e in d.ready] == ["x", "y"]


def test_process_set_ops_wait_only_for_members() -> None:
    table = Table(3)
    d = step(table, 0, (0, req("p", ps=(0, 2))), (2, req("p", ps=(0, 2))))
    assert [e.name for e in d.ready] == ["p"]


def test_mismatch_is_declared_when_all_members_are_in_and_names_every_rank() -> None:
    table = Table(3)
    assert step(table, 0, (0, req("m")), (1, req("m", shape=(5,)))).failed == []
    d = step(table, 1, (2, req("m")))
    (entry, error), = d.failed
    assert isinstance(error, CollectiveMismatchError)
    assert error.fields == ["shape"]
    assert sorted(error.per_rank) == [0, 1, 2]
    assert "rank 1: allreduce dtype=float32 shape=[5]" in str(error)


def test_different_kinds_under_one_sequence_name_are_a_mismatch() -> None:
    table = Table(2)
    d = step(table, 0, (0, req("noname.ps0.3", ps=(0, 1))),
             (1, req("noname.ps0.3", kind="allgather", ps=(0, 1))))
    assert "kind" in d.failed[0][1].fields  # type: ignore[attr-defined]


def test_allgather_rows_may_differ_but_trailing_dims_may_not() -> None:
    table = Table(2)
    ok = step(table, 0, (0, req("g", "allgather", (3, 2), ps=(0, 1))), (1, req("g", "allgather", (1, 2), ps=(0, 1))))
    assert [e.name for e in ok.ready] == ["g"]
    bad = step(table, 1, (0, req("h", "allgather", (3, 2), ps=(0, 1))), (1, req("h", "allgather", (3, 4), ps=(0, 1))))
    assert bad.failed and bad.failed[0][1].fields == ["shape"]  # type: ignore[attr-defined]


def test_joined_ranks_count_as_present_for_every_kind_but_not_as_a_broadcast_root() -> None:
    table = Table(3)
    step(table, 0, (2, req("__join__", "join")))
    assert table.joined == {2}
    d = step(table, 1, (0, req("a")), (1, req("a")))
    assert [e.name for e in d.ready] == ["a"]
    d = step(table, 2, (0, req("t", "alltoall")), (1, req("t", "alltoall")))
    assert [e.name for e in d.ready] == ["t"]  # the joined rank sends no rows (as in Horovod)
    d = step(table, 3, (0, req("b", "broadcast", root=2)), (1, req("b", "broadcast", root=2)))
    (_, error), = d.failed
    assert isinstance(error, CollectiveError) and "join()" in str(error)
    d = step(table, 4, (0, req("__join__", "join")), (1, req("__join__", "join")))
    assert [e.name for e in d.ready] == ["__join__"]
    assert last_joined(d.ready[0]) == 1  # ranks 0 and 1 joined in the same, later round: the higher one


def test_an_op_sent_with_its_ranks_shutdown_fails_when_a_peer_left_earlier() -> None:
    """Rank 1 called shutdown() in an earlier round; rank 0's op and its own shutdown arrive together. The
    shutdown completes (and leaves the table) first, but the op still fails: it can never run."""
    table = Table(2)
    step(table, 0, (1, req("__shutdown__", "shutdown", (), ps=(0, 1))))
    d = step(table, 1, (0, req("late", ps=(0, 1))), (0, req("__shutdown__", "shutdown", (), ps=(0, 1))))
    assert [e.name for e in d.ready] == ["__shutdown__"]
    (entry, error), = d.failed
    assert entry.name == "late" and "rank(s) [1] called shutdown()" in str(error)


def test_latecomers_to_a_failed_name_get_the_same_error() -> None:
    table = Table(3)
    step(table, 0, (2, req("__join__", "join")))
    d = step(table, 1, (0, req("t", "broadcast", root=2)))
    assert d.failed  # its root, rank 2, has joined: fails at once, rank 1 still owes it
    late = step(table, 2, (1, req("t", "broadcast", root=2)))
    assert [(r, n) for r, n, _ in late.late_failures] == [(1, "t")]
    assert "t" not in table.tombstones


def test_a_rejected_call_fails_the_op_at_once_naming_the_rank_and_the_reason() -> None:
    table = Table(3)
    step(table, 0, (1, req("noname.ps0.4")))
    rejected = req("noname.ps0.4", dtype="", shape=(), where="train.py:9", error="ValueError: not contiguous")
    d = step(table, 0, (0, rejected))
    (entry, error), = d.failed  # rank 2 has not submitted yet: it need not
    assert isinstance(error, PeerRejectedCallError) and not isinstance(error, CollectiveError)
    assert str(error).startswith("unnamed allreduce #4 cannot run on process set [0, 1, 2]: ")
    assert "rank 0 rejected its call at train.py:9: ValueError: not contiguous" in str(error)
    late = step(table, 1, (2, req("noname.ps0.4")))  # the latecomer gets the same error
    assert [(r, n, e) for r, n, e in late.late_failures] == [(2, "noname.ps0.4", error)]
    assert table.entries == {} and table.tombstones == {}


def test_call_sites_are_compared_when_every_rank_sent_one() -> None:
    table = Table(2)
    a, b = req("s", ps=(0, 1), site=11, where="t.py:1"), req("s", ps=(0, 1), site=22, where="t.py:2")
    (_, error), = step(table, 0, (0, a), (1, b)).failed
    assert isinstance(error, CollectiveMismatchError) and error.fields == ["call site"]
    assert "at t.py:1" in error.per_rank[0] and "at t.py:2" in error.per_rank[1]
    assert "HORA_CALL_SITE_CHECK=0" in str(error) and "name=" in str(error)
    # a rank that does not check (site 0) opts the op out; equal sites are fine
    assert [e.name for e in step(table, 1, (0, a._replace(name="t")), (1, b._replace(name="t", site=0))).ready] == ["t"]
    assert [e.name for e in step(table, 2, (0, a._replace(name="u")), (1, a._replace(name="u", where="x"))).ready] \
        == ["u"]
