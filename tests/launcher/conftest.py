"""Helpers for end-to-end ``hora run`` tests on localhost: run the real CLI as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

PYTHON = sys.executable
HORA = [PYTHON, "-m", "hora"]


def write_script(tmp_path: Path, name: str, body: str) -> str:
    """Write a worker script into ``tmp_path`` and return its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def hora_run(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``hora run ARGS`` to completion, capturing what the user sees."""
    return subprocess.run([*HORA, "run", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          check=False)


def alive(pid: int) -> bool:
    """True if ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def wait_until(predicate, timeout: float, step: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


@dataclass
class Background:
    """A ``hora run`` started in its own session (like a terminal's foreground job), output to files."""

    proc: subprocess.Popen[str]
    out: Path
    err: Path

    def finish(self, timeout: float = 30) -> tuple[int, str, str]:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        return code, self.out.read_text(), self.err.read_text()


@pytest.fixture
def background(tmp_path: Path):  # type: ignore[no-untyped-def]
    started: list[Background] = []

    def start(args: list[str]) -> Background:
        out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
        with out.open("w") as fout, err.open("w") as ferr:  # the child keeps its own descriptors
            proc = subprocess.Popen([*HORA, "run", *args], cwd=tmp_path, stdout=fout, stderr=ferr, text=True,
                                    start_new_session=True)
        started.append(Background(proc, out, err))
        return started[-1]

    yield start
    for job in started:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait()
