"""The stall inspector and the timeline across hosts: a rank stuck on another host is named with its host
and function, the job stops, and every host's rank ends up in one merged timeline on the launcher host."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.cluster import jobs, netns
from tests.stalled_job import write_stalled_script

pytestmark = pytest.mark.cluster


def test_rank_stuck_on_another_host_is_named_and_the_job_stopped(hosts: netns.Cluster, tmp_path: Path) -> None:
    script = write_stalled_script(tmp_path, stuck_rank=2)
    trace = tmp_path / "trace.json"
    spec = ",".join(f"{h.addr}:1" for h in hosts.hosts)
    flags = [
        "-np",
        "3",
        "-H",
        spec,
        *jobs.hora_ssh_flags(hosts),
        "--stall-check-warning-time-seconds",
        "1",
        "--stall-check-shutdown-time-seconds",
        "4",
        "--timeline-filename",
        str(trace),
    ]
    code, job = jobs.run_job(hosts, flags, [jobs.PYTHON, str(script)], tmp_path, timeout=120)
    out = job.stdout + job.stderr
    assert code not in (0, None), job.describe()
    logged = [line for line in out.splitlines() if re.match(r"\[\d+\]<stderr>:hora stall:", line)]
    assert len(logged) == 1 and logged[0].startswith("[0]<stderr>:hora stall: allreduce 'loss'"), job.describe()
    stuck = hosts.host(4).addr
    assert re.search(rf"missing: rank 2 on {re.escape(stuck)}: running train\.py:\d+ stuck_in_data_loader", out)
    assert "CollectiveTimeoutError: hora stall: allreduce 'loss'" in out
    assert re.search(rf"hora run: rank 2 on host {re.escape(stuck)} failed first: did not call allreduce 'loss' within "
                     r"--stall-check-shutdown-time-seconds 4 s \(running train\.py:\d+ stuck_in_data_loader", out), out
    events = json.loads(trace.read_text())
    assert {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"} == {
        0: "rank 0",
        1: "rank 1",
        2: "rank 2",
    }
    assert jobs.leftovers(hosts, within=15) == {}
