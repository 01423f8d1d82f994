"""Preflight across hosts: each problem is one line naming the host and the fix, exit 2, nothing started."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from tests.cluster import jobs, netns
from tests.polling import wait_until

pytestmark = pytest.mark.cluster

PROBLEM = re.compile(r"^hora run: error: (host \S+: .*)$", re.MULTILINE)


def _problems(job: jobs.Job) -> list[str]:
    """The per-host problem lines the launcher printed (its closing summary line left out)."""
    return [p for p in PROBLEM.findall(job.stderr) if not p.startswith("host preflight")]


def _assert_nothing_started(cluster: netns.Cluster, job: jobs.Job) -> None:
    assert "<stdout>" not in job.stdout + job.stderr, job.describe()  # no worker ever printed
    assert jobs.leftovers(cluster, within=5) == {}


def test_unreachable_host_is_one_line_with_the_ssh_command_to_reproduce(hosts: netns.Cluster, tmp_path: Path) -> None:
    flags = ["-np", "4", "-H", "10.78.0.3:2,10.78.0.9:2", "--start-timeout", "8", *jobs.hora_ssh_flags(hosts)]
    code, job = jobs.run_job(hosts, flags, jobs.worker("report"), tmp_path, timeout=60)
    assert code == 2, job.describe()
    problems = _problems(job)
    assert len(problems) == 1 and problems[0].startswith("host 10.78.0.9: "), job.describe()
    reproduce = problems[0].split("try: ", 1)[1]
    argv = shlex.split(reproduce)
    assert argv[0] == "ssh" and "10.78.0.9" in argv, reproduce
    again = hosts.host(2).run(argv, timeout=60)  # the command the user is told to try fails the same way
    assert again.returncode == 255, again
    _assert_nothing_started(hosts, job)


def test_each_host_refusing_the_key_gets_its_own_line(hosts: netns.Cluster, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    flags = [
        "-np",
        "2",
        "-H",
        "10.78.0.3:1,10.78.0.4:1",
        "-i",
        str(stranger),
        "--ssh-option",
        "StrictHostKeyChecking=no",
        "--ssh-option",
        "UserKnownHostsFile=/dev/null",
    ]
    code, job = jobs.run_job(hosts, flags, jobs.worker("report"), tmp_path, timeout=60)
    assert code == 2, job.describe()
    problems = sorted(_problems(job))
    assert [p.split(":")[0] for p in problems] == ["host 10.78.0.3", "host 10.78.0.4"], job.describe()
    assert all("cannot connect over ssh" in p and "Permission denied" in p for p in problems), problems
    _assert_nothing_started(hosts, job)


def test_unknown_hostname(hosts: netns.Cluster, tmp_path: Path) -> None:
    flags = ["-np", "2", "-H", "node3:1,node9:1", "--ssh-config-file", str(hosts.ssh_config)]
    code, job = jobs.run_job(hosts, flags, jobs.worker("report"), tmp_path, timeout=60)
    assert code == 2, job.describe()
    problems = _problems(job)
    assert len(problems) == 1 and problems[0].startswith("host node9: "), job.describe()
    assert "node9" in problems[0].split("try: ", 1)[1]
    _assert_nothing_started(hosts, job)


@pytest.fixture
def hora_metadata() -> Iterator[str]:
    """The installed hora's METADATA file (the test bind-mounts a copy over it in node4's mount namespace)."""
    dist = metadata.distribution("hora")
    meta = next(f for f in dist.files or [] if f.name == "METADATA" and ".dist-info" in str(f))
    yield str(Path(str(meta.locate())).resolve())


def test_version_mismatch_names_the_host_and_both_versions(
    hosts: netns.Cluster, tmp_path: Path, hora_metadata: str
) -> None:
    real = Path(hora_metadata)
    fake = tmp_path / "METADATA"
    mine = metadata.version("hora")
    fake.write_text(re.sub(r"(?m)^Version: .*$", "Version: 0.0.1", real.read_text()))
    node4 = hosts.host(4)
    node4.run(["mount", "--bind", str(fake), str(real)], check=True)
    try:
        flags = ["-np", "4", "-H", "10.78.0.3:2,10.78.0.4:2", *jobs.hora_ssh_flags(hosts)]
        code, job = jobs.run_job(hosts, flags, jobs.worker("report"), tmp_path, timeout=60)
    finally:
        node4.run(["umount", str(real)], check=True)
    assert code == 2, job.describe()
    expected = f"host 10.78.0.4: hora 0.0.1, but the launcher has hora {mine}; install the same versions on every host"
    assert _problems(job) == [expected], job.describe()
    _assert_nothing_started(hosts, job)


def test_more_ranks_than_slots_across_hosts(hosts: netns.Cluster, tmp_path: Path) -> None:
    flags = ["-np", "8", "-H", "10.78.0.3:2,10.78.0.4:2", *jobs.hora_ssh_flags(hosts)]
    code, job = jobs.run_job(hosts, flags, jobs.worker("report"), tmp_path, timeout=60)
    assert code == 2, job.describe()
    errors = [line for line in job.stderr.splitlines() if line.startswith("hora run: error:")]
    assert len(errors) == 1 and "-np 8" in errors[0] and "4" in errors[0], job.describe()
    _assert_nothing_started(hosts, job)


# Holds N connections to HOST:22 that never log in (what several jobs starting at once look like to sshd, whose
# MaxStartups is 100 here), prints "held", and lets them go when its stdin closes.
HOLD_STARTUPS = """
import socket, sys
held = [socket.create_connection((sys.argv[1], 22), timeout=10) for _ in range(int(sys.argv[2]))]
print("held", flush=True)
sys.stdin.read()
"""


def test_ssh_connections_dropped_by_a_busy_sshd_are_retried_then_name_max_startups(
        hosts: netns.Cluster, tmp_path: Path) -> None:
    flags = ["-np", "2", "-H", "10.78.0.2:1,10.78.0.3:1", *jobs.hora_ssh_flags(hosts)]
    hold = hosts.host(2).popen([jobs.PYTHON, "-c", HOLD_STARTUPS, "10.78.0.3", "100"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
    try:
        assert hold.stdout is not None and hold.stdout.readline() == "held\n"
        busy = tmp_path / "busy"
        busy.mkdir()
        code, job = jobs.run_job(hosts, flags, jobs.worker("report"), busy, timeout=90)  # busy all along
        assert code == 2, job.describe()
        assert re.search(r"^hora run: host 10\.78\.0\.3: sshd dropped the connection before the handshake \(kex_"
                         r"exchange_identification: .*\); trying again, up to 4 more times$", job.stderr, re.MULTILINE)
        problems = _problems(job)
        dropped = "host 10.78.0.3: sshd dropped the ssh connection before the handshake 5 times (kex_exchange_"
        assert len(problems) == 1 and problems[0].startswith(dropped), job.describe()
        assert "than its MaxStartups allows (default 10:30:100)" in problems[0] and "try: ssh " in problems[0]
        assert "<stdout>" not in job.stdout + job.stderr, job.describe()  # nothing started

        job = jobs.start_job(hosts, flags, jobs.worker("report"), tmp_path)  # busy for a moment
        assert wait_until(lambda: "trying again" in job.stderr, timeout=60, step=0.05,
                          unless=lambda: job.proc.poll() is not None), job.describe()
    finally:
        assert hold.stdin is not None
        hold.stdin.close()
        hold.wait(timeout=30)
    assert job.wait(120) == 0, job.describe()
    assert sorted(r["rank"] for r in jobs.worker_reports(job.stdout)) == [0, 1], job.describe()
    assert jobs.leftovers(hosts, within=15) == {}
