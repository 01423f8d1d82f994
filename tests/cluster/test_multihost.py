"""`hora run` across three hosts over ssh: ranks, topology, a real allreduce, nothing left behind."""

from __future__ import annotations

from pathlib import Path

import jobs
import netns
import pytest

pytestmark = pytest.mark.cluster

HOSTS = "10.78.0.2:2,10.78.0.3:2,10.78.0.4:2"


def test_six_ranks_on_three_hosts_allreduce_with_horovod_topology(hosts: netns.Cluster, tmp_path: Path) -> None:
    code, job = jobs.run_job(
        hosts, ["-np", "6", "-H", HOSTS, *jobs.hora_ssh_flags(hosts)], jobs.worker("report"), tmp_path
    )
    assert code == 0, job.describe()
    reports = jobs.worker_reports(job.stdout)
    seen = [(r["rank"], r["prefix_rank"], r["hostname"], r["local_rank"], r["cross_rank"]) for r in reports]
    # Ranks fill hosts in order; local rank = index on the host; cross rank = index of the host.
    assert seen == [
        (0, 0, "node2", 0, 0),
        (1, 1, "node2", 1, 0),
        (2, 2, "node3", 0, 1),
        (3, 3, "node3", 1, 1),
        (4, 4, "node4", 0, 2),
        (5, 5, "node4", 1, 2),
    ], job.describe()
    assert {(r["size"], r["local_size"], r["cross_size"]) for r in reports} == {(6, 2, 3)}
    assert [r["sum"] for r in reports] == [21.0] * 6  # 1 + 2 + ... + 6 on every rank
    assert [r["horovod_hostname"] for r in reports] == ["10.78.0.2"] * 2 + ["10.78.0.3"] * 2 + ["10.78.0.4"] * 2
    assert jobs.leftovers(hosts, within=10) == {}


def test_hostfile_launcher_off_the_hosts_np_caps_and_per_rank_logs(hosts: netns.Cluster, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the workers\nnode3 slots=2\n\nnode4:2   # by name, resolved like on a real cluster\n")
    logs = tmp_path / "logs"
    flags = [
        "-np",
        "3",
        "--hostfile",
        str(hostfile),
        "--ssh-config-file",
        str(hosts.ssh_config),
        "--output-filename",
        str(logs),
    ]
    code, job = jobs.run_job(hosts, flags, jobs.worker("report"), tmp_path)  # from node2
    assert code == 0, job.describe()
    reports = jobs.worker_reports(job.stdout)
    assert [(r["rank"], r["hostname"], r["local_rank"], r["cross_rank"]) for r in reports] == [
        (0, "node3", 0, 0),
        (1, "node3", 1, 0),
        (2, "node4", 0, 1),
    ], job.describe()
    assert [(r["local_size"], r["cross_size"], r["sum"]) for r in reports] == [
        (2, 2, 6.0),
        (2, 1, 6.0),
        (1, 2, 6.0),
    ]
    assert (logs / "rank.2" / "stdout").read_text().startswith('REPORT {"rank": 2,')
    assert jobs.leftovers(hosts, within=10) == {}
