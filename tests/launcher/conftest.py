"""Fixtures for end-to-end ``hora run`` tests on localhost (helpers: tests/launcher/helpers.py)."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launcher.helpers import HORA


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
