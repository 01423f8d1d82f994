"""stall.py: when the stall inspector speaks, and the report a user reads."""

from __future__ import annotations

import pytest

from hora.common.knobs import Knobs
from hora.diagnostics.stall_report import StallAction, StallPolicy, format_ranks, format_stall_report
from hora.errors import ConfigError


def test_policy_from_knobs_reads_horovod_and_hora_variables():
    p = StallPolicy.from_knobs(Knobs.from_environ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "2",
                                                   "HORA_STALL_SHUTDOWN_TIME_SECONDS": "9"}))
    assert (p.warning_s, p.shutdown_s, p.enabled) == (2.0, 9.0, True)
    off = StallPolicy.from_knobs(Knobs.from_environ({"HORA_STALL_CHECK_DISABLE": "1"}))
    assert off.enabled is False
    default = StallPolicy.from_knobs(Knobs.from_environ({}))
    assert (default.warning_s, default.shutdown_s, default.enabled) == (60.0, 0.0, True)


def test_one_report_per_stall_then_quiet():
    p = StallPolicy(warning_s=60, shutdown_s=0)
    assert p.decide(59.9, reported=False) is StallAction.NONE
    assert p.decide(60.0, reported=False) is StallAction.REPORT
    assert [p.decide(w, reported=True) for w in (61, 120, 3600)] == [StallAction.NONE] * 3


def test_shutdown_after_the_shutdown_time_even_if_reported():
    p = StallPolicy(warning_s=2, shutdown_s=10)
    assert p.decide(5, reported=True) is StallAction.NONE
    assert p.decide(10, reported=True) is StallAction.SHUTDOWN
    assert p.decide(11, reported=False) is StallAction.SHUTDOWN  # shutdown carries the report itself


def test_disabled_never_acts():
    p = StallPolicy(warning_s=1, shutdown_s=2, enabled=False)
    assert p.decide(100, reported=False) is StallAction.NONE
    assert p.next_check_s(0, reported=False) is None


def test_next_check_tells_an_idle_negotiator_how_long_it_may_block():
    p = StallPolicy(warning_s=60, shutdown_s=90)
    assert p.next_check_s(0, reported=False) == 60
    assert p.next_check_s(70, reported=True) == 20
    assert p.next_check_s(95, reported=True) == 0.0  # act now
    assert StallPolicy(warning_s=60).next_check_s(70, reported=True) is None  # nothing more to do


@pytest.mark.parametrize("kwargs", [{"warning_s": 0}, {"warning_s": -1}, {"shutdown_s": -5}])
def test_bad_times_are_config_errors_naming_the_flag(kwargs):
    with pytest.raises(ConfigError, match="stall-check"):
        StallPolicy(**kwargs)


def test_format_ranks_collapses_runs():
    assert format_ranks([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8"
    assert format_ranks([]) == "none"


def test_report_names_op_arrived_and_each_missing_rank_with_host_and_place():
    text = format_stall_report(
        "allreduce", "grad.bucket.3", 17, 62.4, arrived=[0, 1, 3],
        missing={2: ("node2", "running train.py:41 load_batch <- train.py:88 main")},
    )
    lines = text.splitlines()
    assert lines[0] == ("hora stall: allreduce 'grad.bucket.3' (#17) has waited 62 s: "
                        "3 of 4 ranks arrived, 1 missing.")
    assert lines[1] == "  arrived: ranks 0-1, 3"
    assert lines[2] == "  missing: rank 2 on node2: running train.py:41 load_batch <- train.py:88 main"
    assert "busy in their own code" in lines[3]


def test_report_groups_missing_ranks_stuck_in_the_same_place():
    where = "waiting in broadcast 'weights' (called from train.py:10 setup)"
    missing = {r: (f"node{r // 4}", where) for r in range(4, 12)}
    missing[12] = ("node3", "")
    text = format_stall_report("allreduce", "loss", 5, 61, arrived=[0, 1, 2, 3], missing=missing)
    lines = text.splitlines()
    assert lines[2] == f"  missing: ranks 4-11 on node1, node2: {where}"
    assert lines[3] == "           rank 12 on node3: no answer"
    assert "wait in another collective" in text
    assert len(lines) == 5  # one line per place, not one per rank


def test_unnamed_collectives_are_shown_by_their_number():
    from hora.diagnostics.where import describe_op

    assert describe_op("allreduce", "noname.ps0.17") == "unnamed allreduce #17"
    assert describe_op("broadcast", "noname.ps2.3") == "unnamed broadcast #3 of process set 2"
    assert describe_op("allreduce", "loss") == "allreduce 'loss'"
    text = format_stall_report("allreduce", "noname.ps0.17", 4, 61, [0], {1: ("n1", "waiting in unnamed "
                                                                             "broadcast #17")})
    assert text.splitlines()[0].startswith("hora stall: unnamed allreduce #17 has waited 61 s")
