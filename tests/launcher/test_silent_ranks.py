"""Ranks that cannot speak for themselves (issue 17, items 2, 6 and 8), on localhost with real processes.

A rank that is stopped, stuck in a native call that holds the GIL, late to ``init()``, or gone while a process
it forked holds its connections open: the ranks that wait for it report it on the configured deadlines (not
after a fixed 120 s), the launcher says what its process is doing (its agent reads /proc), the headline names
that rank rather than a waiting one, and nothing is left running. Processes a rank starts in a new session end
with the job. A rank frozen in the middle of a large data transfer (not in a negotiation round) is found from
the transfers its peers posted as unfinished. The tests assert what was reported (the seconds the reports
state, the ranks and hosts they name), never how long a run took.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from tests.launcher.helpers import PYTHON, alive, hora_run, write_script
from tests.polling import wait_until

FAST_STALL = ["--stall-check-warning-time-seconds", "2", "--stall-check-shutdown-time-seconds", "4"]

PRELUDE = """
import ctypes, os, signal, subprocess, sys, time
import torch
import hora as hvd

out = sys.argv[1]
hvd.init()
with open(f"{out}/pid.{hvd.rank()}", "w") as fh:
    fh.write(str(os.getpid()))
hvd.allreduce(torch.ones(2), name="warmup")
"""


def _pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp_path.glob("pid.*"))]


def _nothing_left(tmp_path: Path) -> None:
    pids = _pids(tmp_path)
    assert pids, "the workers never wrote their pids"
    assert wait_until(lambda: not any(alive(p) for p in pids), 15), [p for p in pids if alive(p)]


def _run(tmp_path: Path, body: str, flags: list[str], np: int = 2) -> tuple[int, str]:
    script = write_script(tmp_path, "train.py", PRELUDE + body)
    result = hora_run(["-np", str(np), *flags, PYTHON, script, str(tmp_path)], tmp_path, timeout=150)
    return result.returncode, result.stderr


def test_a_stopped_rank_is_reported_and_blamed_on_the_configured_deadlines(tmp_path: Path) -> None:
    code, err = _run(tmp_path, """
if hvd.rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # cannot run Python any more: its peers must speak for it
hvd.allreduce(torch.ones(2), name="loss")
""", FAST_STALL)
    assert code == 1, err
    assert re.search(r"\[0\]<stderr>:hora stall: rank 1 on localhost has not answered rank 0's negotiation round "
                     r"for [23] s\. Its process cannot run Python", err), err
    assert re.search(r"hora run: stall: rank 1 on host localhost has not answered its peers for [23] s: its process is "
                     r"stopped \(state T: SIGSTOP, Ctrl-Z or a debugger\)", err), err
    assert re.search(r"hora run: rank 1 on host localhost failed first: did not answer its peers for [45] s "
                     r"\(--stall-check-shutdown-time-seconds 4\): its process is stopped .*\(rank 0 on host localhost "
                     r"waited for it and raised CollectiveTimeoutError\)", err), err
    _nothing_left(tmp_path)


def test_with_recursive_doubling_the_stopped_rank_is_named_not_the_peers_that_wait_for_it(tmp_path: Path) -> None:
    """5 ranks, rounds by recursive doubling: only ranks 1 and 2 exchange frames with rank 3; rank 0 waits
    for rank 2 and rank 4 for rank 0, which all wait too. The reports follow the posted waits to rank 3."""
    code, err = _run(tmp_path, """
if hvd.rank() == 3:
    os.kill(os.getpid(), signal.SIGSTOP)
hvd.allreduce(torch.ones(2), name="loss")
""", [*FAST_STALL, "-x", "HORA_MESH_FULL_UPTO=1"], np=5)
    assert code == 1, err
    assert re.search(r"\[0\]<stderr>:hora stall: rank 3 on localhost has not answered rank 0's negotiation round "
                     r"for [234] s\. Its process cannot run Python", err), err
    assert re.search(r"hora run: stall: rank 3 on host localhost has not answered its peers for [234] s: its process "
                     r"is stopped", err), err
    assert re.search(r"hora run: rank 3 on host localhost failed first: did not answer its peers for [45] s", err), err
    for waiting in (0, 1, 2, 4):
        assert f"hora stall: rank {waiting} on localhost has not answered" not in err, err
    _nothing_left(tmp_path)


def test_a_native_call_holding_the_gil_is_reported_and_the_job_goes_on_when_it_returns(tmp_path: Path) -> None:
    # no shutdown time: a freeze of a few seconds is reported on time, then the job finishes normally
    code, err = _run(tmp_path, """
if hvd.rank() == 1:
    ctypes.PyDLL(None).sleep(6)  # libc's sleep() through PyDLL: the GIL stays held for 6 s
print("sum", hvd.allreduce(torch.ones(2), name="loss").tolist())
""", ["--stall-check-warning-time-seconds", "2"])
    assert code == 0, err
    assert re.search(r"\[0\]<stderr>:hora stall: rank 1 on localhost has not answered rank 0's negotiation round "
                     r"for [23] s\..*It waits on \(no --stall-check-shutdown-time-seconds\)", err), err
    assert re.search(r"hora run: stall: rank 1 on host localhost has not answered its peers for [23] s: its process is "
                     r"sleeping in the (clock_)?nanosleep system call", err), err
    _nothing_left(tmp_path)


BIG = """
big = torch.full((16 << 20,), float(hvd.rank() + 1))  # 64 MB: not on the wire long before the stop
def on_the_wire(handle):  # negotiated: every rank launched the transfer
    return "pending" not in repr(handle)
"""


def test_a_rank_stopped_in_the_middle_of_a_large_transfer_is_named_and_the_job_ends_at_the_shutdown_time(
        tmp_path: Path) -> None:
    code, err = _run(tmp_path, BIG + """
if hvd.rank() == 1:
    handle = hvd.allreduce_async(big, name="big")
    while not on_the_wire(handle):
        pass
    os.kill(os.getpid(), signal.SIGSTOP)  # its peers are inside the backend now, not in a negotiation round
hvd.allreduce(big, name="big")
print("RETURNED", file=sys.stderr, flush=True)
""", FAST_STALL, np=3)
    assert code == 1, err
    assert re.search(r"\[0\]<stderr>:hora stall: rank 0: allreduce 'big' \(64\.0 MB on ranks 0-2\) has been in the "
                     r"communication backend for \d+ s and has not finished\.", err), err
    assert re.search(r"hora run: stall: rank 1 on host localhost has not finished allreduce 'big' \(64\.0 MB\), which "
                     r"ranks 0, 2 have waited \d+ s for in the communication backend: its process is stopped "
                     r"\(state T: SIGSTOP, Ctrl-Z or a debugger\)", err), err
    assert re.search(r"hora run: rank 1 on host localhost failed first: did not finish allreduce 'big' \(64\.0 MB\) "
                     r"within --stall-check-shutdown-time-seconds 4 s while ranks 0, 2 waited for it in the "
                     r"communication backend: its process is stopped \(state T", err), err
    assert "hora run: stopping the other 2 ranks" in err, err  # the culprit is not one of "the other" ranks
    assert "hora run: job failed: rank 1 on host localhost: did not finish allreduce 'big'" in err, err
    assert "RETURNED" not in err and "CollectiveTimeoutError" not in err, err
    _nothing_left(tmp_path)


def test_a_transfer_held_up_for_a_while_is_reported_and_goes_on_when_the_rank_resumes(tmp_path: Path) -> None:
    # no shutdown time: the frozen rank is woken after 6 s (a helper sends SIGCONT), the transfer completes
    code, err = _run(tmp_path, BIG + """
if hvd.rank() == 1:
    handle = hvd.allreduce_async(big, name="big")
    while not on_the_wire(handle):
        pass
    subprocess.Popen(["sh", "-c", f"sleep 6; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)
    total = hvd.synchronize(handle)
else:
    total = hvd.allreduce(big, name="big")
hvd.allreduce(torch.ones(2), name="after")
print("sum", float(total[0]), float(total[-1]), file=sys.stderr, flush=True)
""", ["--stall-check-warning-time-seconds", "2"])
    assert code == 0, err
    assert re.search(r"\[0\]<stderr>:hora stall: rank 0: allreduce 'big' \(64\.0 MB on ranks 0-1\) has been in the "
                     r"communication backend for \d+ s and has not finished\..*It waits on \(no "
                     r"--stall-check-shutdown-time-seconds\)", err), err
    assert re.search(r"hora run: stall: rank 1 on host localhost has not finished allreduce 'big' \(64\.0 MB\), which "
                     r"rank 0 has waited [23] s for in the communication backend: its process is stopped", err), err
    assert "failed first" not in err, err
    assert "[0]<stderr>:sum 1.5 1.5" in err and "[1]<stderr>:sum 1.5 1.5" in err, err  # the average of 1 and 2
    assert "[1]<stderr>:hora stall" not in err, err  # the rank that was stopped blames nobody once it resumes
    _nothing_left(tmp_path)


def test_a_rank_that_exited_while_a_forked_child_holds_its_sockets_is_noticed_at_once(tmp_path: Path) -> None:
    code, err = _run(tmp_path, """
if hvd.rank() == 1:
    child = os.fork()
    if child == 0:  # inherits the rank's connections and keeps them open
        time.sleep(300)
        os._exit(0)
    with open(f"{out}/pid.child", "w") as fh:
        fh.write(str(child))
    os._exit(0)  # the rank itself ends "successfully", long before its peers
hvd.allreduce(torch.ones(2), name="loss")
""", [])
    assert code == 1, err
    # the headline below comes from the board: the agent saw rank 1's own process exit and the waiting rank named
    # it (it used to be a round timeout of 120 s, blaming rank 0)
    assert re.search(r"hora run: rank 1 on host localhost failed first: exited \(exit code 0\) while its peers waited "
                     r"for it in a collective; a process it started \(fork, multiprocessing\) kept its connections "
                     r"open, hiding the exit \(rank 0 on host localhost waited for it and raised PeerLostError\)",
                     err), err
    _nothing_left(tmp_path)


def test_a_rank_late_to_init_is_named_without_internal_store_keys(tmp_path: Path) -> None:
    script = write_script(tmp_path, "late.py", """
import os, sys, time
import hora as hvd
if os.environ["HORA_RANK"] == "1":
    time.sleep(12)  # slow work before init(), longer than --start-timeout
with open(f"{sys.argv[1]}/pid.{os.environ['HORA_RANK']}", "w") as fh:
    fh.write(str(os.getpid()))
hvd.init()
""")
    result = hora_run(["-np", "2", "--start-timeout", "3", PYTHON, script, str(tmp_path)], tmp_path, timeout=150)
    err = result.stderr
    assert result.returncode == 1, err
    assert "[0]<stderr>:hora.CollectiveError: rank 0: rank 1 did not call hvd.init() within the start timeout " \
           "of 3 s (--start-timeout, HORA_START_TIMEOUT)" in err, err
    assert "(hora's own frames are not shown" in err and "/hora/runtime.py" not in err, err  # one line, user frames
    assert re.search(r"hora run: rank 1 on host localhost failed first: did not call hvd\.init\(\) within "
                     r"the start timeout of 3 s \(--start-timeout, HORA_START_TIMEOUT; its peers waited for it\) "
                     r"\(rank 0 on host localhost waited for it and raised CollectiveError\)", err), err
    assert "DistStoreError" not in err and "/default/" not in err, err
    _nothing_left(tmp_path)


def test_processes_a_rank_started_in_a_new_session_end_with_the_job(tmp_path: Path) -> None:
    code, err = _run(tmp_path, """
if hvd.rank() == 1:
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    with open(f"{out}/pid.daemon", "w") as fh:
        fh.write(str(daemon.pid))
    # a double fork: the shell exits at once, its background sleep is orphaned in a new session
    subprocess.run(["setsid", "sh", "-c", f"sleep 300 & echo $! > {out}/pid.orphan"], check=True)
hvd.allreduce(torch.ones(2), name="loss")
hvd.shutdown()
""", [])
    assert code == 0, err
    assert (tmp_path / "pid.daemon").exists() and (tmp_path / "pid.orphan").exists()
    _nothing_left(tmp_path)


def test_torch_hostname_warnings_do_not_hide_a_rank_s_last_words(tmp_path: Path) -> None:
    script = write_script(tmp_path, "noisy.py", """
import os, signal, sys
with open(f"{sys.argv[1]}/pid.{os.environ['HORA_RANK']}", "w") as fh:
    fh.write(str(os.getpid()))
if os.environ["HORA_RANK"] == "1":
    print("loading shard 7 of 9 failed: disk quota exceeded", file=sys.stderr)
    for _ in range(40):
        print("[W1201 10:00:00.000000000 socket.cpp:460] [c10d] The hostname of the client socket cannot be "
              "retrieved. err=-3", file=sys.stderr)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
import time; time.sleep(60)
""")
    result = hora_run(["-np", "2", PYTHON, script, str(tmp_path)], tmp_path)
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    report = result.stderr[result.stderr.index("hora run: rank 1 on host localhost failed first"):]
    assert "[1]: loading shard 7 of 9 failed: disk quota exceeded" in report, result.stderr
    assert "hostname of the client socket" not in report, result.stderr
    _nothing_left(tmp_path)
