"""Starting ``hora run`` on a simulated host and watching what it leaves behind.

A :class:`Job` is one ``hora run`` started on a login host (node2 by default) in its own session, its
stdout and stderr going to files (never a pipe that could fill up and block it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster.netns import Cluster, Host, Proc
from tests.polling import wait_until

HORA = [str(Path(sys.executable).parent / "hora")]
PYTHON = sys.executable
WORKER = str(Path(__file__).resolve().parent / "worker.py")
ROOT = Path(__file__).resolve().parents[2]
WORKER_API: list[str] = []  # ["--api", "torch"]: plain torch.distributed workers (see worker.py)


def worker(*args: str) -> list[str]:
    """The command line of the test worker, e.g. ``worker("loop", "/tmp/x")``."""
    return [PYTHON, WORKER, *args, *WORKER_API]


def hora_ssh_flags(cluster: Cluster) -> list[str]:
    """hora run's flags to reach the hosts: identity and the ssh options (ssh ignores $HOME/.ssh)."""
    return [
        "-i",
        str(cluster.key),
        "--ssh-option",
        "StrictHostKeyChecking=no",
        "--ssh-option",
        "UserKnownHostsFile=/dev/null",
        "--ssh-option",
        "LogLevel=ERROR",
    ]


@dataclass
class Job:
    """One ``hora run`` process on a login host."""

    proc: subprocess.Popen[str]
    stdout_path: Path
    stderr_path: Path
    argv: list[str]

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None (after killing the launcher) if it did not end within ``timeout``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the launcher alone (a SIGKILL it cannot handle, or a SIGTERM from a scheduler)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def interrupt(self) -> None:
        """Ctrl-C in the terminal: SIGINT to the launcher's whole process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def describe(self) -> str:
        """Everything the user saw, for assertion messages."""
        return f"$ {' '.join(self.argv)}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}"


def start_job(cluster: Cluster, flags: Sequence[str], command: Sequence[str], workdir: Path, login: int = 2) -> Job:
    """Start ``hora run <flags> <command>`` on host ``login`` (cwd: the repository root)."""
    host = cluster.host(login)
    argv = [*HORA, "run", *flags, *command]
    out, err = workdir / "launcher.stdout", workdir / "launcher.stderr"
    with open(out, "w") as fout, open(err, "w") as ferr:
        proc = host.popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=fout, stderr=ferr, start_new_session=True)
    return Job(proc, out, err, argv)


def run_job(
    cluster: Cluster, flags: Sequence[str], command: Sequence[str], workdir: Path, timeout: float = 120
) -> tuple[int | None, Job]:
    """Start a job and wait for it to end (None: it had to be killed after ``timeout``)."""
    job = start_job(cluster, flags, command, workdir)
    return job.wait(timeout), job


def worker_reports(text: str) -> list[dict[str, Any]]:
    """The ``REPORT {json}`` lines the workers printed, as the launcher showed them (``[r]<stdout>:...``)."""
    found = []
    for match in re.finditer(r"^\[(\d+)\]<stdout>:REPORT (\{.*\})$", text, re.MULTILINE):
        report = json.loads(match.group(2))
        report["prefix_rank"] = int(match.group(1))
        found.append(report)
    return sorted(found, key=lambda r: r["rank"])


def wait_ready(job: Job, ready_dir: Path, ranks: int, timeout: float = 120) -> dict[int, dict[str, Any]]:
    """Wait until every rank of a ``loop`` job finished its first allreduce; return their reports."""
    files = wait_until(lambda: len(found := sorted(ready_dir.glob("ready.*[0-9]"))) == ranks and found,
                       timeout=timeout, step=0.1, unless=lambda: job.proc.poll() is not None)
    if files:
        return {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in files}
    if job.proc.poll() is not None:
        raise AssertionError(f"the job ended ({job.proc.returncode}) before all ranks were ready\n{job.describe()}")
    job.kill()
    raise AssertionError(
        f"only {len(list(ready_dir.glob('ready.*[0-9]')))} of {ranks} ranks ready after {timeout:g}s\n{job.describe()}"
    )


def job_processes(host: Host, ignore_sshd: bool = False) -> list[Proc]:
    """What the job left on ``host``: every process but the sshd listener (the hosts run nothing else).

    ``ignore_sshd``: also leave out sshd's per-session processes (a session whose client vanished behind a
    dead link lingers until TCP gives up; it is sshd's, not hora's).
    """
    return [p for p in host.ps() if not (ignore_sshd and p.cmdline.startswith("sshd"))]


def leftovers(cluster: Cluster, within: float, ignore_sshd: bool = False) -> dict[str, list[str]]:
    """Poll every host until none has a job process left or ``within`` seconds pass; return what is left."""
    def left() -> dict[str, list[str]]:
        found = {
            h.hostname: [f"{p.pid} {p.cmdline[:120]}" for p in job_processes(h, ignore_sshd)] for h in cluster.hosts
        }
        return {name: procs for name, procs in found.items() if procs}

    wait_until(lambda: not left(), timeout=within, step=0.2)
    return left()
