"""What /proc says about a process (hora.launcher.procs), in the words the stall report uses."""

from __future__ import annotations

import os

from hora.launcher import procs


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
