"""``hora run`` end to end on localhost: environment, output, logs, failures, signals, orphans."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest

from tests.launcher.helpers import PYTHON, alive, hora_run, parent_of, write_script
from tests.polling import wait_until

ENV_WORKER = """
import json, os, socket, sys
env = {k: v for k, v in os.environ.items() if k.startswith(("HORA_", "HOROVOD_", "GLOO_"))
       or k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")}
with socket.create_connection((env["HORA_STORE_ADDR"], int(env["HORA_STORE_PORT"])), timeout=10):
    env["store_ok"] = True  # the driver's store listens where the workers are told it is
with open(sys.argv[1] + "/env." + env["HORA_RANK"] + ".json", "w") as fh:
    json.dump(env, fh)
print("rank", env["HORA_RANK"], "done")
"""


def test_every_rank_gets_its_place_in_all_three_variable_families(tmp_path: Path) -> None:
    script = write_script(tmp_path, "envdump.py", ENV_WORKER)
    result = hora_run(["-np", "3", "-H", "localhost:4", "-x", "EXTRA_FLAG=on",
                       PYTHON, script, str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr
    envs = [json.loads((tmp_path / f"env.{r}.json").read_text()) for r in range(3)]
    # rank, size, local rank/size, cross rank/size, host (several hosts: tests/cluster/test_multihost.py)
    expect = [(0, 0, 3, 0, 1, "localhost"), (1, 1, 3, 0, 1, "localhost"), (2, 2, 3, 0, 1, "localhost")]
    for env, (rank, local, local_size, cross, cross_size, host) in zip(envs, expect):
        for family in ("HORA", "HOROVOD"):
            assert env[f"{family}_RANK"] == str(rank)
            assert env[f"{family}_SIZE"] == "3"
            assert env[f"{family}_LOCAL_RANK"] == str(local)
            assert env[f"{family}_LOCAL_SIZE"] == str(local_size)
            assert env[f"{family}_CROSS_RANK"] == str(cross)
            assert env[f"{family}_CROSS_SIZE"] == str(cross_size)
            assert env[f"{family}_HOSTNAME"] == host
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank), str(local), "3", str(local_size))
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (env["HORA_STORE_ADDR"], env["HORA_STORE_PORT"])
        assert env["HORA_HOST_KEY"] == host
        assert env["GLOO_SOCKET_IFNAME"] == "lo"
        assert env["PYTHONPATH"].endswith(os.path.join("hora", "_compat"))
        assert env["store_ok"] is True
    assert len({e["HORA_JOB_ID"] for e in envs}) == 1
    assert sorted(result.stdout.splitlines()) == [f"[{r}]<stdout>:rank {r} done" for r in range(3)]


def test_output_lines_carry_rank_and_land_in_per_rank_logs(tmp_path: Path) -> None:
    script = write_script(tmp_path, "talk.py", """
        import os, sys
        r = os.environ["HORA_RANK"]
        print(f"out {r}")
        print(f"err {r}", file=sys.stderr)
        sys.stdout.write("".join(f"\\rstep {i}%" for i in range(101)) + "\\n")
        sys.stdout.write("no newline at end")
    """)
    logs = tmp_path / "logs"
    result = hora_run(["-np", "2", "--output-filename", str(logs), "--prefix-output-with-timestamp",
                       PYTHON, script], tmp_path)
    assert result.returncode == 0, result.stderr
    out_lines = result.stdout.splitlines()
    for r in range(2):
        mine = [line.split(f"[{r}]<stdout>:", 1)[1] for line in out_lines if f"[{r}]<stdout>:" in line]
        assert mine[0] == f"out {r}"
        assert mine[-2:] == ["step 100%", "no newline at end"]  # the bar's final state, whole lines
        assert len(mine) < 10  # 101 redraws thinned, not 101 lines
        assert f"[{r}]<stderr>:err {r}" in result.stderr
        stdout_log = (logs / f"rank.{r}" / "stdout").read_text().splitlines()
        assert stdout_log[0] == f"out {r}" and stdout_log[-1] == "no newline at end"
        assert (logs / f"rank.{r}" / "stderr").read_text() == f"err {r}\n"
    assert "\r" not in result.stdout
    # --prefix-output-with-timestamp: "Mon Nov 30 05:35:48 2026[0]<stdout>:out 0"
    first = next(line for line in out_lines if line.endswith("[0]<stdout>:out 0"))
    assert len(first.split("[0]")[0].split()) == 5


FAILING = """
import os, sys, time, signal
r = int(os.environ["HORA_RANK"])
open(os.path.join(sys.argv[1], f"pid.{r}"), "w").write(str(os.getpid()))
if r == 1:
    time.sleep(0.5)
    print("working on it", file=sys.stderr)
    if sys.argv[2] == "raise":
        def load_batch():
            raise ValueError("corrupt batch 17")
        try:
            load_batch()
        except ValueError:
            import traceback; traceback.print_exc()
            sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _stopped(tmp_path: Path, ranks: range) -> bool:
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in ranks]
    return not any(alive(p) for p in pids)


def test_failing_rank_exit_code_root_cause_first_and_others_stopped(tmp_path: Path) -> None:
    script = write_script(tmp_path, "fail.py", FAILING)
    result = hora_run(["-np", "3", PYTHON, script, str(tmp_path), "raise"], tmp_path)
    assert result.returncode == 3
    report = result.stderr[result.stderr.index("hora run: rank 1"):].splitlines()
    assert report[0] == "hora run: rank 1 on host localhost failed first: exit code 3"
    assert report[1] == "hora run: stopping the other 2 ranks"
    assert report[2] == "hora run: ---- traceback of rank 1 (localhost) ----"
    assert report[3] == "[1]: Traceback (most recent call last):"
    assert "[1]:     raise ValueError(\"corrupt batch 17\")" in report
    assert "[1]: ValueError: corrupt batch 17" in report
    assert result.stderr.splitlines()[-1] == "hora run: job failed: rank 1 on host localhost: exit code 3"
    assert _stopped(tmp_path, range(3))


def test_rank_killed_by_sigkill_is_named_and_others_stopped(tmp_path: Path) -> None:
    script = write_script(tmp_path, "fail.py", FAILING)
    result = hora_run(["-np", "3", PYTHON, script, str(tmp_path), "kill"], tmp_path)
    assert result.returncode == 128 + 9
    assert "hora run: rank 1 on host localhost failed first: signal SIGKILL (9)" in result.stderr
    assert "[1]: working on it" in result.stderr  # its last stderr lines
    assert _stopped(tmp_path, range(3))


SLEEPER = """
import os, sys, time
r = int(os.environ["HORA_RANK"])
open(os.path.join(sys.argv[1], f"pid.{r}.tmp"), "w").write(str(os.getpid()))
os.rename(os.path.join(sys.argv[1], f"pid.{r}.tmp"), os.path.join(sys.argv[1], f"pid.{r}"))
print("sleeping", flush=True)
time.sleep(120)
"""


def _started(tmp_path: Path, n: int) -> list[int]:
    assert wait_until(lambda: all((tmp_path / f"pid.{r}").exists() for r in range(n)), 30), "workers never started"
    return [int((tmp_path / f"pid.{r}").read_text()) for r in range(n)]


def test_sigkill_of_the_launcher_leaves_no_worker_and_no_agent(tmp_path: Path, background) -> None:  # type: ignore[no-untyped-def]
    script = write_script(tmp_path, "sleep.py", SLEEPER)
    job = background(["-np", "3", PYTHON, script, str(tmp_path)])
    pids = _started(tmp_path, 3)
    agents = {parent_of(p) for p in pids}
    assert len(agents) == 1 and job.proc.pid not in agents  # driver -> agent (one per host) -> workers
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait()
    assert wait_until(lambda: not any(alive(p) for p in pids + sorted(agents)), 15), [
        p for p in pids + sorted(agents) if alive(p)]


def _cmdlines() -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            found[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            continue
    return found


def test_ctrl_c_stops_every_worker_and_no_secret_was_ever_in_argv(
        tmp_path: Path, background) -> None:  # type: ignore[no-untyped-def]
    script = write_script(tmp_path, "sleep.py", SLEEPER)
    secret = "tok-" + os.urandom(8).hex()
    job = background(["-np", "2", "-x", f"API_TOKEN={secret}", PYTHON, script, str(tmp_path)])
    pids = _started(tmp_path, 2)
    # the job spec (with the environment) travels on the agents' stdin: no agent or worker argv shows it
    assert [pid for pid, cmd in _cmdlines().items() if secret in cmd] == [job.proc.pid]
    os.killpg(job.proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    code, _, err = job.finish()
    assert code == 130
    assert "hora run: interrupted (SIGINT): stopping 2 rank(s)" in err
    assert not any(alive(p) for p in pids)


STUBBORN = """
import os, signal, sys, time
r = int(os.environ["HORA_RANK"])
signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM: still busy", flush=True))  # slow to stop
open(os.path.join(sys.argv[1], f"pid.{r}.tmp"), "w").write(str(os.getpid()))
os.rename(os.path.join(sys.argv[1], f"pid.{r}.tmp"), os.path.join(sys.argv[1], f"pid.{r}"))
time.sleep(120)
"""


def test_second_ctrl_c_says_it_kills_then_that_everything_stopped(
        tmp_path: Path, background) -> None:  # type: ignore[no-untyped-def]
    script = write_script(tmp_path, "stubborn.py", STUBBORN)
    job = background(["-np", "2", PYTHON, script, str(tmp_path)])
    pids = _started(tmp_path, 2)
    os.killpg(job.proc.pid, signal.SIGINT)
    assert wait_until(lambda: "SIGTERM: still busy" in job.out.read_text(), 20), job.err.read_text()
    os.killpg(job.proc.pid, signal.SIGINT)  # the user presses Ctrl-C again while the ranks ignore SIGTERM
    code, _, err = job.finish()
    assert code == 130
    lines = [ln for ln in err.splitlines() if ln.startswith("hora run:")]
    assert lines[0].startswith("hora run: interrupted (SIGINT): stopping 2 rank(s) (SIGTERM, SIGKILL after 25s; "
                               "press Ctrl-C again to kill them now)"), err
    assert "hora run: interrupted again: killing the 2 rank(s) still running now (SIGKILL)" in lines, err
    assert lines[-1] == "hora run: stopped after SIGINT: no rank is running; exit code 130", err
    assert "before the job started" not in err
    assert not any(alive(p) for p in pids)


def test_horovod_script_runs_unchanged_on_the_shim(tmp_path: Path) -> None:
    script = write_script(tmp_path, "hvd.py", """
        import os
        import horovod.torch as hvd
        import hora
        hvd.init()
        where = os.sep.join(hvd.__file__.split(os.sep)[-4:])
        print(where, hvd.allreduce is hora.allreduce, hvd.size(), hvd.rank())
        hvd.shutdown()
    """)
    result = hora_run(["-np", "2", PYTHON, script], tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        f"[{r}]<stdout>:_compat/horovod/torch/__init__.py True 2 {r}" for r in range(2)]


FOLLOW_ON = """
import os, sys, time
r = int(os.environ["HORA_RANK"])
marker = os.path.join(sys.argv[1], "rank1-raised")
if r == 1:
    print("Traceback (most recent call last):", file=sys.stderr)
    print("ValueError: the real problem", file=sys.stderr, flush=True)
    open(marker, "w").close()
    time.sleep(30)  # stuck in teardown: its peer's follow-on error exits first
    sys.exit(3)
while not os.path.exists(marker):
    time.sleep(0.01)
# a follow-on error comes a moment after its cause (a peer noticing the loss); the agent timestamps lines when
# it reads them, so without the gap a starved agent could read this rank's line first on a loaded machine
time.sleep(0.3)
print("Traceback (most recent call last):", file=sys.stderr)
print("RuntimeError: connection closed by peer", file=sys.stderr, flush=True)
sys.exit(1)
"""


def test_root_cause_is_the_rank_whose_traceback_came_first_not_the_first_to_exit(tmp_path: Path) -> None:
    script = write_script(tmp_path, "follow_on.py", FOLLOW_ON)
    result = hora_run(["-np", "2", PYTHON, script, str(tmp_path)], tmp_path)
    assert result.returncode == 1  # rank 0's status: rank 1 never finished exiting (it was stopped)
    report = result.stderr[result.stderr.index("hora run: rank"):].splitlines()
    cause = ("rank 1 on host localhost raised an exception (traceback below); then rank 0 on host localhost "
             "ended with exit code 1")
    # no "stopping the other ranks" line: rank 0 has ended, and rank 1 (still exiting) is the culprit itself
    assert report[:2] == [f"hora run: {cause.replace(' raised', ' failed first: raised', 1)}",
                          "hora run: ---- traceback of rank 1 (localhost) ----"]
    assert report[3] == "[1]: ValueError: the real problem"
    assert result.stderr.splitlines()[-1] == f"hora run: job failed: {cause}"


def test_exception_before_a_collective_is_reported_on_the_raising_rank(tmp_path: Path) -> None:
    script = write_script(tmp_path, "hvd_fail.py", """
        import torch
        import hora as hvd
        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("bad shard on rank 1")
        hvd.allreduce(torch.ones(4), name="grads")
        hvd.shutdown()
    """)
    result = hora_run(["-np", "2", PYTHON, script], tmp_path)
    assert result.returncode == 1
    report = result.stderr[result.stderr.index("hora run: rank"):].splitlines()
    # Rank 0's follow-on CollectiveError may end its process before rank 1 finishes exiting: the report
    # still leads with rank 1, whose traceback began first.
    assert report[0].startswith("hora run: rank 1 on host localhost "), report[0]
    assert "hora run: ---- traceback of rank 1 (localhost) ----" in report[1:3]
    end = report.index("hora run: ----")
    assert "[1]: ValueError: bad shard on rank 1" in report[:end]
    assert "[rank" not in result.stderr  # one rank tag per line (hora run's), not torch's "[rank1]: " as well


def test_agent_killed_takes_its_workers_down_and_the_launcher_names_the_host(
        tmp_path: Path, background) -> None:  # type: ignore[no-untyped-def]
    script = write_script(tmp_path, "sleep.py", SLEEPER)
    job = background(["-np", "2", PYTHON, script, str(tmp_path)])
    pids = _started(tmp_path, 2)
    agent = parent_of(pids[0])
    os.kill(agent, signal.SIGKILL)  # the workers' PR_SET_PDEATHSIG fires
    code, _, err = job.finish()
    assert code == 1
    assert ("hora run: rank 0 on host localhost failed first: lost: the agent on host localhost ended "
            "(signal SIGKILL (9)) before ranks 0, 1 exited") in err
    assert wait_until(lambda: not any(alive(p) for p in pids), 10)


def test_np_caps_workers_and_hosts_left_without_ranks_are_never_contacted(tmp_path: Path) -> None:
    # 10.255.255.1 has no ssh server (nor a route): touching it would fail preflight with exit code 2
    result = hora_run(["-np", "2", "-H", "localhost:3,10.255.255.1:4", PYTHON, "-c",
                       "import os; print(os.environ['HORA_RANK'], os.environ['HORA_SIZE'])"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:0 2", "[1]<stdout>:1 2"]


@pytest.mark.parametrize("spec", ["localhost:1,127.0.0.1:1", f"{socket.gethostname()}:1,localhost:1"])
def test_one_machine_under_two_names_is_refused_before_anything_starts(tmp_path: Path, spec: str) -> None:
    # as two hosts both ranks would get local_rank 0 (the same GPU): one line naming both, exit code 2
    script = write_script(tmp_path, "touch.py", "open(__import__('sys').argv[1], 'w').close()\n")
    marker = tmp_path / "ran"
    result = hora_run(["-np", "2", "-H", spec, PYTHON, script, str(marker)], tmp_path)
    first, second = (e.split(":")[0] for e in spec.split(","))
    total = sum(int(e.split(":")[1]) for e in spec.split(","))
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr == (
        f"hora run: error: hosts {first} and {second} are the same machine (this machine): listed twice, its ranks "
        "would be numbered as on separate hosts (each starting at local_rank 0, so two ranks on one GPU); list it "
        f"once with all its slots, e.g. -H {first}:{total}\n")
    assert not marker.exists()
