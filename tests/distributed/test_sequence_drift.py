"""Unnamed ops never pair with the wrong op: a call rejected on one rank still takes its place in the
sequence and its peers' matching op fails naming that rank and the reason; ops reached from different lines
of code are reported as a mismatch naming both call sites (issue 17, item 1)."""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Callable

import pytest
import torch

import hora as hvd
from tests.distributed.expect import close
from tests.distributed.harness import rank_store, run_ranks

FILE = __file__  # call sites in messages are this file's lines


def _issue_script(rank: int, size: int) -> dict:
    """Issue 17's script, as written there: the ranks call from different lines (rank-dependent branches)."""
    seen: dict = {}
    b = torch.full((2, 2), float(rank + 1))
    if rank == 0:
        try:
            hvd.allreduce(torch.full((2, 4), 10.0)[:, ::2], op=hvd.Sum)
        except ValueError as e:
            seen["a"] = f"{type(e).__name__}: {e}"
        try:
            seen["b"] = hvd.allreduce(b, op=hvd.Sum)[0, 0].item()
        except (hvd.PeerRejectedCallError, hvd.CollectiveMismatchError) as e:
            seen["b"] = f"{type(e).__name__}: {e}"
    else:
        try:
            seen["a"] = hvd.allreduce(torch.full((2, 2), 20.0), op=hvd.Sum)[0, 0].item()
        except (hvd.PeerRejectedCallError, hvd.CollectiveMismatchError) as e:
            seen["a"] = f"{type(e).__name__}: {e}"
        try:
            seen["b"] = hvd.allreduce(b, op=hvd.Sum)[0, 0].item()
        except (hvd.PeerRejectedCallError, hvd.CollectiveMismatchError) as e:
            seen["b"] = f"{type(e).__name__}: {e}"
    # the job goes on: an op both ranks reach from the same line is right
    seen["after"] = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum).tolist()
    return seen


def test_issue_script_without_the_call_site_check_pairs_the_right_ops() -> None:
    r0, r1 = run_ranks(_issue_script, 2, env={"HORA_CALL_SITE_CHECK": "0"}, timeout=30)
    assert r0["a"].startswith("InvalidCallError") and "contiguous" in r0["a"]
    # rank 1's A met rank 0's rejected call: it fails naming rank 0 and the reason, it does not wait or pair
    assert r1["a"].startswith("PeerRejectedCallError") and "rank 0" in r1["a"] and "contiguous" in r1["a"], r1["a"]
    assert r0["b"] == 3.0 and r1["b"] == 3.0  # not 21.0: B pairs with B
    assert r0["after"] == r1["after"] == [1.0, 1.0, 1.0]


def _lines(fn: Callable[..., object], text: str) -> list[int]:
    """Line numbers of the lines of ``fn`` that contain ``text`` (call sites the messages must name)."""
    lines, start = inspect.getsourcelines(fn)
    return [start + i for i, line in enumerate(lines) if text in line]


def test_issue_script_with_the_call_site_check_names_both_lines() -> None:
    r0, r1 = run_ranks(_issue_script, 2, timeout=30)
    assert r0["a"].startswith("InvalidCallError") and "contiguous" in r0["a"]
    assert r1["a"].startswith("PeerRejectedCallError") and "rank 0 rejected its call at" in r1["a"], r1["a"]
    # B is reached from a different line on each rank: reported on both, naming both lines, with the opt-outs
    first, second = _lines(_issue_script, "seen[\"b\"] = hvd.allreduce(b")
    for seen in (r0, r1):
        msg = seen["b"]
        assert msg.startswith("CollectiveMismatchError") and "ranks disagree on call site" in msg, msg
        assert f"rank 0: allreduce dtype=float32 shape=[2, 2] op=Sum process_set=[0, 1] device=cpu at {FILE}:{first}" \
            in msg, msg
        assert f"rank 1: allreduce dtype=float32 shape=[2, 2] op=Sum process_set=[0, 1] device=cpu at {FILE}:{second}" \
            in msg, msg
        assert "name=" in msg and "HORA_CALL_SITE_CHECK=0" in msg, msg
    assert r0["after"] == r1["after"] == [1.0, 1.0, 1.0]


class _Boom:
    """A compressor that fails on the rank it is given to (an error while the op is prepared)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        raise RuntimeError("boom: this rank's compressor failed")

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        return tensor


def _sparse(bad: bool) -> object:
    t = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,))
    return hvd.sparse_allreduce_async(t, op=hvd.Max if bad else hvd.Sum).wait()


# (what, call(bad), error type on the rejecting rank, its reason as a regex)
REJECTED: list[tuple[str, Callable[[bool], object], type, str]] = [
    ("non-contiguous", lambda bad: hvd.allreduce(torch.ones(2, 4)[:, ::2] if bad else torch.ones(2, 2)),
     ValueError, "not contiguous"),
    ("dtype", lambda bad: hvd.allreduce(torch.ones(3, dtype=torch.complex64 if bad else torch.float32)),
     TypeError, "complex64 is not supported"),
    ("root", lambda bad: hvd.broadcast(torch.ones(3), root_rank=7 if bad else 0), ValueError, "root rank 7"),
    ("reduce op", lambda bad: hvd.allreduce(torch.ones(3), op=99 if bad else hvd.Sum), ValueError,
     "unknown reduce op 99"),
    ("bool Sum", lambda bad: hvd.allreduce(torch.ones(3, dtype=torch.bool), op=hvd.Sum if bad else hvd.Max),
     TypeError, "Sum of bool"),
    ("bool prescale", lambda bad: hvd.allreduce(torch.ones(3, dtype=torch.bool), op=hvd.Max,
                                                prescale_factor=2.0 if bad else 1.0), TypeError, "prescale"),
    ("alltoall splits", lambda bad: hvd.alltoall(torch.ones(4), splits=[3, 3] if bad else [2, 2]), ValueError,
     "splits"),
    ("reducescatter 0-d", lambda bad: hvd.reducescatter(torch.tensor(1.0) if bad else torch.ones(2)), ValueError,
     "at least one dimension"),
    ("allgather non-contiguous", lambda bad: hvd.allgather(torch.ones(3, 2).t() if bad else torch.ones(2, 3)),
     ValueError, "not contiguous"),
    ("compressor", lambda bad: hvd.allreduce(torch.ones(3), compression=_Boom() if bad else hvd.Compression.none),
     RuntimeError, "boom"),
    ("unregistered process set", lambda bad: hvd.allreduce(
        torch.ones(3), process_set=hvd.ProcessSet([0, 1]) if bad else hvd.global_process_set), ValueError,
     "not registered"),
    ("grouped", lambda bad: hvd.grouped_allreduce([torch.ones(3), torch.ones(4, 2).t() if bad else torch.ones(2, 4)]),
     ValueError, "not contiguous"),
    ("async", lambda bad: hvd.synchronize(hvd.allreduce_async(torch.ones(2, 4)[:, ::2] if bad else torch.ones(2, 2))),
     ValueError, "not contiguous"),
    ("sparse", _sparse, ValueError, "sparse allreduce supports Average and Sum"),
    ("named", lambda bad: hvd.allreduce(torch.ones(2, 4)[:, ::2] if bad else torch.ones(2, 2), name="named.x"),
     ValueError, "not contiguous"),
]


def _rejected(rank: int, size: int) -> list[str]:
    store = rank_store()
    messages = []
    for i, (what, call, error, reason) in enumerate(REJECTED):
        for bad_first in (True, False):
            bad_rank = i % size
            key = f"{i}.{bad_first}"
            if rank == bad_rank:
                if not bad_first:
                    store.get(key)  # the peer is about to submit: its op waits when the rejection arrives
                    time.sleep(0.05)
                with pytest.raises(error, match=reason):
                    call(True)
                if bad_first:
                    store.set(key, "1")
            else:
                if bad_first:
                    store.get(key)  # the rejection was announced before this rank submits (a tombstone)
                else:
                    store.set(key, "1")
                with pytest.raises(hvd.PeerRejectedCallError) as info:
                    call(False)
                msg = str(info.value)
                # a programming error like the rejecting rank's own, not one elastic training restarts on
                assert isinstance(info.value, hvd.InvalidCallError), f"{what}: {msg}"
                assert not isinstance(info.value, hvd.HorovodInternalError), f"{what}: {msg}"
                assert f"rank {bad_rank} rejected its call at {FILE}:" in msg, f"{what}: {msg}"
                assert re.search(reason, msg), f"{what}: the reason is given: {msg}"
                messages.append(msg)
            # the job goes on, unnamed ops pair as before
            got = hvd.allreduce(torch.full((2,), float(rank + i)), op=hvd.Sum)
            close(got, torch.full((2,), float(sum(range(size)) + size * i)), f"allreduce after {what}")
    return messages


@pytest.mark.parametrize("plane", ["tcp", "gloo"])
def test_a_call_rejected_on_one_rank_fails_the_peers_op_and_the_sequence_stays_in_step(plane: str) -> None:
    messages = run_ranks(_rejected, 2, timeout=60, env={"HORA_CONTROL_PLANE": plane})
    assert len(messages[0]) + len(messages[1]) == 2 * len(REJECTED)
    assert messages[1][0].startswith("unnamed allreduce #"), messages[1][0]


def _not_announced(rank: int, size: int) -> None:
    """Rejections that belong to no sequence of this rank are not announced, and shift nothing."""
    only_1 = hvd.add_process_set([1])
    if rank == 0:
        with pytest.raises(ValueError, match="rank 0 is not a member"):
            hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=only_1)
        h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="dup")
        with pytest.raises(ValueError, match="'dup' is still in flight"):
            hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="dup")
        with pytest.raises(TypeError, match="names are strings"):
            hvd.allreduce(torch.ones(3), name=5)  # type: ignore[arg-type]
    else:
        close(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=only_1), torch.ones(2), "a set of one")
        h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="dup")
    close(hvd.synchronize(h), torch.full((3,), 2.0), "the in-flight op")
    for i in range(3):
        close(hvd.allreduce(torch.full((2,), float(rank + i)), op=hvd.Sum), torch.full((2,), 1.0 + 2 * i), f"op {i}")


def test_a_rejection_outside_this_ranks_sequences_shifts_nothing() -> None:
    run_ranks(_not_announced, 2, timeout=30)


def _helper(t: torch.Tensor) -> torch.Tensor:
    return hvd.allreduce(t, op=hvd.Sum)


def _call_sites(rank: int, size: int) -> dict:
    """Same op, same position, different lines; and the cases that must not be taken for that."""
    seen: dict = {}
    t = torch.full((2,), float(rank + 1))
    try:
        if rank == 0:
            seen["branch"] = hvd.allreduce(t, op=hvd.Sum).tolist()
        else:
            seen["branch"] = hvd.allreduce(t, op=hvd.Sum).tolist()
    except hvd.CollectiveMismatchError as e:
        seen["branch"] = str(e)
        seen["fields"] = e.fields
    # named: matched by name, from any line (the per-call opt-out)
    if rank == 0:
        seen["named"] = hvd.allreduce(t, op=hvd.Sum, name="on purpose").tolist()
    else:
        seen["named"] = hvd.allreduce(t, op=hvd.Sum, name="on purpose").tolist()
    # a helper of the user's reached from different lines: its own line is the call site
    seen["helper"] = (_helper(t) if rank == 0 else _helper(t)).tolist()
    # autograd on one rank only goes through torch's Function machinery: still the user's line
    x = t.clone().requires_grad_(rank == 0)
    seen["autograd"] = hvd.allreduce(x, op=hvd.Sum).tolist()
    # the gradient's allreduce is unnamed too, submitted from inside torch's backward()
    w = torch.ones(2, requires_grad=True)
    hvd.allreduce(w * 2.0, op=hvd.Sum).sum().backward()
    seen["grad"] = w.grad.tolist()
    # barriers are not checked: no data to mix up, and no name= to opt out with
    if rank == 0:
        hvd.barrier()
    else:
        hvd.barrier()
    # a different kind at the same position, from the same line: a kind mismatch (sites agree)
    try:
        (hvd.allreduce if rank else hvd.allgather)(t)
    except hvd.CollectiveMismatchError as e:
        seen["kind"] = e.fields
    seen["after"] = hvd.allreduce(t, op=hvd.Sum).tolist()
    return seen


@pytest.mark.parametrize("check", ["1", "0"])
def test_ranks_reaching_an_op_from_different_lines_are_told_both_lines(check: str) -> None:
    r0, r1 = run_ranks(_call_sites, 2, env={"HORA_CALL_SITE_CHECK": check}, timeout=30)
    first, second = _lines(_call_sites, 'seen["branch"] = hvd.allreduce(')
    desc = "allreduce dtype=float32 shape=[2] op=Sum process_set=[0, 1] device=cpu at"
    for seen in (r0, r1):
        if check == "1":
            assert seen["fields"] == ["call site"], seen
            msg = seen["branch"]
            assert f"rank 0: {desc} {FILE}:{first}\n" in msg and f"rank 1: {desc} {FILE}:{second}\n" in msg, msg
            assert "name=" in msg and "HORA_CALL_SITE_CHECK=0" in msg, msg
        else:
            assert seen["branch"] == [3.0, 3.0]
        assert seen["named"] == seen["helper"] == seen["autograd"] == seen["after"] == [3.0, 3.0], seen
        assert "kind" in seen["kind"] and "call site" not in seen["kind"], seen
    assert r0["grad"] == r1["grad"] == [4.0, 4.0]


def _sets_and_async(rank: int, size: int) -> dict:
    """Each process set has its own sequence; async ops in flight on several sets stay paired."""
    pair = hvd.add_process_set([0, 1])  # rank 2 keeps only the global sequence
    seen: dict = {}
    g1 = hvd.allreduce_async(torch.full((2,), 1.0 + rank), op=hvd.Sum)
    bad = p1 = p2 = None
    if rank == 0:
        with pytest.raises(ValueError, match="not contiguous"):
            hvd.allreduce_async(torch.ones(2, 4)[:, ::2], op=hvd.Sum, process_set=pair)
    elif rank == 1:
        bad = hvd.allreduce_async(torch.ones(2, 2), op=hvd.Sum, process_set=pair)
    if pair.included():
        p1 = hvd.allreduce_async(torch.full((3,), 10.0 * (rank + 1)), op=hvd.Sum, process_set=pair)
    g2 = hvd.allgather_async(torch.full((rank + 1,), float(rank)))
    if pair.included():
        p2 = hvd.broadcast_async(torch.full((2,), float(rank)), root_rank=1, process_set=pair)
    seen["g1"], seen["g2"] = hvd.synchronize(g1).tolist(), hvd.synchronize(g2).tolist()
    if p1 is not None and p2 is not None:
        seen["p1"], seen["p2"] = hvd.synchronize(p1).tolist(), hvd.synchronize(p2).tolist()
    if bad is not None:
        with pytest.raises(hvd.PeerRejectedCallError, match="rank 0 rejected its call at .*not contiguous") as info:
            hvd.synchronize(bad)
        seen["bad"] = str(info.value)
    sets = (pair, hvd.global_process_set, pair) if pair.included() else (hvd.global_process_set,)
    seen["after"] = [hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps).item() for ps in sets]
    return seen


def test_process_set_sequences_and_async_ops_stay_in_step() -> None:
    r0, r1, r2 = run_ranks(_sets_and_async, 3, timeout=30)
    for seen in (r0, r1, r2):
        assert seen["g1"] == [6.0, 6.0] and seen["g2"] == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    for seen in (r0, r1):
        assert seen["p1"] == [30.0, 30.0, 30.0] and seen["p2"] == [1.0, 1.0]
        assert seen["after"] == [2.0, 3.0, 2.0]
    assert r2["after"] == [3.0]
    assert r1["bad"].startswith("unnamed allreduce #0 of process set 1 cannot run on process set [0, 1]: "), r1["bad"]


def _exceptions(rank: int, size: int) -> dict:
    """An exception between submit and wait leaves the op to run; an extra call on one rank is reported."""
    seen: dict = {}
    h = hvd.allreduce_async(torch.full((2,), float(rank)), op=hvd.Sum)
    try:
        if rank == 0:
            raise KeyError("the user's own error, before synchronize()")
        seen["dropped"] = hvd.synchronize(h).tolist()
    except KeyError:
        del h  # rank 0 never synchronizes: the op still runs with its peers
    seen["next"] = hvd.allreduce(torch.full((2,), 5.0), op=hvd.Sum).tolist()
    # rank 0 makes one call more than rank 1 (say a retry after an exception it caught)
    if rank == 0:
        try:
            hvd.allreduce(torch.ones(2), op=hvd.Sum)  # the extra call
        except hvd.CollectiveMismatchError as e:
            seen["extra"] = str(e)
    for step in range(1 if rank == 0 else 2):  # rank 1 repeats the step on purpose: back in step after it
        try:
            seen[f"step{step}"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()
        except hvd.CollectiveMismatchError as e:
            seen[f"step{step}"] = str(e)
    seen["after"] = hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum).tolist()
    return seen


def test_exceptions_between_submit_and_wait_and_an_extra_call_on_one_rank() -> None:
    r0, r1 = run_ranks(_exceptions, 2, timeout=30)
    assert r1["dropped"] == [1.0, 1.0] and r0["next"] == r1["next"] == [10.0, 10.0]
    extra, = _lines(_exceptions, "# the extra call")
    shared, = _lines(_exceptions, 'seen[f"step{step}"] = hvd.allreduce(')
    msg = r1["step0"]
    assert "ranks disagree on call site" in msg and f"{FILE}:{extra}" in msg and f"{FILE}:{shared}" in msg, msg
    assert "if a rank skipped or added a collective" in msg, msg
    assert r0["extra"] == msg  # the same error on both ranks
    assert r0["step0"] == r1["step1"] == [2.0, 2.0] and r0["after"] == r1["after"] == [1.0, 1.0]


def _integer_average(rank: int, size: int) -> dict:
    """Average of integers sums without overflow, then divides truncating toward zero (issue 17, item 8)."""
    values = {torch.uint8: (200, 100), torch.int8: (-100, -101), torch.int16: (30000, 30001),
              torch.int32: (2_000_000_000, 2_000_000_001)}
    seen: dict = {}
    for dtype, pair in values.items():
        for n in (3, 40):  # 3 elements travel inside the round, 40 on the data plane
            t = torch.full((n,), pair[rank], dtype=dtype)
            out = hvd.allreduce(t)
            assert out.dtype == dtype, out.dtype
            seen[f"{dtype}.{n}"] = out.unique().tolist()
    t = torch.full((4,), values[torch.uint8][rank], dtype=torch.uint8)
    hvd.allreduce_(t, op=hvd.Average)
    seen["inplace"] = t.tolist()
    seen["grouped"] = [o.tolist() for o in hvd.grouped_allreduce([torch.full((2,), 250 - 50 * rank, dtype=torch.uint8),
                                                                  torch.full((1,), 255, dtype=torch.uint8)])]
    seen["reducescatter"] = hvd.reducescatter(torch.full((4,), 200 - 100 * rank, dtype=torch.uint8)).tolist()
    seen["sum wraps as in torch"] = hvd.allreduce(torch.full((1,), 200 - 100 * rank, dtype=torch.uint8),
                                                  op=hvd.Sum).tolist()
    return seen


def test_integer_average_does_not_overflow() -> None:
    for seen in run_ranks(_integer_average, 2, timeout=30):
        for n in (3, 40):
            assert seen[f"torch.uint8.{n}"] == [150]  # was 22: 300 wrapped to 44 in uint8
            assert seen[f"torch.int8.{n}"] == [-100]  # -100.5 truncated toward zero
            assert seen[f"torch.int16.{n}"] == [30000]
            assert seen[f"torch.int32.{n}"] == [2_000_000_000]
        assert seen["inplace"] == [150] * 4
        assert seen["grouped"] == [[225, 225], [255]]
        assert seen["reducescatter"] == [150, 150]
        assert seen["sum wraps as in torch"] == [44]


def _joined(rank: int, size: int) -> dict:
    """A rank that has joined keeps its sequence in step through a rejection it never saw."""
    seen: dict = {}
    if rank < 2:
        seen["while joined"] = hvd.allreduce(torch.full((2,), rank + 1.0), op=hvd.Sum).tolist()  # rank 2 adds 0
        try:  # the last unnamed op before everyone joins: only its failure moves rank 2's sequence on
            seen["rejected"] = hvd.allreduce(torch.ones(2, 4)[:, ::2] if rank == 0 else torch.ones(2, 2)).tolist()
        except (hvd.InvalidCallError, hvd.PeerRejectedCallError) as e:
            seen["rejected"] = type(e).__name__
    hvd.join()
    seen["after"] = hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum).tolist()
    return seen


def test_a_joined_rank_stays_in_step_through_a_rejection() -> None:
    r0, r1, r2 = run_ranks(_joined, 3, timeout=30)
    assert r0["rejected"] == "InvalidCallError" and r1["rejected"] == "PeerRejectedCallError"
    assert r0["while joined"] == r1["while joined"] == [3.0, 3.0]
    assert r0["after"] == r1["after"] == r2["after"] == [3.0, 3.0]
