"""The launcher's root-cause report: what a user reads when a rank fails; its lines under a cluster framework."""

from __future__ import annotations

import sys

import pytest

from hora.launcher.output import failure_report

NO_TORCH = ["Traceback (most recent call last):", '  File "/tmp/train.py", line 1, in <module>',
            "    import torch", "ModuleNotFoundError: No module named 'torch'"]


def test_a_rank_without_torch_is_told_which_python_has_it() -> None:
    report = failure_report(0, "localhost", "exit code 1", NO_TORCH, 1)
    assert report[-1] == (f"hora run: hint: the rank's Python cannot import 'torch', but the launcher's Python "
                          f"({sys.executable}) can: activate its environment, or name it in the command "
                          f"(hora run ... {sys.executable} train.py)")


def test_other_missing_modules_get_no_interpreter_hint() -> None:
    tail = [*NO_TORCH[:-1], "ModuleNotFoundError: No module named 'mydata'"]
    report = failure_report(0, "localhost", "exit code 1", tail, 0)
    assert report[-1] == "hora run: ----"
    assert report[-2] == "[0]: ModuleNotFoundError: No module named 'mydata'"


LOST_PEER = ["Traceback (most recent call last):", '  File "/tmp/train.py", line 9, in <module>',
             "hora.errors.CollectiveError: rank 0: negotiation with peers failed: Connection closed by peer"]


def test_ranks_that_finished_before_a_lost_collective_point_at_join() -> None:
    report = failure_report(0, "localhost", "exit code 1", LOST_PEER, 0, finished=[2, 1])
    assert report[-1] == ("hora run: hint: ranks 1, 2 had already finished (exit code 0) while this rank waited in "
                          "a collective: if ranks run different numbers of steps (uneven data), call hvd.join() "
                          "after the training loop so finished ranks keep serving the others' collectives")


def test_no_join_hint_when_nobody_finished_or_the_error_is_the_users_own() -> None:
    assert failure_report(0, "localhost", "exit code 1", LOST_PEER, 1)[-1] == "hora run: ----"
    own = [*LOST_PEER[:-1], "ValueError: bad batch"]
    assert failure_report(0, "localhost", "exit code 1", own, 0, finished=[1])[-1] == "hora run: ----"


def test_a_cluster_framework_speaks_the_launchers_lines_in_its_own_terms(capsys: pytest.CaptureFixture[str]) -> None:
    from hora.launcher import output

    with output.speaking_as("hora.ray", lambda text: text.replace("--min-np", "min_workers")):
        output.note("elastic: fewer than the 3 of --min-np")
        output.print_lines(["hora run: ----", "[1]: a worker's own line"])
    output.note("back to --min-np")
    assert capsys.readouterr().err.splitlines() == [
        "hora.ray: elastic: fewer than the 3 of min_workers", "hora.ray: ----", "[1]: a worker's own line",
        "hora run: back to --min-np"]
