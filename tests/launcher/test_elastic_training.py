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
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import HORA, PYTHON, alive

WORKER = str(Path(__file__).with_name("elastic_sampler_worker.py"))
SAMPLES, EPOCHS = 96, 2  # as in the worker
WAIT_S = 180.0  # a loaded 2-core machine imports torch in 10-20 s per process; nothing here is timed


class Job:
    def __init__(self, tmp_path: Path, flags: list[str]) -> None:
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.log = tmp_path / "launcher.log"
        self.proc = subprocess.Popen([*HORA, "run", *flags, PYTHON, WORKER, str(self.out)], cwd=tmp_path,
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def steps(self) -> list[dict[str, Any]]:
        path = self.out / "steps.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait_size(self, size: int, since: int = 0) -> set[str]:
        """Wait until ``size`` workers stepped together in a world of that size (after step ``since``)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            wids = {s["wid"] for s in self.steps() if s["size"] == size and s["step"] > since}
            if len(wids) == size:
                return wids
            time.sleep(0.1)
        raise AssertionError(f"never saw {size} workers stepping together; launcher output:\n{self.log.read_text()}")

    def hold(self) -> None:
        (self.out / "hold").touch()

    def release(self) -> None:
        (self.out / "hold").unlink()

    def wait_file(self, *names: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not all((self.out / n).exists() for n in names):
            assert time.monotonic() < deadline and self.proc.poll() is None, self.log.read_text()
            time.sleep(0.1)

    def finish(self) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        return code, self.log.read_text()

    def results(self) -> list[dict[str, Any]]:
        return sorted((json.loads(p.read_text()) for p in self.out.glob("final.*.json")), key=lambda r: r["rank"])


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    started: list[Job] = []

    def start(*flags: str) -> Job:
        started.append(Job(tmp_path, list(flags)))
        return started[-1]

    yield start
    for j in started:
        if j.proc.poll() is None:
            os.killpg(j.proc.pid, signal.SIGKILL)
            j.proc.wait()


def _check(j: Job, code: int, log: str, survivors: int, sizes: set[int]) -> None:
    assert code == 0, log
    results = j.results()
    assert len(results) == survivors, log
    first = results[0]
    for r in results[1:]:
        assert r["params"] == first["params"], "ranks ended with different parameters"
        assert r["applied"] == first["applied"]
    epochs: list[list[int]] = [[]]
    for batch in first["applied"]:
        if len(epochs[-1]) == SAMPLES:
            epochs.append([])
        epochs[-1].extend(batch)
    assert len(epochs) == EPOCHS
    for n, samples in enumerate(epochs):
        assert sorted(samples) == list(range(SAMPLES)), f"epoch {n}: samples lost or repeated"
    assert first["params"] == pytest.approx(first["replay"], rel=1e-5, abs=1e-6)
    assert {s["size"] for s in j.steps()} == sizes
    left = [s["pid"] for s in j.steps() if alive(s["pid"])]
    assert not left, f"worker processes left running: {left}"


def test_a_horovod_elastic_script_grows_and_shrinks_with_the_discovery_script(job: Callable[..., Job],
                                                                               tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:2\n")
    j = job("-np", "2", "--min-np", "2", "--max-np", "4", "--host-discovery-script", f"cat {hosts}")
    j.wait_size(2)
    j.hold()  # the new host's workers start (import torch...) while the others wait at a commit
    hosts.write_text("127.0.0.1:2\n127.0.0.2:2\n")
    j.wait_file("built.127.0.0.2:0", "built.127.0.0.2:1")
    time.sleep(3)  # they post ready in train(state); the launcher announces them within its poll
    j.release()
    grown = j.wait_size(4)
    assert grown == {"127.0.0.1:0", "127.0.0.1:1", "127.0.0.2:0", "127.0.0.2:1"}
    last = max(s["step"] for s in j.steps())
    j.hold()
    hosts.write_text("127.0.0.1:2\n")
    time.sleep(3)  # the launcher reads the hosts about once a second and announces the removal
    j.release()
    assert j.wait_size(2, since=last) == {"127.0.0.1:0", "127.0.0.1:1"}
    code, log = j.finish()
    _check(j, code, log, survivors=2, sizes={2, 4})


def test_a_killed_worker_drops_its_host_and_the_survivors_go_on_from_the_last_commit(
        job: Callable[..., Job]) -> None:
    j = job("-H", "127.0.0.1:2,127.0.0.2:2", "--min-np", "2")
    j.wait_size(4)
    (j.out / "kill.127.0.0.2:1").touch()
    code, log = j.finish()
    assert "127.0.0.2:1" in log and "SIGKILL" in log, log
    _check(j, code, log, survivors=2, sizes={2, 4})
