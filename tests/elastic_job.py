"""An elastic job as the end-to-end elastic tests watch it: its workers append one JSON line per step to
``out/steps.jsonl`` (tests/launcher/elastic_protocol_worker.py, tests/launcher/elastic_sampler_worker.py,
benchmarks/elastic_worker.py); the tests wait for the worlds those steps show, for lines of the launcher's
output and for files the workers leave. One :class:`ElasticJob` is an ``hora run`` started in the background on
this machine (tests/launcher); tests/cluster starts its jobs through ssh and waits with :func:`wait_steps`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.polling import wait_until

Steps = list[dict[str, Any]]


def read_steps(out: Path) -> Steps:
    """The steps recorded so far; a line still being written (no closing brace yet) is left for the next read."""
    path = out / "steps.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.rstrip().endswith("}")]


def wait_steps(out: Path, what: str, predicate: Callable[[Steps], bool], timeout: float,
               ended: Callable[[], bool], describe: Callable[[], str]) -> Steps:
    """Wait until ``predicate`` holds for the recorded steps and return them; give up when ``ended()`` (the
    job is over: no more steps will come) or after ``timeout`` seconds, raising AssertionError with
    ``what`` and ``describe()`` (what the job said)."""
    found = wait_until(lambda: (steps,) if predicate(steps := read_steps(out)) else None, timeout=timeout, step=0.1,
                       unless=ended)
    if not found:
        raise AssertionError(f"never saw {what}; {describe()}")
    return found[0]


class ElasticJob:
    """``hora run <flags> <command>`` in the background from ``cwd``, its output (both streams) in
    ``cwd/launcher.log``, its workers writing to ``cwd/out``."""

    def __init__(self, cwd: Path, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
                 out: Path | None = None) -> None:
        self.out = out or cwd / "out"
        self.out.mkdir(exist_ok=True)  # a test may put the workers' knobs in it first
        self.log = cwd / "launcher.log"
        self.timeout = timeout  # for each wait, and for the job's end
        with self.log.open("w") as fh:  # the child keeps its own descriptor; ours is closed at once
            self.proc = subprocess.Popen(list(argv), cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True, env={**os.environ, **(env or {})})

    def output(self) -> str:
        return self.log.read_text()

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def steps(self) -> Steps:
        return read_steps(self.out)

    def pids(self) -> set[int]:
        """Every worker process that recorded a step."""
        return {s["pid"] for s in self.steps()}

    def wait_steps(self, what: str, predicate: Callable[[Steps], bool]) -> Steps:
        return wait_steps(self.out, what, predicate, self.timeout, self.ended,
                          lambda: f"launcher output:\n{self.output()}")

    def wait_output(self, text: str) -> None:
        """Wait until the launcher's output holds ``text``."""
        assert wait_until(lambda: text in self.output(), timeout=self.timeout, step=0.1, unless=self.ended), (
            f"never saw {text!r}; launcher output:\n{self.output()}")

    def wait_files(self, *names: str) -> None:
        """Wait until the workers wrote every one of ``names`` into ``out``."""
        assert wait_until(lambda: all((self.out / n).exists() for n in names), timeout=self.timeout, step=0.1,
                          unless=self.ended), f"never saw {names} in {self.out}; launcher output:\n{self.output()}"

    def finish(self, stop: bool = False) -> tuple[int, str]:
        """Wait for the job's end (``stop``: first ask the workers to stop, by ``out/stop``); return its exit
        status and output. A job still running after the timeout is killed, with every process it started."""
        if stop:
            (self.out / "stop").touch()
        try:
            code = self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return code, self.output()

    def kill(self) -> None:
        """End the job now, with every process in its session (a test's teardown)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def check_same_training(results: Sequence[Mapping[str, Any]], samples: int, epochs: int) -> None:
    """What the survivors of an elastic job report (``params``, and ``applied``: the batches of sample indices
    their state committed, in order) shows one training: the same parameters and batches on every rank, and
    every sample applied exactly once per epoch, across the resizes (none lost or repeated)."""
    first = results[0]
    for r in results[1:]:
        assert r["params"] == first["params"], "ranks ended with different parameters"
        assert r["applied"] == first["applied"]
    split: list[list[int]] = [[]]
    for batch in first["applied"]:
        if len(split[-1]) == samples:
            split.append([])
        split[-1].extend(batch)
    assert len(split) == epochs
    for n, seen in enumerate(split):
        assert sorted(seen) == list(range(samples)), f"epoch {n}: samples lost or repeated"
