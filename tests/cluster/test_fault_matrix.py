"""Faults across hosts that only the other ranks or the launcher can see (issue 17, items 2, 6 and 7).

A network partition between two worker hosts (ssh to the launcher stays up), a rank on another host stopped in
the middle of a large allreduce, two hosts lost at once, and one machine listed under two names. Each test
checks the line naming the culprit (host, rank), the exit status and that nothing is left on any host; the
session cluster is shared with the other cluster tests.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import jobs, netns

pytestmark = pytest.mark.cluster

THREE = "10.78.0.2:1,10.78.0.3:1,10.78.0.4:1"  # rank 0 on node2 (the launcher's host), 1 on node3, 2 on node4


def _blackhole(host: netns.Host, peer: netns.Host, on: bool) -> None:
    verb = "add" if on else "del"
    subprocess.run(["ip", "-n", host.ns, "route", verb, "blackhole", f"{peer.addr}/32"], check=on,
                   capture_output=True)


@pytest.fixture
def partition(hosts: netns.Cluster) -> Iterator[tuple[netns.Host, netns.Host]]:
    """Cut node3 and node4 off from each other, once called; both still reach node2 (and its launcher)."""
    pair = (hosts.host(3), hosts.host(4))
    yield pair
    _blackhole(pair[0], pair[1], False)
    _blackhole(pair[1], pair[0], False)


def test_partition_between_two_worker_hosts_is_named_as_such(
        hosts: netns.Cluster, partition: tuple[netns.Host, netns.Host], tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    flags = ["-np", "3", "-H", THREE, *jobs.hora_ssh_flags(hosts),
             "--stall-check-warning-time-seconds", "2", "--stall-check-shutdown-time-seconds", "5"]
    job = jobs.start_job(hosts, flags, jobs.worker("loop", str(ready)), tmp_path)
    try:
        jobs.wait_ready(job, ready, 3)
        _blackhole(partition[0], partition[1], True)
        _blackhole(partition[1], partition[0], True)
        code = job.wait(90)
    finally:
        job.kill()
    err = job.stderr
    assert code == 1, job.describe()
    assert re.search(r"hora run: stall: hosts 10\.78\.0\.3 and 10\.78\.0\.4 cannot reach each other: rank 1 on "
                     r"10\.78\.0\.3 and rank 2 on 10\.78\.0\.4 wait for each other and all are running",
                     err), job.describe()
    assert re.search(r"hora run: rank 2 on host 10\.78\.0\.4 failed first: unreachable from host 10\.78\.0\.3: .*the "
                     r"network between hosts 10\.78\.0\.3 and 10\.78\.0\.4 is cut", err), job.describe()
    assert jobs.leftovers(hosts, within=15) == {}


FROZEN_MID_TRANSFER = """
import os, signal
import torch
import hora as hvd

hvd.init()
hvd.allreduce(torch.ones(2), name="warmup")
big = torch.full((16 << 20,), float(hvd.rank() + 1))  # 64 MB
if hvd.rank() == 2:
    handle = hvd.allreduce_async(big, name="big")
    while "pending" in repr(handle):  # negotiated: every rank has launched the transfer
        pass
    os.kill(os.getpid(), signal.SIGSTOP)
hvd.allreduce(big, name="big")
print("RETURNED", flush=True)
"""


def test_a_rank_on_another_host_stopped_in_the_middle_of_a_transfer_is_named_by_its_agent(
        hosts: netns.Cluster, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(FROZEN_MID_TRANSFER)
    flags = ["-np", "3", "-H", THREE, *jobs.hora_ssh_flags(hosts),
             "--stall-check-warning-time-seconds", "2", "--stall-check-shutdown-time-seconds", "5"]
    code, job = jobs.run_job(hosts, flags, [jobs.PYTHON, str(script)], tmp_path, timeout=120)
    err = job.stderr
    assert code == 1, job.describe()
    assert re.search(r"\[0\]<stderr>:hora stall: rank 0: allreduce 'big' \(64\.0 MB on ranks 0-2\) has been in the "
                     r"communication backend for [23] s", err), job.describe()
    assert re.search(r"hora run: stall: rank 2 on host 10\.78\.0\.4 has not finished allreduce 'big' \(64\.0 MB\), "
                     r"which ranks 0, 1 have waited [23] s for in the communication backend: its process is stopped "
                     r"\(state T", err), job.describe()
    assert re.search(r"hora run: rank 2 on host 10\.78\.0\.4 failed first: did not finish allreduce 'big' \(64\.0 MB\) "
                     r"within --stall-check-shutdown-time-seconds 5 s while ranks 0, 1 waited for it in the "
                     r"communication backend: its process is stopped", err), job.describe()
    assert "RETURNED" not in job.stdout, job.describe()
    assert jobs.leftovers(hosts, within=15) == {}


def test_two_hosts_lost_at_once_are_both_named(hosts: netns.Cluster, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    flags = ["-np", "3", "-H", THREE, *jobs.hora_ssh_flags(hosts), "--heartbeat-timeout", "6"]
    job = jobs.start_job(hosts, flags, jobs.worker("loop", str(ready)), tmp_path)
    try:
        jobs.wait_ready(job, ready, 3)
        hosts.host(3).link_down()
        hosts.host(4).link_down()
        code = job.wait(60)
    finally:
        job.kill()
    assert code not in (None, 0), job.describe()
    assert re.search(r"failed first: lost: hosts 10\.78\.0\.3 and 10\.78\.0\.4 stopped answering: their ssh "
                     r"connections ended before ranks 1, 2 exited", job.stderr), job.describe()
    assert "exit code 255" not in job.stderr, job.describe()
    # the cut-off hosts' agents stop their workers themselves (heartbeat timeout); sshd sessions linger
    assert jobs.leftovers(hosts, within=20, ignore_sshd=True) == {}


@pytest.mark.parametrize(("spec", "names", "mine"), [
    ("node3:1,10.78.0.3:1", "node3 and 10.78.0.3", ""),
    ("node2:1,10.78.0.2:1", "node2 and 10.78.0.2", " (this machine)"),
])
def test_one_machine_under_its_name_and_its_address_is_refused(
        hosts: netns.Cluster, tmp_path: Path, spec: str, names: str, mine: str) -> None:
    code, job = jobs.run_job(hosts, ["-np", "2", "-H", spec, *jobs.hora_ssh_flags(hosts)],
                             jobs.worker("report"), tmp_path, timeout=60)
    first = spec.split(":")[0]
    assert code == 2, job.describe()
    assert job.stderr == (
        f"hora run: error: hosts {names} are the same machine{mine}: listed twice, its ranks would be numbered as on "
        "separate hosts (each starting at local_rank 0, so two ranks on one GPU); list it once with all its slots, "
        f"e.g. -H {first}:2\n"), job.describe()
    assert jobs.leftovers(hosts, within=5) == {}
