"""Signals to a real ``hora run`` (issue 25, item 4): the grace between SIGTERM and SIGKILL is a flag whose
default fits Kubernetes and Slurm, the report names the ranks killed after it, and SIGHUP (a closed terminal)
stops the job like SIGTERM, unless the launcher was started under ``nohup``."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import termios
import threading
from pathlib import Path

from tests.launcher.helpers import HORA, PYTHON, alive, write_script
from tests.polling import wait_until

# Each rank writes its pid once its SIGTERM handler is in place. Rank 0's handler saves (writes a file, after
# SAVE_S seconds) and exits 0; with STUBBORN set, rank 1's handler ignores SIGTERM (a save that never ends).
SAVER = """
import os, signal, sys, time
rank, folder = int(os.environ["HORA_RANK"]), sys.argv[1]
save_s, stubborn = float(os.environ.get("SAVE_S", "0")), os.environ.get("STUBBORN") == "1"

def on_term(*_):
    if stubborn and rank == 1:
        print("SIGTERM: not stopping", flush=True)
        return
    time.sleep(save_s)  # a checkpoint written on SIGTERM
    open(os.path.join(folder, f"saved.{rank}"), "w").write("ok")
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
open(os.path.join(folder, f"pid.{rank}.tmp"), "w").write(str(os.getpid()))
os.rename(os.path.join(folder, f"pid.{rank}.tmp"), os.path.join(folder, f"pid.{rank}"))
while True:
    time.sleep(0.05)
"""


def _pids(folder: Path, n: int) -> list[int]:
    assert wait_until(lambda: all((folder / f"pid.{r}").exists() for r in range(n)), 30), "workers never started"
    return [int((folder / f"pid.{r}").read_text()) for r in range(n)]


def test_sigterm_gives_ranks_the_grace_period_and_names_the_ranks_killed_after_it(
        tmp_path: Path, background) -> None:  # type: ignore[no-untyped-def]
    script = write_script(tmp_path, "saver.py", SAVER)
    job = background(["-np", "2", "--grace-period", "2", "-x", "STUBBORN=1", PYTHON, script, str(tmp_path)])
    pids = _pids(tmp_path, 2)
    os.kill(job.proc.pid, signal.SIGTERM)  # a scheduler stops the job (kubelet, scancel): the launcher alone
    code, out, err = job.finish()
    assert code == 143, err
    lines = [ln for ln in err.splitlines() if ln.startswith("hora run:")]
    assert lines[0] == "hora run: interrupted (SIGTERM): stopping 2 rank(s) (SIGTERM, SIGKILL after 2s)", err
    assert (tmp_path / "saved.0").read_text() == "ok"  # rank 0 saved within the grace
    assert "[1]<stdout>:SIGTERM: not stopping" in out
    assert lines[-2].startswith("hora run: rank 1 on host localhost was still running 2s after SIGTERM "
                                "(--grace-period) and was killed (SIGKILL); if they need longer to stop"), err
    assert "HORA_GRACE_PERIOD" in lines[-2] and "terminationGracePeriodSeconds" in lines[-2]
    assert lines[-1] == "hora run: stopped after SIGTERM: no rank is running; exit code 143", err
    assert not any(alive(p) for p in pids)


def _drain(fd: int, sink: list[bytes], stop: threading.Event) -> None:
    """Read the terminal's output until ``stop`` (a read in progress would keep the terminal open)."""
    while not stop.is_set():
        if select.select([fd], [], [], 0.05)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            sink.append(chunk)


def test_a_closed_terminal_stops_the_job_like_sigterm_with_the_grace_period(tmp_path: Path) -> None:
    # hora run in a terminal of its own (its controlling tty); the terminal closes (an ssh session to the login
    # node drops): the kernel sends SIGHUP. Each rank needs 1.5 s to save on SIGTERM, more than the 1 s the
    # agents gave when the launcher simply died of SIGHUP.
    script = write_script(tmp_path, "saver.py", SAVER)
    master, slave = os.openpty()
    env = {**os.environ, "SAVE_S": "1.5"}
    env.pop("HORA_GRACE_PERIOD", None)
    proc = subprocess.Popen([*HORA, "run", "-np", "2", "-x", "SAVE_S", PYTHON, script, str(tmp_path)], cwd=tmp_path,
                            stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    seen: list[bytes] = []
    stop = threading.Event()
    reader = threading.Thread(target=_drain, args=(master, seen, stop), daemon=True)
    reader.start()
    try:
        pids = _pids(tmp_path, 2)
        stop.set()
        reader.join()
        os.close(master)  # the terminal goes away: SIGHUP to hora run; its output now fails with EIO
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 129, b"".join(seen).decode(errors="replace")
    assert [(tmp_path / f"saved.{r}").exists() for r in range(2)] == [True, True]
    assert not any(alive(p) for p in pids)


def test_under_nohup_sighup_leaves_the_job_running(tmp_path: Path) -> None:
    script = write_script(tmp_path, "finish.py", """
        import os, sys, time
        rank, folder = os.environ["HORA_RANK"], sys.argv[1]
        open(os.path.join(folder, f"pid.{rank}"), "w").write(str(os.getpid()))
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.05)
        print("finished", rank)
        """)
    out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
    with out.open("w") as fout, err.open("w") as ferr:
        proc = subprocess.Popen([*HORA, "run", "-np", "2", PYTHON, script, str(tmp_path)], cwd=tmp_path,
                                stdout=fout, stderr=ferr, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # what nohup does
    try:
        _pids(tmp_path, 2)
        os.kill(proc.pid, signal.SIGHUP)
        (tmp_path / "go").write_text("")
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 0, err.read_text()
    assert sorted(out.read_text().splitlines()) == ["[0]<stdout>:finished 0", "[1]<stdout>:finished 1"]
    assert "interrupted" not in err.read_text()
