"""The launcher's root-cause report: what a user reads when a rank fails."""

from __future__ import annotations

import sys

from hora.launch.output import failure_report

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
