"""Helpers for end-to-end ``hora run`` tests on localhost: run the real CLI as a subprocess."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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
