"""Elastic training end to end: ``hora run``'s elastic driver with a Horovod elastic script (hvd.elastic).

The hosts are loopback addresses (127.0.0.1, 127.0.0.2: each its own host for the driver, no ssh). The
script (elastic_sampler_worker.py, ``import horovod.torch as hvd``) trains with an ElasticSampler and a
TorchState; the world grows and shrinks by the discovery script, or loses a host whose worker is killed.
Each test checks what a user cares about: the job ends with 0, every survivor ends with the same parameters,
the batches the state applied hold every sample exactly once per epoch across the resizes, the parameters
equal a one-process replay of those batches (no committed step lost or repeated), nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.elastic_job import ElasticJob, check_same_training
from tests.launcher.helpers import HORA, PYTHON, alive
from tests.polling import wait_until

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("elastic_sampler_worker.py"))
SAMPLES, EPOCHS = 96, 2  # as in the worker
WAIT_S = 180.0  # a loaded 2-core machine imports torch in 10-20 s per process; nothing here is timed


class Job(ElasticJob):
    """``hora run <flags>`` of elastic_sampler_worker.py in the background, writing to ``tmp_path/out``."""

    def __init__(self, tmp_path: Path, flags: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__(tmp_path, [*HORA, "run", *flags, PYTHON, WORKER, str(tmp_path / "out")], WAIT_S, env)

    def wait_size(self, size: int, since: int = 0) -> set[str]:
        """Wait until ``size`` workers stepped together in a world of that size (after step ``since``)."""
        def stepping(steps: list[dict[str, Any]]) -> set[str]:
            return {s["wid"] for s in steps if s["size"] == size and s["step"] > since}

        return stepping(self.wait_steps(f"{size} workers stepping together",
                                        lambda steps: len(stepping(steps)) == size))

    def hold(self) -> None:
        (self.out / "hold").touch()

    def release(self) -> None:
        (self.out / "hold").unlink()

    def results(self) -> list[dict[str, Any]]:
        return sorted((json.loads(p.read_text()) for p in self.out.glob("final.*.json")), key=lambda r: r["rank"])


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    started: list[Job] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> Job:
        started.append(Job(tmp_path, list(flags), env))
        return started[-1]

    yield start
    for j in started:
        j.kill()


def _check(j: Job, code: int, log: str, survivors: int, sizes: set[int] | None) -> None:
    assert code == 0, log
    results = j.results()
    assert len(results) == survivors, log
    first = results[0]
    check_same_training(results, SAMPLES, EPOCHS)
    assert first["params"] == pytest.approx(first["replay"], rel=1e-5, abs=1e-6)
    if sizes is not None:
        assert {s["size"] for s in j.steps()} == sizes
    left = [s["pid"] for s in j.steps() if alive(s["pid"])]
    assert not left, f"worker processes left running: {left}"


def test_a_horovod_elastic_script_grows_and_shrinks_with_the_discovery_script(job: Callable[..., Job],
                                                                               tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:2\n")
    j = job("-np", "2", "--min-np", "2", "--max-np", "4", "--host-discovery-script", f"cat {hosts}",
            env={"HORA_LOG_LEVEL": "INFO"})  # rank 0 logs the host updates it reads
    j.wait_size(2)
    j.hold()  # the new host's workers start (import torch...) while the others wait at a commit
    hosts.write_text("127.0.0.1:2\n127.0.0.2:2\n")
    j.wait_output("host update 1 announced by the launcher")  # they posted ready in train(state); rank 0 read it
    j.release()
    grown = j.wait_size(4)
    assert grown == {"127.0.0.1:0", "127.0.0.1:1", "127.0.0.2:0", "127.0.0.2:1"}
    last = max(s["step"] for s in j.steps())
    j.hold()
    hosts.write_text("127.0.0.1:2\n")
    j.wait_output("hosts removed: 127.0.0.2")  # the launcher read the hosts and announces the removal
    j.release()
    assert j.wait_size(2, since=last) == {"127.0.0.1:0", "127.0.0.1:1"}
    code, log = j.finish()
    _check(j, code, log, survivors=2, sizes={2, 4})


def test_a_killed_worker_drops_its_host_and_the_survivors_go_on_from_the_last_commit(
        job: Callable[..., Job]) -> None:
    j = job("-H", "127.0.0.1:2,127.0.0.2:1", "--min-np", "2")
    j.wait_size(3)
    (j.out / "kill.127.0.0.2:0").touch()
    code, log = j.finish()
    assert "127.0.0.2:0" in log and "SIGKILL" in log, log
    assert "host 127.0.0.2 blacklisted for good" in log, log
    _check(j, code, log, survivors=2, sizes={2, 3})


def test_the_only_host_replaced_by_a_slow_newcomer_hands_it_the_state_as_in_horovod_028(
        job: Callable[..., Job], tmp_path: Path) -> None:
    """Horovod 0.28.1's elastic scenario (test/integration/elastic_common.py, one slot per host): host A, then A
    and B, then B only. A host that discovery removes leaves gracefully: its worker hands the training state to
    the newcomer, waiting up to --elastic-timeout for it, then exits 0. B starts slowly (5 s before
    hvd.init()), so A is removed while B is still starting (hora failed with "no worker of world 1 is left to
    carry the training state"). B's hvd.init() gives it the rank and size of the world it joins (1 of 2), as
    Horovod's does."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:1\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "slow.127.0.0.2:0").write_text("5")
    (tmp_path / "out" / "pace").write_text("0.05")  # training outlasts the three worlds (about 5 s of steps)
    j = job("-np", "1", "--min-np", "1", "--max-np", "2", "--host-discovery-script", f"cat {hosts}",
            env={"HORA_LOG_LEVEL": "INFO"})  # rank 0 logs the host updates it reads
    j.wait_size(1)
    j.hold()  # A waits at its next commit while the hosts change
    hosts.write_text("127.0.0.1:1\n127.0.0.2:1\n")
    j.wait_files("started.127.0.0.2:0")  # B's process runs, and sleeps 5 s before hvd.init()
    hosts.write_text("127.0.0.2:1\n")
    j.wait_output("hosts removed: 127.0.0.1")
    j.wait_output("announced by the launcher")  # rank 0 read the removal: A's next commit takes it
    j.release()
    code, log = j.finish()
    _check(j, code, log, survivors=1, sizes=None)
    assert json.loads((j.out / "init.127.0.0.2:0.json").read_text()) == {"rank": 1, "size": 2}
    assert (j.out / "notified.127.0.0.1:0").exists()  # rank 0 got Horovod's notice (state._host_messages)
    assert j.results()[0]["wid"] == "127.0.0.2:0"  # B trained to the end, from A's state (checked above)
    assert "hosts 127.0.0.1 removed: their workers hold the training state and wait for new workers" in log, log
    assert "world 2: 2 workers on 127.0.0.1, 127.0.0.2; joined: 127.0.0.2:0" in log, log
    assert "world 3: 1 worker on 127.0.0.2; left: 127.0.0.1:0" in log, log
    assert "job failed" not in log and "Traceback" not in log, log


def _worker_pid(launcher: int, worker_id: str) -> int | None:
    """The pid of the worker process ``worker_id`` (HORA_WORKER_ID) started under ``launcher``."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    for pid in parents:
        up = pid
        while up in parents and up != launcher:
            up = parents[up]
        if up != launcher:
            continue
        try:
            variables = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"HORA_WORKER_ID={worker_id}".encode() in variables:
            return pid
    return None


def test_the_documented_elastic_example_survives_a_sigkill_on_one_machine(tmp_path: Path) -> None:
    """docs/elastic.md's example on one machine (examples/elastic_hosts.txt: ``localhost:2``): a SIGKILLed
    worker blacklists its host for new workers but must not take its healthy host-mate, which holds the only
    copy of the training state, with it (hora failed with "every host is blacklisted", and with a cooldown
    with "no worker of world 1 is left to carry the training state"). The survivor trains on alone."""
    log = tmp_path / "launcher.log"
    argv = [*HORA, "run", "-np", "2", "--min-np", "1", "--max-np", "4", "--host-discovery-script",
            "examples/elastic_discovery.sh", PYTHON, "examples/elastic_train.py", "--epochs", "3",
            "--step-sleep", "0.02"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # rank 0 finished an epoch on 2 ranks
        assert wait_until(lambda: "epoch 0:" in log.read_text(), timeout=WAIT_S, step=0.1,
                          unless=lambda: proc.poll() is not None), log.read_text()
        victim = _worker_pid(proc.pid, "localhost:1")
        assert victim is not None, log.read_text()
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert code == 0, text
    assert "worker localhost:1 (process [1], rank 1) on host localhost failed: signal SIGKILL (9)" in text, text
    assert "host localhost blacklisted for good (no new worker starts there)" in text, text
    assert "world 2: 1 worker on localhost; left: localhost:1" in text, text
    assert "done: loss" in text and "1 ranks at the end" in text, text
    assert "job failed" not in text, text
