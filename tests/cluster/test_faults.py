"""Failures across hosts (issue 4, point 5): each ends the job in time, names the root cause, leaves nothing.

Every test starts four ranks on node2..node4 from node2, waits until each rank finished an allreduce and
keeps reducing, then breaks one thing on node3 (ranks 1 and 2) and checks what the user sees: the exit
status, the one line naming rank, host and exit code or signal, and an empty ``ps`` on every host.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import jobs, netns

pytestmark = pytest.mark.cluster

HOSTS = "10.78.0.2:1,10.78.0.3:2,10.78.0.4:1"  # four ranks: 0 on node2, 1 and 2 on node3, 3 on node4
FAULT_DEADLINE_S = 15.0  # issue 4 point 5: "every case ends within 15 seconds"
# The configured silent-link timeout (--heartbeat-timeout): ssh keep-alives every timeout/3 s, 3 missed end the
# session on the launcher's side, and the cut-off host's agent stops its workers when the driver's pings stop.
HEARTBEAT_TIMEOUT_S = 9.0
SILENT_LINK_S = HEARTBEAT_TIMEOUT_S
# a lost host is reported as lost (ssh's exit code 255 is not the agent's), whether the agent was killed, its
# ssh session dropped or its link pulled
LOST_AGENT = re.compile(r"rank [12] on host 10\.78\.0\.3 failed first: lost: host 10\.78\.0\.3 stopped answering: its "
                        r"ssh connection ended before ranks 1, 2 exited")


@dataclass
class Running:
    """A four-rank job in its steady state."""

    job: jobs.Job
    reports: dict[int, dict[str, Any]]
    cluster: netns.Cluster

    def wait_after_fault(self, deadline: float) -> tuple[int | None, float]:
        """Wait for the launcher to end; its exit status (None: killed at the deadline) and the seconds taken."""
        start = time.monotonic()
        code = self.job.wait(deadline)
        return code, time.monotonic() - start

    def agent_on(self, index: int) -> netns.Proc:
        found = [p for p in self.cluster.host(index).ps() if "hora.launcher.remote.agent" in p.cmdline]
        assert len(found) == 1, [p.cmdline for p in self.cluster.host(index).ps()]
        return found[0]


@pytest.fixture
def running(hosts: netns.Cluster, tmp_path: Path) -> Iterator[Running]:
    ready = tmp_path / "ready"
    ready.mkdir()
    job = jobs.start_job(
        hosts,
        ["-np", "4", "-H", HOSTS, "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), *jobs.hora_ssh_flags(hosts)],
        jobs.worker("loop", str(ready)),
        tmp_path,
    )
    try:
        reports = jobs.wait_ready(job, ready, 4)
        assert [reports[r]["hostname"] for r in range(4)] == ["node2", "node3", "node3", "node4"]
        yield Running(job, reports, hosts)
    finally:
        job.kill()


def _assert_nothing_left(running: Running, within: float, ignore_sshd: bool = False) -> None:
    left = jobs.leftovers(running.cluster, within=within, ignore_sshd=ignore_sshd)
    assert left == {}, f"processes left on the hosts: {left}\n{running.job.describe()}"


def test_worker_sigkilled_on_one_host(running: Running) -> None:
    os.kill(running.reports[2]["pid"], signal.SIGKILL)  # node3 keeps rank 1: its agent must stop it
    code, took = running.wait_after_fault(FAULT_DEADLINE_S)
    assert code == 128 + signal.SIGKILL, f"ended with {code} after {took:.1f}s\n{running.job.describe()}"
    assert "rank 2 on host 10.78.0.3 failed first: signal SIGKILL (9)" in running.job.stderr, running.job.describe()
    _assert_nothing_left(running, within=5)


def test_agent_killed_on_one_host(running: Running) -> None:
    os.kill(running.agent_on(3).pid, signal.SIGKILL)
    code, took = running.wait_after_fault(FAULT_DEADLINE_S)
    assert code not in (None, 0), f"ended with {code} after {took:.1f}s\n{running.job.describe()}"
    assert LOST_AGENT.search(running.job.stderr), running.job.describe()
    _assert_nothing_left(running, within=5)


def test_ssh_session_dropped(running: Running) -> None:
    sessions = running.cluster.host(3).ssh_sessions()
    assert sessions, "no ssh session to node3 while the job runs"
    for session in sessions:
        os.kill(session.pid, signal.SIGKILL)
    code, took = running.wait_after_fault(FAULT_DEADLINE_S)
    assert code not in (None, 0), f"ended with {code} after {took:.1f}s\n{running.job.describe()}"
    assert LOST_AGENT.search(running.job.stderr), running.job.describe()
    _assert_nothing_left(running, within=5)


def test_link_down_ends_the_job_and_the_cut_off_host_cleans_up(running: Running) -> None:
    running.cluster.host(3).link_down()
    fault = time.monotonic()
    code, took = running.wait_after_fault(SILENT_LINK_S + FAULT_DEADLINE_S)
    assert code not in (None, 0), f"ended with {code} after {took:.1f}s\n{running.job.describe()}"
    assert LOST_AGENT.search(running.job.stderr), running.job.describe()
    # node3 cannot hear anyone: its agent must stop its workers on its own, the link still down. (Its
    # sshd session lingers until TCP gives up: sshd's, not hora's, and gone once the link is back.)
    remaining = HEARTBEAT_TIMEOUT_S + FAULT_DEADLINE_S - (time.monotonic() - fault)
    _assert_nothing_left(running, within=max(remaining, 5), ignore_sshd=True)


def test_launcher_sigkilled(running: Running) -> None:
    running.job.kill(signal.SIGKILL)
    _assert_nothing_left(running, within=FAULT_DEADLINE_S)


@pytest.mark.parametrize(("how", "status"), [("ctrl-c", 128 + signal.SIGINT), ("sigterm", 128 + signal.SIGTERM)])
def test_launcher_interrupted_stops_every_host(running: Running, how: str, status: int) -> None:
    if how == "ctrl-c":
        running.job.interrupt()  # the terminal's SIGINT to the launcher's process group
    else:
        running.job.kill(signal.SIGTERM)  # a scheduler's
    code, took = running.wait_after_fault(FAULT_DEADLINE_S)
    assert code == status, f"ended with {code} after {took:.1f}s\n{running.job.describe()}"
    name = "SIGINT" if how == "ctrl-c" else "SIGTERM"
    assert f"interrupted ({name}): stopping 4 rank(s)" in running.job.stderr, running.job.describe()
    _assert_nothing_left(running, within=5)
