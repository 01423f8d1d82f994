"""Elastic jobs across hosts: hosts added and removed, workers killed, the job goes on.

``hora run`` starts on node2 and reaches node3 and node4 over ssh; the workers run
benchmarks/elastic_worker.py (hvd.elastic.run, TorchState, a commit every step), which records every step.
Each test checks the worlds the survivors trained in (sizes, ranks), the exit status, the launcher's lines,
that the final parameters are the same on every rank, and that nothing is left on any host.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster import jobs, netns
from tests.elastic_job import Steps, read_steps, wait_steps

pytestmark = pytest.mark.cluster

WORKER = str(jobs.ROOT / "benchmarks" / "elastic_worker.py")
WAIT_S = 180.0  # torch imports on a loaded 2-core machine; nothing here is timed
N3, N4 = "10.78.0.3", "10.78.0.4"


def _wait(job: jobs.Job, out: Path, what: str, predicate: Callable[[Steps], bool]) -> None:
    try:
        wait_steps(out, what, predicate, WAIT_S, ended=lambda: job.proc.poll() is not None, describe=job.describe)
    except AssertionError:
        job.kill()
        raise


def _world(out: Path, size: int, since: float = 0.0) -> dict[str, tuple[int, int]]:
    """wid -> (rank, pid) of the workers that stepped in a world of ``size`` after ``since``."""
    return {s["wid"]: (s["rank"], s["pid"]) for s in read_steps(out) if s["size"] == size and s["t"] > since}


def _wait_world(job: jobs.Job, out: Path, size: int, since: float = 0.0) -> dict[str, tuple[int, int]]:
    _wait(job, out, f"{size} workers stepping together",
          lambda steps: len({s["wid"] for s in steps if s["size"] == size and s["t"] > since}) == size)
    return _world(out, size, since)


def _finish(job: jobs.Job, out: Path, cluster: netns.Cluster, size: int) -> None:
    (out / "stop").touch()
    code = job.wait(WAIT_S)
    assert code == 0, job.describe()
    finals = [json.loads((out / f"final.{r}").read_text()) for r in range(size)]
    assert {f["size"] for f in finals} == {size}, finals
    assert all(f["params"] == finals[0]["params"] for f in finals), "ranks ended with different parameters"
    left = jobs.leftovers(cluster, within=10)
    assert left == {}, f"processes left on the hosts: {left}\n{job.describe()}"


def _start(cluster: netns.Cluster, tmp_path: Path, flags: list[str]) -> tuple[jobs.Job, Path]:
    out = tmp_path / "out"
    out.mkdir()
    job = jobs.start_job(cluster, [*flags, *jobs.hora_ssh_flags(cluster)],
                         [jobs.PYTHON, WORKER, str(out), "--sleep", "0.05"], tmp_path)
    return job, out


def test_hosts_added_then_removed_by_the_discovery_script(hosts: netns.Cluster, tmp_path: Path) -> None:
    listed = tmp_path / "hosts.txt"
    listed.write_text(f"{N3}:2\n")
    job, out = _start(hosts, tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "4",
                                        "--host-discovery-script", f"cat {listed}"])
    first = _wait_world(job, out, 2)
    assert {w: r for w, (r, _) in first.items()} == {f"{N3}:0": 0, f"{N3}:1": 1}
    listed.write_text(f"{N3}:2\n{N4}:2\n")
    grown = _wait_world(job, out, 4)
    assert {w: r for w, (r, _) in grown.items()} == {f"{N3}:0": 0, f"{N3}:1": 1, f"{N4}:0": 2, f"{N4}:1": 3}
    assert {w: p for w, (_, p) in grown.items() if w.startswith(N3)} == {w: p for w, (_, p) in first.items()}
    shrink = time.time()
    listed.write_text(f"{N3}:2\n")
    shrunk = _wait_world(job, out, 2, since=shrink)
    # the survivors keep their start ranks and their processes: nobody restarted
    assert shrunk == first, (shrunk, first)
    assert "hora run: elastic: hosts removed: 10.78.0.4" in job.stderr + job.stdout, job.describe()
    _finish(job, out, hosts, 2)


@pytest.mark.parametrize("how", ["sigkill", "exception"])
def test_a_failing_worker_blacklists_its_host_and_the_job_goes_on(hosts: netns.Cluster, tmp_path: Path,
                                                                   how: str) -> None:
    job, out = _start(hosts, tmp_path, ["-np", "4", "--min-np", "2", "-H", f"{N3}:2,{N4}:2"])
    world = _wait_world(job, out, 4)
    victim = f"{N4}:1"
    failed = time.time()
    if how == "sigkill":
        os.kill(world[victim][1], signal.SIGKILL)  # the hosts share this machine's process ids
    else:
        (out / f"raise.{victim}").touch()
    after = _wait_world(job, out, 3, since=failed)
    # its host takes no new worker, but its healthy host-mate trains on (issue 27 item 2)
    assert {w: r for w, (r, _) in after.items()} == {f"{N3}:0": 0, f"{N3}:1": 1, f"{N4}:0": 2}
    assert after[f"{N4}:0"][1] == world[f"{N4}:0"][1]  # the same process
    said = job.stderr + job.stdout
    assert f"host {N4} blacklisted for good" in said, job.describe()
    expected = "signal SIGKILL (9)" if how == "sigkill" else "exit code 1"
    assert f"worker {victim} (process [3], rank 3) on host {N4} failed: {expected}" in said, job.describe()
    _finish(job, out, hosts, 3)


def test_a_host_removed_while_its_peers_sit_in_a_collective(hosts: netns.Cluster, tmp_path: Path) -> None:
    listed = tmp_path / "hosts.txt"
    listed.write_text(f"{N3}:1\n{N4}:1\n")
    job, out = _start(hosts, tmp_path, ["-np", "2", "--min-np", "1", "--host-discovery-script", f"cat {listed}"])
    _wait_world(job, out, 2)
    (out / f"slow.{N4}:0").write_text("3")  # node3's rank waits in the step's allreduce for 3 s
    time.sleep(1.0)
    removed = time.time()
    listed.write_text(f"{N3}:1\n")
    after = _wait_world(job, out, 1, since=removed)
    assert list(after) == [f"{N3}:0"]
    _finish(job, out, hosts, 1)
