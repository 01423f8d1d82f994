"""The job's secret travels as the job spec does and shows nowhere else (issue 23): every rank of a ``hora run``
job (fixed and elastic) gets it in its own environment, no other process holds it in its environment or on its
command line, and a job that stalls and fails, with every log at DEBUG, per-rank logs and a timeline, never
prints it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launcher.helpers import PYTHON, hora_run

WORKER = str(Path(__file__).with_name("secret_worker.py"))


def _everything_written(tmp_path: Path, out: str, err: str) -> str:
    """What the user sees and every file the job wrote (the scans aside: they hold the secret on purpose)."""
    files = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith("scan.")]
    return "\n".join([out, err, *(p.read_text(errors="replace") for p in files)])


@pytest.mark.parametrize("kind", ["fixed", "elastic"])
def test_only_the_ranks_hold_the_secret_and_nothing_prints_it(tmp_path: Path, kind: str) -> None:
    flags = ["-np", "2", "--log-level", "DEBUG", "--output-filename", str(tmp_path / "logs"),
             "--timeline-filename", str(tmp_path / "timeline.json")]
    if kind == "fixed":  # a stall: reported after 1 s, the job stopped after 3 s
        flags += ["--stall-check-warning-time-seconds", "1", "--stall-check-shutdown-time-seconds", "3"]
        mode = "stall"
    else:
        flags += ["--min-np", "1", "--max-np", "2"]
        mode = "raise"
    done = hora_run([*flags, PYTHON, WORKER, str(tmp_path), mode], cwd=tmp_path, timeout=180)
    assert done.returncode != 0, done.stderr[-3000:]
    scans = [json.loads((tmp_path / f"scan.{r}").read_text()) for r in (0, 1)]
    secret = scans[0]["secret"]
    assert len(secret) == 64 and int(secret, 16) and scans[1]["secret"] == secret
    for s in scans:
        assert s["cmdline"] == [], s["cmdline"]  # not the launcher's ssh or agent command, not a worker's
        assert {p["pid"] for p in s["environ"]} == {scans[0]["pid"], scans[1]["pid"]}, s["environ"]
    assert ("stall" if kind == "fixed" else "rank 1 gives up") in done.stderr, done.stderr[-3000:]
    written = _everything_written(tmp_path, done.stdout, done.stderr)
    assert list(tmp_path.glob("timeline*.json")) and list((tmp_path / "logs").rglob("stderr"))
    assert "rendezvous store on" in written and "rank 1: initialised" in written  # logs were there to look at
    assert secret not in written and secret.upper() not in written
